"""Matmul FLOPs of a function, recomputation included, counted on its jaxpr.

XLA's compiled cost analysis is the obvious estimate of what a remat policy recomputes, but
it counts the body of a loop once (a model whose layers run under `lax.scan` looks 1/L as
expensive), sees nothing inside Pallas kernels, and on GPU counts only the matmuls XLA emits
as Triton fusions, not those it hands to cuBLAS, a choice autotuning makes per compile (the
1b train step at batch 4 reads 1,265 GFLOP, and 27 with
`--xla_gpu_enable_triton_gemm=false`, on an H100). Counting on the jaxpr of the whole step
(forward and backward, as `jax.make_jaxpr` traces it) avoids all three: a scan's body counts
`length` times, what `jax.checkpoint` recomputes appears in the backward's `remat` bodies, a
`pallas_call` counts its `cost_estimate` (memeff_jax's kernels give one), and every
dot_general counts however XLA lowers it.

Counted: dot_general (2·M·N·K) and the cost estimates of Pallas kernels (pallas_call, and
mpmd_map for Mosaic GPU kernels launched by pl.kernel). Elementwise work is left out.
A `while_loop` body counts once (its trip count is not static); `cond` counts its dearest
branch. Only equations whose results are used count: the backward's `remat` body still
holds, e.g., the attention forward kernel when a policy saved its outputs (JAX's own DCE
keeps a pallas_call), but XLA drops it, and so does this count.
"""

from __future__ import annotations

import math

import jax
from jax.extend import core as jex_core


def _sub_jaxprs(value):
  if isinstance(value, jex_core.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jex_core.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _sub_jaxprs(v)


def _eqn_flops(eqn) -> float:
  name = eqn.primitive.name
  if name == "dot_general":
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    k = math.prod(lhs[i] for i in lhs_contract)
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * k
  if name in ("pallas_call", "mpmd_map"):  # a Pallas kernel (mpmd_map: Mosaic GPU's pl.kernel)
    cost = eqn.params.get("cost_estimate")
    return float(cost.flops) if cost is not None else 0.0
  subs = [jaxpr_flops(j) for v in eqn.params.values() for j in _sub_jaxprs(v)]
  if name == "scan":
    return eqn.params["length"] * sum(subs)
  if name == "cond":
    return max(subs, default=0.0)
  return sum(subs)


def _live_eqns(jaxpr):
  """The equations with an effect (a kernel writing a Ref) or a result that reaches the
  jaxpr's outputs."""
  live = {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
  kept = []
  for eqn in reversed(jaxpr.eqns):
    if eqn.effects or any(v in live for v in eqn.outvars):
      kept.append(eqn)
      live.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
  return kept[::-1]


def jaxpr_flops(jaxpr) -> float:
  """Matmul FLOPs of a Jaxpr or ClosedJaxpr (see the module docstring)."""
  if isinstance(jaxpr, jex_core.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  return sum(_eqn_flops(eqn) for eqn in _live_eqns(jaxpr))


def matmul_flops(fn, *args, **kwargs) -> float:
  """Matmul FLOPs of `fn(*args)` (arrays or ShapeDtypeStructs), traced, never run.

  >>> import jax, jax.numpy as jnp
  >>> matmul_flops(lambda a, b: a @ b, jnp.ones((4, 8)), jnp.ones((8, 16)))
  1024.0
  """
  return jaxpr_flops(jax.make_jaxpr(fn)(*args, **kwargs))
