# The logits GEMM on the ring schedule (configs/tuning/linear_cross_entropy.toml): the
# Mosaic GEMM tests and the LCE tests that run them, the llama3-8b set ($PROVIDERS) and the
# bridged loss ($BRIDGE; empty skips either).
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
echo "=== tests $(date +%T)"
timeout ${TESTS_S:-200} python3 -m pytest -q -m gpu tests/ops/test_mosaic_gemm.py \
  tests/ops/linear_cross_entropy -k "${TESTS_K:-mosaic}" -p no:cacheprovider 2>&1 \
  | tee $OUT/gpu_tests.log | tail -6
if [ -n "${PROVIDERS:-}" ]; then
  echo "=== bench $(date +%T)"
  timeout ${BENCH_S:-300} python3 benchmarks/linear_cross_entropy.py --set llama3-8b --reps 10 \
    --out $OUT/results/linear_cross_entropy.jsonl --providers "$PROVIDERS" 2>&1 \
    | grep -v -i warning | tee $OUT/bench.log
fi
if [ -n "${BRIDGE:-}" ]; then
  echo "=== bridge $(date +%T)"
  timeout ${BRIDGE_S:-240} python3 benchmarks/torch_bridge.py --op loss --providers "$BRIDGE" \
    --out $OUT/results/torch_bridge.jsonl 2>&1 | grep -v -i warning | tee $OUT/bridge.log
fi
echo "=== done $(date +%T)"
