# Session 25: dx's row scale in the Mosaic dx GEMM's epilogue (mosaic_gemm row_scale) and the
# exp partials' log-sum-exp as one plain sum: GEMM and loss GPU tests, the default's optimized
# HLO, then an A/B of both switches in one process, then the small ops traced.
# (The two switches were pallas_gpu._SCALE_IN_EPILOGUE and _LSE_BY_SUM, removed after this A/B.)
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -m gpu tests/ops/test_mosaic_gemm.py -k "row_scale or tma_add or row_windows" 2>&1 | tail -4 | tee $OUT/gemm-tests.log
timeout 300 python3 -m pytest -q -m gpu tests/ops/linear_cross_entropy \
  -k "${K1:-test_memory or exp_logits or default}" 2>&1 | tail -4 | tee $OUT/lce-gpu-tests.log
REPS=2 HLO=$OUT/hlo.txt timeout 150 python3 benchmarks/scratch/lce_profile.py memeff 2>&1 | grep -v -i warn | tail -12 | tee $OUT/hlo.log
timeout 280 python3 benchmarks/scratch/lce_flag_ab.py --flags _SCALE_IN_EPILOGUE,_LSE_BY_SUM --rounds ${ROUNDS:-5} 2>&1 | grep -v -i warn | tee $OUT/ab.log | tail -12
