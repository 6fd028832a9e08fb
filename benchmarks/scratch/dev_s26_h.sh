# Session 26: auto_gemms puts dx alone on cuBLAS where its tiles fill the waves poorly and
# the dW GEMM runs ping-pong on its own slots (Gemma-2-2b, GPT-2): those sets beside the
# old default (all cuBLAS, dw=weight), then the loss's exp_logits, default and own-slot
# (512-token chunks) GPU tests.
# Run in session 27 on an H100 (logs 2026-11-24-h100-s27-lce*.log): 22 tests pass.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
for set in gemma2-2b gpt2; do
  timeout 120 python3 benchmarks/linear_cross_entropy.py --set $set --rounds 3 \
    --providers floor,memeff,memeff:pallas_gpu:dw=weight \
    --out $OUT/linear_cross_entropy.jsonl 2>&1 | grep -v -i warn | grep -v "^  File\|^    " | tee -a $OUT/lce.log | tail -4
done
timeout 240 python3 -m pytest -q -m gpu tests/ops/linear_cross_entropy \
  -k "exp_logits or default or own_slot" --tb=short 2>&1 | grep -v "^E1124\|^===\|^external\|^$" | tail -4 | tee $OUT/lce-tests.log
