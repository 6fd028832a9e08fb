# Session 28: the pipelined one-pass backward with dK reading dSᵀ from shared memory
# (onepass_dk_smem.py), ptxas spills and timings, both masks.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
for c in "" "--causal"; do
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 250 python3 benchmarks/scratch/onepass_dk_smem.py --rounds 5 $c \
    > $OUT/dk-smem-raw$c.log 2>&1
  grep -i -E "spill" $OUT/dk-smem-raw$c.log | sort | uniq -c | head > $OUT/dk-smem-ptxas$c.log
  cat $OUT/dk-smem-ptxas$c.log
  grep -v -i -E "ptxas|warn|spill|registers|^$|bytes stack|Compiling entry|Function properties" \
    $OUT/dk-smem-raw$c.log | tee $OUT/dk-smem$c.log | tail -12
done
