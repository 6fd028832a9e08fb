# Session 18: where the bridged light setting's time goes (bridge_overhead.py), with Liger.
. "$(dirname "$0")/../device_env.sh"
timeout ${BENCH_S:-420} python3 benchmarks/scratch/bridge_overhead.py 2>&1 | grep -v -i warn \
  | tee $OUT/bridge-overhead.log
