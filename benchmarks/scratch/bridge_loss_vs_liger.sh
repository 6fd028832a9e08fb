# Sourced by the dev_*.sh scripts after device_env.sh: torch_bridge.py --op loss, the light
# setting ($LIGHT: all three GEMMs on Mosaic, tma_add, fused_lse, 512-token chunks,
# cuda_async) alternated three times with Liger-Kernel in fresh processes, beside the floor,
# the default and jax_direct. PROVIDERS, BENCH_S (time limit) and LOG (under $OUT) override.
LIGHT=memeff:chunk=512:mosaic:tma:lse:async
timeout ${BENCH_S:-330} python3 benchmarks/torch_bridge.py --op loss \
  --providers ${PROVIDERS:-floor,memeff,jax_direct,$LIGHT,liger,$LIGHT,liger,$LIGHT,liger} \
  --out $OUT/bridge.jsonl 2>&1 | grep -v -i warning | tee $OUT/${LOG:-bridge-loss.log}
