# Device check of the Mosaic GPU attention forward: GPU tests, then the headline with variants.
. "$(dirname "$0")/../device_env.sh"
echo "=== tests $(date +%T)"
timeout ${TEST_S:-200} python3 -m pytest -q -x -m gpu tests/ops/flash_attention/test_pallas_mosaic_gpu.py -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} 2>&1 | grep -v -i warning | tail -25
echo "=== headline $(date +%T)"
timeout ${BENCH_S:-300} python3 benchmarks/flash_attention.py --set headline --out $OUT/results/flash_attention.jsonl \
  --providers ${PROVIDERS:-memeff,memeff:pallas_mosaic_gpu:pingpong=0,memeff:pallas_mosaic_gpu:stages=3,memeff:pallas_triton,cudnn,tokamax:mosaic} 2>&1 | grep -v -i warning | tee $OUT/headline.log | tail -30
echo "=== done $(date +%T)"
