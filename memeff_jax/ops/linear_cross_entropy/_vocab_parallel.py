"""Linear cross-entropy with the vocabulary sharded over a mesh axis (Megatron's vocab-parallel
loss), run per shard inside `jax.shard_map` or `custom_partitioning`.

Each shard holds W's columns [o, o + V_s) (and the bias's) and every token. The chunked
implementations merge each token chunk's row statistics across the axis inside their chunk
loop, between the logits GEMM and G (see _chunked):

  1. z = x_c · W_s, the slice's statistics: lse_s, the label logit where the label is in
     the slice (else 0), Σ_v ẑ for label smoothing, μ_s = Σ_v p_s ẑ for the entropy;
  2. merged over the axis through [C]-sized collectives only (`VocabShards.merge`):
       lse = m + log Σ_s exp(lse_s − m)      m = max_s lse_s (pmax)
     and psums of the label logit, Σ_v ẑ and exp(lse_s − m) μ_s;
  3. G of the slice with the global lse: exp(ẑ − lse) is the global softmax restricted to
     the slice, so dx_c = G W_sᵀ is the slice's share of dx and dW_s = x_cᵀ G is exactly
     dW's slice.

So a shard runs the single-device loss's three matmuls on its slice (no logits recomputed
for a global lse), dW and the bias's gradient stay local, and each shard's dx is its
slice's share, summed over the axis once: by `_vma.cotangents_like` under check_vma (x is
invariant over the axis, its share varies), by shard_map's own transpose of a replicated
input without it, by _partition under custom_partitioning. Nothing of size [N, V] or
[D, V] crosses devices.

Every shard computes the same loss. Under shard_map with check_vma off, JAX's transpose
hands each shard 1/n of a replicated output's cotangent (its psum transposes to the psum
that adds the shares back), so the backward sums the cotangents over the axis first
(`cotangent_shares`); under check_vma, and per shard of custom_partitioning, each shard
gets the whole cotangent.

The reference merges the same statistics of its whole slice and is differentiated by JAX.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from memeff_jax.ops import _vma
from memeff_jax.ops.linear_cross_entropy import _common
from memeff_jax.ops.linear_cross_entropy._common import LossOptions, Stats


@dataclasses.dataclass(frozen=True)
class VocabShards:
  """The mesh axis (or axes) W's vocabulary is sharded over; hashable, for a custom_vjp's
  static arguments."""

  axis: str | tuple[str, ...]
  cotangent_shares: bool = False  # the outputs' cotangents arrive split over the axis

  def offset(self, v_local: int) -> jax.Array:
    """The first global class id of this shard's slice of `v_local` columns."""
    return jax.lax.axis_index(self.axis) * v_local

  def options(self, opts: LossOptions, weight) -> LossOptions:
    """A shard's options for its slice `weight` of W: the slice's size, and the whole
    vocabulary's for label smoothing."""
    return dataclasses.replace(opts, vocab_size=_common.vocab_of(weight, opts),
                               whole_vocab=opts.vocab_size)

  def merge(self, local: Stats) -> Stats:
    """The whole vocabulary's Stats from every shard's Stats of its slice (the label logit 0
    where the label lies in another slice): a pmax and a psum of [3, C] ([4, C] with the
    entropy's μ, each slice's weighted by its share of the softmax, exp(lse_s − lse))."""
    m = jax.lax.pmax(jax.lax.stop_gradient(local.lse), self.axis)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))  # all -inf: no −inf − −inf
    share = jnp.exp(local.lse - m)
    parts = [share, local.label_logit, local.logit_sum]
    if local.mean_logit is not None:
      parts.append(share * local.mean_logit)
    s, label_logit, logit_sum, *weighted = jax.lax.psum(jnp.stack(parts), self.axis)
    mean_logit = weighted[0] / s if weighted else None
    return Stats(m + jnp.log(s), label_logit, logit_sum, mean_logit)

  def sum(self, x):
    return jax.lax.psum(x, self.axis)

  def cotangents(self, *cts):
    """The outputs' whole cotangents (None for a zero one) from what this shard was given."""
    if not self.cotangent_shares:
      return cts
    return tuple(None if ct is None else self.sum(ct) for ct in cts)

  def invariant(self, tree):
    """`tree`'s arrays, which every shard of the axis holds alike, typed as invariant over it
    under check_vma (a pmax of equal values: exact). A chunk loop's outputs are typed varying
    over every axis its inputs vary over, W's vocabulary axis among them."""
    return _vma.invariant_over(tree, self.axis)
