"""Inputs sharded on an Explicit mesh (`jax.set_mesh(jax.make_mesh(...))`): which mesh axes
shard which dimension, read from the arrays' types. Each op runs its single-device code per
shard under `jax.shard_map` over those axes, where the kernels see plain local arrays."""

from __future__ import annotations

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P


def _explicit_names(mesh) -> frozenset:
  return frozenset(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                   if kind == AxisType.Explicit)


def layout(x):
  """(mesh, [the explicit mesh axes of each dimension, a tuple]) of an array's type, or
  (None, None) where no dimension is sharded over an explicit axis."""
  if x is None or not hasattr(x, "shape"):  # None, or a Python value: not sharded
    return None, None
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not mesh.axis_names:
    return None, None
  names = _explicit_names(mesh)
  dims = []
  for entry in tuple(sharding.spec) + (None,) * (jax.typeof(x).ndim - len(sharding.spec)):
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    dims.append(tuple(a for a in axes if a in names))
  return (mesh, dims) if any(dims) else (None, None)


def spec(dims) -> P:
  """A PartitionSpec from per-dimension axis tuples."""
  return P(*(None if not axes else axes[0] if len(axes) == 1 else axes for axes in dims))


def common_mesh(*arrays):
  """The mesh of the arrays sharded on explicit axes (None if none is); one mesh only."""
  meshes = [m for m, _ in map(layout, arrays) if m is not None]
  if not meshes:
    return None
  if any(m != meshes[0] for m in meshes[1:]):
    raise ValueError("the inputs are sharded over different meshes")
  return meshes[0]


def dims_of(x, ndim: int):
  """Per-dimension explicit axes of x ([()] * ndim where it has none)."""
  _, dims = layout(x)
  return dims if dims is not None else [()] * ndim


def spec_of(x):
  """x's PartitionSpec as its type carries it (None for None): shard_map's in_spec for it."""
  return None if x is None else jax.typeof(x).sharding.spec
