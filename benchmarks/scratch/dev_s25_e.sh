# Session 25: the exp GEMM's partials as plain per-strip sums, and dx's row scale in the dx
# GEMM's epilogue: the GEMM's and the loss's GPU tests, then the README's full-provider run.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 150 python3 -m pytest -q -m gpu tests/ops/test_mosaic_gemm.py -k "${K0:-row_scale or exp_out or tma_add or row_stats}" --tb=short 2>&1 | tail -${TAILN:-4} | tee $OUT/gemm-tests.log
timeout 300 python3 -m pytest -q -m gpu tests/ops/linear_cross_entropy \
  -k "${K1:-exp_logits or test_memory or default}" --tb=short 2>&1 | tail -${TAILN:-4} | tee $OUT/lce-gpu-tests.log
timeout ${BENCH_S:-200} python3 benchmarks/linear_cross_entropy.py --set llama3-8b --rounds 3 \
  --providers ${PROVIDERS:-floor,memeff,memeff:pallas_gpu:dw=weight,memeff:pallas_gpu:gemms=logits+dx+dw:dw=tma_add:fused_lse=1,jax_naive,torch_compile,liger} \
  --out $OUT/linear_cross_entropy.jsonl 2>&1 | grep -v -i warn | grep -v "^  File\|^    " | tee $OUT/lce.log | tail -9
