# Sourced by every script run on the device machine (benchmarks/device_session.sh and the
# diagnostics in benchmarks/scratch/): peer wheels carried in .whl, the import path, JAX's
# allocation on demand, one persistent compilation cache, and $OUT/results.
set -o pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# One persistent compilation cache for every process of the call: a train step compiled for
# one measurement is loaded, not recompiled (and not re-autotuned), by the next.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/results"
