# Session 16: the bridge's light setting (all-Mosaic, "vd" 512, tma_add, fused_lse) under
# variants of the dW GEMM's schedule (ring 128 x 256 CTA tiles with CTA pairs, as "dv" uses)
# and of the single-sweep softmax kernel's tile, in interleaved rounds.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
L='impl.dw_accumulation="tma_add"+impl.fused_lse=True'
R='dw.schedule="ring"+dw.epilogue_rows=64'
VARIANTS="$L;$L+$R+dw.band=4;$L+$R;$L+kernel.num_stages=3;$L+kernel.block_v=4096;$L+kernel.num_warps=4;$L+kernel.block_v=16384+kernel.num_warps=16" \
  LAYOUT=vd CHUNK=512 ROUNDS=${ROUNDS:-5} timeout 480 python3 benchmarks/scratch/lce_gemm_variants.py 2>&1 \
  | grep -v -i warning | tee $OUT/variants.log
