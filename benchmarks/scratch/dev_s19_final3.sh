# Session 19, after removing the eager Function: exits of processes that ran the bridge
# (bridge_exit_loop.sh), GPU tests, then torch_bridge.py: attention against SDPA and the
# light loss setting alternated with Liger in fresh processes.
. "$(dirname "$0")/../device_env.sh"
MODES="op lce-op" bash benchmarks/scratch/bridge_exit_loop.sh 2>&1 | grep -E "^ +[0-9]+ " | tee $OUT/exit-loop.log
timeout 200 python3 -m pytest -q -m gpu tests/interop -x 2>&1 | tail -1 | tee $OUT/interop-gpu-tests.log
timeout 150 python3 benchmarks/torch_bridge.py --op attention --out $OUT/bridge.jsonl 2>&1 \
  | grep -v -i warning | tee $OUT/bridge-attention.log
BENCH_S=${BENCH_S:-300} . "$(dirname "$0")/bridge_loss_vs_liger.sh"
