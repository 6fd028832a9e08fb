# Session 27: Q (forward) and Q, dO (dq kernel) as WGMMA register operands: each kernel alone
# against its shared-memory twin, then the deterministic fwd+bwd (attn_registers.py), both masks.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
for c in "" "--causal"; do
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 280 python3 benchmarks/scratch/attn_registers.py --rounds 5 $c \
    > $OUT/regs-raw$c.log 2>&1
  grep -i -E "spill|Used [0-9]+ registers|^compiling" $OUT/regs-raw$c.log | head -80 > $OUT/regs-ptxas$c.log
  grep -v -i -E "ptxas|warn|spill|registers|^$|bytes stack|Compiling entry|Function properties" \
    $OUT/regs-raw$c.log | tee $OUT/regs$c.log | tail -40
done
