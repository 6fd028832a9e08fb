# Device check of the Mosaic GPU attention backward: smoke, GPU tests, headline with variants.
. "$(dirname "$0")/../device_env.sh"
echo "=== smoke $(date +%T)"
timeout ${SMOKE_S:-120} python3 benchmarks/scratch/mosaic_bwd_smoke.py 2>&1 | grep -v -i warning | tail -30
if [ -n "${TESTS:-1}" ]; then
echo "=== tests $(date +%T)"
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests/ops/flash_attention/test_pallas_mosaic_gpu.py -n 4 -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} 2>&1 | grep -v -i warning | tail -25
fi
echo "=== headline $(date +%T)"
timeout ${BENCH_S:-240} python3 benchmarks/flash_attention.py --set ${SET:-headline} --out $OUT/results/flash_attention.jsonl \
  --providers ${PROVIDERS:-memeff,memeff:pallas_mosaic_gpu:bwd_dq_split=0,memeff:pallas_mosaic_gpu:bwd_stages=3,memeff:pallas_mosaic_gpu:bwd=triton,cudnn,tokamax:mosaic} 2>&1 | grep -v -i warning | tee $OUT/headline.log | tail -30
echo "=== done $(date +%T)"
