#!/usr/bin/env bash
# Downloads the torch and JAX peers' wheels (pure Python, plus the few compiled dependencies
# tokamax needs that the device image lacks) into .whl/, which the device calls carry
# (carry [".whl"]) and benchmarks/gpu.sh installs there. The image already has jax,
# torch, triton, flax, optax, chex, numpy and absl. Compiled wheels are fetched for the
# image's Python (3.12, manylinux x86_64).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
pip download -q --no-deps -d .whl liger-kernel cut-cross-entropy tokamax immutabledict \
  einshape qwix jaxtyping wadler-lindig "typeguard==2.13.3" pydantic annotated-types \
  typing-inspection typing-extensions
pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 -d .whl pydantic-core
ls .whl
