# Session 26, after the tuned ping-pong tiles got their ring fallbacks (tuned_gemm_config):
# the ping-pong / row-statistics GEMM tests, the loss's exp_logits, memory and default
# tests, then llama3-8b and gemma2-2b (D = 2,304: the exp GEMM on the fallback) beside the
# floor.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 150 python3 -m pytest -q -m gpu tests/ops/test_mosaic_gemm.py -k "pingpong or own_slots or exp_out or row_stats" --tb=short 2>&1 | grep -v "^E1124\|^===\|^external\|^$" | tail -6 | tee $OUT/gemm-tests.log
timeout 300 python3 -m pytest -q -m gpu tests/ops/linear_cross_entropy \
  -k "exp_logits or test_memory or default" --tb=short 2>&1 | grep -v "^E1124\|^===\|^external\|^$" | tail -4 | tee $OUT/lce-tests.log
for set in llama3-8b gemma2-2b; do
  timeout 100 python3 benchmarks/linear_cross_entropy.py --set $set --rounds 3 --providers floor,memeff \
    --out $OUT/linear_cross_entropy.jsonl 2>&1 | grep -v -i warn | grep -v "^  File\|^    " | tee -a $OUT/lce.log | tail -3
done
