"""Flax NNX layers."""

from __future__ import annotations

from typing import Any

from flax import nnx
from flax.nnx.nn.dtypes import promote_dtype
import jax
import jax.numpy as jnp

from memeff_jax.flax._attention_fn import flash_attention_fn
from memeff_jax.ops.linear_cross_entropy import linear_cross_entropy

__all__ = ["FusedLMHead", "flash_attention_fn"]


class FusedLMHead(nnx.Module):
  """An LM head whose call returns the loss, never the logits.

  Parameters are those of `nnx.Linear(in_features, vocab_size, use_bias=...)`: `kernel`
  [D, V] and `bias` [V], with the same initializers, so a model can switch between this and
  Linear + optax in either direction. Unlike Linear's, `use_bias` defaults to False (LM
  heads have none, and a bias costs the fused loss its fastest path): pass use_bias=True to
  hold the parameters of a default `nnx.Linear(in_features, vocab_size)`. Given
  `tied_embedding` (an `nnx.Embed` with a [V, D] table) it owns no kernel and reads that
  table in place, shared, not copied.

  Args:
    in_features: D.
    vocab_size: V.
    use_bias, dtype, param_dtype, kernel_init, bias_init: as `nnx.Linear`.
    tied_embedding: optional `nnx.Embed` to tie to.
    implementation: passed to `linear_cross_entropy`.
    rngs: for the initializers.
  """

  def __init__(self, in_features: int, vocab_size: int, *, use_bias: bool = False,
               dtype: Any = None, param_dtype: Any = jnp.float32,
               kernel_init=nnx.initializers.lecun_normal(),
               bias_init=nnx.initializers.zeros_init(),
               tied_embedding: nnx.Embed | None = None, implementation=None,
               rngs: nnx.Rngs):
    self.in_features, self.vocab_size = in_features, vocab_size
    self.dtype, self.implementation = dtype, implementation
    if tied_embedding is not None:
      shape = tied_embedding.embedding.shape
      if shape != (vocab_size, in_features):
        raise ValueError(f"tied_embedding table {shape} must be (vocab_size, in_features)="
                         f"({vocab_size}, {in_features})")
      self.tied_embedding = tied_embedding
      self.kernel = None
    else:
      self.tied_embedding = None
      self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, vocab_size),
                                          param_dtype))
    self.bias = (nnx.Param(bias_init(rngs.params(), (vocab_size,), param_dtype))
                 if use_bias else None)

  def _weights(self, x):
    if self.tied_embedding is not None:
      weight, layout = self.tied_embedding.embedding[...], "vd"
    else:
      weight, layout = self.kernel[...], "dv"
    bias = None if self.bias is None else self.bias[...]
    x, weight, bias = promote_dtype((x, weight, bias), dtype=self.dtype)
    return x, weight, bias, layout

  def __call__(self, x, labels=None, **loss_options) -> jax.Array:
    """Loss of `x` [..., D] against `labels` [...] (options as linear_cross_entropy); with
    labels=None, the logits (for inference), as the linen layer."""
    if labels is None:
      if loss_options:
        raise ValueError(f"loss options {sorted(loss_options)} need labels")
      return self.logits(x)
    x, weight, bias, layout = self._weights(x)
    return linear_cross_entropy(x, weight, labels, bias=bias, weight_layout=layout,
                                implementation=self.implementation, **loss_options)

  def logits(self, x) -> jax.Array:
    """[..., V] logits, for inference (this materializes them)."""
    x, weight, bias, layout = self._weights(x)
    logits = x @ (weight if layout == "dv" else weight.T)
    return logits if bias is None else logits + bias
