"""Tuned kernel configs per GPU kind, read from TOML tables shipped in memeff_jax/configs/tuning/.

A table `tuning/<op>.toml` holds, per implementation, a `default` section and one
section per device kind (matched as a case-insensitive substring of
`jax.devices()[0].device_kind`, e.g. "H100" or "H200"):

    [pallas_triton.default]
    block_v = 4096
    [pallas_triton.H200]
    block_v = 8192

The directory is `$MEMEFF_JAX_CONFIG_DIR/tuning` if that variable is set, else the package's
own `configs/tuning` (package data, so a regular install has it too). Missing files or
sections fall back to the dataclass defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import tomllib

import jax


PACKAGE_CONFIGS = pathlib.Path(__file__).resolve().parent / "configs"


def config_dir() -> pathlib.Path:
  """Where the tuning tables are read from: $MEMEFF_JAX_CONFIG_DIR, else PACKAGE_CONFIGS."""
  env = os.environ.get("MEMEFF_JAX_CONFIG_DIR")
  if env:
    return pathlib.Path(env)
  return PACKAGE_CONFIGS


@functools.cache
def _table(op: str) -> dict:
  path = config_dir() / "tuning" / f"{op}.toml"
  if not path.exists():
    return {}
  with path.open("rb") as f:
    return tomllib.load(f)


def lookup(op: str, implementation: str, *, fields=None, device_kind: str | None = None) -> dict:
  """Tuned settings of `implementation` for this device kind (default section first)."""
  table = _table(op).get(implementation, {})
  if device_kind is None:
    device_kind = jax.devices()[0].device_kind
  found = dict(table.get("default", {}))
  for key, section in table.items():
    if key != "default" and key.lower() in device_kind.lower():
      for name, value in section.items():
        if isinstance(value, dict) and isinstance(found.get(name), dict):
          found[name] = {**found[name], **value}
        else:
          found[name] = value
  if fields is not None:
    names = {f.name for f in dataclasses.fields(fields)}
    unknown = set(found) - names
    if unknown:
      raise ValueError(f"tuning/{op}.toml [{implementation}] has unknown keys "
                       f"{sorted(unknown)}; {fields.__name__} takes {sorted(names)}")
  return found
