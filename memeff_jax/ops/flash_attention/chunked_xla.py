"""FlashAttention's recurrence in plain XLA: any backend, no [T, S] buffer.

Forward (Rabe & Staats 2021; Dao et al. 2022, Alg. 1): for each block of `block_q` queries,
walk the key blocks the mask can reach with an online softmax (running max m, sum l,
unnormalized output acc). Backward (Dao 2023, FlashAttention-2 §3.1.2), two passes that
recompute p from the saved log-sum-exp: one over query blocks for dq, one over key blocks
for dk and dv. The largest live buffer is [B, Hq, block_q, block_k].

GQA runs as [B, Hkv, G, ...] with G = Hq / Hkv query heads per key head: k and v are never
repeated. A dense boolean mask (flash_attention's `mask`) runs masked_attention instead:
query blocks against all keys, recomputed in the backward.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from memeff_jax.ops import _vma
from memeff_jax.ops.flash_attention import _common
from memeff_jax.ops.flash_attention import masks
from memeff_jax.ops.flash_attention._common import AttentionOptions, Residuals


@dataclasses.dataclass(frozen=True)
class ChunkedXla:
  """Pure-XLA blocked attention. Block sizes are clipped to the sequence lengths."""

  block_q: int = 512
  block_k: int = 512
  name: str = "chunked_xla"

  def _static(self, q, k, opts):
    return _Static(opts, min(self.block_q, q.shape[1]), min(self.block_k, k.shape[1]))

  def __call__(self, q, k, v, q_seg, kv_seg, *, opts: AttentionOptions):
    return _attention(self, self._static(q, k, opts), q, k, v, q_seg, kv_seg)

  def backward(self, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, *, opts: AttentionOptions):
    """(dq, dk, dv) from saved out and lse [B, Hq, T], without a forward pass."""
    res = Residuals(q, k, v, q_seg, kv_seg, out, lse)
    return _bwd(self._static(q, k, opts), res, (d_out, d_lse))[:3]

  def masked(self, q, k, v, q_seg, kv_seg, mask, *, opts: AttentionOptions):
    """With a dense boolean mask [B|1, Hq|1, T, S] too: masked_attention, 128 query rows
    a block (its scores are [B, Hq, 128, S]), differentiated by JAX."""
    return masked_attention(q, k, v, q_seg, kv_seg, mask, opts=opts,
                            block_q=min(self.block_q, 128))


@dataclasses.dataclass(frozen=True)
class _Static:
  opts: AttentionOptions
  block_q: int
  block_k: int


def _pad_to(x, axis, multiple, value=0):
  pad = -x.shape[axis] % multiple
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


class _Blocked:
  """The inputs re-laid out and padded: q [B, K, G, Tp, D], k/v [B, K, Sp, D]."""

  def __init__(self, st: _Static, q, k, v, q_seg, kv_seg):
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    self.st, self.t, self.s, self.g = st, t, s, hq // hkv
    q5 = q.reshape(b, t, hkv, self.g, d).transpose(0, 2, 3, 1, 4)
    self.q = _pad_to(q5, 3, st.block_q)
    self.k = _pad_to(k.transpose(0, 2, 1, 3), 2, st.block_k)
    self.v = _pad_to(v.transpose(0, 2, 1, 3), 2, st.block_k)
    self.q_seg = None if q_seg is None else _pad_to(q_seg, 1, st.block_q, -1)
    self.kv_seg = None if kv_seg is None else _pad_to(kv_seg, 1, st.block_k, -2)

  def from_q_layout(self, x):  # [B, K, G, Tp, ...] -> [B, T, Hq, ...]
    b, kh, g = x.shape[:3]
    x = x[:, :, :, :self.t]
    return jnp.moveaxis(x, 3, 1).reshape(b, self.t, kh * g, *x.shape[4:])

  def q_block(self, x, i):  # block i of a [B, K, G, Tp, ...] array
    return jax.lax.dynamic_slice_in_dim(x, i * self.st.block_q, self.st.block_q, axis=3)

  def k_block(self, x, j):  # block j of a [B, K, Sp, D] array
    return jax.lax.dynamic_slice_in_dim(x, j * self.st.block_k, self.st.block_k, axis=2)

  def scores(self, qb, kb, i, j):
    """(capped scores, visible) for query block i and key block j: [B, K, G, bq, bk]."""
    st = self.st
    s = jnp.einsum("bkgqd,bksd->bkgqs", qb, kb, preferred_element_type=jnp.float32)
    s = _common.cap(s * st.opts.scale, st.opts.logit_softcap)
    q_idx = i * st.block_q + jnp.arange(st.block_q)
    k_idx = j * st.block_k + jnp.arange(st.block_k)
    seen = masks.visible(st.opts.mask, q_idx, k_idx)
    seen = seen & (k_idx < self.s)[None, :] & (q_idx < self.t)[:, None]
    seen = seen[None, None, None]
    if st.opts.mask.segments:
      qs = jax.lax.dynamic_slice_in_dim(self.q_seg, i * st.block_q, st.block_q, axis=1)
      ks = jax.lax.dynamic_slice_in_dim(self.kv_seg, j * st.block_k, st.block_k, axis=1)
      seen = seen & (qs[:, :, None] == ks[:, None, :])[:, None, None]
    return s, seen

  def kv_range(self, i):
    return masks.kv_block_range(self.st.opts.mask, i * self.st.block_q, self.st.block_q,
                                self.s, self.st.block_k)

  def q_range(self, j):
    return masks.q_block_range(self.st.opts.mask, j * self.st.block_k, self.st.block_k,
                               self.t, self.st.block_q)


def _forward(st: _Static, q, k, v, q_seg, kv_seg):
  blk = _Blocked(st, q, k, v, q_seg, kv_seg)
  b, kh, g, tp, d = blk.q.shape

  def one_q_block(i):
    qb = blk.q_block(blk.q, i)
    shape = (b, kh, g, st.block_q)

    def step(j, carry):
      m, l, acc = carry
      s, seen = blk.scores(qb, blk.k_block(blk.k, j), i, j)
      s = jnp.where(seen, s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      m_use = _common.finite_or_zero(m_new)
      p = jnp.where(seen, jnp.exp(s - m_use[..., None]), 0.0)
      alpha = jnp.exp(m - m_use)  # 0 while m is still -inf
      acc = acc * alpha[..., None] + jnp.einsum(
          "bkgqs,bksd->bkgqd", p.astype(v.dtype), blk.k_block(blk.v, j),
          preferred_element_type=jnp.float32)
      return m_new, l * alpha + jnp.sum(p, axis=-1), acc

    init = _vma.varying_like((jnp.full(shape, -jnp.inf, jnp.float32),
                              jnp.zeros(shape, jnp.float32),
                              jnp.zeros(shape + (d,), jnp.float32)), q, k, v, q_seg, kv_seg)
    lo, hi = blk.kv_range(i)
    m, l, acc = jax.lax.fori_loop(lo, hi, step, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.astype(q.dtype), _common.lse_from(m, l)

  out, lse = jax.lax.map(one_q_block, jnp.arange(tp // st.block_q))  # [nq, B, K, G, bq, ...]
  out = jnp.moveaxis(out, 0, 3).reshape(b, kh, g, tp, d)
  lse = jnp.moveaxis(lse, 0, 3).reshape(b, kh, g, tp)
  out = blk.from_q_layout(out)
  lse = lse[..., :blk.t].reshape(b, kh * g, blk.t)
  return out, lse


def _bwd(st: _Static, res: Residuals, cts):
  d_out, d_lse = cts
  q, k, v = res.q, res.k, res.v
  blk = _Blocked(st, q, k, v, res.q_segment_ids, res.kv_segment_ids)
  b, kh, g, tp, d = blk.q.shape
  to_q5 = lambda x: _pad_to(x.reshape(b, blk.t, kh, g, *x.shape[3:]).transpose(
      0, 2, 3, 1, *range(4, x.ndim + 1)), 3, st.block_q)
  do5 = to_q5(d_out)
  # delta_i = Σ_d dO·O (Dao 2023, eq. after Alg. 2); a cotangent on lse adds -g_lse.
  delta = jnp.sum(d_out.astype(jnp.float32) * res.out.astype(jnp.float32), axis=-1)
  if d_lse is not None:
    delta = delta - jnp.moveaxis(d_lse, 1, 2)  # lse is [B, Hq, T]
  delta5 = to_q5(delta)
  lse5 = to_q5(jnp.moveaxis(res.lse, 1, 2))
  inputs = (q, k, v, res.q_segment_ids, res.kv_segment_ids, res.out, res.lse, d_out, d_lse)

  def probs_and_dscores(i, j, qb, dob):
    s, seen = blk.scores(qb, blk.k_block(blk.k, j), i, j)
    lse_b = _common.finite_or_zero(blk.q_block(lse5, i))
    p = jnp.where(seen, jnp.exp(s - lse_b[..., None]), 0.0)
    dp = jnp.einsum("bkgqd,bksd->bkgqs", dob, blk.k_block(blk.v, j),
                    preferred_element_type=jnp.float32)
    ds = p * (dp - blk.q_block(delta5, i)[..., None]) * _common.cap_grad(
        s, st.opts.logit_softcap)
    return p, ds * st.opts.scale

  def dq_block(i):
    qb, dob = blk.q_block(blk.q, i), blk.q_block(do5, i)

    def step(j, dq):
      _, ds = probs_and_dscores(i, j, qb, dob)
      return dq + jnp.einsum("bkgqs,bksd->bkgqd", ds.astype(k.dtype), blk.k_block(blk.k, j),
                             preferred_element_type=jnp.float32)

    lo, hi = blk.kv_range(i)
    init = _vma.varying_like(jnp.zeros(qb.shape, jnp.float32), *inputs)
    return jax.lax.fori_loop(lo, hi, step, init).astype(q.dtype)

  def dkv_block(j):
    def step(i, carry):
      dk, dv = carry
      qb, dob = blk.q_block(blk.q, i), blk.q_block(do5, i)
      p, ds = probs_and_dscores(i, j, qb, dob)
      dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p.astype(v.dtype), dob,
                           preferred_element_type=jnp.float32)
      dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds.astype(q.dtype), qb,
                           preferred_element_type=jnp.float32)
      return dk, dv

    zeros = _vma.varying_like(jnp.zeros((b, kh, st.block_k, d), jnp.float32), *inputs)
    lo, hi = blk.q_range(j)
    dk, dv = jax.lax.fori_loop(lo, hi, step, (zeros, zeros))
    return dk.astype(k.dtype), dv.astype(v.dtype)

  dq = jax.lax.map(dq_block, jnp.arange(tp // st.block_q))
  dq = blk.from_q_layout(jnp.moveaxis(dq, 0, 3).reshape(b, kh, g, tp, d))
  sp = blk.k.shape[2]
  dk, dv = jax.lax.map(dkv_block, jnp.arange(sp // st.block_k))
  to_bshd = lambda x: jnp.moveaxis(x, 0, 2).reshape(b, kh, sp, d)[:, :, :blk.s].transpose(
      0, 2, 1, 3)
  return dq, to_bshd(dk), to_bshd(dv), None, None


_attention = _common.attention_vjp(_forward, _bwd, "chunked_xla")


def masked_attention(q, k, v, q_seg, kv_seg, mask, *, opts: AttentionOptions, block_q: int):
  """(out, lse [B, Hq, T]) with a dense boolean `mask` [B|1, Hq|1, T, S] besides `opts`'
  masks, differentiable by JAX (no custom_vjp).

  Query blocks of `block_q` rows see every key at once, one block at a time under
  jax.checkpoint: the forward keeps one block's [B, Hq, block_q, S] scores, and the backward
  recomputes each block's from its inputs, so no [T, S] float buffer is held (the mask
  itself is the caller's)."""
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  bq = min(block_q, t)
  tp = -(-t // bq) * bq
  q5 = _pad_to(q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4), 3, bq)  # [B, K, G, Tp, D]
  kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, D]
  heads = mask.shape[1]
  m5 = mask.reshape(mask.shape[0], hkv if heads > 1 else 1, g if heads > 1 else 1, t, s)
  m5 = _pad_to(m5, 3, bq, False)
  q_ids = None if q_seg is None else _pad_to(q_seg, 1, bq, -1)
  k_idx = jnp.arange(s)

  @jax.checkpoint
  def one_block(i):
    qb = jax.lax.dynamic_slice_in_dim(q5, i * bq, bq, axis=3)
    sc = jnp.einsum("bkgqd,bksd->bkgqs", qb, kt, preferred_element_type=jnp.float32)
    sc = _common.cap(sc * opts.scale, opts.logit_softcap)
    q_idx = i * bq + jnp.arange(bq)
    seen = masks.visible(opts.mask, q_idx, k_idx)[None, None, None]
    seen = seen & jax.lax.dynamic_slice_in_dim(m5, i * bq, bq, axis=3)
    if q_ids is not None:
      ids = jax.lax.dynamic_slice_in_dim(q_ids, i * bq, bq, axis=1)
      seen = seen & (ids[:, :, None] == kv_seg[:, None, :])[:, None, None]
    sc = jnp.where(seen, sc, -jnp.inf)
    m = jnp.max(sc, axis=-1)
    p = jnp.where(seen, jnp.exp(sc - _common.finite_or_zero(m)[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    out = jnp.einsum("bkgqs,bksd->bkgqd", p / jnp.where(l > 0, l, 1.0)[..., None],
                     vt.astype(jnp.float32))
    return out.astype(q.dtype), _common.lse_from(m, l)

  out, lse = jax.lax.map(one_block, jnp.arange(tp // bq))  # [nq, B, K, G, bq, ...]
  out = jnp.moveaxis(out, 0, 3).reshape(b, hkv, g, tp, d)[:, :, :, :t]
  lse = jnp.moveaxis(lse, 0, 3).reshape(b, hkv, g, tp)[..., :t]
  return jnp.moveaxis(out, 3, 1).reshape(b, t, hq, d), lse.reshape(b, hq, t)
