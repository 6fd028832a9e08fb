"""Helpers of the ops' `custom_partitioning`s, which run them per shard on Auto meshes
(flash_attention/_partition.py, linear_cross_entropy/_partition.py)."""

from __future__ import annotations

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import PartitionSpec as P

from memeff_jax.ops import _explicit


def axes(entry) -> tuple:
  """A PartitionSpec entry as a tuple of mesh axis names."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec(*dims) -> P:
  """A PartitionSpec from per-dimension tuples of axis names."""
  return _explicit.spec(dims)


def size(mesh, names: tuple) -> int:
  """How many shards the mesh axes `names` make together."""
  n = 1
  for a in names:
    n *= mesh.shape[a]
  return n


def available() -> bool:
  """Whether calls may go through custom_partitioning: not under jax_enable_x64, where the
  kernels are traced with 64-bit types off (hopper.without_x64), which custom_partitioning's
  re-trace at lowering would undo; such calls run unpartitioned."""
  return not jax.config.jax_enable_x64


def partitioned(fn, partition, rule):
  """fn as a custom_partitioning. partition(mesh, arg_shapes, result_shape) -> (mesh, the
  per-shard function, output shardings, argument shardings) also gives GSPMD its output
  shardings; rule(mesh, value_types, result_types) -> the Shardy rule."""
  part = custom_partitioning(fn)
  part.def_partition(partition=partition,
                     infer_sharding_from_operands=lambda *a: partition(*a)[2],
                     sharding_rule=rule)
  return part
