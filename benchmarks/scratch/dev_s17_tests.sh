# Session 17: the attention GPU tests after block_q (the Mosaic kernels' file whole, or the
# tests named by K), in 4 pytest-xdist workers.
. "$(dirname "$0")/../device_env.sh"
N=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4" || echo "")
timeout ${TEST_S:-540} python3 -m pytest -q -m gpu -p no:cacheprovider $N ${K:+-k "$K"} \
  ${FILES:-tests/ops/flash_attention/test_pallas_mosaic_gpu.py} 2>&1 | grep -v -i warn \
  | tail -15 | tee $OUT/tests.log
