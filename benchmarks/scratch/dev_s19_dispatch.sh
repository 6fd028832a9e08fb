# Session 19: what JAX's dispatch of the light setting does before its first kernel, with
# cuda_async and BFC, and cuda_async without command buffers (bridge_trace.py).
. "$(dirname "$0")/../device_env.sh"
run() {  # tag, allocator, XLA_FLAGS
  echo "=== $1"
  XLA_PYTHON_CLIENT_ALLOCATOR=$2 XLA_FLAGS=$3 timeout 150 python3 benchmarks/scratch/bridge_trace.py \
    light --reps 4 2>&1 | grep -v -i warn | awk '/^--- step 3/,0' | grep -v "aten::\|host +" \
    | tee $OUT/dispatch-$1.log
}
run async cuda_async ""
run bfc default ""
run async-nocb cuda_async "--xla_gpu_enable_command_buffer="
