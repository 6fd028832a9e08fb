# ncu's sections (speed of light, warp stalls, memory) for one steady-state chunk's three
# GEMMs of the fused loss at llama3-8b, cuBLAS against ops.mosaic_gemm, "vd" at 512 tokens.
#   bash benchmarks/scratch/dev_lce_ncu_detail.sh        (on the GPU machine; text in $OUT)
. "$(dirname "$0")/../device_env.sh"
export LCE_LAYOUT=${LCE_LAYOUT:-vd}
for gemms in cublas logits+dx+dw; do
  if [ $gemms = cublas ]; then unset LCE_GEMMS; regex="regex:nvjet"; else export LCE_GEMMS=$gemms; regex="regex:mosaic"; fi
  python3 benchmarks/scratch/lce_profile.py memeff ${CHUNK:-512} > /dev/null 2>&1  # fill the cache
  timeout 240 ncu --clock-control none -k "$regex" --launch-skip 12 --launch-count 3 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy \
    python3 benchmarks/scratch/lce_profile.py memeff ${CHUNK:-512} 2>&1 | grep -v -i warning > $OUT/ncu-detail-${gemms//+/-}.txt
  echo "=== $gemms: $(grep -c 'Section: GPU Speed' $OUT/ncu-detail-${gemms//+/-}.txt) kernels"
done
