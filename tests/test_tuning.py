"""Tuned tables: the default section first, then the device kind's, merged key by key."""

import pytest

from memeff_jax import _tuning


@pytest.fixture
def table(tuning_tables):
  tuning_tables(op="[impl.default]\nblock = 64\nwarps = 4\n[impl.default.d128]\nblock_q = 128\n"
                   "[impl.H200]\nwarps = 8\n[impl.H200.d128]\nblock_k = 32\n")


def test_device_section_overrides_default(table):
  del table
  got = _tuning.lookup("op", "impl", device_kind="NVIDIA H200")
  assert got == {"block": 64, "warps": 8, "d128": {"block_q": 128, "block_k": 32}}
  assert _tuning.lookup("op", "impl", device_kind="NVIDIA H100 80GB HBM3")["warps"] == 4


def test_unknown_keys_are_an_error(table):
  del table
  import dataclasses  # pylint: disable=import-outside-toplevel

  @dataclasses.dataclass
  class Fields:
    block: int = 0

  with pytest.raises(ValueError, match=r"unknown keys \['d128', 'warps'\]"):
    _tuning.lookup("op", "impl", fields=Fields, device_kind="cpu")
