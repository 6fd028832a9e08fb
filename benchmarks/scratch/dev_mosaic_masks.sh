# Device check of window and segment ids in the Mosaic GPU attention kernels: smoke, tests, sets.
. "$(dirname "$0")/../device_env.sh"
echo "=== smoke $(date +%T)"
timeout ${SMOKE_S:-150} python3 benchmarks/scratch/mosaic_mask_smoke.py 2>&1 | grep --line-buffered -v -i warning | tee $OUT/smoke.log | tail -30
if [ -n "${TESTS:-1}" ]; then
echo "=== tests $(date +%T)"
timeout ${TEST_S:-240} python3 -m pytest -q -W ignore -m gpu tests/ops/flash_attention/test_pallas_mosaic_gpu.py -n 4 -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} 2>&1 | tee $OUT/tests.log | tail -25
fi
for s in ${SETS-packed window}; do
echo "=== $s $(date +%T)"
timeout ${BENCH_S:-200} python3 benchmarks/flash_attention.py --set $s --out $OUT/results/flash_attention.jsonl \
  --providers ${PROVIDERS:-memeff,memeff:pallas_triton,cudnn,tokamax:mosaic} 2>&1 | grep --line-buffered -v -i warning | tee $OUT/$s.log | tail -12
done
if [ -n "${HEADLINE:-1}" ]; then
echo "=== headline $(date +%T)"
timeout ${BENCH_S:-200} python3 benchmarks/flash_attention.py --set headline --out $OUT/results/flash_attention.jsonl \
  --providers memeff,cudnn,tokamax:mosaic 2>&1 | grep -v -i warning | tee $OUT/headline.log | tail -8
fi
echo "=== done $(date +%T)"
