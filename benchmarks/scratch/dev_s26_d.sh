# Session 26, round 2 of ping-pong on own slots: around the 192-wide dW tiles, and the exp
# GEMM on them.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 benchmarks/scratch/lce_dw_accumulate.py --rounds 5 --no-power \
  --tiles pp192_s4_ep64,pp192_nocl,pp192_cn,pp192_b8,pp192_minor_n,pp64x256 \
  --variants "cublas store,mosaic tma" 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/pp2-dw-alone.log
timeout 170 python3 benchmarks/scratch/dx_gemm_tiles.py --gemm dw_tma_dv --loss ${DW_LOSS:-pp192_s4_ep64,pp192_nocl,pp64x256} --rounds 5 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/pp2-dw-loss.log
timeout 130 python3 benchmarks/scratch/dx_gemm_tiles.py --gemm logits --loss pp192_s4_ep64,pp64x256 --rounds 5 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/pp2-logits-loss.log
