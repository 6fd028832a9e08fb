# Session 19: one bridged loss step from an idle GPU on the host's and the GPU's timelines
# (bridge_trace.py), the light setting with cuda_async and BFC, the default, and Liger.
. "$(dirname "$0")/../device_env.sh"
for m in ${MODES:-light-async light default liger}; do
  echo "=== $m $(date +%T)"
  alloc=; [[ $m == *-async ]] && alloc=cuda_async
  XLA_PYTHON_CLIENT_ALLOCATOR=${alloc:-default} timeout 200 python3 benchmarks/scratch/bridge_trace.py \
    ${m%-async} --reps ${REPS:-4} 2>&1 | grep -v -i warn | tee $OUT/trace-$m.log
done
