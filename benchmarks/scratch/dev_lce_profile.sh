# Per-kernel durations (ncu) of the fused loss and of the floor at llama3-8b: one plain run
# fills the compilation cache (no autotuning under ncu), then ncu times every kernel.
#   MODES="memeff floor liger" CHUNK=512 TAG=-vd LCE_LAYOUT=vd LCE_GEMMS=logits+dx+dw bash benchmarks/scratch/dev_lce_profile.sh
. "$(dirname "$0")/../device_env.sh"
for mode in ${MODES:-memeff floor}; do
  echo "=== $mode $(date +%T)"
  python3 benchmarks/scratch/lce_profile.py $mode $CHUNK 2>&1 | grep -v -i warning
  timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum \
    python3 benchmarks/scratch/lce_profile.py $mode $CHUNK 2>&1 | grep -v -i warning > $OUT/lce-$mode${TAG:-}.log
  grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" $OUT/lce-$mode${TAG:-}.log | paste - - \
    | awk '{u=$(NF-1); v=$(NF); if (u=="ms") v*=1000; if (u=="ns") v/=1000; print $1, v}' > $OUT/lce-$mode${TAG:-}.txt
  python3 - $OUT/lce-$mode${TAG:-}.txt <<'PY'
import collections, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
second = rows[len(rows) // 2:]  # the second of the two identical calls
agg = collections.OrderedDict()
for name, us in second:
  n, t = agg.get(name, (0, 0.0)); agg[name] = (n + 1, t + float(us))
for name, (n, t) in agg.items():
  print(f"{name[:70]:70s} {n:4d} launches {t/1000:9.3f} ms total {t/n:9.1f} us each")
print(f"{'one call':70s} {len(second):4d} launches {sum(float(u) for _, u in second)/1000:9.3f} ms")
PY
done
echo "=== done $(date +%T)"
