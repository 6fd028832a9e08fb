# Session 20: host time of each piece of a bridged attention call, BFC and cuda_async.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for c in 1 0; do
  echo "== causal=$c, BFC" | tee -a $OUT/host.log
  timeout 150 python3 benchmarks/scratch/bridge_attn_host.py --causal $c 2>&1 | grep -v -i warning | tee -a $OUT/host.log
done
echo "== causal=1, cuda_async" | tee -a $OUT/host.log
XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async timeout 150 python3 benchmarks/scratch/bridge_attn_host.py --causal 1 2>&1 | grep -v -i warning | tee -a $OUT/host.log
