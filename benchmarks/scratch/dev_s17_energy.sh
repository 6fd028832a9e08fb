# Session 17: energy per call of the attention pieces, ours against cuDNN's, at the headline
# (benchmarks/scratch/attn_energy.py).
. "$(dirname "$0")/../device_env.sh"
timeout ${BENCH_S:-300} python3 benchmarks/scratch/attn_energy.py 2>&1 | grep -v -i warn \
  | tee $OUT/energy.log
