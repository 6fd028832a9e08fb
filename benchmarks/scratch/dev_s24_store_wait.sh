# Session 24: the ring kernels' store wait deferred to the epilogue (mosaic_gemm.DEFER_STORE_WAIT):
# the Mosaic GEMM tests, then the loss A/B in one process.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout ${TEST_S:-240} python3 -m pytest -q -m gpu -x tests/ops/test_mosaic_gemm.py 2>&1 | tail -3 | tee $OUT/tests.log
timeout 300 python3 benchmarks/scratch/store_wait_ab.py --rounds ${ROUNDS:-5} 2>&1 | grep -v -i warn | tee $OUT/ab.log
