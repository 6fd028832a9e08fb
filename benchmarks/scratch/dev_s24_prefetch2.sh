# Session 24, round 2: prefetching the next tile's reduce-add target (PREFETCH_AHEAD), then the
# settings side by side with the prefetch on (default, Mosaic dW by TMA adds, all-Mosaic).
. "$(dirname "$0")/../device_env.sh"
SKIP_TESTS=1 FLAG=PREFETCH_AHEAD bash benchmarks/scratch/dev_s24_prefetch.sh
timeout 250 python3 benchmarks/linear_cross_entropy.py --set llama3-8b --rounds 3 \
  --providers floor,memeff,memeff:pallas_gpu:gemms=dw:dw=tma_add,memeff:pallas_gpu:gemms=logits+dx+dw:dw=tma_add \
  --out $OUT/linear_cross_entropy.jsonl 2>&1 | grep -v -i warn | grep -v "^  File\|^    " | tee $OUT/lce.log | tail -6
