. benchmarks/device_env.sh
MODES=memeff CHUNK=512 LCE_LAYOUT=vd TAG=-vd-cublas REPS=8 bash benchmarks/scratch/dev_lce_trace.sh 2>&1 | grep -E "done|call [0-9]"
echo "=== no command buffers"
XLA_FLAGS=--xla_gpu_enable_command_buffer= MODES=memeff CHUNK=512 LCE_LAYOUT=vd TAG=-vd-cublas-nocb REPS=8 bash benchmarks/scratch/dev_lce_trace.sh 2>&1 | grep -E "done|call [0-9]"
echo "=== harness"
for flags in "" "--xla_gpu_enable_command_buffer="; do
  echo "XLA_FLAGS=$flags"
  XLA_FLAGS=$flags timeout 200 python3 benchmarks/linear_cross_entropy.py --set llama3-8b --reps 10 --out $OUT/results/lce.jsonl \
    --providers floor,memeff,memeff:pallas_gpu:layout=vd:budget_mib=126,memeff:pallas_gpu:layout=vd:budget_mib=126:gemms=logits+dx+dw 2>&1 | grep -E "^  (floor|memeff)"
done
