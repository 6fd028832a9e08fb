# Session 28: the pipelined one-pass backward's spills (onepass_spills.py: dK reading dSᵀ from
# shared memory, dSᵀ before Pᵀ's cast, both; its first run had dK from smem alone), ptxas
# spills in compile order and timings, both masks.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
for c in "" "--causal"; do
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 270 python3 benchmarks/scratch/onepass_spills.py --rounds 5 $c \
    > $OUT/spills-raw$c.log 2>&1
  grep -i -E "bytes stack frame" $OUT/spills-raw$c.log > $OUT/spills-ptxas$c.log
  cat $OUT/spills-ptxas$c.log
  grep -v -i -E "ptxas|warn|spill|registers|^$|bytes stack|Compiling entry|Function properties" \
    $OUT/spills-raw$c.log | tee $OUT/spills$c.log | tail -12
done
