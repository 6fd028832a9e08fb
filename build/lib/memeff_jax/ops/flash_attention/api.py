"""flash_attention(): argument checks and the choice of implementation."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from memeff_jax.kernels import hopper
from memeff_jax.ops import _dispatch
from memeff_jax.ops.flash_attention._common import AttentionOptions
from memeff_jax.ops.flash_attention.chunked_xla import ChunkedXla
from memeff_jax.ops.flash_attention.masks import MaskSpec
from memeff_jax.ops.flash_attention.pallas_mosaic_gpu import PallasMosaicGpu
from memeff_jax.ops.flash_attention.pallas_triton import PallasTriton
from memeff_jax.ops.flash_attention.reference import Reference

IMPLEMENTATIONS = {
    "reference": Reference(),
    "chunked_xla": ChunkedXla(),
    "pallas_triton": PallasTriton(),
    "pallas_mosaic_gpu": PallasMosaicGpu(),
}
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MIN_HEAD_DIM, MAX_HEAD_DIM = 32, 256


def _check_segments(name, ids, batch, length, which):
  ids = jnp.asarray(ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"{name} must be integers, got {name}.dtype={ids.dtype}")
  if ids.shape != (batch, length):
    raise ValueError(f"{name}.shape={ids.shape} must be (B, {which})=({batch}, {length})")
  return ids.astype(jnp.int32)


def _default() -> tuple[str, ...]:
  if hopper.on_nvidia_gpu():
    return ("pallas_mosaic_gpu", "pallas_triton", "chunked_xla")
  return ("chunked_xla",)


def _prepare(q, k, v, *, causal, scale, q_segment_ids, kv_segment_ids, sliding_window,
             logit_softcap, deterministic):
  """Checks every argument; returns (AttentionOptions, q_segment_ids, kv_segment_ids)."""
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  for name, a in (("q", q), ("k", k), ("v", v)):
    if a.ndim != 4:
      raise ValueError(f"{name} must be [B, {'T' if name == 'q' else 'S'}, heads, D], got "
                       f"{name}.shape={a.shape}")
    if a.dtype not in _DTYPES:
      raise TypeError(f"{name} must be float32, bfloat16 or float16, got "
                      f"{name}.dtype={a.dtype}")
  if not q.dtype == k.dtype == v.dtype:
    raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  b, t, hq, d = q.shape
  if k.shape != v.shape:
    raise ValueError(f"k.shape={k.shape} and v.shape={v.shape} must be equal")
  if k.shape[0] != b or k.shape[3] != d:
    raise ValueError(f"k.shape={k.shape} must be [B={b}, S, Hkv, D={d}] for q.shape={q.shape}")
  s, hkv = k.shape[1], k.shape[2]
  if hq % hkv:
    raise ValueError(f"query heads Hq={hq} must be a multiple of key/value heads Hkv={hkv} "
                     f"(q.shape={q.shape}, k.shape={k.shape})")
  if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
    raise ValueError(f"head dim D={d} is not supported; expected {MIN_HEAD_DIM} ≤ D ≤ "
                     f"{MAX_HEAD_DIM} (q.shape={q.shape})")
  if q_segment_ids is None and kv_segment_ids is not None:
    raise ValueError("kv_segment_ids needs q_segment_ids")
  if q_segment_ids is not None:
    q_segment_ids = _check_segments("q_segment_ids", q_segment_ids, b, t, "T")
    if kv_segment_ids is None:
      if s != t:
        raise ValueError(f"kv_segment_ids defaults to q_segment_ids, which needs T == S; got "
                         f"T={t}, S={s}: pass kv_segment_ids")
      kv_segment_ids = q_segment_ids
    kv_segment_ids = _check_segments("kv_segment_ids", kv_segment_ids, b, s, "S")
  if sliding_window is not None:
    window = (sliding_window,) * 2 if isinstance(sliding_window, numbers.Integral) else \
        tuple(sliding_window)
    if len(window) != 2 or not all(isinstance(w, numbers.Integral) and w >= 0 for w in window):
      raise ValueError(f"sliding_window must be an int ≥ 0 or a (left, right) pair of them, "
                       f"got {sliding_window!r}")
    sliding_window = tuple(int(w) for w in window)
  if logit_softcap is not None and (not isinstance(logit_softcap, numbers.Real)
                                    or logit_softcap <= 0):
    raise ValueError(f"logit_softcap must be None or > 0, got {logit_softcap!r}")
  if not isinstance(deterministic, (bool, np.bool_)):
    raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
  if scale is None:
    scale = 1.0 / math.sqrt(d)
  elif not isinstance(scale, numbers.Real):
    raise TypeError(f"scale must be a Python number, got {type(scale).__name__}")

  opts = AttentionOptions(
      mask=MaskSpec.make(bool(causal), sliding_window, q_segment_ids is not None),
      scale=float(scale),
      logit_softcap=None if logit_softcap is None else float(logit_softcap),
      deterministic=bool(deterministic))
  return opts, q_segment_ids, kv_segment_ids


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sliding_window: int | tuple[int, int] | None = None,
    logit_softcap: float | None = None,
    return_lse: bool = False,
    deterministic: bool = True,
    implementation=None,
):
  """Scaled dot-product attention without the [T, S] score matrix.

    s = scale · q kᵀ,  ŝ = c·tanh(s / c) (c = logit_softcap),  out = softmax(ŝ) v

  over the keys each query sees. Same layout and mask meanings as
  `jax.nn.dot_product_attention`: `causal` lets query i see keys 0..i (top-left aligned);
  `sliding_window=(left, right)` keys i-left..i+right (an int w means (w, w)); with segment
  ids a query sees a key only where their ids are equal. All combine. A query that sees no
  key gets output 0 (and lse -inf) with zero gradients.

  Args:
    q: [B, T, Hq, D]; k, v: [B, S, Hkv, D] with Hq % Hkv == 0 (GQA, MQA: k/v are not
      repeated in memory). T ≠ S allowed; D in [32, 256]; float32, bfloat16 or float16.
    causal, sliding_window, q_segment_ids ([B, T] ints), kv_segment_ids ([B, S] ints;
      defaults to q_segment_ids, which then needs T == S): the mask.
    scale: default 1/sqrt(D).
    logit_softcap: optional c > 0 (Gemma 2).
    return_lse: also return the float32 log-sum-exp, [B, T, Hq] (differentiable).
    deterministic: the backward gives bitwise-identical gradients on every run (the
      default). pallas_mosaic_gpu's one-pass backward adds dq (and, for GQA with
      gqa_per_query_head, dk and dv) into float32 buffers by TMA reductions. With
      deterministic=False they land in whatever order the CTAs arrive; with True, at D = 128
      (save causal GQA), in a fixed order (as fast as arrival order on an H100), and
      elsewhere its kernel computes dk and dv alone and a Mosaic dq kernel dq (1.2× slower
      forward+backward at D = 256, no float32 dq buffer). Every other implementation is
      deterministic either way.
    implementation: None (fastest available: on NVIDIA GPUs "pallas_mosaic_gpu" where it
      serves the call (Hopper, bf16/f16, D 64/128/192/256, T and S multiples of 128), then
      "pallas_triton", then "chunked_xla"), a name, an implementation object or a sequence
      tried in order.

  Returns:
    out [B, T, Hq, D] in q's dtype; with return_lse, (out, lse).

  Memory: reference holds [B, Hq, T, S] float32 scores; chunked_xla [B, Hq, block_q,
  block_k]; pallas_triton and pallas_mosaic_gpu only the kernels' tiles.

  Raises:
    ValueError / TypeError: bad shapes, dtypes or options; the message names the argument.
    NotImplementedError: when an explicitly chosen implementation cannot serve the call.

  >>> import jax, jax.numpy as jnp
  >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 128, 4, 64))
  >>> flash_attention(q, k, v, causal=True).shape
  (1, 128, 4, 64)
  """
  opts, q_segment_ids, kv_segment_ids = _prepare(
      q, k, v, causal=causal, scale=scale, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids, sliding_window=sliding_window,
      logit_softcap=logit_softcap, deterministic=deterministic)
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  out, lse = _dispatch.first_that_serves(
      _dispatch.resolve(implementation, IMPLEMENTATIONS, _default()),
      lambda impl: impl(q, k, v, q_segment_ids, kv_segment_ids, opts=opts))
  if return_lse:
    return out, jnp.moveaxis(lse, 1, 2)
  return out


def flash_attention_backward(q, k, v, out, lse, d_out, d_lse=None, *, causal=False, scale=None,
                             q_segment_ids=None, kv_segment_ids=None, sliding_window=None,
                             logit_softcap=None, deterministic=True, implementation=None):
  """(dq, dk, dv) of flash_attention from its saved output and log-sum-exp.

  For callers that keep their own residuals (the PyTorch bridge): out [B, T, Hq, D] and
  lse [B, T, Hq] as flash_attention(..., return_lse=True) returned them, d_out like out,
  d_lse like lse or None. Options must equal the forward call's. No forward pass is run
  (the reference implementation excepted: it recomputes).
  """
  opts, q_segment_ids, kv_segment_ids = _prepare(
      q, k, v, causal=causal, scale=scale, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids, sliding_window=sliding_window,
      logit_softcap=logit_softcap, deterministic=deterministic)
  lse = jnp.moveaxis(jnp.asarray(lse, jnp.float32), 2, 1)  # public [B, T, H] -> [B, H, T]
  d_lse = jnp.zeros_like(lse) if d_lse is None else jnp.moveaxis(
      jnp.asarray(d_lse, jnp.float32), 2, 1)
  return _dispatch.first_that_serves(
      _dispatch.resolve(implementation, IMPLEMENTATIONS, _default()),
      lambda impl: impl.backward(q, k, v, q_segment_ids, kv_segment_ids, out, lse, d_out,
                                 d_lse, opts=opts))
