# The Mosaic dq kernel: variants timed and checked (dq_variants.py), then its GPU tests.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
echo "=== variants $(date +%T)"
timeout ${VARIANT_S:-400} python3 benchmarks/scratch/dq_variants.py $VARIANTS 2>&1 | grep -v -i warning | tee $OUT/variants.log
[ -z "$TEST_K" ] && exit 0
echo "=== tests $(date +%T)"
timeout ${TEST_S:-180} python3 -m pytest -q -x -p no:cacheprovider \
  tests/ops/flash_attention/test_pallas_mosaic_gpu.py -k "$TEST_K" 2>&1 | tail -15 | tee $OUT/tests.log
echo "=== done $(date +%T)"
