# deterministic=True by default: the GPU tests that touch the choice of backward, the interop
# attention tests, then the headline set with both modes and the peers. Logs into $OUT.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
echo "=== tests $(date +%T)"
timeout ${TEST_S:-240} python3 -m pytest -q -x -p no:cacheprovider \
  tests/ops/flash_attention/test_pallas_mosaic_gpu.py \
  -k "${TEST_K:-reproducible or deterministic or softcap or packed or triton_backward or saved_residuals or d64_and_lse or default_picks}" \
  2>&1 | tail -8 | tee $OUT/tests.log
timeout ${TORCH_S:-120} python3 -m pytest -q -x -p no:cacheprovider tests/interop -k "attention" 2>&1 | tail -4 | tee -a $OUT/tests.log
[ -z "$PROVIDERS" ] && exit 0
echo "=== headline $(date +%T)"
timeout ${BENCH_S:-400} python3 benchmarks/flash_attention.py --set headline --reps 10 \
  --out $OUT/results/flash_attention.jsonl --providers "$PROVIDERS" 2>&1 | grep -v -i warning | tee $OUT/headline.log
echo "=== done $(date +%T)"
