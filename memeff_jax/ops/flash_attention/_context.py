"""Context parallelism by all-gathering the keys: attention over a sequence sharded across a
mesh axis, inside jax.shard_map.

Shard i holds queries [i·T, (i+1)·T) and keys [i·S, (i+1)·S) of the whole sequence (contiguous
chunks in shard order). It gathers every shard's keys, values and key segment ids, then runs
the single-device attention of its queries against the span of keys its mask can reach. A
query at global position i·T + a sees the key at global position j where j ≤ i·T + a + right
and j ≥ i·T + a − left (causal is right = 0): against the keys [lo, hi) that any of its
queries can reach, lo = max(0, i·T − left), that is the window (left − (i·T − lo),
right + i·T − lo) of local positions, both sides ≥ 0. Where the model's lengths and window
are multiples of 128 so are the slices, as the Hopper kernels want (others fall through to
the next implementation). Each shard's bounds are static,
so every shard's call is compiled once and `lax.switch` on the shard index picks its own
(a dense mask without a window is the same call everywhere). The backward is autodiff's:
the slice pads dk/dv back to the whole sequence, and the gather's transpose reduce-scatters
them over the axis, in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gathered(x, axis):
  """x's shards concatenated along dim 1 over `axis`; the cotangent reduce-scattered back in
  float32 (a bf16 sum over many shards would round at every step)."""
  return jax.lax.all_gather(x, axis, axis=1, tiled=True)


def _gathered_fwd(x, axis):
  return _gathered(x, axis), None


def _gathered_bwd(axis, _, ct):
  summed = jax.lax.psum_scatter(ct.astype(jnp.float32), axis, scatter_dimension=1, tiled=True)
  return (summed.astype(ct.dtype),)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def key_span(shard: int, t: int, s_total: int, window) -> tuple[int, int, tuple]:
  """(lo, hi, window) for the shard's queries [shard·t, (shard+1)·t): the keys [lo, hi) its
  mask can reach and its (left, right) window in positions local to q and to that slice,
  both sides ≥ 0 (None: unbounded)."""
  left, right = window
  start = shard * t
  lo = 0 if left is None else min(max(0, start - left), s_total)
  hi = s_total if right is None else max(lo, min(s_total, start + t + right))
  offset = start - lo
  local = (None if left is None else left - offset, None if right is None else right + offset)
  return lo, hi, local


def attention(attend, q, k, v, q_seg, kv_seg, *, axis, shards: int, window):
  """attend(q, k, v, q_seg, kv_seg, window) -> (out, lse [B, T, H]) over the whole sequence,
  for this shard's q (and segment ids) against every shard's keys. `window`: the (left,
  right) bounds of the call's mask (None: unbounded; causal is right = 0)."""
  k, v = _gathered(k, axis), _gathered(v, axis)
  kv_seg = None if kv_seg is None else jax.lax.all_gather(kv_seg, axis, axis=1, tiled=True)
  t, s_total = q.shape[1], k.shape[1]
  if window == (None, None):
    return attend(q, k, v, q_seg, kv_seg, None)

  def branch(shard):
    lo, hi, local = key_span(shard, t, s_total, window)

    def run(q, k, v, q_seg, kv_seg):
      if hi == lo:  # no key in reach: output 0, lse -inf (as one device gives)
        return (jnp.zeros(q.shape, q.dtype),
                jnp.full(q.shape[:3], -jnp.inf, jnp.float32))
      cut = lambda a: None if a is None else a[:, lo:hi]
      return attend(q, cut(k), cut(v), q_seg, cut(kv_seg), local)
    return run

  index = jax.lax.axis_index(axis)
  return jax.lax.switch(index, [branch(i) for i in range(shards)], q, k, v, q_seg, kv_seg)
