# Warp-stall samples per SASS instruction of one steady-state dW += GEMM of the fused loss
# (ops.mosaic_gemm, "vd" at 512 tokens): which instructions the warps wait at.
#   bash benchmarks/scratch/dev_lce_ncu_sass.sh      (on the GPU machine; $OUT/dw-sass.csv)
. "$(dirname "$0")/../device_env.sh"
export LCE_LAYOUT=vd LCE_GEMMS=logits+dx+dw
python3 benchmarks/scratch/lce_profile.py memeff 512 > /dev/null 2>&1  # fill the cache
# per chunk: logits, dW +=, dx (the first chunk: logits, dx, dW =): launch 13 is a dW +=
timeout 200 ncu --clock-control none -k regex:mosaic --launch-skip ${SKIP:-13} --launch-count 1 \
  --section WarpStateStats --section SourceCounters -o $OUT/dw -f \
  python3 benchmarks/scratch/lce_profile.py memeff 512 > $OUT/ncu.log 2>&1
ncu --import $OUT/dw.ncu-rep --page source --print-source sass --csv > $OUT/dw-sass.csv 2> $OUT/sass.err
ncu --import $OUT/dw.ncu-rep --page details > $OUT/dw-details.txt 2>&1
wc -l $OUT/dw-sass.csv; head -c 600 $OUT/sass.err
rm -f $OUT/dw.ncu-rep
