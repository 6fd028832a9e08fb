# Session 36: dq_stagger (the compute warpgroups half a step apart). Its GPU tests, then the
# headline fwd+bwd against the deterministic default, both masks, with ptxas's spill report.
. "$(dirname "$0")/../device_env.sh"
# TGROUPS: pytest -k expressions separated by ';'.
IFS=';' read -ra groups <<< "${TGROUPS:-staggered;TestMosaicGpuOrderedDqStagger}"
gpu_test_groups ${TEST_S:-200} "${groups[@]}"
ab() {  # ab NAME [--causal] VARIANTS...
  local name=$1; shift
  echo "== bwd_config_ab $name" | tee -a $OUT/ab.log
  MOSAIC_GPU_DUMP_PTXAS=1 timeout -k 5 ${AB_S:-170} python3 benchmarks/scratch/bwd_config_ab.py \
    --rounds ${ROUNDS:-5} "$@" > $OUT/ab-$name-full.log 2>&1
  grep -i "spill\|^== " $OUT/ab-$name-full.log | sort | uniq -c | head -20 | tee -a $OUT/ab.log
  grep -v -i "warn\|ptxas\|spill\|bytes stack\|registers\|^ *$" $OUT/ab-$name-full.log \
    | tail -${TAIL:-10} | tee -a $OUT/ab.log
}
ab noncausal ${VARIANTS_NC:-dq_stagger=true}
ab causal --causal ${VARIANTS_C:-fused_delta=false dq_stagger=true,fused_delta=false}
