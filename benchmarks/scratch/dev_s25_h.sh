# Session 25, final code: the bridge's GPU tests, then the README's full-provider run of the
# loss (5 rounds).
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -m gpu tests/interop 2>&1 | tail -3 | tee $OUT/interop-gpu-tests.log
timeout ${BENCH_S:-330} python3 benchmarks/linear_cross_entropy.py --set llama3-8b --rounds ${ROUNDS:-5} \
  --providers ${PROVIDERS:-floor,memeff,memeff:pallas_gpu:dw=weight,memeff:pallas_gpu:gemms=logits+dx+dw:dw=tma_add:fused_lse=1,jax_naive,torch_compile,liger} \
  --out $OUT/linear_cross_entropy.jsonl 2>&1 | grep -v -i warn | grep -v "^  File\|^    " | tee $OUT/lce.log | tail -9
