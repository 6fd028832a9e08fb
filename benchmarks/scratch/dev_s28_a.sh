# Session 28: the GPU tests of the one-pass backward after session 27's three refactors
# (store_dq, share_ds, the pipelined step branching after the softmax): every backward
# config against the reference, then the features suite through dq_pipelined.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 550 python3 -m pytest -q -m gpu tests/ops/flash_attention/test_pallas_mosaic_gpu.py \
  -k "mosaic_backward_matches_reference or Pipelined" 2>&1 \
  | grep -v "^E1124\|^external\|^$" | tail -25 | tee $OUT/tests.log
