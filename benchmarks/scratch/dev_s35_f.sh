# Session 35: warp-stall samples per SASS instruction of one of our attention kernels (KERNEL, a
# regex of its name: the backward by default; the non-causal headline, one call): which
# instructions its warps wait at ($OUT/$KERNEL-sass.csv).
. "$(dirname "$0")/../device_env.sh"
K=${KERNEL:-flash_attention_bwd}
timeout ${NCU_S:-300} ncu --clock-control none -k "regex:$K" \
  --section WarpStateStats --section SourceCounters -o $OUT/$K -f \
  python3 benchmarks/scratch/ncu_attention.py $CAUSAL > $OUT/ncu.log 2>&1
ncu --import $OUT/$K.ncu-rep --page source --print-source sass --csv > $OUT/$K-sass.csv 2> $OUT/sass.err
ncu --import $OUT/$K.ncu-rep --page details > $OUT/$K-details.txt 2>&1
wc -l $OUT/$K-sass.csv; head -c 600 $OUT/sass.err; head -3 $OUT/$K-sass.csv | cut -c1-600
rm -f $OUT/$K.ncu-rep
