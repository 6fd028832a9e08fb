# Session 18: host time of each piece of the bridged loss's call (bridge_host.py), with JAX's
# BFC allocator and with cuda_async (the light setting's, whose peak has no BFC slack).
. "$(dirname "$0")/../device_env.sh"
timeout 150 python3 benchmarks/scratch/bridge_host.py 2>&1 | grep -v -i warn \
  | tee $OUT/bridge-host-bfc.log
XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async timeout 150 python3 benchmarks/scratch/bridge_host.py \
  2>&1 | grep -v -i warn | tee $OUT/bridge-host-async.log
