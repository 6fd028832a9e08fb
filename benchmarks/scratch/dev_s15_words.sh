# Session 15: fused_lse's partials stored as words in dx's rows (mosaic_gemm row_stats_into):
# GPU tests, the loss's temporaries and time ("vd" 512), then the bridge against Liger.
. "$(dirname "$0")/../device_env.sh"
timeout 150 python3 -m pytest -q -m gpu tests/ops/test_mosaic_gemm.py -k "window or row_stats or tail" 2>&1 | tail -2
timeout 150 python3 -m pytest -q -m gpu tests/ops/linear_cross_entropy -k "fused or mosaic_gemms" 2>&1 | tail -2
L='impl.dw_accumulation="tma_add"'
VARIANTS="$L+impl.fused_lse=True;$L" LAYOUT=vd CHUNK=512 ROUNDS=3 timeout 150 \
  python3 benchmarks/scratch/lce_gemm_variants.py 2>&1 | grep -v -i warning
P=memeff:chunk=512:mosaic:tma
timeout 250 python3 benchmarks/torch_bridge.py --op loss \
  --providers floor,$P:lse:async,$P:async,liger,$P:lse:async,liger --out $OUT/bridge.jsonl 2>&1 \
  | grep -v -i warning
