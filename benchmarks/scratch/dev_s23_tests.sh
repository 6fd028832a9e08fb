# Session 23: the GPU tests that the exp_logits changes touch (the loss's exp, Mosaic and
# memory tests, the Mosaic GEMM's exp_out, the torch bridge's loss).
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout ${T1:-330} python3 -m pytest -q -m gpu tests/ops/linear_cross_entropy \
  -k "${K1:-exp_logits or test_memory or mosaic_gemms or fused_lse or refuse}" 2>&1 | tail -6 | tee $OUT/lce-gpu-tests.log
timeout ${T3:-150} python3 -m pytest -q -m gpu tests/interop -k "linear_cross_entropy or lce or loss" 2>&1 | tail -3 | tee $OUT/interop-gpu-tests.log
