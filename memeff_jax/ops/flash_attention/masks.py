"""Which keys a query sees: one definition shared by every implementation.

Query i sees key j when all of these hold (each only if asked for):

  causal          j ≤ i                         (top-left aligned, as jax.nn)
  sliding_window  i - left ≤ j ≤ i + right      (an int w means (w, w))
  segments        q_segment_ids[i] == kv_segment_ids[j]
  keys            j < keys                      (a call run at padded lengths: its real keys)

`visible` evaluates this for index blocks (the reference, chunked_xla and the kernels all
call it); `kv_block_range` / `q_block_range` give the blocks a causal or windowed mask can
reach at all, so loops skip the rest.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static part of a mask. left/right None mean unbounded. `keys` is set only on a
  call run at padded lengths (pallas_mosaic_gpu's _padding): the keys from it on are padding,
  hidden from every query."""

  left: int | None = None
  right: int | None = None
  segments: bool = False
  keys: int | None = None

  @classmethod
  def make(cls, causal: bool, sliding_window, segments: bool) -> "MaskSpec":
    left = right = None
    if sliding_window is not None:
      left, right = ((sliding_window, sliding_window) if isinstance(sliding_window, int)
                     else tuple(sliding_window))
    if causal:
      right = 0 if right is None else min(right, 0)
    return cls(left=left, right=right, segments=segments)

  @property
  def is_causal_band(self) -> bool:
    """Causal with no window on the left, with or without segment ids."""
    return self.left is None and self.right == 0

  @property
  def is_causal(self) -> bool:
    """Exactly causal: no window on the left, no segment ids, every key real."""
    return self.is_causal_band and not self.segments and self.keys is None

  @property
  def sees_all_keys(self) -> bool:
    """No band and no segment ids: every query sees every key (every real one: `keys`)."""
    return self.left is None and self.right is None and not self.segments

  @property
  def is_dense(self) -> bool:
    """Nothing to mask: every query sees every key."""
    return self.sees_all_keys and self.keys is None

  @property
  def rows_may_be_empty(self) -> bool:
    """Whether a query may see no key at all (a window, segment ids), so that kernels guard
    its softmax. Without a window on the left every query sees key 0 under the band."""
    return self.segments or not (self.sees_all_keys or self.is_causal_band)

  def span(self, s: int) -> int:
    """The most keys one query's band can see out of s: left + right + 1 (s where the band
    is open on a side). Segment ids and the key bound are not counted."""
    if self.left is None or self.right is None:
      return s
    return min(s, self.left + self.right + 1)

  def visible_pairs(self, t: int, s: int) -> int:
    """How many (query, key) pairs of a [t, s] score matrix the band lets through (segment
    ids, unknown until run time, are not counted)."""
    rows = np.arange(t)
    lo = np.zeros(t, np.int64) if self.left is None else np.maximum(rows - self.left, 0)
    s = s if self.keys is None else min(s, self.keys)
    hi = np.full(t, s - 1) if self.right is None else np.minimum(rows + self.right, s - 1)
    return int(np.maximum(hi - lo + 1, 0).sum())


def visible(spec: MaskSpec, q_idx, k_idx, q_seg=None, k_seg=None):
  """[len(q_idx), len(k_idx)] bool: query q_idx[a] sees key k_idx[b] (index bounds apart).

  Segment ids are compared only when given (callers with a batch dimension compare them
  themselves).
  """
  q, k = q_idx[:, None], k_idx[None, :]
  ok = jnp.ones((q_idx.shape[0], k_idx.shape[0]), jnp.bool_)
  if spec.right is not None:
    ok = ok & (k <= q + spec.right)
  if spec.left is not None:
    ok = ok & (k >= q - spec.left)
  if spec.keys is not None:
    ok = ok & (k < spec.keys)
  if q_seg is not None:
    ok = ok & (q_seg[:, None] == k_seg[None, :])
  return ok


def kv_block_range(spec: MaskSpec, q_start, q_len: int, kv_len: int, block_k: int):
  """[lo, hi) of key blocks that queries [q_start, q_start + q_len) can see."""
  n_blocks = -(-(kv_len if spec.keys is None else min(kv_len, spec.keys)) // block_k)
  lo, hi = 0, n_blocks
  if spec.left is not None:
    lo = jnp.maximum(0, (q_start - spec.left) // block_k)
  if spec.right is not None:
    last = q_start + q_len - 1 + spec.right  # last key the block's last query sees
    hi = jnp.clip(last // block_k + 1, 0, n_blocks)
  return lo, hi


def q_block_range(spec: MaskSpec, k_start, k_len: int, q_len_total: int, block_q: int):
  """[lo, hi) of query blocks that can see keys [k_start, k_start + k_len)."""
  n_blocks = -(-q_len_total // block_q)
  lo, hi = 0, n_blocks
  if spec.right is not None:  # i ≥ j - right
    lo = jnp.clip((k_start - spec.right) // block_q, 0, n_blocks)
  if spec.left is not None:  # i ≤ j + left
    last = k_start + k_len - 1 + spec.left
    hi = jnp.clip(last // block_q + 1, 0, n_blocks)
  if spec.keys is not None:  # keys that are all padding are seen by none
    hi = jnp.where(k_start < spec.keys, hi, lo)
  return lo, hi
