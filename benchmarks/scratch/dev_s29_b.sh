# Session 29, for the next device session: dq_ordered (the one-pass backward's dq reductions
# in a fixed order) on the GPU. WHAT=tests (default): GPU test groups, four pytest processes
# side by side, each group's summary and failures in $OUT/tests.log (TEST_GROUPS overrides the
# groups, ';'-separated -k expressions). WHAT=time: onepass_ordered.py, both masks, with
# ptxas's reports.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
if [ "${WHAT:-tests}" = tests ]; then
  IFS=';' read -ra groups <<< "${TEST_GROUPS:-ordered_backward_is_bitwise;TestMosaicGpuOrderedDq and not D256;TestMosaicGpuOrderedDqD256;TestMosaicGpuFeaturesDeterministic and not D64 and not D256}"
  gpu_test_groups ${TEST_S:-300} "${groups[@]}"
else
  for c in "" "--causal"; do  # ptxas's report per variant (spills, WGMMA serialization)
    MOSAIC_GPU_DUMP_PTXAS=1 timeout 280 python3 benchmarks/scratch/onepass_ordered.py \
      --rounds 5 $c > $OUT/raw$c.log 2>&1
    grep -i -E "bytes stack frame|serializ|C75[0-9][0-9]" $OUT/raw$c.log > $OUT/ptxas$c.log
    grep -v -i -E "ptxas|warn|spill|registers|^$|bytes stack|Compiling entry|Function properties" \
      $OUT/raw$c.log | tee $OUT/ordered$c.log
  done
fi
