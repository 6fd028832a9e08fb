"""A drop-in `attention_fn` for flax's attention modules, over memeff_jax.flash_attention.

flax calls attention_fn(query, key, value, bias, mask, broadcast_dropout, dropout_rng,
dropout_rate, deterministic, dtype, precision, module, is_causal). What flash_attention can
express is mapped; everything else raises, so a mask or dropout is never dropped silently:

  - `is_causal=True` (nnx), or `causal=True` bound with functools.partial → causal.
  - `mask`: a concrete mask that is all True, or exactly the causal mask, runs the fast
    kernels. Any other mask, a traced one too (nnx.make_causal_mask under nnx.jit, the
    decode path's), goes to flash_attention's dense `mask`, which chunked_xla serves in
    query blocks without a [T, S] float buffer. Binding `causal`, `sliding_window` or
    `segment_ids` with functools.partial keeps the fast kernels.
  - `bias`, attention dropout in training (`dropout_rate > 0` and not deterministic),
    `module` (sowing attention weights) and a non-default `precision` raise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from memeff_jax.ops.flash_attention import flash_attention


def _mask_kind(mask, t: int, s: int) -> str:
  """'full' or 'causal' for a concrete [..., T, S] mask that is one of them, else 'dense'
  (a traced mask too: its values are unknown at trace time)."""
  if np.ndim(mask) < 2 or np.shape(mask)[-2:] != (t, s):
    raise ValueError(f"mask.shape={np.shape(mask)} must end in (T, S)=({t}, {s})")
  if isinstance(mask, jax.core.Tracer):
    return "dense"
  m = np.asarray(mask).astype(bool)
  if m.all():
    return "full"
  if np.array_equal(m, np.broadcast_to(np.tril(np.ones((t, s), bool)), m.shape)):
    return "causal"
  return "dense"


def _flat_mask(mask, batch: tuple[int, ...]):
  """flax's [batch..., H|1, T, S] mask (leading dims may broadcast) as [B, H|1, T, S]."""
  mask = jnp.asarray(mask).astype(jnp.bool_)
  mask = mask.reshape((1,) * (len(batch) + 3 - mask.ndim) + mask.shape)
  mask = jnp.broadcast_to(mask, batch + mask.shape[-3:])
  return mask.reshape((-1,) + mask.shape[-3:])


def flash_attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                       dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                       precision=None, module=None, is_causal=False, *, causal=False,
                       sliding_window=None, segment_ids=None, logit_softcap=None,
                       deterministic_backward=True, implementation=None):
  """`attention_fn` for `flax.linen.MultiHeadDotProductAttention` / `flax.nnx.MultiHeadAttention`.

  query [..., T, H, D], key/value [..., S, H, D] (flax's layout; leading dims are batch).
  Keyword-only arguments are ours, to bind with functools.partial. flax's `deterministic`
  turns dropout off; `deterministic_backward` is flash_attention's `deterministic`
  (bitwise-reproducible gradients; False allows the faster Hopper backward).
  """
  del broadcast_dropout, dropout_rng  # meaningful only with dropout, which raises below
  if bias is not None:
    raise NotImplementedError("flash_attention_fn does not take an additive attention bias")
  if dropout_rate > 0.0 and not deterministic:
    raise NotImplementedError("flash_attention_fn does not implement attention dropout; "
                              "set dropout_rate=0 or deterministic=True")
  if module is not None:
    raise NotImplementedError("flash_attention_fn never forms attention weights, so it "
                              "cannot sow them (sow_weights=True)")
  if precision not in (None, jax.lax.Precision.DEFAULT):
    raise NotImplementedError(f"flash_attention_fn takes no precision, got {precision!r}")
  t, s = query.shape[-3], key.shape[-3]
  causal = bool(causal or is_causal)
  kind = None if mask is None else _mask_kind(mask, t, s)
  causal = causal or kind == "causal"
  if dtype is not None:
    query, key, value = (a.astype(dtype) for a in (query, key, value))
  batch = query.shape[:-3]
  flat = lambda a: a.reshape((-1,) + a.shape[-3:])
  seg = None if segment_ids is None else jnp.asarray(segment_ids).reshape(-1, t)
  out = flash_attention(flat(query), flat(key), flat(value), causal=causal,
                        sliding_window=sliding_window, q_segment_ids=seg,
                        logit_softcap=logit_softcap,
                        mask=_flat_mask(mask, batch) if kind == "dense" else None,
                        deterministic=deterministic_backward, implementation=implementation)
  return out.reshape(batch + out.shape[1:])
