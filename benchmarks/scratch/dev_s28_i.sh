# Session 28: GPU tests after key_tiles (K/V operands at an opaque offset): every backward
# config against the reference (TESTS overrides the selection).
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout ${TEST_S:-540} python3 -m pytest -q -m gpu tests/ops/flash_attention/test_pallas_mosaic_gpu.py \
  -k "${TESTS:-mosaic_backward_matches_reference}" 2>&1 \
  | grep -v "^E1124\|^external\|^$" | tail -25 | tee $OUT/tests.log
