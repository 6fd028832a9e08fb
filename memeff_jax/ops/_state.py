"""Functions whose kernels write into mutable arrays (jax.new_ref: a fused backward's
statistics, GEMM accumulators), run as pure functions: their state discharged into values,
as jax.jit does before lowering. Places that lower or re-type a function by parts need this:
custom_partitioning lowers each shard's function as a module of its own, which may not have
effects, and a region traced with check_vma off must not be re-traced (discharged) later with
the checks on."""

from __future__ import annotations

import jax


def pure(fn):
  """fn (of arrays, returning a pytree of arrays) with its mutable arrays discharged."""
  def call(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    if closed.effects:
      closed = _discharge_state(closed)
    leaves, tree = jax.tree.flatten(out_shape)
    outs = eval_jaxpr(closed.jaxpr, closed.consts, *args)  # then the discharged state's
    return jax.tree.unflatten(tree, outs[:len(leaves)])
  return call


def _discharge_state(closed):
  from jax._src.state import discharge  # pylint: disable=import-outside-toplevel
  try:
    return discharge.discharge_state(closed)
  except TypeError:  # the older spelling: (jaxpr, consts) -> (jaxpr, consts)
    jaxpr, consts = discharge.discharge_state(closed.jaxpr, closed.consts)
    return closed.replace(jaxpr=jaxpr, consts=consts)


def eval_jaxpr(jaxpr, consts, *args):
  evaluate = getattr(jax.core, "eval_jaxpr", None)
  if evaluate is None:  # pragma: no cover - where jax.core no longer exports it
    from jax._src.core import eval_jaxpr as evaluate  # pylint: disable=import-outside-toplevel
  return evaluate(jaxpr, consts, *args)
