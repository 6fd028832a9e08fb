# Session 18: the bridged loss at llama3-8b with the queued timing (torch_bridge.py's
# queued_ms): the light setting alternated three times with Liger-Kernel, beside the floor,
# the default and the same JAX function called directly.
. "$(dirname "$0")/../device_env.sh"
P=memeff:chunk=512:mosaic:tma:lse:async
timeout 580 python3 benchmarks/torch_bridge.py --op loss \
  --providers ${PROVIDERS:-floor,memeff,jax_direct,$P,liger,$P,liger,$P,liger} \
  --out $OUT/bridge.jsonl 2>&1 | grep -v -i warning | tee $OUT/bridge.log
