"""Flax linen layers."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
from flax.linen.dtypes import promote_dtype
import jax
import jax.numpy as jnp

from memeff_jax.flax._attention_fn import flash_attention_fn
from memeff_jax.ops.linear_cross_entropy import linear_cross_entropy

__all__ = ["FusedLMHead", "flash_attention_fn"]


class FusedLMHead(nn.Module):
  """An LM head whose call returns the loss, never the logits.

  Parameters are those of `nn.Dense(vocab_size, use_bias=...)`: `kernel` [D, V] and
  `bias` [V], with the same initializers, so a model can switch between this and
  Dense + optax in either direction. Unlike Dense's, `use_bias` defaults to False (LM heads
  have none, and a bias costs the fused loss its fastest path): pass use_bias=True to hold
  the parameters of a default `nn.Dense(vocab_size)`. With `tied=True` it owns no kernel and
  uses the embedding table passed at call ([V, D], e.g. an `nn.Embed`'s `embedding`) in
  place.

  Attributes:
    vocab_size: V.
    use_bias, dtype, param_dtype, kernel_init, bias_init: as `nn.Dense`.
    tied: use `embedding=` at call instead of an own kernel.
    implementation: passed to `linear_cross_entropy`.
  """

  vocab_size: int
  use_bias: bool = False
  tied: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Any = nn.initializers.lecun_normal()
  bias_init: Any = nn.initializers.zeros_init()
  implementation: Any = None

  @nn.compact
  def __call__(self, x, labels=None, *, embedding=None, **loss_options):
    """Loss of `x` [..., D] against `labels` [...] (options as linear_cross_entropy);
    with labels=None, the logits (for inference)."""
    d = x.shape[-1]
    if self.tied:
      if embedding is None:
        raise ValueError("FusedLMHead(tied=True) needs embedding=<[V, D] table> at call")
      if embedding.shape != (self.vocab_size, d):
        raise ValueError(f"embedding.shape={embedding.shape} must be (vocab_size, D)="
                         f"({self.vocab_size}, {d})")
      weight, layout = embedding, "vd"
    else:
      if embedding is not None:
        raise ValueError("embedding= is only for FusedLMHead(tied=True)")
      weight = self.param("kernel", self.kernel_init, (d, self.vocab_size), self.param_dtype)
      layout = "dv"
    bias = (self.param("bias", self.bias_init, (self.vocab_size,), self.param_dtype)
            if self.use_bias else None)
    x, weight, bias = promote_dtype(x, weight, bias, dtype=self.dtype)
    if labels is None:
      if loss_options:
        raise ValueError(f"loss options {sorted(loss_options)} need labels")
      logits = x @ (weight if layout == "dv" else weight.T)
      return logits if bias is None else logits + bias
    return linear_cross_entropy(x, weight, labels, bias=bias, weight_layout=layout,
                                implementation=self.implementation, **loss_options)

  def logits(self, x, *, embedding=None) -> jax.Array:
    """[..., V] logits, for inference (this materializes them)."""
    return self(x, None, embedding=embedding)
