# Session 22: the rest of the loss's GPU tests (test_memory and the Mosaic ones, which the
# first call's time limit cut), then the llama3-8b headline with exp_logits as the default.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -m gpu tests/ops/linear_cross_entropy \
  -k "test_memory or mosaic_gemms or fused_lse or exp_logits or refuse or Float32Dw" 2>&1 | tail -3 | tee $OUT/lce-gpu-tests-2.log
timeout 360 python3 benchmarks/linear_cross_entropy.py --set llama3-8b --rounds 3 \
  --providers floor,memeff,memeff:pallas_gpu:exp_logits=0,memeff:pallas_gpu:gemms=logits+dx+dw:dw=tma_add:fused_lse=1,liger \
  --out $OUT/linear_cross_entropy.jsonl 2>&1 | grep -v -i warn | tee $OUT/lce.log | tail -12
