# Session 36: bwd_config_ab runs (ptxas's spill report beside each), no tests. AB: a list of
# runs separated by ';', each "NAME ARGS..." (bwd_config_ab.py's flags and variants).
. "$(dirname "$0")/../device_env.sh"
IFS=';' read -ra runs <<< "$AB"
for r in "${runs[@]}"; do
  set -- $r
  name=$1; shift
  echo "== bwd_config_ab $name: $*" | tee -a $OUT/ab.log
  MOSAIC_GPU_DUMP_PTXAS=1 timeout -k 5 ${AB_S:-200} python3 benchmarks/scratch/bwd_config_ab.py \
    --rounds ${ROUNDS:-5} "$@" > $OUT/ab-$name-full.log 2>&1
  grep -i "spill\|^== " $OUT/ab-$name-full.log | sort | uniq -c | head -20 | tee -a $OUT/ab.log
  grep -v -i "warn\|ptxas\|spill\|bytes stack\|registers\|^ *$" $OUT/ab-$name-full.log \
    | tail -${TAIL:-12} | tee -a $OUT/ab.log
done
