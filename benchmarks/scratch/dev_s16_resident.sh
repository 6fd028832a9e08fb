# Session 16: GemmConfig.b_resident (B's column block, all of K, held in shared memory; the
# ring carries A alone). Its GPU tests, then the light setting's loss ("vd" 512, tma_add,
# fused_lse) with the dW GEMM resident, in interleaved rounds; then the other GEMM tests.
# Needs benchmarks/scratch/patches/b_resident.diff applied (not merged).
. "$(dirname "$0")/../device_env.sh"
timeout 150 python3 -m pytest -q -x -m gpu tests/ops/test_mosaic_gemm.py -k resident 2>&1 \
  | tail -15 | tee $OUT/resident-tests.log
L='impl.dw_accumulation="tma_add"+impl.fused_lse=True'
B='dw.b_resident=True+dw.minor="n"+dw.epilogue_rows=64'
VARIANTS="$L;$L+$B;$L+$B+dw.cluster=\"n\";$L+$B+dw.cluster=None;$L+$B+dw.cluster=\"n\"+dw.max_concurrent_steps=3" \
  LAYOUT=vd CHUNK=512 ROUNDS=${ROUNDS:-5} timeout 300 python3 benchmarks/scratch/lce_gemm_variants.py 2>&1 \
  | grep -v -i warning | tee $OUT/resident-variants.log
timeout 100 python3 -m pytest -q -m gpu tests/ops/test_mosaic_gemm.py -k "not resident" 2>&1 \
  | tail -8 | tee $OUT/gemm-tests.log
