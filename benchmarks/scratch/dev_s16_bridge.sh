# Session 16: the bridged loss at llama3-8b, issue 5's comparison: the light setting
# (all-Mosaic, 512-token chunks, tma_add, fused_lse, cuda_async) alternated three times with
# Liger-Kernel, beside the floor, the default and the same JAX function called directly.
. "$(dirname "$0")/../device_env.sh"
P=memeff:chunk=512:mosaic:tma:lse:async
timeout 560 python3 benchmarks/torch_bridge.py --op loss \
  --providers floor,memeff,jax_direct,$P,liger,$P,liger,$P,liger --out $OUT/bridge.jsonl 2>&1 \
  | grep -v -i warning | tee $OUT/bridge.log
