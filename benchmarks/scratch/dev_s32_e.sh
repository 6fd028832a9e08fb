# Session 32: the persistent backward with rotated walks on whole heads a round (128 of 132
# CTAs at the headline), non-causal, against the grid; arrival order both ways.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout -k 5 ${NC_S:-200} python3 benchmarks/scratch/onepass_ordered.py --rounds 3 \
  --variants "arrival,all+rotate,arrival+persistent,all+rotate+persistent" 2>&1 \
  | grep -v -i -E "ptxas|warn|spill|registers|^$|bytes stack" | tee $OUT/ordered.log
