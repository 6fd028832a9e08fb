"""Types inside `jax.shard_map`: with check_vma, a value computed from a per-shard input varies
over the mesh axes that input varies over. A loop's carry must keep its type, so a carry
started from constants is marked varying over the same axes as the inputs the loop reads;
a function of Pallas kernels is traced with the checks off (a kernel body mixes per-shard
refs with constants, and its outputs have no types to check against) and its outputs are
then declared varying over the axes of its inputs (`unchecked`). Code using these runs on
one device, under shard_map with either check_vma setting, and anywhere else unchanged."""

from __future__ import annotations

import functools

import jax
from jax._src import config as _config  # check_vma's switch: no public spelling yet
from jax.extend import core as jex_core
from jax.interpreters import batching
from jax.interpreters import mlir

from memeff_jax.ops import _state


def _vma(x) -> frozenset:
  """The manual mesh axes x varies over (jax 0.10: aval.manual_axis_type; older: aval.vma)."""
  aval = jax.typeof(x)
  axis_type = getattr(aval, "manual_axis_type", None)
  if axis_type is not None:
    return frozenset(axis_type.varying)
  return frozenset(getattr(aval, "vma", ()) or ())


def checking() -> bool:
  """Whether check_vma's checks are on (inside jax.shard_map(check_vma=True))."""
  return bool(_config._check_vma.value)  # pylint: disable=protected-access


def _axes(refs) -> frozenset:
  """The manual axes any array of `refs` varies over; none where check_vma is off (types
  then carry no such axes: inside shard_map(check_vma=False) and inside `unchecked`)."""
  if not checking():
    return frozenset()
  arrays = (r for r in jax.tree.leaves(refs) if isinstance(r, jax.Array))
  return frozenset().union(*(_vma(r) for r in arrays))


def unchecked(fn):
  """fn (a function of Pallas kernels) traced with check_vma's checks off inside
  jax.shard_map, its array outputs marked varying over every manual axis its array inputs
  vary over; elsewhere fn itself. Each shard's kernel computes from that shard's values
  only, so its outputs vary as its inputs do.

  The region is traced as a jit of its own with its mutable arrays already discharged:
  lowering discharges the state of the program around it by re-tracing each equation with
  the checks on, which the region's untyped values would fail; a jit's equation is bound
  whole."""
  @functools.wraps(fn)
  def call(*args, **kwargs):
    axes = _axes((args, kwargs))
    if not axes:
      return fn(*args, **kwargs)
    leaves, tree = jax.tree.flatten((args, kwargs))
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]

    def region(*values):
      full = list(leaves)
      for i, x in zip(arrays, values):
        full[i] = _untyped(x)
      a, k = jax.tree.unflatten(tree, full)
      return fn(*a, **k)

    with _config._check_vma(False):  # pylint: disable=protected-access
      out = jax.jit(_state.pure(region))(*(leaves[i] for i in arrays))
    return _marked(out, axes)
  return call


def _untyped(x):
  """x with a type that names no manual axes (Mosaic GPU kernels refuse such inputs); the
  same bits."""
  if not isinstance(x, jax.Array) or not _vma(x):
    return x
  return _untyped_p.bind(x)


# The identity whose result type varies over no manual axis. A primitive of its own, so that
# its type is the same whether check_vma is on or off: the region's jaxpr is re-traced with
# the checks on wherever JAX transforms the program around it (the partial evaluation of
# jax.checkpoint and of a scan's linearization), and an equation that drops the axes only
# because the checks were off (x · 1) fails there.
_untyped_p = jex_core.Primitive("memeff_untyped")
_untyped_p.def_impl(lambda x: x)
_untyped_p.def_abstract_eval(
    lambda aval: jax.core.ShapedArray(aval.shape, aval.dtype, aval.weak_type,
                                      sharding=aval.sharding))
mlir.register_lowering(_untyped_p, lambda ctx, x: [x])
batching.primitive_batchers[_untyped_p] = lambda args, dims: (_untyped_p.bind(*args), dims[0])


def varying_like(tree, *refs):
  """`tree`'s arrays marked varying over every manual axis any of `refs` varies over."""
  return _marked(tree, _axes(refs))


def _marked(tree, axes: frozenset):
  def mark(x):
    missing = tuple(sorted(axes - _vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(mark, tree) if axes else tree


def invariant_over(tree, axis):
  """`tree`'s arrays typed invariant over the manual axes `axis` (a name or a tuple) where
  they vary over them: for values every shard of those axes holds alike (a pmax of equal
  values, which changes no bit)."""
  axes = frozenset((axis,) if isinstance(axis, str) else axis)

  def fix(x):
    over = tuple(sorted(axes & _vma(x))) if isinstance(x, jax.Array) else ()
    return jax.lax.pmax(x, over) if over else x

  return jax.tree.map(fix, tree)


def cotangents_like(cts, primals):
  """A custom_vjp backward's cotangents given the primal inputs' types: summed over the manual
  axes a cotangent varies over and its input does not (an input the shard shares, such as a
  replicated weight, gets the sum of every shard's contribution, as JAX's own transpose of
  the implicit broadcast gives it), and marked varying where its input is."""
  def fix(ct, primal):
    if ct is None or primal is None:
      return ct
    extra = tuple(sorted(_vma(ct) - _vma(primal)))
    if extra:
      ct = jax.lax.psum(ct, extra)
    missing = tuple(sorted(_vma(primal) - _vma(ct)))
    return jax.lax.pcast(ct, missing, to="varying") if missing else ct

  return tuple(fix(ct, p) for ct, p in zip(cts, primals))
