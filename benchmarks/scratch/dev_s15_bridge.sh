# Session 15: the bridge's loss with the logits GEMM's tail tiles (configs/tuning logits_vd)
# against Liger, in one run; the "dv" 1,024 all-Mosaic loss with and without tail tiles;
# a trace of the bridge's fused_lse setting under load.
. "$(dirname "$0")/../device_env.sh"
P=memeff:chunk=512:mosaic:tma
timeout 260 python3 benchmarks/torch_bridge.py --op loss \
  --providers floor,$P:lse:async,$P:async,liger,$P:lse:async,liger --out $OUT/bridge.jsonl 2>&1 \
  | grep -v -i warning
L='impl.dw_accumulation="tma_add"'
VARIANTS="$L+impl.fused_lse=True;$L+impl.fused_lse=True+logits.tail_n=64;$L;$L+logits.tail_n=64" \
  LAYOUT=dv CHUNK=1024 ROUNDS=3 timeout 200 python3 benchmarks/scratch/lce_gemm_variants.py 2>&1 \
  | grep -v -i warning
LCE_FUSED_LSE=1 TAG=-tail MODES=bridge LCE_LAYOUT=vd CHUNK=512 REPS=10 timeout 120 \
  bash benchmarks/scratch/dev_lce_trace.sh 2>&1 | grep -v "^call"
