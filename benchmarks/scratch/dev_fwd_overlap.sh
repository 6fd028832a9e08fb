# The forward with intra-warpgroup overlap: interleaved timing rounds against cuDNN and
# tokamax (carry .whl), at D = 128 and then the head dims in $DS, then its GPU tests.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
MOSAIC_GPU_DUMP_PTXAS=1 timeout ${TIME_S:-300} python3 benchmarks/scratch/fwd_variants.py \
  ${PROVIDERS:-default,overlap,cudnn,tokamax,vjp:default,vjp:overlap,vjp:cudnn} ${ROUNDS:-5} \
  > $OUT/fwd-variants-raw.log 2>&1
grep -i -E "spill|serializ" $OUT/fwd-variants-raw.log | sort | uniq -c | head
grep -E "^causal|FAILED" $OUT/fwd-variants-raw.log | tee $OUT/fwd-variants.log
for d in ${DS:-}; do
  D=$d H=$((4096 / d)) timeout 150 python3 benchmarks/scratch/fwd_variants.py default,overlap,cudnn 3 2>&1 \
    | grep -E "^causal|FAILED" | sed "s/^/D=$d /" | tee -a $OUT/fwd-variants.log
done
[ -n "${TESTS:-}" ] && { timeout ${TEST_S:-240} python3 -m pytest -q -x -p no:cacheprovider \
  tests/ops/flash_attention/test_pallas_mosaic_gpu.py -k "$TESTS" > $OUT/tests.log 2>&1
  echo "tests rc=$?"; tail -3 $OUT/tests.log; }
true
