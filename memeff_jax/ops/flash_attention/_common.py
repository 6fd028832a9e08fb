"""Pieces shared by the flash_attention implementations."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
import jax.numpy as jnp

from memeff_jax.ops import _checks
from memeff_jax.ops import _vma
from memeff_jax.ops.flash_attention import _context
from memeff_jax.ops.flash_attention.masks import MaskSpec


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """Static options of one call (hashable: custom_vjp nondiff argument)."""

  mask: MaskSpec
  scale: float
  logit_softcap: float | None = None
  deterministic: bool = True  # the backward must give bitwise-identical gradients every run
  # (context_order, context_strategy) where an Auto mesh shards the sequence (_partition).
  context: tuple[str, str] = _context.DEFAULT


class Residuals(NamedTuple):
  q: jax.Array
  k: jax.Array
  v: jax.Array
  q_segment_ids: jax.Array | None
  kv_segment_ids: jax.Array | None
  out: jax.Array
  lse: jax.Array  # float32 [B, Hq, T]; -inf for a query that sees no key


def attention_vjp(forward, backward, name: str):
  """custom_vjp of forward(static, q, k, v, q_seg, kv_seg) -> (out, lse [B, Hq, T]), called
  as attention(impl, static, q, k, v, q_seg, kv_seg) with `impl` the implementation object
  that made `static` (on an Auto mesh that shards the sequence, its shards call it anew).

  The residuals are the inputs, the output and the float32 log-sum-exp (Residuals);
  backward(static, residuals, (d_out, d_lse)) -> (dq, dk, dv, None, None). The output and
  the log-sum-exp carry the checkpoint names "attention_out" and "attention_lse": a remat
  policy that saves both (memeff_jax.remat's "attention") never reruns the forward kernel.
  First order only: a second-order gradient raises, naming the implementation `name`.
  On an Auto mesh both run per shard of the batch, heads and sequence (_partition).
  """

  from memeff_jax.ops.flash_attention import _partition  # pylint: disable=import-outside-toplevel
  forward = _partition.partitioned_forward(forward)  # per shard on Auto meshes
  backward = _partition.partitioned_backward(backward)

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
  def attention(impl, static, q, k, v, q_seg, kv_seg):
    return forward(impl, static, q, k, v, q_seg, kv_seg)

  def fwd(impl, static, q, k, v, q_seg, kv_seg):
    out, lse = forward(impl, static, *_checks.first_order_only(name, q, k, v), q_seg, kv_seg)
    out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
    return (out, lse), Residuals(q, k, v, q_seg, kv_seg, out, lse)

  def bwd(impl, static, res, cts):
    q, k, v, out, lse, *cts = _checks.first_order_only(name, res.q, res.k, res.v, res.out,
                                                       res.lse, *cts)
    dq, dk, dv, *rest = backward(impl, static, res._replace(q=q, k=k, v=v, out=out, lse=lse),
                                 tuple(cts))
    return (*_vma.cotangents_like((dq, dk, dv), (res.q, res.k, res.v)), *rest)

  attention.defvjp(fwd, bwd)
  return attention


def rank_segments(q_ids, kv_ids):
  """(q_ids, kv_ids) with each row's ids replaced by their int32 rank among the row's
  distinct ids (0, 1, ...): equal exactly where the given ids are, in the same order."""
  both = jnp.concatenate([q_ids, kv_ids], axis=1)  # [B, T + S]
  # Sorts along the rows only (no scatter, no gather): they stay per shard on a mesh whose
  # axes shard the batch. The positions are sharded as the ids are (an Explicit mesh's
  # sort takes operands sharded alike).
  position = jnp.cumsum(jnp.ones_like(both, jnp.int32), axis=1) - 1
  ranked, order = lax.sort((both, position), dimension=1, num_keys=1)
  new = jnp.concatenate([jnp.zeros_like(ranked[:, :1], jnp.bool_),
                         ranked[:, 1:] != ranked[:, :-1]], axis=1)
  rank = jnp.cumsum(new, axis=1, dtype=jnp.int32)
  _, rank = lax.sort((order, rank), dimension=1, num_keys=1)  # back to the rows' order
  return rank[:, :q_ids.shape[1]], rank[:, q_ids.shape[1]:]


def softmax_delta(out, d_out, d_lse):
  """Δ = rowsum(dO ∘ O) − d_lse, float32 [B, Hq, T]: what the backward kernels subtract from
  dP (a cotangent on the log-sum-exp enters here)."""
  # The row sums are taken in the arrays' own [B, T, H] order (a reduction over contiguous D)
  # and only the small result is transposed. Reduced straight into [B, H, T], XLA fused the
  # sum into the transpose's loop, one strided row per thread, several times slower (the
  # design doc's "Alternatives tried").
  rows = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  return jnp.swapaxes(lax.optimization_barrier(rows), 1, 2) - d_lse


def cap(s, softcap):
  return s if softcap is None else softcap * jnp.tanh(s / softcap)


def cap_grad(s_capped, softcap):
  """d capped / d raw, from the capped value."""
  return 1.0 if softcap is None else 1.0 - jnp.square(s_capped / softcap)


def finite_or_zero(x):
  return jnp.where(jnp.isfinite(x), x, 0.0)


def lse_from(m, l):
  """log-sum-exp from a running max and sum; -inf where nothing was visible (l = 0)."""
  return jnp.where(l > 0, finite_or_zero(m) + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)


def cost_estimate(opts: AttentionOptions, q, k, matmuls: int) -> pl.CostEstimate:
  """`matmuls` [T, S] × D products per head (2 for the forward, 3 for dq, 4 for dk/dv) over
  the pairs the mask's band lets through. XLA does not see inside the kernels;
  memeff_jax.remat.fit reads this to count what a remat policy recomputes."""
  b, t, hq, d = q.shape
  pairs = opts.mask.visible_pairs(t, k.shape[1])
  itemsize = jnp.dtype(q.dtype).itemsize
  return pl.CostEstimate(flops=2 * matmuls * b * hq * pairs * d,
                         transcendentals=b * hq * pairs,
                         bytes_accessed=(2 * q.size + 2 * k.size) * itemsize)
