# Kernel durations under sustained load (REPS back-to-back calls traced by torch's profiler,
# which sees JAX's kernels too) against ncu's isolated ones: per call, the kernels' time, the
# span of the GPU's work and the gaps in it.
#   MODES="memeff liger" CHUNK=512 LCE_LAYOUT=vd REPS=12 bash benchmarks/scratch/dev_lce_trace.sh
. "$(dirname "$0")/../device_env.sh"
export REPS=${REPS:-12}
for mode in ${MODES:-memeff liger}; do
  tag=$mode${TAG:-}
  echo "=== $tag $(date +%T)"
  TRACE=/tmp/$tag.json timeout 300 python3 benchmarks/scratch/lce_profile.py $mode $CHUNK 2>&1 \
    | grep -v -i warning | grep done
  python3 - /tmp/$tag.json $((REPS - 2)) <<'PY'
import collections, json, sys
events = json.load(open(sys.argv[1]))
events = events["traceEvents"] if isinstance(events, dict) else events
k = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"),
           key=lambda e: e["ts"])
n = int(sys.argv[2])
calls, cur = [], [k[0]]
for e in k[1:]:  # a call ends where the GPU idles for > 1 ms (the host syncs between calls)
  if e["ts"] - max(x["ts"] + x["dur"] for x in cur) > 1000:
    calls.append(cur)
    cur = [e]
  else:
    cur.append(e)
calls.append(cur)
for i, c in enumerate(calls):
  span = max(x["ts"] + x["dur"] for x in c) - c[0]["ts"]
  busy = sum(x["dur"] for x in c)
  print(f"call {i}: {len(c)} kernels, span {span / 1e3:.3f} ms, kernels {busy / 1e3:.3f} ms, "
        f"gaps {(span - busy) / 1e3:.3f} ms")
agg = collections.OrderedDict()
for c in calls:
  for x in c:
    name = x["name"][:70]; m, t = agg.get(name, (0, 0.0)); agg[name] = (m + 1, t + x["dur"])
for name, (m, t) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
  print(f"{name:70s} {m / len(calls):6.1f}/call {t / len(calls) / 1e3:8.3f} ms/call {t / m:8.1f} us each")
PY
done
echo "=== done $(date +%T)"
