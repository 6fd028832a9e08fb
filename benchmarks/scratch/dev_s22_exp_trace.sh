# Session 22: exp_logits' optimized program (temporaries, [C, V] copies) and its kernels
# traced under load, beside the default's.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 120 python3 -m pytest -q -m gpu tests/ops/linear_cross_entropy/test_linear_cross_entropy.py \
  -k "exp_logits_gemm" 2>&1 | tail -3 | tee $OUT/exp-gemm-test.log
LCE_EXP=1 HLO=$OUT/exp.hlo REPS=2 timeout 200 python3 benchmarks/scratch/lce_profile.py memeff 1024 \
  2>&1 | grep -v -i warning | tee $OUT/exp-hlo.log
MODES="${MODES:-memeff}" CHUNK=1024 REPS=8 LCE_EXP=1 TAG=-exp timeout 300 \
  bash benchmarks/scratch/dev_lce_trace.sh 2>&1 | tee $OUT/exp-trace.log | head -40
