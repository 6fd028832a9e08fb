# Session 28: cuDNN's attention kernels beside ours under ncu (launch shape, registers, shared
# memory, throughputs, stalls), headline non-causal: cuDNN, the default deterministic pair and
# the one-pass kernel (tuned, deterministic=False). Text per mode in $OUT/ncu-<mode>.txt.
. "$(dirname "$0")/../device_env.sh"
NCU=${NCU:-ncu}
command -v ncu >/dev/null || NCU=$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for mode in ${MODES:-cudnn default tuned}; do
  python3 benchmarks/scratch/attn_bwd_profile.py ${MASK:-full} $mode > /dev/null 2>&1  # fill the cache
  timeout ${NCU_S:-150} $NCU --clock-control none -k "regex:sdpa|fmha|flash|mosaic|cudnn|bprop|fprop" \
    --launch-count ${COUNT:-6} \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    python3 benchmarks/scratch/attn_bwd_profile.py ${MASK:-full} $mode 2>&1 \
    | grep -v -i warning > $OUT/ncu-$mode.txt
  echo "=== $mode: $(grep -c 'Section: GPU Speed' $OUT/ncu-$mode.txt) kernels"
  grep -E "^  [a-zA-Z_].*\(|Duration|Block Size|Grid Size|Registers Per|Shared Memory Config|Dynamic Shared|Compute \(SM\) Th|Memory Throughput|Executed Ipc A|L2 Cache Th|No Eligible" \
    $OUT/ncu-$mode.txt | head -80
done
