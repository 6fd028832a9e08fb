# Session 18: the one-pass backward's swizzled float32 dQ tile: the GPU tests of the one-pass
# kernel, then its backward time with and without the swizzle (dq_tile_swizzle.py).
. "$(dirname "$0")/../device_env.sh"
N=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4" || echo "")
timeout ${TEST_S:-300} python3 -m pytest -q -m gpu -p no:cacheprovider $N \
  -k "${K:-mosaic_backward_matches_reference or d256_column_split or d64_and_lse or rows_that_see_no_key}" \
  tests/ops/flash_attention/test_pallas_mosaic_gpu.py 2>&1 | grep -v -i warn \
  | tail -8 | tee $OUT/tests.log
timeout ${BENCH_S:-240} python3 benchmarks/scratch/dq_tile_swizzle.py 2>&1 | grep -v -i warn \
  | tee $OUT/swizzle.log
