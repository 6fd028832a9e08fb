# Session 23: the full-provider llama3-8b run for the README, with the all-Mosaic exp_logits
# setting (dx written and scaled in place, 0.2485 GiB) beside the others.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout ${BENCH_S:-470} python3 benchmarks/linear_cross_entropy.py --set llama3-8b --rounds 3 \
  --providers ${PROVIDERS:-floor,memeff,memeff:pallas_gpu:exp_logits=0,memeff:pallas_gpu:gemms=logits+dx+dw:dw=tma_add,memeff:pallas_gpu:gemms=logits+dx+dw:dw=tma_add:fused_lse=1,jax_naive,torch_compile,liger} \
  --out $OUT/linear_cross_entropy.jsonl 2>&1 | grep -v -i warn | grep -v "^  File\|^    " | tee $OUT/lce.log | tail -14
