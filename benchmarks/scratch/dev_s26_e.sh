# Session 26: the GPU tests of the Mosaic GEMM and of the loss's exp_logits, memory and
# default paths, with the dW and exp GEMMs on ping-pong over their own slots (the tuned
# default for "dv"); then (PART=2) the new own-slots GEMM tests, the loss's pallas_gpu class
# tests (K2) and the full-provider run (dev_s26_b.sh).
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
if [ "${PART:-1}" = 1 ]; then
  timeout 260 python3 -m pytest -q -m gpu tests/ops/test_mosaic_gemm.py --tb=short 2>&1 | grep -v "^E1124\|^===\|^external\|^$" | tail -8 | tee $OUT/gemm-tests.log
  timeout 300 python3 -m pytest -q -m gpu tests/ops/linear_cross_entropy \
    -k "exp_logits or test_memory or default" --tb=short 2>&1 | grep -v "^E1124\|^===\|^external\|^$" | tail -8 | tee $OUT/lce-tests-1.log
else
  timeout 120 python3 -m pytest -q -m gpu tests/ops/test_mosaic_gemm.py -k own_slots --tb=short 2>&1 | grep -v "^E1124\|^===\|^external\|^$" | tail -8 | tee $OUT/gemm-own-slots-tests.log
  timeout 300 python3 -m pytest -q -m gpu tests/ops/linear_cross_entropy \
    -k "${K2:-TestPallasGpuOnGpu}" --tb=short 2>&1 | grep -v "^E1124\|^===\|^external\|^$" | tail -8 | tee $OUT/lce-tests-2.log
  timeout 150 bash benchmarks/scratch/dev_s26_b.sh
fi
