# Session 26, final code: every GPU test of the Mosaic GEMM (the shared-memory check must
# let every tested config through).
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 280 python3 -m pytest -q -m gpu tests/ops/test_mosaic_gemm.py --tb=short 2>&1 | grep -v "^E1124\|^===\|^external\|^$" | tail -6 | tee $OUT/gemm-tests.log
