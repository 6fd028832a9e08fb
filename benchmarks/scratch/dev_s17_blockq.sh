# Session 17: the dK/dV kernel with 80 or 96 query rows per step (FlashAttention-3's backward
# takes 80 at D = 128): its GPU tests, then dK/dV alone and the deterministic fwd+bwd against
# cuDNN in interleaved rounds (benchmarks/scratch/dkv_block_q.py).
. "$(dirname "$0")/../device_env.sh"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 300 python3 -m pytest -q -x -m gpu -p no:cacheprovider \
    tests/ops/flash_attention/test_pallas_mosaic_gpu.py -k "wide_step" 2>&1 | tail -8 \
    | tee $OUT/tests.log
fi
timeout ${BENCH_S:-280} python3 benchmarks/scratch/dkv_block_q.py 2>&1 | grep -v -i warning \
  | tee $OUT/blockq.log
