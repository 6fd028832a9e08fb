# Session 28: K/V operands at an opaque offset (onepass_opaque.py): ptxas spills in compile
# order (before, opaque; one-pass then dK/dV) and timings, both masks; the PTX and ptxas
# report of the new one-pass kernel (non-causal) in $OUT/dump.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
for c in "" "--causal"; do
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 250 python3 benchmarks/scratch/onepass_opaque.py --rounds 5 $c \
    > $OUT/opaque-raw$c.log 2>&1
  grep -i -E "bytes stack frame" $OUT/opaque-raw$c.log | tee $OUT/opaque-ptxas$c.log
  grep -v -i -E "ptxas|warn|spill|registers|^$|bytes stack|Compiling entry|Function properties" \
    $OUT/opaque-raw$c.log | tee $OUT/opaque$c.log | tail -14
done
