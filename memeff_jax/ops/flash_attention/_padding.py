"""Calls whose lengths or head dim the Mosaic kernels do not take, run padded.

The Mosaic GPU kernels take T a multiple of two query blocks, S a multiple of the key block
(and of the backward CTA's keys) and the head dims of HEAD_DIMS. pallas_mosaic_gpu pads
other calls (T = 1,000, D = 40, ...) with zeros, runs the kernels on the padded call (on
copies, or in place: below) and cuts the output, the log-sum-exp and the gradients back:

- head dims 33–255 go up to the next of HEAD_DIMS, never past the next power of two, the
  head dim pallas_triton computes with; at 32 and under that power is less than 48, so
  padding would be work pallas_triton does not do, and such calls stay with it;
- zero features add nothing to q·k and give zero output columns (the scale is the call's);
- padded query rows are cut away, and their zero dO gives them no share of dk and dv;
- padded keys stay hidden from every real query: by the mask where it already hides keys
  at and past S (causal, or a window whose right side ends before S), else by a key bound
  in the mask (MaskSpec.keys = S), which the kernels apply to the one key block it cuts,
  so that such calls run the kernels and tiles of calls without padding;
- segment ids are padded with each row's last id (its padded queries and keys then see
  whatever they see, which nothing real reads).

Where the head dim is the kernels' own, T and S are whole 8-row TMA tiles and the backward is
all Mosaic (`in_place`), nothing of q, k, v, the output or the cotangents is copied: the
kernels run at the padded lengths on the call's arrays, whose rows past the end TMA loads as
zeros and whose stores there it drops, the same values as the copies'; only the segment ids
and the backward's row statistics ([B, H, T]-sized) are padded.

Padded lengths are work pallas_triton does not do (its blocks stop at T and S), so where
they add more than its kernels lose (TRITON_SLOWDOWN, on copies or in place: T = 257 runs
at 384, 2.2× the work), `implementation=None` leaves the call to pallas_triton
(PallasMosaicGpu's pad="where_faster"). Copies cost memory: about eight [B, T, H, D]
arrays at the padded sizes live through the backward (q, k, v, out, dO and the three
gradients): 0.31 GiB at B=2, T=4,096, H=16, D=144 (run at 160) against cuDNN's 0.11.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from memeff_jax.ops.flash_attention import _common
from memeff_jax.ops.flash_attention.masks import MaskSpec

# The head dims the Mosaic forward and backward take: multiples of 16 (WGMMA's K step) up to
# 128, and of 32 above, where the backward splits dK, dV and dQ by columns between its
# warpgroups (each half whole 32-byte swizzle groups). A row goes in the widest of the 128-,
# 64- and 32-byte swizzles that divides it.
HEAD_DIMS = (48, 64, 80, 96, 112, 128, 160, 192, 224, 256)
# The head dims whose settings were measured; the others take those of the next one up.
TUNED_HEAD_DIMS = (64, 96, 128, 192, 256)
# pallas_triton's forward+backward time over the Mosaic kernels' on the same work, by the
# head dim the padded call runs at and whether it runs in place: the least measured (H200,
# `benchmarks/flash_attention.py`, the `odd` and `models` sets and calls of T = S from 136 to
# 700 at B·T ≈ 9,000, both masks; a padded call's time divided by its padding's work). A
# padding pays while it multiplies the work by less. In place the Mosaic kernels pay for no
# copies, which matters most at small calls (the design doc's padded calls).
TRITON_SLOWDOWN = {64: 1.05, 96: 1.52, 128: 1.18, 192: 4.07, 256: 3.68}
TRITON_SLOWDOWN_IN_PLACE = {64: 1.58, 96: 2.13, 128: 2.37, 192: 4.41, 256: 3.66}


class Padding(NamedTuple):
  """The padded sizes of a call's T, S and head dim, the key bound that hides the padded
  keys (S where the mask lets a real query reach them, else None), and whether the kernels
  run at the padded lengths on the call's own arrays (`in_place`: the head dim is theirs,
  and the rows past an array's end load as zeros and take no stores, as TMA copies them)
  rather than on padded copies. In place only the segment ids and the kernels' row
  statistics are padded."""
  t: int
  s: int
  d: int
  keys: int | None
  in_place: bool = False

  def inputs(self, q, k, v, q_seg, kv_seg):
    """q, k, v (padded copies unless in_place) and the segment ids (None for none),
    padded."""
    if not self.in_place:
      q = _pad(_pad(q, 1, self.t), 3, self.d)
      k, v = (_pad(_pad(x, 1, self.s), 3, self.d) for x in (k, v))
    if q_seg is None:
      return q, k, v, None, None
    return q, k, v, _pad(q_seg, 1, self.t, mode="edge"), _pad(kv_seg, 1, self.s, mode="edge")

  def work(self, t: int, s: int) -> float:
    """The padded call's attention work over that of the call (lengths t, s). The head dim
    is left out: pallas_triton's tiles pad it as far."""
    return self.t * self.s / (t * s)

  def slowdown(self) -> float:
    """What pallas_triton's kernels lose to the Mosaic ones on this padded call's work (at
    D = 48 and 80, not measured, that of the next head dim measured: 64 and 96)."""
    table = TRITON_SLOWDOWN_IN_PLACE if self.in_place else TRITON_SLOWDOWN
    return table[next(d for d in sorted(table) if d >= self.d)]

  def pays(self, t: int, s: int) -> bool:
    """Whether the Mosaic kernels on the padded call beat pallas_triton on the call."""
    return self.work(t, s) <= self.slowdown()

  def options(self, opts):
    """The call's AttentionOptions for the padded call: its mask with the key bound."""
    return dataclasses.replace(opts, mask=dataclasses.replace(opts.mask, keys=self.keys))

  def rows(self, x, axis: int, *, features: bool = True):
    """A per-query array (out, d_out [B, T, H, D]; lse, d_lse [B, H, T]) padded with zeros
    (as it is in_place: the kernels pad their row statistics themselves)."""
    if self.in_place:
      return x
    x = _pad(x, axis, self.t)
    return _pad(x, 3, self.d) if features else x


def settings_dim(d: int) -> int:
  """The head dim of TUNED_HEAD_DIMS whose measured settings a call of head dim d takes: the
  next one up (D = 48 takes D = 64's, 160 those of 192); d itself past them."""
  return next((m for m in TUNED_HEAD_DIMS if m >= d), d)


def head_dim(d: int) -> int:
  """The head dim a call of head dim d runs at: the next of HEAD_DIMS, unless that exceeds
  the next power of two (pallas_triton's head dim: D 32 and under) or no kernel takes it
  (over 256); then d."""
  padded = next((h for h in HEAD_DIMS if h >= d), d)
  return padded if padded <= pl.next_power_of_2(d) else d


def plan(t: int, s: int, d: int, mask: MaskSpec, block_q: int, block_kv: int,
         backward_keys: int) -> Padding | None:
  """How a call of lengths t, s and head dim d runs padded, or None where the kernels take it
  as it is (or padding cannot help). `block_q`, `block_kv`: the forward's tiles at
  head_dim(d); `backward_keys`: the keys of a backward CTA there, so that the padded call
  runs the Mosaic backward too."""
  d_pad = head_dim(d)
  if d_pad not in HEAD_DIMS or (
      d_pad == d and t % (2 * block_q) == 0 and s % block_kv == 0):
    return None
  t_pad = _round_up(t, math.lcm(2 * block_q, 128))
  s_pad = _round_up(s, math.lcm(block_kv, backward_keys))
  # A real query i sees keys up to i + right: the padded keys (from s on) only where that
  # reaches s for the last real query.
  reaches = s_pad > s and (mask.right is None or t - 1 + mask.right >= s)
  return Padding(t_pad, s_pad, d_pad, s if reaches else None)


def forward(pad: Padding, fn, q, k, v, q_seg, kv_seg):
  """(out, lse [B, H, T]) of the call, from fn(q, k, v, q_seg, kv_seg) of the padded call."""
  t, d = q.shape[1], q.shape[3]
  out, lse = fn(*pad.inputs(q, k, v, q_seg, kv_seg))
  return _cut(_cut(out, 1, t), 3, d), _cut(lse, 2, t)


def backward(pad: Padding, fn, res: _common.Residuals, cts):
  """(dq, dk, dv, *rest) of the call, from fn(residuals, cotangents) of the padded call."""
  (t, d), s, (d_out, d_lse) = res.q.shape[1::2], res.k.shape[1], cts
  padded = pad.inputs(res.q, res.k, res.v, res.q_segment_ids, res.kv_segment_ids)
  # Padded query rows: zero output and cotangents, log-sum-exp 0 (a finite softmax that their
  # zero dO turns into no share of dk and dv).
  res = _common.Residuals(*padded, pad.rows(res.out, 1), pad.rows(res.lse, 2, features=False))
  cts = (pad.rows(d_out, 1), pad.rows(d_lse, 2, features=False))
  dq, dk, dv, *rest = fn(res, cts)
  return (*(_cut(_cut(g, 1, n), 3, d) for g, n in ((dq, t), (dk, s), (dv, s))), *rest)


def _cut(x, axis: int, n: int):
  return lax.slice_in_dim(x, 0, n, axis=axis)


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _pad(x, axis: int, n: int, mode: str = "constant"):
  if x.shape[axis] == n:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, n - x.shape[axis])
  return jnp.pad(x, widths, mode=mode)
