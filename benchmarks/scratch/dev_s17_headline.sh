# Session 17: the attention headline (3 interleaved rounds) with the deterministic default's
# dK/dV kernel at 80 query rows per step, beside the one-pass kernel, cuDNN and tokamax.
. "$(dirname "$0")/../device_env.sh"
timeout ${BENCH_S:-560} python3 benchmarks/flash_attention.py --set headline --rounds 3 \
  --providers ${PROVIDERS:-memeff,memeff:nondeterministic,cudnn,tokamax:mosaic} \
  --out $OUT/flash_attention.jsonl 2>&1 | grep -v -i warn | tee $OUT/headline.log | tail -20
