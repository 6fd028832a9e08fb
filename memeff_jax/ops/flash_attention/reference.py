"""Materializing float32 attention: the oracle, the math, the debug path.

  s = scale · q kᵀ            [B, Hq, T, S], float32
  ŝ = c · tanh(s / c)          (c = logit_softcap)
  p = softmax(ŝ over visible keys); a query that sees no key gets p = 0, output 0
  out = p v,  lse = log Σ_visible exp(ŝ)   (-inf for a query that sees no key)

GQA: query head h uses key/value head h // (Hq / Hkv). Gradients by JAX autodiff.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from memeff_jax.ops.flash_attention import _common
from memeff_jax.ops.flash_attention import masks
from memeff_jax.ops.flash_attention._common import AttentionOptions


def reference_attention(q, k, v, q_seg, kv_seg, opts: AttentionOptions, mask=None):
  b, t, hq, d = q.shape
  s_len, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  qf = q.astype(jnp.float32).reshape(b, t, hkv, g, d)
  s = jnp.einsum("btkgd,bskd->bkgts", qf, k.astype(jnp.float32)) * opts.scale
  s = _common.cap(s, opts.logit_softcap)
  seen = masks.visible(opts.mask, jnp.arange(t), jnp.arange(s_len))[None]  # [1, T, S]
  if opts.mask.segments:
    seen = seen & (q_seg[:, :, None] == kv_seg[:, None, :])
  seen = seen[:, None, None]  # [B, 1, 1, T, S]
  if mask is not None:  # [B|1, Hq|1, T, S]
    heads = mask.shape[1]
    seen = seen & mask.reshape(mask.shape[0], hkv if heads > 1 else 1, g if heads > 1 else 1,
                               t, s_len)
  s = jnp.where(seen, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(seen, jnp.exp(s - _common.finite_or_zero(m)), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.einsum("bkgts,bskd->btkgd", p / jnp.where(l > 0, l, 1.0), v.astype(jnp.float32))
  lse = _common.lse_from(m[..., 0], l[..., 0])  # [B, Hkv, G, T]
  return out.reshape(b, t, hq, d), lse.reshape(b, hq, t)


@dataclasses.dataclass(frozen=True)
class Reference:
  """Holds the [B, Hq, T, S] float32 scores. For tests and debugging only."""

  name: str = "reference"

  def __call__(self, q, k, v, q_seg, kv_seg, *, opts: AttentionOptions):
    out, lse = reference_attention(q, k, v, q_seg, kv_seg, opts)
    return out.astype(q.dtype), lse

  def masked(self, q, k, v, q_seg, kv_seg, mask, *, opts: AttentionOptions):
    """With a dense boolean mask [B|1, Hq|1, T, S] too."""
    out, lse = reference_attention(q, k, v, q_seg, kv_seg, opts, mask)
    return out.astype(q.dtype), lse

  def backward(self, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, *, opts: AttentionOptions):
    """(dq, dk, dv) by autodiff of the reference (it recomputes the forward)."""
    del out, lse
    f = lambda q, k, v: self(q, k, v, q_seg, kv_seg, opts=opts)
    return jax.vjp(f, q, k, v)[1]((d_out, d_lse))
