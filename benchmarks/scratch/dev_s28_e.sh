# Session 28: tensor-pipe use, warp stall reasons, shared-memory wavefronts and L2 sector
# traffic per kernel under ncu, cuDNN's backward beside ours (headline non-causal).
. "$(dirname "$0")/../device_env.sh"
NCU=${NCU:-ncu}
command -v ncu >/dev/null || NCU=$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
M=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
M=$M,sm__cycles_elapsed.avg,smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum
M=$M,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_sectors_op_red.sum,lts__t_sectors_op_atom.sum
M=$M,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum
M=$M,smsp__sass_inst_executed_op_local_ld.sum,smsp__sass_inst_executed_op_local_st.sum
M=$M,"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
for mode in ${MODES:-cudnn tuned default}; do
  python3 benchmarks/scratch/attn_bwd_profile.py ${MASK:-full} $mode > /dev/null 2>&1  # fill the cache
  timeout ${NCU_S:-150} $NCU --clock-control none -k "regex:bprop|bwd|dq_mosaic" --launch-count ${COUNT:-2} \
    --metrics "$M" python3 benchmarks/scratch/attn_bwd_profile.py ${MASK:-full} $mode 2>&1 \
    | grep -v -i warning > $OUT/metrics-$mode.txt
  echo "=== $mode"
  grep -E "^  [a-zA-Z_].*\(|hmma|elapsed|inst_executed|wavefronts|sectors|stalled" $OUT/metrics-$mode.txt \
    | awk '$NF != "0" && $NF != "0.00"' | head -60
done
