# Session 19: the light setting's idle-GPU time and first kernel under JAX allocator and XLA
# command-buffer settings (bridge_ab.py, the bridge against Liger in each process; the first
# GPU op from bridge_trace.py).
# (Run in session 19 with the eager Function since removed; its "function" is now "bridge".)
. "$(dirname "$0")/../device_env.sh"
which perf py-spy gdb nsys 2>&1 | head -5
run() {  # tag, allocator, XLA_FLAGS
  echo "=== $1"
  XLA_PYTHON_CLIENT_ALLOCATOR=$2 XLA_FLAGS=$3 timeout 120 python3 benchmarks/scratch/bridge_ab.py \
    --rounds 4 --variants bridge,liger 2>&1 | grep -v -i warn | grep medians
  XLA_PYTHON_CLIENT_ALLOCATOR=$2 XLA_FLAGS=$3 timeout 120 python3 benchmarks/scratch/bridge_trace.py \
    light --reps 5 2>&1 | grep "first GPU" | tail -3
}
run async cuda_async ""
run async-nocb cuda_async "--xla_gpu_enable_command_buffer="
run async-fusion-cb cuda_async "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL"
run bfc default ""
