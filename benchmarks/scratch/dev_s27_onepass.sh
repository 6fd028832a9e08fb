# Session 27: the one-pass backward's dQ path taken apart (onepass_ablate.py), both masks.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
for c in "" "--causal"; do
  timeout 280 python3 benchmarks/scratch/onepass_ablate.py --rounds 5 $c 2>&1 \
    | grep -v -i -E "warn|^$" | tee $OUT/onepass$c.log | tail -20
done
