# Session 20: bridged attention's overhead against one jitted vjp (bridge_attn_ab.py).
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 400 python3 benchmarks/scratch/bridge_attn_ab.py ${ARGS:-} 2>&1 | grep -v -i warning | tee $OUT/bridge-attn-ab.log
