# Session 35: warp-stall samples per SASS instruction of our deterministic backward kernel
# (non-causal headline, one call): which instructions its warps wait at ($OUT/bwd-sass.csv).
. "$(dirname "$0")/../device_env.sh"
timeout ${NCU_S:-300} ncu --clock-control none -k "regex:${KERNEL:-flash_attention_bwd}" \
  --section WarpStateStats --section SourceCounters -o $OUT/bwd -f \
  python3 benchmarks/scratch/ncu_attention.py $CAUSAL > $OUT/ncu.log 2>&1
ncu --import $OUT/bwd.ncu-rep --page source --print-source sass --csv > $OUT/bwd-sass.csv 2> $OUT/sass.err
ncu --import $OUT/bwd.ncu-rep --page details > $OUT/bwd-details.txt 2>&1
wc -l $OUT/bwd-sass.csv; head -c 600 $OUT/sass.err; head -3 $OUT/bwd-sass.csv | cut -c1-600
rm -f $OUT/bwd.ncu-rep
