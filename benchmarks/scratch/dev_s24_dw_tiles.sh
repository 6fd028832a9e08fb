# Session 24: the dW GEMM (TMA adds) with narrower CTA tiles inside the all-Mosaic loss.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
cd benchmarks/scratch
timeout 540 python3 dx_gemm_tiles.py --gemm dw_tma_dv --rounds ${ROUNDS:-5} \
  --loss ${LOSS:-n64_s6,m64_n160_s5,m64_n192_s4,m64_n256_s3,splitm_n160_s3,n80_s5} 2>&1 \
  | grep -v -i warn | tee $OUT/dw-tiles.log
