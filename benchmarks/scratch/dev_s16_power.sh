# Session 16: power draw and SM clock (nvidia-smi, every 50 ms) while the light setting, the
# floor and Liger-Kernel run back to back: is the loss at the power cap?
. "$(dirname "$0")/../device_env.sh"
export LCE_GEMMS=logits+dx+dw LCE_DW=tma_add LCE_FUSED_LSE=1 LCE_LAYOUT=vd REPS=40
for mode in memeff floor liger; do
  nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks.mem,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader,nounits -lms 50 > /tmp/smi-$mode.csv &
  pid=$!
  timeout 200 python3 benchmarks/scratch/lce_profile.py $mode 512 2>&1 | grep done
  kill $pid
  python3 - /tmp/smi-$mode.csv $mode <<'PY'
import sys, statistics
rows = [l.split(", ") for l in open(sys.argv[1]) if l.strip()]
busy = [r for r in rows if float(r[1]) > 300]  # samples while the loss runs
p = [float(r[1]) for r in busy]; c = [float(r[2]) for r in busy]
print(f"{sys.argv[2]:8s} samples {len(busy):4d}  power median {statistics.median(p):6.1f} W "
      f"(max {max(p):.0f})  SM clock median {statistics.median(c):.0f} MHz (min {min(c):.0f})  "
      f"throttle reasons {sorted(set(r[5].strip() for r in busy))[:4]}")
PY
done 2>&1 | tee $OUT/power.log
