# Session 27, second round: the one-pass backward's dQ path with the fence cuts too
# (onepass_ablate.py), non-causal.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 280 python3 benchmarks/scratch/onepass_ablate.py --rounds 5 2>&1 \
  | grep -v -i -E "warn|^$" | tee $OUT/onepass2.log | tail -30
