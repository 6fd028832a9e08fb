# Session 28: do the one-pass backward's dQ reductions queue on each other?
# (onepass_rotate.py, non-causal), then the D = 64 features suite (the non-split dQ path).
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 150 python3 -m pytest -q -m gpu tests/ops/flash_attention/test_pallas_mosaic_gpu.py \
  -k "TestMosaicGpuPipelinedDq and (unsorted or packed)" 2>&1 \
  | grep -v "^E1124\|^external\|^$" | tail -12 | tee $OUT/tests-rest.log
timeout 330 python3 benchmarks/scratch/onepass_rotate.py --rounds 5 2>&1 \
  | grep -v -i -E "warn|^$" | tee $OUT/rotate.log | tail -30
timeout 100 python3 -m pytest -q -m gpu tests/ops/flash_attention/test_pallas_mosaic_gpu.py \
  -k "TestMosaicGpuFeaturesD64 and not Deterministic" 2>&1 \
  | grep -v "^E1124\|^external\|^$" | tail -12 | tee $OUT/tests-d64.log
