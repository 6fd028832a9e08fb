# Forward turn-ordering variants (headline set, peers alongside) and the backward's dq
# reduction ablation. Logs into $OUT.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
if [ -n "${ABLATE:-1}" ]; then
echo "=== ablate $(date +%T)"
timeout ${ABLATE_S:-150} python3 benchmarks/scratch/bwd_ablate.py 2>&1 | grep -v -i warning | tee $OUT/ablate.log
fi
[ -z "$PROVIDERS" ] && exit 0
echo "=== headline $(date +%T)"
timeout ${BENCH_S:-400} python3 benchmarks/flash_attention.py --set headline --reps 10 \
  --out $OUT/results/flash_attention.jsonl --providers "$PROVIDERS" 2>&1 | grep -v -i warning | tee $OUT/headline.log
echo "=== done $(date +%T)"
