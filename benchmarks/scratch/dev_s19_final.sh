# Session 19: the bridge with the eager Function, one-handshake imports and the backward's
# on-GPU scale (no host sync): GPU tests, bridge_ab.py, then torch_bridge.py's light setting
# alternated with Liger in fresh processes beside the floor, the default and jax_direct.
. "$(dirname "$0")/../device_env.sh"
timeout 200 python3 -m pytest -q -m gpu tests/interop -x 2>&1 | tail -3 | tee $OUT/interop-gpu-tests.log
XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async timeout 200 python3 benchmarks/scratch/bridge_ab.py \
  --rounds ${ROUNDS:-5} 2>&1 | grep -v -i warn | tee $OUT/bridge-ab.log
LOG=bridge.log . "$(dirname "$0")/bridge_loss_vs_liger.sh"
