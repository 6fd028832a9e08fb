# Session 16: power and clock of the floor, the default loss (cuBLAS, "dv" 1,024) and the
# all-Mosaic loss (0.245 GiB) under sustained load: energy per call = power x time.
. "$(dirname "$0")/../device_env.sh"
export LCE_LAYOUT=dv REPS=40
sample() {  # mode, label, env...
  local mode=$1 label=$2; shift 2
  nvidia-smi --query-gpu=power.draw,clocks.sm --format=csv,noheader,nounits -lms 50 > /tmp/smi.csv &
  local pid=$!
  env "$@" timeout 200 python3 benchmarks/scratch/lce_profile.py $mode 1024 2>&1 | grep done \
    | sed "s/^/$label /"
  kill $pid
  python3 - /tmp/smi.csv $label <<'PY'
import sys, statistics
rows = [l.split(", ") for l in open(sys.argv[1]) if l.strip()]
busy = [(float(p), float(c)) for p, c in rows if float(p) > 300]
print(f"{sys.argv[2]:12s} samples {len(busy):4d}  power median {statistics.median(b[0] for b in busy):6.1f} W  "
      f"SM clock median {statistics.median(b[1] for b in busy):.0f} MHz")
PY
}
{
sample floor floor
sample memeff default
sample memeff all-mosaic LCE_GEMMS=logits+dx+dw LCE_DW=tma_add LCE_FUSED_LSE=1
sample floor floor
} 2>&1 | tee $OUT/power-dv.log
