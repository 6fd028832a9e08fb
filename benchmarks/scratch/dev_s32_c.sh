# Session 32: what a CTA's length costs. The non-causal backward (arrival order, and the
# deterministic default) at the headline's work with CTAs of 64, 32 and 16 steps (B·T fixed):
# a causal grid's CTAs average 33 steps. Whole backwards at the 700 W cap.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
for shape in 4,4096,32 16,2048,32 64,1024,32; do
  echo "== B,T,H = $shape"
  timeout -k 5 ${EACH_S:-150} python3 benchmarks/scratch/onepass_ordered.py --rounds 3 \
    --variants "arrival,all+rotate" --shape $shape 2>&1 | grep -E " ms |Error|error" 
done | tee $OUT/cta_length.log
