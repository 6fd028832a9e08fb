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

# gpu_test_groups SECONDS GROUP...: the attention GPU tests, one pytest process per -k
# expression side by side (compiles are the time), each cut off after SECONDS; each group's
# summary, progress line and failures in $OUT/tests.log, the logs' tails in tests-full.log.
gpu_test_groups() {
  local limit=$1 f=tests/ops/flash_attention/test_pallas_mosaic_gpu.py i=0 g summary
  shift
  for g in "$@"; do
    timeout -k 5 "$limit" python3 -m pytest -q -rf -m gpu $f -k "$g" -p no:cacheprovider \
      > /tmp/t$i.log 2>&1 &
    i=$((i+1))
  done
  wait
  i=0
  for g in "$@"; do
    summary=$(grep -E ' (passed|failed|error)' /tmp/t$i.log | tail -1)
    echo "== $g: ${summary:-no summary (timed out)}"
    grep -E '^[.FEsx]+( |$)' /tmp/t$i.log | head -3  # progress: a dot per passed test
    grep -E "^FAILED|^ERROR|Error:|error:" /tmp/t$i.log | head -8
    i=$((i+1))
  done | tee $OUT/tests.log
  [ $# -gt 0 ] && cat /tmp/t*.log | grep -v "^E1124\|^external\|^$" | tail -300 > $OUT/tests-full.log
  true
}
