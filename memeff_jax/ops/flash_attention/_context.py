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
the next implementation). Each shard's bounds are static, so every shard's call is compiled
once and `lax.switch` on the shard index picks its own (without a window or causal mask
every shard makes the same call). The backward is autodiff's: the slice pads dk/dv back to
the whole sequence, and the gather's transpose reduce-scatters them over the axis, in
float32.

Under a causal mask shard i then does (i + ½)·T² of the work. The zig-zag order balances
it: the sequence cut into 2n chunks, shard i holds chunks i and 2n − 1 − i (`zigzag`
reorders tokens, positions, labels and segment ids so; the loss is order-invariant). Each
shard then runs its two query chunks, each against its own span of the keys, put back in
their natural order.
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


ORDERS = ("contiguous", "zigzag")


def _chunks(x, pieces: int, axis: int):
  if x.shape[axis] % pieces:
    raise ValueError(f"the sequence ({x.shape[axis]} along axis {axis}) must split into "
                     f"{pieces} equal chunks for the zig-zag order")
  return jnp.split(x, pieces, axis=axis)


def zigzag_chunks(shards: int) -> list[int]:
  """The natural chunk held at each position of the zig-zag order over `shards`: shard i
  holds chunks i and 2·shards − 1 − i of the sequence cut into 2·shards."""
  return [c for i in range(shards) for c in (i, 2 * shards - 1 - i)]


def zigzag(x, shards: int, axis: int = 1):
  """x's sequence (along `axis`) in the zig-zag order over `shards` (see zigzag_chunks): cut
  it into 2·shards chunks and put chunks i and 2·shards − 1 − i on shard i, so a causal
  mask gives every shard the same work. Tokens, labels, positions and segment ids go
  through it alike; unzigzag undoes it."""
  pieces = _chunks(x, 2 * shards, axis)
  return jnp.concatenate([pieces[c] for c in zigzag_chunks(shards)], axis=axis)


def unzigzag(x, shards: int, axis: int = 1):
  """The natural order of a sequence in the zig-zag order over `shards`."""
  pieces = _chunks(x, 2 * shards, axis)
  where = {c: p for p, c in enumerate(zigzag_chunks(shards))}
  return jnp.concatenate([pieces[where[c]] for c in range(2 * shards)], axis=axis)


def key_span(start: int, t: int, s_total: int, window) -> tuple[int, int, tuple]:
  """(lo, hi, window) for queries [start, start + t) of the sequence: the keys [lo, hi) their
  mask can reach and their (left, right) window in positions local to them and to that
  slice, both sides ≥ 0 (None: unbounded)."""
  left, right = window
  lo = 0 if left is None else min(max(0, start - left), s_total)
  hi = s_total if right is None else max(lo, min(s_total, start + t + right))
  offset = start - lo
  local = (None if left is None else left - offset, None if right is None else right + offset)
  return lo, hi, local


def attention(attend, q, k, v, q_seg, kv_seg, *, axis, shards: int, window, order: str):
  """attend(q, k, v, q_seg, kv_seg, window) -> (out, lse [B, T, H]) over the whole sequence,
  for this shard's q (and segment ids) against every shard's keys. `window`: the (left,
  right) bounds of the call's mask (None: unbounded; causal is right = 0). `order`:
  "contiguous" (shard i holds the i-th of `shards` chunks) or "zigzag" (see zigzag)."""
  k, v = _gathered(k, axis), _gathered(v, axis)
  kv_seg = None if kv_seg is None else jax.lax.all_gather(kv_seg, axis, axis=1, tiled=True)
  if window == (None, None):  # every key for every query: the keys' order does not matter
    return attend(q, k, v, q_seg, kv_seg, None)
  t, s_total = q.shape[1], k.shape[1]
  if order == "zigzag":  # the keys in their natural order; q as its two chunks
    k, v = unzigzag(k, shards), unzigzag(v, shards)
    kv_seg = None if kv_seg is None else unzigzag(kv_seg, shards)
    t //= 2

  def span(q, k, v, q_seg, kv_seg, start):
    lo, hi, local = key_span(start, t, s_total, window)
    if hi == lo:  # no key in reach: output 0, lse -inf (as one device gives)
      return jnp.zeros(q.shape, q.dtype), jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
    cut = lambda a: None if a is None else a[:, lo:hi]
    return attend(q, cut(k), cut(v), q_seg, cut(kv_seg), local)

  def branch(shard):
    def run(q, k, v, q_seg, kv_seg):
      if order == "contiguous":
        return span(q, k, v, q_seg, kv_seg, shard * t)
      halves = [span(q[:, h * t:(h + 1) * t], k, v,
                     None if q_seg is None else q_seg[:, h * t:(h + 1) * t], kv_seg, c * t)
                for h, c in enumerate(zigzag_chunks(shards)[2 * shard:2 * shard + 2])]
      return tuple(jnp.concatenate(parts, axis=1) for parts in zip(*halves))
    return run

  index = jax.lax.axis_index(axis)
  return jax.lax.switch(index, [branch(i) for i in range(shards)], q, k, v, q_seg, kv_seg)
