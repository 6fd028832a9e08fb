#!/usr/bin/env bash
# One device-machine call: carried peer wheels, the llama3-8b benchmark with tuning variants,
# then the gpu-marked tests. Usage (device tool, carry .whl): bash benchmarks/device_lce.sh [providers]
set -o pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
SET=${SET:-llama3-8b}
python3 benchmarks/linear_cross_entropy.py --set "$SET" --out "$OUT/linear_cross_entropy.jsonl" \
  ${1:+--providers "$1"} 2>&1 | tee "$OUT/bench.log"
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -m gpu tests -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
