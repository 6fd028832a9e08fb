"""Force a low-memory order on independent work that XLA would run side by side.

Ten independent branches (relu → matmul → relu → matmul each) need the intermediates of one
branch at a time when run one after another. XLA does not always pick that order: the CPU
compiler's default scheduler favours concurrency and starts every branch's first matmul
before any second one, so all ten hidden activations are live at once, whatever order the
Python source wrote them in. `jax.lax.optimization_barrier` does not help: XLA removes
barriers before it schedules.

What does hold is a data dependency. `after(x, dep)` returns `x` unchanged, but as a value
computed from one element of `dep`, so nothing that reads the result can start before `dep`
exists. Under autodiff the dependency runs the other way too: `dep`'s cotangent is made to
wait for the result's, so the backward pass also runs the branches one at a time (in
reverse). The cost is a scalar read and a fused elementwise op per link.

`sequential(fn, items)` chains a list of branches this way.

Where a global switch is acceptable, XLA flags do the same without touching the code (set
them in XLA_FLAGS before JAX starts; they are read once per process):

  CPU  --xla_cpu_enable_concurrency_optimized_scheduler=false
  GPU  the default scheduler; --xla_gpu_enable_latency_hiding_scheduler=true may trade
       memory for overlap (benchmarks/branches.py measures both)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


def _zero_from(a) -> jax.Array:
  """An exact float32 0 that XLA cannot fold away: 0 · min(|a₀|, 1), NaN read as 0."""
  s = jnp.ravel(jax.lax.stop_gradient(a))[0].astype(jnp.float32)
  s = jnp.where(jnp.isnan(s), 0.0, s)
  return jnp.minimum(jnp.abs(s), 1.0) * 0.0


def _link(x, dep):
  # x - (+0) is x for every x, -0 and NaN included.
  zero = _zero_from(dep)
  return jax.tree.map(lambda a: a - zero.astype(a.dtype), x)


def after(x, *deps):
  """`x`, unchanged in value, but available only once every array in `deps` is computed.

  Args:
    x: a floating-point array or pytree of them.
    *deps: arrays (or pytrees of arrays) that must exist before anything reads the result.

  Returns:
    `x` (same values, shapes and dtypes). Gradients flow to `x` unchanged; `deps` get
    zero gradient, which in the backward pass waits for the gradient of the result.

  >>> import jax.numpy as jnp
  >>> after(jnp.arange(3.0), jnp.ones(4)).tolist()
  [0.0, 1.0, 2.0]
  """
  leaves = [d for dep in deps for d in jax.tree.leaves(dep) if jnp.size(d)]
  for leaf in jax.tree.leaves(x):
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise TypeError(f"after() orders floating-point arrays; x has a leaf of dtype "
                      f"{jnp.result_type(leaf)}")
  for dep in leaves:
    x = _after_one(x, dep)
  return x


def _after_one(x, dep):
  shape, dtype = jnp.shape(dep), jnp.result_type(dep)

  @jax.custom_vjp
  def link(x, dep):
    return _link(x, dep)

  def fwd(x, dep):
    return _link(x, dep), None  # nothing kept: dep's shape is static

  def bwd(_, ct):
    # dep's cotangent is zero, but computed from ct: the backward of what produced dep
    # (an earlier branch) cannot start before the backward of what read x.
    zero = _zero_from(jax.tree.leaves(ct)[0]) if jax.tree.leaves(ct) else 0.0
    if jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating):
      ct_dep = jnp.zeros(shape, dtype) + zero.astype(dtype)
    else:  # integer deps take float0 cotangents
      ct_dep = jnp.zeros(shape, jax.dtypes.float0)
    return ct, ct_dep

  link.defvjp(fwd, bwd)
  return link(x, dep)


def sequential(fn: Callable[..., Any], items: Sequence[Any]) -> list[Any]:
  """`[fn(*item) for item in items]`, forced to run one item after another.

  Each item's first argument is chained `after` the previous item's output, so XLA holds
  the intermediates of one call at a time (in the forward and the backward pass).

  Args:
    fn: the branch; its first argument must be a floating-point array (or pytree).
    items: one tuple of arguments per branch (a bare array is a one-argument tuple).

  Returns:
    The list of outputs, in order.
  """
  outs = []
  for item in items:
    args = item if isinstance(item, tuple) else (item,)
    if outs:
      args = (after(args[0], outs[-1]),) + tuple(args[1:])
    outs.append(fn(*args))
  return outs
