# The backward's row statistics: formulations timed, kernel durations under ncu, the headline set.
. "$(dirname "$0")/../device_env.sh"
echo "=== delta variants $(date +%T)"
python3 benchmarks/scratch/delta_variants.py 2>&1 | grep -v -i warning | tee $OUT/delta.log
for mode in full causal; do
  echo "=== durations $mode $(date +%T)"
  timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum \
    python3 benchmarks/scratch/attn_bwd_profile.py $mode 2>&1 | grep -v -i warning > $OUT/durations-$mode.log
  grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" $OUT/durations-$mode.log | paste - - \
    | awk '{print $1, $(NF-1), $(NF)}' | tail -6
done
echo "=== headline $(date +%T)"
timeout ${BENCH_S:-240} python3 benchmarks/flash_attention.py --set headline --out $OUT/results/flash_attention.jsonl \
  --providers ${PROVIDERS:-memeff,cudnn,tokamax:mosaic} 2>&1 | grep -v -i warning | tee $OUT/headline.log | tail -12
if [ -n "${TESTS:-}" ]; then
echo "=== tests $(date +%T)"
timeout ${TEST_S:-200} python3 -m pytest -q -W ignore -m gpu tests/ops/flash_attention/test_pallas_mosaic_gpu.py -n 8 -p no:cacheprovider 2>&1 | tee $OUT/tests.log | tail -25
fi
echo "=== done $(date +%T)"
