# Session 20: imports through jaxlib's DLPack import directly (the library's _import). GPU
# tests of the bridge, bridged attention against one jitted vjp (interleaved), then
# torch_bridge.py: attention, and the light loss setting alternated with Liger.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -m gpu tests/interop -x 2>&1 | tail -1 | tee $OUT/interop-gpu-tests.log
timeout 240 python3 benchmarks/scratch/bridge_attn_ab.py --rounds 7 \
  --variants bridge,nocb,jax_direct,sdpa_cudnn 2>&1 | grep -v -i warning | tee $OUT/bridge-attn-ab.log
timeout 150 python3 benchmarks/torch_bridge.py --op attention --out $OUT/bridge.jsonl 2>&1 \
  | grep -v -i warning | tee $OUT/bridge-attention.log
. "$(dirname "$0")/bridge_loss_vs_liger.sh"
