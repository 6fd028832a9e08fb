# Session 15: the logits GEMM's tail tiles (GemmConfig.tail_n) in the all-Mosaic loss at
# llama3-8b ("vd", 512-token chunks, tma_add), with and without fused_lse; then the GPU
# tests of ops.mosaic_gemm that the change touches.
. "$(dirname "$0")/../device_env.sh"
L='impl.dw_accumulation="tma_add"'
VARIANTS=${VARIANTS:-"$L+impl.fused_lse=True;$L+impl.fused_lse=True+logits.tail_n=64;$L;$L+logits.tail_n=64"} \
  LAYOUT=${LAYOUT:-vd} CHUNK=${CHUNK:-512} ROUNDS=${ROUNDS:-3} \
  timeout ${BENCH_S:-330} python3 benchmarks/scratch/lce_gemm_variants.py 2>&1 | grep -v -i warning
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests/ops/test_mosaic_gemm.py \
  -k "${TESTS:-tail or row_stats or ragged}" 2>&1 | tail -5
