"""Helpers of the ops' `custom_partitioning`s, which run them per shard on Auto meshes
(flash_attention/_partition.py, linear_cross_entropy/_partition.py)."""

from __future__ import annotations

import jax
from jax.experimental.custom_partitioning import ArrayMapping
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.custom_partitioning import SdyShardingRule
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from memeff_jax.ops import _explicit
from memeff_jax.ops import _state


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


def available(*arrays) -> bool:
  """Whether a call on `arrays` goes through custom_partitioning: where one of them lies on
  a mesh of several devices (under jit, its type names that mesh; single-device code on a
  host with several GPUs keeps the single-device path), outside jax.shard_map (whose axes
  are manual: the call is already per shard, and custom_partitioning there would be lowered
  by re-evaluating the kernels' trace under check_vma), and not under jax_enable_x64, where
  the kernels are traced with 64-bit types off (hopper.without_x64), which
  custom_partitioning's re-trace at lowering would undo."""
  manual = any(t == AxisType.Manual for t in jax.sharding.get_abstract_mesh().axis_types)
  return (not manual and not jax.config.jax_enable_x64
          and any(_mesh_size(a) > 1 for a in arrays))


def _mesh_size(a) -> int:
  if a is None:
    return 0
  mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
  return getattr(mesh, "size", 0) or 0


def partitioned(fn, partition, rule):
  """fn(*arrays) as a custom_partitioning call. partition(mesh, arg_shapes, result_shape) ->
  (mesh, the per-shard function, output shardings, argument shardings) also gives GSPMD
  its output shardings; rule(mesh, value_types, result_types) -> the Shardy rule.

  custom_partitioning refuses a function that closes over constants, and tracing a kernel
  may make some (a persistent kernel's schedule table, built for the call's shapes): they
  become operands of the call, replicated, which the per-shard function (traced anew for
  the shard's shapes, with constants of its own) does not read. The per-shard function's
  mutable arrays are discharged (_state.pure)."""
  def call(*args):
    # Traced once here: custom_partitioning traces `hoisted`, which replays this trace.
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    consts, n = tuple(closed.consts), len(args)
    out_tree = jax.tree.structure(out_shape)
    hoisted = lambda *a: jax.tree.unflatten(
        out_tree, _state.eval_jaxpr(closed.jaxpr, a[n:], *a[:n]))

    def partition_with_consts(mesh, arg_shapes, result_shape):
      mesh, per_shard, out_s, arg_s = partition(mesh, arg_shapes[:n], result_shape)
      replicated = (NamedSharding(mesh, P()),) * len(consts)
      return mesh, lambda *a: _state.pure(per_shard)(*a[:n]), out_s, (*arg_s, *replicated)

    def rule_with_consts(mesh, value_types, result_types):
      r = rule(mesh, value_types[:n], result_types)
      names = [tuple(f"const{i}_{j}" for j in range(c.ndim)) for i, c in enumerate(consts)]
      return SdyShardingRule(
          (*r.operand_mappings, *(ArrayMapping(*dims) for dims in names)), r.result_mappings,
          reduction_factors=r.reduction_factors, permutation_factors=r.permutation_factors,
          need_replication_factors=(*r.need_replication_factors, *sum(names, ())),
          **r.factor_sizes)

    return _custom_partitioning(hoisted, partition_with_consts, rule_with_consts)(
        *args, *consts)
  return call


def _custom_partitioning(fn, partition, rule):
  part = custom_partitioning(fn)
  part.def_partition(partition=partition,
                     infer_sharding_from_operands=lambda *a: partition(*a)[2],
                     sharding_rule=rule)
  return part
