# Session 16: the light setting's dx GEMM ("vd" 512: 128 CTA tiles, one per CTA). In
# ping-pong one compute warpgroup of each CTA works and the other only passes the slots
# on; the ring schedule with 64-row halves (wg_split "m") puts both on the one tile.
. "$(dirname "$0")/../device_env.sh"
L='impl.dw_accumulation="tma_add"+impl.fused_lse=True'
R='dx.schedule="ring"+dx.wg_split="m"+dx.tile_m=64'
VARIANTS="$L;$L+$R;$L+$R+dx.max_concurrent_steps=6;$L+$R+dx.in_flight=0;$L+$R+dx.cluster=None;$L+dw.max_concurrent_steps=5" \
  LAYOUT=vd CHUNK=512 ROUNDS=${ROUNDS:-5} timeout 400 python3 benchmarks/scratch/lce_gemm_variants.py 2>&1 \
  | grep -v -i warning | tee $OUT/dx-variants.log
