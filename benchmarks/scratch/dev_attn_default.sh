# After a change of the attention defaults: the headline and d256 sets through the harness
# (carry .whl for tokamax), then the GPU feature suites of the default kernels.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
for s in ${SETS:-headline d256}; do
  echo "=== $s $(date +%T)"
  timeout ${SET_S:-200} python3 benchmarks/flash_attention.py --set $s --reps 10 \
    --providers ${ATTN_PROVIDERS:-memeff,memeff:nondeterministic,cudnn,tokamax:mosaic} \
    --out $OUT/results/flash_attention.jsonl 2>&1 | grep -v -i warn | tee $OUT/attn-$s.log
done
if [ -n "${TESTS:-}" ]; then
  echo "=== tests $(date +%T)"
  timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider \
    tests/ops/flash_attention/test_pallas_mosaic_gpu.py -k "$TESTS" > $OUT/tests.log 2>&1
  echo "tests rc=$?"; tail -4 $OUT/tests.log
fi
true
