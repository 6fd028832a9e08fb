# Session 23: exp_logits with x's scaled rows in dx's rows (Mosaic dW) and the Mosaic dx
# GEMM writing in place: the temporaries, its GPU tests, then the llama3-8b loss beside the
# default (interleaved rounds).
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
if [ "${COMPILE:-1}" = 1 ]; then
  timeout 200 python3 benchmarks/scratch/exp_dx_compile.py ${CASES:-8,9} > $OUT/compile.log 2>&1
  grep -E "^(OK|FAIL)|temporaries|MiB|GiB" $OUT/compile.log | cut -c1-200 | head -40
fi
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${T1:-200} python3 -m pytest -q -m gpu tests/ops/linear_cross_entropy \
    -k "${TEST_K:-exp_logits}" 2>&1 | tail -4 | tee $OUT/lean-gpu-tests.log
fi
timeout ${BENCH_S:-400} python3 benchmarks/linear_cross_entropy.py --set llama3-8b --rounds ${ROUNDS:-3} \
  --providers ${PROVIDERS:-floor,memeff,memeff:pallas_gpu:exp_logits=1:gemms=dw:dw=tma_add,memeff:pallas_gpu:exp_logits=1:gemms=logits+dx+dw:dw=tma_add,memeff:pallas_gpu:exp_logits=1:gemms=dx,memeff:pallas_gpu:gemms=logits+dx+dw:dw=tma_add:fused_lse=1} \
  --out $OUT/linear_cross_entropy.jsonl 2>&1 | grep -v -i warn | grep -v "^  File\|^    " | tee $OUT/lce.log | tail -24
