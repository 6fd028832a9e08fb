# Session 21: the dK/dV kernel in clusters of two key blocks sharing the Q/dO stream
# (kv_pairs): GPU tests, then the kernel alone and in fwd+bwd against cuDNN (headline).
. "$(dirname "$0")/../device_env.sh"
timeout 200 python3 -m pytest -q -m gpu tests/ops/flash_attention/test_pallas_mosaic_gpu.py \
  -k "paired" 2>&1 | tail -3 | tee $OUT/pairs-tests.log
timeout 300 python3 benchmarks/scratch/dkv_pairs.py --rounds 7 2>&1 | grep -v -i warn \
  | tee $OUT/pairs.log
