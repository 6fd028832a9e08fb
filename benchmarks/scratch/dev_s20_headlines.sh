# Session 20: where issues 2 and 3 stand on today's main (no kernel changed since session 18):
# the attention headline (3 interleaved rounds) or the loss at llama3-8b (3 rounds).
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
if [ "${WHAT:-attention}" = attention ]; then
  timeout 560 python3 benchmarks/flash_attention.py --set ${SET:-headline} --rounds 3 \
    --providers memeff,memeff:nondeterministic,cudnn,tokamax:mosaic \
    --out $OUT/flash_attention.jsonl 2>&1 | grep -v -i warn | tee $OUT/headline.log | tail -24
else
  timeout 560 python3 benchmarks/linear_cross_entropy.py --set llama3-8b --rounds 3 \
    --providers floor,memeff,memeff:pallas_gpu:gemms=logits+dx+dw:dw=tma_add:fused_lse=1,liger \
    --out $OUT/linear_cross_entropy.jsonl 2>&1 | grep -v -i warn | tee $OUT/lce.log | tail -24
fi
