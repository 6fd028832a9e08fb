"""Loop carries inside `jax.shard_map`: with check_vma, a value computed from a per-shard input
varies over the mesh axes that input varies over, and a loop's carry must keep its type. A
carry started from constants is therefore marked varying over the same axes as the inputs
the loop reads, so the loop runs on one device, under shard_map with either check_vma
setting, and anywhere else unchanged."""

from __future__ import annotations

import jax


def _vma(x) -> frozenset:
  """The manual mesh axes x varies over (jax 0.10: aval.manual_axis_type; older: aval.vma)."""
  aval = jax.typeof(x)
  axis_type = getattr(aval, "manual_axis_type", None)
  if axis_type is not None:
    return frozenset(axis_type.varying)
  return frozenset(getattr(aval, "vma", ()) or ())


def varying_like(tree, *refs):
  """`tree`'s arrays marked varying over every manual axis any of `refs` varies over."""
  axes = frozenset().union(*(_vma(r) for r in jax.tree.leaves(refs)))
  if not axes:
    return tree

  def mark(x):
    missing = tuple(sorted(axes - _vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(mark, tree)


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
