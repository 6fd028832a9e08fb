"""Test setup: `gpu` tests skipped without a GPU; JAX allocating GPU memory on demand, so
that the README's `pytest -n 2` workers (pytest-xdist) can share one GPU."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402  (after the allocator setting)
import pytest


def _has_gpu() -> bool:
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  del config
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
