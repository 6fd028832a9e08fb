# Device diagnostic for the bridged loss's memory: XLA options, allocators, the backward sync.
. "$(dirname "$0")/../device_env.sh"
echo "=== temps $(date +%T)"
timeout 200 python3 benchmarks/scratch/lce_temps.py 2>&1 | grep -v -i warning | tee $OUT/temps.log
echo "=== bridge $(date +%T)"
run() {  # run ALLOC NO_SYNC OPTIONS
  for i in 1 2; do
    XLA_PYTHON_CLIENT_ALLOCATOR=$1 NO_SYNC=$2 timeout 80 python3 benchmarks/scratch/bridge_options.py 512 "$3" $([ $i = 1 ] && echo 1 || echo 10) 2>&1 | grep -E "^ROW|Error|error" | tail -1
  done
}
F='{"xla_gpu_experimental_force_split_k": 1, "xla_gpu_enable_cublaslt": true}'
{ run default "" '{}'; run cuda_async "" '{}'; run default "" "$F"; run default 1 "$F"; run platform "" "$F"; } | tee $OUT/bridge.log
echo "=== liger $(date +%T)"
timeout 60 python3 benchmarks/torch_bridge.py --op loss --providers liger --out $OUT/tb.jsonl 2>&1 | grep -v -i warning | tail -3
echo "=== done $(date +%T)"
