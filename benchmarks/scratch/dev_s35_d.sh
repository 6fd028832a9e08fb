# Session 35: our attention kernels and cuDNN's under ncu (launch configuration, occupancy,
# speed of light, memory traffic, warp stalls), non-causal headline, one call each.
. "$(dirname "$0")/../device_env.sh"
timeout ${NCU_S:-400} ncu --clock-control none -k "regex:flash_attention|fprop|bprop" \
  --section SpeedOfLight --section LaunchStats --section Occupancy \
  --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section ComputeWorkloadAnalysis --section WarpStateStats \
  python3 benchmarks/scratch/ncu_attention.py $CAUSAL 2>&1 | grep -v -i "warn" > $OUT/ncu.txt
grep -E "^  [a-z_].*\(|Duration|Registers Per|Shared Memory Config|Dynamic Shared|Block Size|Grid Size|Threads|Achieved Occupancy|Theoretical Occupancy|Block Limit|L2 Cache Throughput|DRAM Throughput|Memory Throughput|Compute \(SM\)|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Issue Slots|Executed Ipc|Warp Cycles Per Issued|Stall" $OUT/ncu.txt | head -150
