# Session 33 (written in session 32): the GPU tests the item-refactored backward has not yet
# run (its grid paths at D = 64 with pingpong, D = 256 with column_split, GQA with a CTA per
# query head; the rest of the persistent suites), side by side; then the headline's
# non-causal whole backward in arrival order, grid against persistent (the candidate
# default for deterministic=False), at the headline and at a 16-step-CTA shape where block
# starts and ends weigh four times as much; and (both masks) the CTAs' exit on their
# stores' read (session 32, unmeasured) against the landing wait before it.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
gpu_test_groups ${TEST_S:-270} "TestMosaicGpuFeaturesD64 and not Deterministic" \
  "TestMosaicGpuFeaturesD256 and not Deterministic" "mosaic_backward_matches_reference" \
  "mosaic_backward_d256_column_split" \
  "TestMosaicGpuPersistent and not Arrival" "TestMosaicGpuPersistentArrival"
for shape in 4,4096,32 64,1024,32; do
  echo "== B,T,H = $shape"
  timeout -k 5 ${EACH_S:-100} python3 benchmarks/scratch/onepass_ordered.py --rounds 3 \
    --variants "arrival,arrival (landing exit),arrival+persistent,all+rotate,all+rotate (landing exit)" \
    --shape $shape 2>&1 | grep -E " ms |identical|Error|error"
done | tee $OUT/persistent.log
echo "== causal" | tee -a $OUT/persistent.log
timeout -k 5 ${CA_S:-80} python3 benchmarks/scratch/onepass_ordered.py --rounds 3 --causal \
  --variants "send warp+two slots,send warp+two slots (landing exit)" 2>&1 \
  | grep -E " ms |identical|Error|error" | tee -a $OUT/persistent.log
