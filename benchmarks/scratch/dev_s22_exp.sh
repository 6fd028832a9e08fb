# Session 22: exp_logits (no softmax pass: the Mosaic logits GEMM stores exp(z)): its GPU
# tests and the softmax pass's, the optimized program's [C, V] copies, then the loss at
# llama3-8b beside the default and the floor (interleaved rounds).
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
if [ "${TESTS:-1}" = 1 ]; then
  timeout 300 python3 -m pytest -q -m gpu tests/ops/linear_cross_entropy/test_linear_cross_entropy.py \
    -k "${TEST_K:-exp_logits or fused_lse}" 2>&1 | tail -4 | tee $OUT/exp-gpu-tests.log
fi
if [ "${HLO:-1}" = 1 ]; then
  LCE_EXP=1 HLO=$OUT/exp.hlo REPS=2 timeout 200 python3 benchmarks/scratch/lce_profile.py memeff 1024 \
    2>&1 | grep -v -i warning | tee $OUT/exp-hlo.log
fi
timeout ${BENCH_S:-480} python3 benchmarks/linear_cross_entropy.py --set llama3-8b --rounds ${ROUNDS:-3} \
  --providers ${PROVIDERS:-floor,memeff,memeff:pallas_gpu:exp_logits=1,memeff:pallas_gpu:exp_logits=1:gemms=logits+dx+dw:dw=tma_add} \
  --out $OUT/linear_cross_entropy.jsonl 2>&1 | grep -v -i warn | tee $OUT/lce.log | tail -24
