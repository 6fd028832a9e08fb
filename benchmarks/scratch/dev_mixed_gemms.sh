# Session 13: which of the three GEMMs to leave on cuBLAS at "vd" 512 tokens (time and
# compiled temporaries): all-Mosaic with dW by TMA reduce-add against one GEMM on cuBLAS.
. benchmarks/device_env.sh
T='impl.dw_accumulation="tma_add"'
VARIANTS="$T;impl.mosaic_gemms=(\"logits\",\"dx\");$T+impl.mosaic_gemms=(\"logits\",\"dw\");$T+impl.mosaic_gemms=(\"dx\",\"dw\");impl.mosaic_gemms=(\"dx\",)" \
  LAYOUT=vd CHUNK=512 ROUNDS=${ROUNDS:-3} timeout 500 python3 benchmarks/scratch/lce_gemm_variants.py 2>&1 | grep -v Warning
