# Session 20, final code: torch_bridge.py attention (idle and queued), twice.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for i in 1 2; do
timeout 250 python3 benchmarks/torch_bridge.py --op attention --providers memeff,jax_direct,sdpa_cudnn,memeff --out $OUT/bridge.jsonl 2>&1 \
  | grep -v -i warning | tee -a $OUT/bridge-attention.log
done
