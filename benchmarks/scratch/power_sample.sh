# Sourced by the power diagnostics: `sample MODE LABEL CHUNK [VAR=value ...]` runs
# lce_profile.py MODE CHUNK with those variables while nvidia-smi samples the GPU every 50 ms,
# then prints the medians of the samples drawn while it ran (power above 300 W).
sample() {
  local mode=$1 label=$2 chunk=$3; shift 3
  nvidia-smi --query-gpu=power.draw,clocks.sm,clocks_throttle_reasons.active \
    --format=csv,noheader,nounits -lms 50 > /tmp/smi.csv &
  local pid=$!
  env "$@" timeout 200 python3 benchmarks/scratch/lce_profile.py $mode $chunk 2>&1 | grep done \
    | sed "s/^/$label /"
  kill $pid
  python3 - /tmp/smi.csv $label <<'PY'
import sys, statistics
rows = [l.split(", ") for l in open(sys.argv[1]) if l.strip()]
busy = [r for r in rows if float(r[0]) > 300]  # samples while the loss runs
if not busy:
  sys.exit(f"{sys.argv[2]}: no sample above 300 W (did the run fail?)")
p = [float(r[0]) for r in busy]; c = [float(r[1]) for r in busy]
print(f"{sys.argv[2]:12s} samples {len(busy):4d}  power median {statistics.median(p):6.1f} W "
      f"(max {max(p):.0f})  SM clock median {statistics.median(c):.0f} MHz (min {min(c):.0f})  "
      f"throttle reasons {sorted(set(r[2].strip() for r in busy))[:4]}")
PY
}
