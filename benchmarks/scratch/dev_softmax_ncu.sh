# ncu's sections for the softmax-gradient pass of one steady-state 512-token chunk (llama3-8b,
# "vd"), ours (Pallas Triton) against Liger-Kernel's cross-entropy kernel: ours takes 140-144
# µs under load, Liger's 116. Text in $OUT.
. "$(dirname "$0")/../device_env.sh"
export LCE_LAYOUT=vd LCE_GEMMS=logits+dx+dw LCE_DW=tma_add
S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy --section InstructionStats"
python3 benchmarks/scratch/lce_profile.py memeff 512 > /dev/null 2>&1  # fill the cache
timeout 200 ncu --clock-control none -k regex:softmax_grad --launch-skip 12 --launch-count 2 $S \
  python3 benchmarks/scratch/lce_profile.py memeff 512 2>&1 | grep -v -i warning > $OUT/ncu-softmax-ours.txt
timeout 200 ncu --clock-control none -k regex:liger_cross_entropy --launch-skip 12 --launch-count 2 $S \
  python3 benchmarks/scratch/lce_profile.py liger 512 2>&1 | grep -v -i warning > $OUT/ncu-softmax-liger.txt
for f in ours liger; do
  echo "=== $f"; grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Executed Ipc A|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Size|Grid Size|L2 Hit|Executed Instructions  |Issue Slots Busy|No Eligible" $OUT/ncu-softmax-$f.txt | head -40
done
