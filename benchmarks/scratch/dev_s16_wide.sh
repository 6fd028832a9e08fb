# Session 16: the loss is at the power cap, so energy per FLOP matters. A 128 x 128
# warpgroup tile issues two m64n128 WGMMAs per K step, each reading B's 16 x 128 slice from
# shared memory (12 KB per 0.5 MFLOP with A); a 64 x 256 tile issues one m64n256 (10 KB).
# The light setting with 64 x 256 warpgroup tiles per GEMM, interleaved.
. "$(dirname "$0")/../device_env.sh"
L='impl.dw_accumulation="tma_add"+impl.fused_lse=True'
LG='logits.tile_m=64+logits.tile_n=256+logits.wg_split="m"+logits.max_concurrent_steps=3'
DX='dx.tile_m=64+dx.tile_n=256+dx.max_concurrent_steps=4'
DW='dw.tile_m=64+dw.tile_n=256'
VARIANTS="$L;$L+$LG+logits.tail_n=None;$L+$LG;$L+$DX;$L+$DW;$L+$LG+$DX+$DW" \
  LAYOUT=vd CHUNK=512 ROUNDS=${ROUNDS:-5} timeout 480 python3 benchmarks/scratch/lce_gemm_variants.py 2>&1 \
  | grep -v -i warning | tee $OUT/wide-variants.log
