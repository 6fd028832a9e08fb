"""Materializing float32 linear cross-entropy: the oracle, the math, the debug path.

Holds the whole [N, V] float32 logits (and their gradient under autodiff). Gradients come
from JAX's autodiff of this plain code on purpose: the oracle must not share a hand-written
backward with the implementations it checks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from memeff_jax.ops.linear_cross_entropy import _common
from memeff_jax.ops.linear_cross_entropy._common import LossOptions, Stats
from memeff_jax.ops.linear_cross_entropy._vocab_parallel import VocabShards


def reference_stats(x, weight, bias, labels, opts: LossOptions) -> Stats:
  """Stats of every token over the vocabulary `weight` holds; the label logit 0 where the
  label is outside it."""
  x = x.astype(jnp.float32)
  w = weight.astype(jnp.float32)
  z = x @ w if opts.weight_layout == "dv" else x @ w.T  # [N, V]
  if bias is not None:
    z = z + bias.astype(jnp.float32)
  z = _common.cap_logits(z, opts.logit_softcap)
  lse = jax.nn.logsumexp(z, axis=-1)
  inside = (labels >= 0) & (labels < opts.vocab_size)
  safe = jnp.where(inside, labels, 0)
  label_logit = jnp.where(inside, jnp.take_along_axis(z, safe[:, None], axis=-1)[:, 0], 0.0)
  mean_logit = None
  if opts.entropy:  # Σ p ẑ, with p ẑ = 0 where ẑ = −inf (p = 0): a bias masking entries
    mean_logit = jnp.sum(jax.nn.softmax(z, axis=-1) * jnp.where(jnp.isneginf(z), 0.0, z),
                         axis=-1)
  return Stats(lse, label_logit, jnp.sum(z, axis=-1), mean_logit)


@dataclasses.dataclass(frozen=True)
class Reference:
  """Materializes float32 logits; memory O(N·V). For tests and debugging only."""

  name: str = "reference"

  def __call__(self, x, weight, bias, labels, valid, weights=None, *, opts: LossOptions,
               chunk_size=None, vocab: VocabShards | None = None):
    del chunk_size  # the reference holds everything at once
    labels = _common.int32_labels(labels)
    if vocab is None:
      stats = reference_stats(x, weight, bias, labels, opts)
    else:  # its slice's statistics, merged over the vocabulary's axis
      local = vocab.options(opts, weight)
      stats = vocab.merge(reference_stats(x, weight, bias,
                                          labels - vocab.offset(local.vocab_size), local))
    return _common.finish(stats, labels, valid, opts, weights)
