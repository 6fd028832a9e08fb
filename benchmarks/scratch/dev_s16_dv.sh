# Session 16: issue 2's memory-target setting (all-Mosaic "dv" 1,024, tma_add, fused_lse:
# 0.245 GiB) under variants of its dx GEMM (256 tiles of 128 x 128, K = 128,256), and the
# default (all cuBLAS) against cuBLAS with one or two GEMMs moved to Mosaic, interleaved.
. "$(dirname "$0")/../device_env.sh"
L='impl.dw_accumulation="tma_add"+impl.fused_lse=True'
VARIANTS="$L;$L+dx.cluster=\"m\";$L+dx.cluster=\"m\"+dx.max_concurrent_steps=5;$L+dx.schedule=\"ring\"+dx.wg_split=\"m\"+dx.tile_m=64;impl.mosaic_gemms=();impl.mosaic_gemms=(\"logits\",)+impl.fused_lse=True;impl.mosaic_gemms=(\"logits\",\"dw\")+$L" \
  LAYOUT=dv CHUNK=1024 ROUNDS=${ROUNDS:-5} timeout 500 python3 benchmarks/scratch/lce_gemm_variants.py 2>&1 \
  | grep -v -i warning | tee $OUT/dv-variants.log
