# Session 21: the GPU tests of the bridge on today's main (issue 5), then where the chunked
# loss's time and energy go beyond the floor (lce_decompose.py).
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -m gpu tests/interop 2>&1 | tail -3 | tee $OUT/interop-gpu-tests.log
timeout 330 python3 benchmarks/scratch/lce_decompose.py --rounds 3 --chunks ${CHUNKS:-1024,2048} \
  2>&1 | grep -v -i warning | tee $OUT/decompose.log
