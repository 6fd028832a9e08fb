# Session 20, final code: GPU tests of the bridge, and bridged attention against one jitted vjp.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -m gpu tests/interop 2>&1 | tail -3 | tee $OUT/interop-gpu-tests.log
timeout 240 python3 benchmarks/scratch/bridge_attn_ab.py --rounds 7 \
  --variants bridge,jax_direct,sdpa_cudnn 2>&1 | grep -v -i warning | tee $OUT/bridge-attn-ab.log
