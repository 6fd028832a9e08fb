# Session 24: PallasGpu()'s GEMMs chosen by auto_gemms (all three on Mosaic at llama3-8b "dv"):
# the loss's memory, exp_logits and default tests on the GPU, then the README's full-provider run.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout ${T1:-300} python3 -m pytest -q -m gpu tests/ops/linear_cross_entropy \
  -k "${K1:-test_memory or exp_logits or default}" 2>&1 | tail -4 | tee $OUT/lce-gpu-tests.log
timeout ${BENCH_S:-280} python3 benchmarks/linear_cross_entropy.py --set llama3-8b --rounds 3 \
  --providers ${PROVIDERS:-floor,memeff,memeff:pallas_gpu:dw=weight,memeff:pallas_gpu:gemms=logits+dx+dw:dw=tma_add:fused_lse=1,jax_naive,torch_compile,liger} \
  --out $OUT/linear_cross_entropy.jsonl 2>&1 | grep -v -i warn | grep -v "^  File\|^    " | tee $OUT/lce.log | tail -9
