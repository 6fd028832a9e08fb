# Session 13: ragged-N GEMM tests, the loss tests on the GPU, and logits GEMM tiles whose
# count fills the H200's 132 SMs' waves ("vd" 512 tokens: 128 x 144 tiles are 27.0 waves,
# the default 128 x 256 CTA tiles 15.2), all-Mosaic loss with dW by TMA reduce-add.
. benchmarks/device_env.sh
python3 -m pytest -q -m gpu tests/ops/test_mosaic_gemm.py -k ragged 2>&1 | tail -4
python3 -m pytest -q -m gpu tests/ops/linear_cross_entropy 2>&1 | tail -4
T='impl.dw_accumulation="tma_add"'
VARIANTS="$T;$T+logits.schedule=\"pingpong\"+logits.tile_n=144;$T+logits.schedule=\"pingpong\"+logits.tile_n=144+logits.max_concurrent_steps=5;$T+logits.schedule=\"pingpong\"+logits.tile_n=144+logits.cluster=\"m\";$T+logits.tile_n=72;$T+logits.schedule=\"pingpong\"+logits.tile_n=192;$T+logits.schedule=\"pingpong\"+logits.tile_n=144+logits.epilogue_rows=None" \
  LAYOUT=vd CHUNK=512 ROUNDS=${ROUNDS:-3} timeout 420 python3 benchmarks/scratch/lce_gemm_variants.py 2>&1 | grep -v Warning
