# Session 25, final code: every GPU test of the Mosaic GEMM and of the loss (the bridge's in
# dev_s25_h.sh), on one machine.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -m gpu tests/ops/test_mosaic_gemm.py 2>&1 | tail -3 | tee $OUT/gemm-tests.log
timeout 380 python3 -m pytest -q -m gpu tests/ops/linear_cross_entropy 2>&1 | tail -3 | tee $OUT/lce-gpu-tests.log
