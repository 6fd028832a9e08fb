#!/usr/bin/env bash
# The GPU tests and benchmarks, run from a source checkout on a machine with an NVIDIA GPU
# and jax with CUDA:
#
#   bash benchmarks/gpu.sh tests                          # every `gpu`-marked test
#   bash benchmarks/gpu.sh tests:1/3                      # the first of three parts of them
#   bash benchmarks/gpu.sh attention:headline lce:llama3-8b train
#
# Parts run in the order given: `tests` (8 pytest-xdist workers per GPU, then the mesh tests
# on all of the host's GPUs); `attention:SET` and `lce:SET` (a shape set of
# configs/benchmarks/<op>.toml, every provider side by side in interleaved rounds);
# `train` (the 1B train step against plain Flax; `train:fsdp=4` on a mesh of the host's
# GPUs, each run 3 steps, its largest batch searched); `bridge` (the PyTorch bridge); `scaling`
# (both ops on 1, 2, 4 GPUs of the host; NCCL's NVLink multicast off).
# The peers' wheels (tokamax, Liger-Kernel, Cut Cross-Entropy) are installed first from .whl/
# when present (`bash benchmarks/fetch_peer_wheels.sh` downloads them). Results are
# appended to $RESULTS (default benchmarks/results); `python benchmarks/make_results.py`
# then regenerates benchmarks/RESULTS.md and the README's tables.
set -o pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/memeff-peers .whl/*.whl && export PYTHONPATH=/tmp/memeff-peers
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
RESULTS=${RESULTS:-benchmarks/results}
ROUNDS=${ROUNDS:-3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for part in "$@"; do
  echo "=== $part ($(date +%T))"
  case $part in
    tests|tests:*)  # the workers spread over the GPUs; then the mesh tests, every GPU in one
      # process. tests:K/N runs the K-th of N interleaved parts of each (pytest --shard).
      SHARD=(); [ "$part" = tests ] || SHARD=(--shard "${part#tests:}")
      # No XLA autotuning: the suite is compile-bound (up to 5 min a test with it, under 1
      # without). Set for the tests alone: under it XLA's GEMMs in the benchmarks after them
      # ran many times slower (the loss's floor at Llama-3-8B: 1,386 against 78 ms, H200).
      GPUS=$(nvidia-smi -L | wc -l)
      TEST_XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
      XLA_FLAGS=$TEST_XLA_FLAGS MEMEFF_TEST_GPUS=$GPUS python3 -m pytest -q -m gpu tests \
        -n "${WORKERS:-$((8 * GPUS))}" -p no:cacheprovider -p no:benchmark \
        --ignore tests/ops/test_meshes_gpu.py --durations 15 "${SHARD[@]}"
      if [ "$GPUS" -gt 1 ]; then
        XLA_FLAGS=$TEST_XLA_FLAGS NCCL_NVLS_ENABLE=0 python3 -m pytest -q \
          tests/ops/test_meshes_gpu.py -p no:cacheprovider "${SHARD[@]}"
      fi ;;
    attention:*) python3 benchmarks/flash_attention.py --set "${part#*:}" --rounds "$ROUNDS" \
        ${ATTENTION_PROVIDERS:+--providers "$ATTENTION_PROVIDERS"} \
        --out "$RESULTS/flash_attention.jsonl" ;;
    lce:*) python3 benchmarks/linear_cross_entropy.py --set "${part#*:}" --rounds "$ROUNDS" \
        ${LCE_PROVIDERS:+--providers "$LCE_PROVIDERS"} \
        --out "$RESULTS/linear_cross_entropy.jsonl" ;;
    train) python3 benchmarks/train_step.py --config 1b --out "$RESULTS/train_step.jsonl" ;;
    train:*) NCCL_NVLS_ENABLE=0 python3 benchmarks/train_step.py --config 1b --mesh "${part#*:}" \
        --steps 3 --run-timeout 600 --out "$RESULTS/train_step.jsonl" ;;
    bridge) python3 benchmarks/torch_bridge.py --out "$RESULTS/torch_bridge.jsonl" ;;
    # A loss call's time varies by 3% between rounds: scaling takes at least 7 of them.
    scaling) NCCL_NVLS_ENABLE=0 python3 benchmarks/scaling.py \
        --rounds "$((ROUNDS > 7 ? ROUNDS : 7))" --out "$RESULTS/scaling.jsonl" ;;
    *) echo "unknown part: $part (tests[:K/N], attention:SET, lce:SET, train[:MESH], bridge," \
         "scaling)"
       exit 2 ;;
  esac
done
