# The LCE softmax kernel with a persistent grid: ncu durations of one variant, then the
# llama3-8b set with the floor and several kernel variants side by side.
. "$(dirname "$0")/../device_env.sh"
if [ -n "${NCU_KERNEL:-}" ]; then
for kern in $NCU_KERNEL; do
  echo "=== ncu $kern $(date +%T)"
  [ "$kern" = default ] && K= || K=$kern
  LCE_KERNEL=$K python3 benchmarks/scratch/lce_profile.py memeff 2>&1 | grep -v -i warning
  LCE_KERNEL=$K timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
    -k regex:softmax_grad --launch-count 3 python3 benchmarks/scratch/lce_profile.py memeff 2>&1 \
    | grep -E "softmax_grad|duration|bytes|hit_rate" | tail -5
done
fi
echo "=== bench $(date +%T)"
timeout ${BENCH_S:-400} python3 benchmarks/linear_cross_entropy.py --set llama3-8b --reps 10 \
  --out $OUT/results/linear_cross_entropy.jsonl --providers "$PROVIDERS" 2>&1 | grep -v -i warning | tee $OUT/bench.log
echo "=== done $(date +%T)"
