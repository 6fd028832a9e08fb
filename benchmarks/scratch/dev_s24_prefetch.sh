# Session 24: the dW GEMM's TMA reduce-add target prefetched into L2 (mosaic_gemm.PREFETCH_ADD_TARGET):
# tests, the dW GEMM alone over 16 chunks, then the all-Mosaic loss, each A/B in one process.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
[ -n "$SKIP_TESTS" ] || timeout 150 python3 -m pytest -q -m gpu tests/ops/test_mosaic_gemm.py -k "tma_add or accumulates" 2>&1 | tail -2 | tee $OUT/tests.log
timeout 200 python3 benchmarks/scratch/lce_dw_accumulate.py --flag ${FLAG:-PREFETCH_ADD_TARGET} --no-power \
  --variants "cublas store,cublas add,mosaic tma store" --rounds ${ROUNDS:-5} 2>&1 | grep -v -i warn | tee $OUT/dw.log
timeout 240 python3 benchmarks/scratch/lce_flag_ab.py --flags mg.${FLAG:-PREFETCH_ADD_TARGET} --settings all-Mosaic \
  --rounds ${ROUNDS:-5} 2>&1 | grep -v -i warn | tee $OUT/loss.log
