# Session 22: the GPU tests that exp_logits (now the default on Hopper) touches: the loss,
# the Mosaic GEMM's exp_out, the torch bridge's loss.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout ${T1:-330} python3 -m pytest -q -m gpu tests/ops/linear_cross_entropy ${K1:+-k "$K1"} 2>&1 | tail -6 | tee $OUT/lce-gpu-tests.log
timeout 100 python3 -m pytest -q -m gpu tests/ops/test_mosaic_gemm.py -k "exp_out or row_stats" 2>&1 | tail -2 | tee $OUT/gemm-gpu-tests.log
timeout ${T3:-150} python3 -m pytest -q -m gpu tests/interop -k "linear_cross_entropy or lce or loss" 2>&1 | tail -3 | tee $OUT/interop-gpu-tests.log
