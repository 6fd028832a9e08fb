# ncu profile of the Mosaic attention backward at the headline shape (non-causal and causal),
# plus every kernel's duration in one fwd+bwd, and ptxas's register/spill report.
# env: MODES ("full causal"), CONFIG (MosaicBackwardConfig k=v,... or "default"), KERNEL (regex, "bwd").
. "$(dirname "$0")/../device_env.sh"
NCU=${NCU:-ncu}
command -v ncu >/dev/null || NCU=$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
for mode in ${MODES:-full causal}; do
  echo "=== durations $mode $(date +%T)"
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 200 $NCU --clock-control none --metrics gpu__time_duration.sum \
    python3 benchmarks/scratch/attn_bwd_profile.py $mode $CONFIG 2>&1 \
    | grep -v -i warning > $OUT/durations-$mode.log
  grep -E "spill|Used|registers" $OUT/durations-$mode.log | sort | uniq -c | head -20
  grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" $OUT/durations-$mode.log | paste - - \
    | awk '{print $1, $(NF)}' | tail -40
  echo "=== ncu full $mode $(date +%T)"
  timeout ${FULL_S:-240} $NCU --clock-control none -k regex:${KERNEL:-bwd} --launch-count 1 --set full \
    --import-source no -o /tmp/bwd-$mode python3 benchmarks/scratch/attn_bwd_profile.py $mode $CONFIG \
    2>&1 | grep -v -i warning | tail -5
  $NCU --import /tmp/bwd-$mode.ncu-rep --page details > $OUT/details-$mode.txt 2>&1
  $NCU --import /tmp/bwd-$mode.ncu-rep --page source --csv --print-source sass > $OUT/sass-$mode.csv 2>&1
  ls -la $OUT
done
echo "=== done $(date +%T)"
