# Session 18: host time of each piece of the bridged loss's call (bridge_host.py).
. "$(dirname "$0")/../device_env.sh"
timeout ${BENCH_S:-240} python3 benchmarks/scratch/bridge_host.py --profile 2>&1 | grep -v -i warn \
  | tee $OUT/bridge-host.log
