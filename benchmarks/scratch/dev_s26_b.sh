# Session 26: the README's full-provider run of the loss at llama3-8b (5 rounds), for the
# machine it lands on (an H100 was last measured in session 24, before session 25's changes).
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout ${BENCH_S:-420} python3 benchmarks/linear_cross_entropy.py --set llama3-8b --rounds ${ROUNDS:-5} \
  --providers ${PROVIDERS:-floor,memeff,memeff:pallas_gpu:dw=weight,memeff:pallas_gpu:gemms=logits+dx+dw:dw=tma_add:fused_lse=1,jax_naive,torch_compile,liger} \
  --out $OUT/linear_cross_entropy.jsonl 2>&1 | grep -v -i warn | grep -v "^  File\|^    " | tee $OUT/lce.log | tail -9
