# Session 26: GemmConfig.skew (the second compute warpgroup K steps behind the first, so that
# their epilogues do not coincide): GPU tests, the dW GEMM alone over 16 chunks, then the
# loss with the skew on the dW GEMM and on the exp (logits) GEMM.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 150 python3 -m pytest -q -m gpu tests/ops/test_mosaic_gemm.py -k "ringS or ringES" 2>&1 | tail -3 | tee $OUT/skew-tests.log
timeout 150 python3 benchmarks/scratch/lce_dw_accumulate.py --rounds 5 --no-power --skew 1,2,3 \
  --variants "cublas store,mosaic tma store,mosaic tma,mosaic tma skew1,mosaic tma skew2,mosaic tma skew3" 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/skew-dw-alone.log
timeout 130 python3 benchmarks/scratch/dx_gemm_tiles.py --gemm dw_tma_dv --loss skew1,skew2 --rounds 5 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/skew-dw-loss.log
timeout 130 python3 benchmarks/scratch/dx_gemm_tiles.py --gemm logits --loss skew1,skew2 --rounds 5 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/skew-logits-loss.log
