# Session 25: dx's row scale in the Mosaic dx GEMM's epilogue (mosaic_gemm row_scale): the
# GEMM's and the loss's GPU tests, then the default's kernels traced under load.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -m gpu tests/ops/test_mosaic_gemm.py -k "${K0:-row_scale}" --tb=short 2>&1 | tail -${TAILN:-4} | tee $OUT/gemm-tests.log
[ -n "$T1" ] || timeout 300 python3 -m pytest -q -m gpu tests/ops/linear_cross_entropy \
  -k "${K1:-test_memory or exp_logits or default}" 2>&1 | tail -4 | tee $OUT/lce-gpu-tests.log
[ -n "$NOTRACE" ] || MODES=memeff CHUNK=1024 REPS=8 TAG=-default timeout 200 \
  bash benchmarks/scratch/dev_lce_trace.sh 2>&1 | tee $OUT/trace.log | head -30
