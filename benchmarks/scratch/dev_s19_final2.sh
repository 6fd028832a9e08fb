# Session 19: after the eager Function for attention too: the bridge's GPU tests, the
# attention through the bridge against SDPA, and four more alternations of the light loss
# setting with Liger (fresh processes).
. "$(dirname "$0")/../device_env.sh"
timeout 200 python3 -m pytest -q -m gpu tests/interop -x 2>&1 | tail -3 | tee $OUT/interop-gpu-tests.log
timeout 200 python3 benchmarks/torch_bridge.py --op attention --out $OUT/bridge.jsonl 2>&1 \
  | grep -v -i warning | tee $OUT/bridge-attention.log
LIGHT=memeff:chunk=512:mosaic:tma:lse:async
PROVIDERS=${PROVIDERS:-liger,$LIGHT,liger,$LIGHT,liger,$LIGHT,liger,$LIGHT} . "$(dirname "$0")/bridge_loss_vs_liger.sh"
