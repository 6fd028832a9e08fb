#!/usr/bin/env bash
# One device-machine call: carried peer wheels (.whl), the benchmark for each shape set,
# the gpu-marked tests, and the interpret-mode kernel tests on that image's jax (CPU).
#   SETS="llama3-8b gpt2" SKIP_TESTS=1 bash benchmarks/device_lce.sh [providers]
set -o pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
FULL=floor,jax_naive,jax_scan_remat,memeff,memeff:pallas_gpu:budget_mib=192,memeff:pallas_gpu:budget_mib=512,memeff:pallas_gpu:dw=float32,memeff:chunked_xla,tokamax,torch_naive,torch_compile,liger,cce
SHORT=floor,jax_naive,memeff,memeff:chunked_xla,tokamax,torch_compile,liger,cce
for set in ${SETS:-llama3-8b gemma2-2b gpt2}; do
  providers=${1:-$([ "$set" = llama3-8b ] && echo $FULL || echo $SHORT)}
  python3 benchmarks/linear_cross_entropy.py --set "$set" --providers "$providers" \
    --out "$OUT/linear_cross_entropy.jsonl" 2>&1 | grep -v Warning | tee -a "$OUT/bench.log"
done
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
  JAX_PLATFORMS=cpu python3 -m pytest -q tests -k "Interpret or errors or memory" \
    -p no:cacheprovider 2>&1 | tee "$OUT/interpret_tests.log" | tail -4
fi
