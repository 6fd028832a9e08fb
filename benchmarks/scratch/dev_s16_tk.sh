# Session 16: K steps of 128 instead of 64 for the light setting's short-K dW GEMM (4 steps
# per tile instead of 8: half the barrier round trips) and for dx, in interleaved rounds.
. "$(dirname "$0")/../device_env.sh"
L='impl.dw_accumulation="tma_add"+impl.fused_lse=True'
VARIANTS="$L;$L+dw.tile_k=128+dw.max_concurrent_steps=3+dw.epilogue_rows=64;$L+dw.tile_k=128+dw.max_concurrent_steps=2;$L+dx.tile_k=128+dx.max_concurrent_steps=3+dx.epilogue_rows=64;$L+dw.epilogue_rows=64" \
  LAYOUT=vd CHUNK=512 ROUNDS=${ROUNDS:-5} timeout 400 python3 benchmarks/scratch/lce_gemm_variants.py 2>&1 \
  | grep -v -i warning | tee $OUT/tk-variants.log
