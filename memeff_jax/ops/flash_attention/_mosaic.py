"""Pieces shared by the Mosaic GPU attention kernels (pallas_mosaic_gpu, mosaic_gpu_backward,
mosaic_gpu_dq): the exp2-domain scores, which key and query blocks a mask lets a CTA skip,
the score masks, and the memory warpgroup that streams key blocks past resident queries.
Op-independent Hopper pieces live in memeff_jax.kernels.hopper."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from memeff_jax.kernels import hopper
from memeff_jax.kernels.hopper import LOG2E

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None


class SegmentScratch(NamedTuple):
  """The segment ids of the kernels that keep query blocks resident and stream key blocks
  (the forward, the dq kernel): per compute warpgroup its queries' ids, per ring slot a key
  block's, and their barriers."""
  q_ids: Any
  kv_ids: Any
  q_ready: Any
  kv_ready: Any

  @classmethod
  def shapes(cls, block_q: int, block_kv: int, stages: int) -> "SegmentScratch":
    return cls(plgpu.SMEM((2, block_q), jnp.int32), plgpu.SMEM((stages, block_kv), jnp.int32),
               plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=stages))


def stats_to(stats, t: int):
  """mosaic_gpu_backward.row_stats ([B, Hq, 2, T]) padded with zero rows to the T a kernel
  runs at (pallas_mosaic_gpu's _Static.lengths): the query rows past the arrays' ends then
  have zero lse and Δ, as their Q and dO load as zeros."""
  return jnp.pad(stats, [(0, 0)] * 3 + [(0, t - stats.shape[3])])


def exp2_scores(s, scale: float, softcap: float | None):
  """(z, tanh) for the backward kernels: the scores s·scale in the exp2 domain, or with a
  cap z = cap·tanh(s·scale/cap)·log2 e and tanh for dz/ds = 1 − tanh² (None without)."""
  if softcap is None:
    return s * (scale * LOG2E), None
  tanh = jnp.tanh(s * (scale / softcap))
  return tanh * (softcap * LOG2E), tanh

def band_blocks(before: int | None, after: int | None, start, length: int, n_blocks: int,
                block: int):
  """Blocks of the other axis that the indices start..start+length-1 reach through a band.

  An index i reaches the other axis's indices i-before..i+after (None: unbounded), which is
  a key's view of the keys a query sees with before = left and after = right, and the
  query's view with before = right and after = left. Returns (lo, hi, full_lo, full_hi):
  blocks [lo, hi) are reached at all, and blocks [full_lo, full_hi) ⊆ [lo, hi) are reached
  by every one of the indices, so need no mask. masks.kv_block_range / q_block_range are
  the same bounds in plain jnp; this version lowers in Mosaic GPU kernels (traced start).
  """
  last = start + length - 1
  lo = 0 if before is None else jnp.maximum(hopper.floor_div(start - before, block), 0)
  hi = (n_blocks if after is None
        else jnp.clip(hopper.floor_div(last + after, block) + 1, 0, n_blocks))
  lo = jnp.minimum(lo, hi)
  # ⌈(last - before) / block⌉
  full_lo = lo if before is None else -hopper.floor_div(before - last, block)
  full_hi = hi if after is None else hopper.floor_div(start + after + 1, block)
  full_lo = jnp.clip(full_lo, lo, hi)
  return lo, hi, full_lo, jnp.clip(full_hi, full_lo, hi)

def segment_block_ranges(ids, other_ids, block: int, other_block: int):
  """[B, L/block, 4] int32: per block of `ids` ([B, L] segment ids), which of the M blocks of
  `other_ids` ([B, M·other_block]) it meets, as (lo, −hi, full_lo, full_hi) for
  segment_bounds: [lo, hi) holds the blocks holding any id within the block's range of ids,
  and [full_lo, full_hi) is the first run of blocks whose ids all equal the block's one id,
  so that every pair of the two blocks shares a segment and needs no segment mask. Where
  there are none, lo, full_lo and full_hi are M and hi 0; full_hi is M too where the run
  reaches the last block. Query blocks against key blocks for the forward, the reverse for
  the backward.

  [lo, hi) is a superset of the blocks with a visible pair whatever the ids' order, and
  both ranges are exact for packed documents (ids that never decrease along the sequence).
  Each of the four is the least of a value per block of `other_ids` (hi negated), so that
  XLA computes them in one reduction: the run ends at the first block without the id that
  follows one with it, which needs no full_lo first. Plain XLA, run before the kernels,
  which read it as scalars.
  """
  b, n = ids.shape
  m = other_ids.shape[1] // other_block
  mine = ids.reshape(b, n // block, 1, 1, block)  # [B, n, 1, 1, ·] against [B, 1, 1, m]
  other = other_ids.reshape(b, 1, 1, m, other_block)
  my_lo, my_hi = mine.min(-1), mine.max(-1)
  other_lo, other_hi = other.min(-1), other.max(-1)
  overlap = (other_lo <= my_hi) & (my_lo <= other_hi)

  def same(lo, hi):  # both blocks hold one id, the same
    return (lo == my_hi) & (hi == my_lo)

  whole = same(other_lo, other_hi)
  shift = lambda x: jnp.pad(x[..., :-1], [(0, 0)] * 3 + [(1, 0)])  # block j − 1's at j
  run_ends = same(shift(other_lo), shift(other_hi)) & ~whole
  run_ends &= lax.broadcasted_iota(jnp.int32, (1, 1, 1, m), 3) > 0
  column = lax.broadcasted_iota(jnp.int32, (1, 1, 4, m), 2)
  j = lax.broadcasted_iota(jnp.int32, (1, 1, 4, m), 3)
  counts = jnp.where(column < 2, overlap, jnp.where(column == 2, whole, run_ends))
  value, none = jnp.where(column == 1, -1 - j, j), jnp.where(column == 1, 0, m)
  return jnp.min(jnp.where(counts, value, none), -1)

def segment_bounds(band, segment_range):
  """(lo, hi, full_lo, full_hi) of blocks a block sees through the band (band_blocks) and
  its segment ids (a row of segment_block_ranges): seen at all where both let it, and
  whole (no mask) where both see it whole."""
  lo, hi, full_lo, full_hi = band
  seg_lo, seg_neg_hi, seg_full_lo, seg_full_hi = segment_range
  lo = jnp.maximum(lo, seg_lo)
  hi = jnp.maximum(jnp.minimum(hi, -seg_neg_hi), lo)
  full_lo = jnp.clip(jnp.maximum(full_lo, seg_full_lo), lo, hi)
  return lo, hi, full_lo, jnp.clip(jnp.minimum(full_hi, seg_full_hi), full_lo, hi)

def key_bound(mask, bounds, block: int):
  """(lo, hi, full_lo, full_hi) of key blocks (as band_blocks) within mask.keys: the blocks
  from ⌈keys / block⌉ on hold only padding and are not visited, and a block the bound cuts
  is masked. Python ints stay ints."""
  if mask.keys is None:
    return bounds
  lo, hi, full_lo, full_hi = bounds
  ints = all(isinstance(x, int) for x in bounds)
  lower, upper = (min, max) if ints else (jnp.minimum, jnp.maximum)
  hi = lower(hi, -(-mask.keys // block))
  lo = lower(lo, hi)
  full_lo = lower(upper(full_lo, lo), hi)
  return lo, hi, full_lo, lower(upper(lower(full_hi, mask.keys // block), full_lo), hi)

def visible(mask, shape, key_axis: int, first_key, first_query, row_ids=None, col_ids=None):
  """Bool tile (WGMMA layout) of which pairs a score tile keeps, or None for all of them.

  `key_axis` is the axis along which the key index runs (1 for the forward's S, 0 for the
  backward's Sᵀ); `first_key`, `first_query`: the tile's first key and query. Every test
  compares a vector along one axis with a vector along the other (hopper.index_vector),
  both broadcast over the tile: no full tile of indices is made, whose registers the
  compute warpgroups do not have. The band compares the keys' offsets with the queries'
  shifted by its bounds, the key bound the keys' offsets with a scalar; segment ids, when
  given as a vector per row and per column, must be equal.
  """
  ok = None

  def both(a, b):
    return b if a is None else a & b

  def tile(vector, axis):
    return lax.broadcast_in_dim(vector, shape, [axis])

  query_axis = 1 - key_axis
  if mask.left is not None or mask.right is not None or mask.keys is not None:
    keys = tile(hopper.index_vector(shape, key_axis), key_axis)
  if mask.left is not None or mask.right is not None:
    # key - query against the band's bounds: key offset against query offset + a shift.
    queries = hopper.index_vector(shape, query_axis) + (first_query - first_key)
    if mask.right is not None:
      ok = both(ok, keys <= tile(queries + mask.right, query_axis))
    if mask.left is not None:
      ok = both(ok, keys >= tile(queries - mask.left, query_axis))
  if mask.keys is not None:
    ok = both(ok, keys < mask.keys - first_key)
  if row_ids is not None:
    ok = both(ok, tile(row_ids, 0) == tile(col_ids, 1))
  return ok

def query_cta_index(mask, n_ctas: int, launch):
  """The query-CTA index of a head's CTA at launch position `launch` (grid axis "q", or a
  persistent kernel's tile order), heaviest first under a causal mask.

  CUDA starts CTAs in grid order, and "q", the grid's last axis, is its fastest (Pallas
  makes the last axis CUDA's x): a head's query CTAs start together, and under a causal
  mask those of the last query rows (which see the most keys) would start last and make
  the final wave the longest. Walking the query rows backwards starts them first, and the
  light CTAs fill the tail (the design doc's "launched heaviest first" row). The dq kernel
  keeps grid order (no gain measured there).
  """
  return n_ctas - 1 - launch if mask.is_causal else launch

def interleaved_heads(mask, n_heads: int, n_ctas: int, sms: int) -> int:
  """How many heads' query CTAs a causal forward interleaves in launch order (see
  query_cta_at): the fewest, a power of two, whose CTAs fill the `sms` SMs. 1 without a
  causal mask, where a head's CTAs all take the same time."""
  group = 1
  while mask.is_causal and group < n_heads and group * n_ctas < sms:
    group *= 2
  return min(group, n_heads)

def query_cta_at(mask, n_heads: int, n_ctas: int, group: int, launch):
  """(head, query-CTA index) of the CTA at launch position `launch` over all heads (head
  b·H + h), `group` heads at a time (interleaved_heads), their CTAs interleaved heaviest
  first.

  Head by head, each head's heaviest CTAs start when the last head's come up, and where a
  head has fewer CTAs than the GPU has SMs the last heads' heaviest start in the final wave:
  a list-scheduling estimate (CTAs dealt in launch order to the SM that frees first, their
  key blocks as cost) puts that 3% over the best deal at B4 T4k H32 and 18% at B2 T3k H16.
  Taking the query CTAs of `group` heads together (all their heaviest first, then the
  next), the heavy CTAs start at least a wave before the end, and the CTAs running at once
  still come from a few heads, whose keys they stream together from L2 (figures: the
  design doc's "launched together" row)."""
  first = hopper.div(launch, group * n_ctas) * group
  size = (group if n_heads % group == 0  # else the last group has fewer heads
          else lax.min(jnp.int32(group), jnp.int32(n_heads) - first))
  within = launch - first * n_ctas
  return (first + hopper.rem(within, size),
          query_cta_index(mask, n_ctas, hopper.div(within, size)))

def query_cta_key_blocks(mask, ranges_ref, b, qi, block_q: int, block_kv: int, n_blocks: int):
  """The key blocks a CTA of two query blocks (rows qi·2·block_q ..) visits, for kernels that
  stream keys past resident queries (the forward, the dq kernel).

  Returns (per_block, cta_lo, cta_hi): per_block[w] = (lo, hi, full_lo, full_hi) for query
  block w, which sees key blocks [lo, hi) in part and [full_lo, full_hi) whole (by the band
  and, with segment ids, their ranges: segment_bounds); the CTA streams [cta_lo, cta_hi),
  the union of the two (an empty range adds nothing). `ranges_ref` is
  segment_block_ranges(q_ids, kv_ids, ...) or None. Python ints where every query sees every
  key (MaskSpec.sees_all_keys): the blocks up to the key bound, the last masked where it
  ends inside it.
  """
  if mask.sees_all_keys:
    bounds = key_bound(mask, (0, n_blocks, 0, n_blocks), block_kv)
    return [bounds] * 2, 0, bounds[1]

  def blocks_for(w):
    lo, hi, full_lo, full_hi = band_blocks(mask.left, mask.right, (2 * qi + w) * block_q,
                                           block_q, n_blocks, block_kv)
    if mask.segments:
      lo, hi, full_lo, full_hi = segment_bounds(
          (lo, hi, full_lo, full_hi), [ranges_ref[b, 2 * qi + w, i] for i in range(4)])
    return key_bound(mask, (lo, hi, full_lo, full_hi), block_kv)

  per_block = [blocks_for(w) for w in (0, 1)]
  cta_lo = jnp.minimum(*[jnp.where(hi > lo, lo, n_blocks) for lo, hi, _, _ in per_block])
  cta_hi = jnp.maximum(*[jnp.where(hi > lo, hi, 0) for lo, hi, _, _ in per_block])
  return per_block, jnp.minimum(cta_lo, cta_hi), cta_hi

def my_key_blocks(per_block, cta_lo, cta_hi, wg):
  """Warpgroup wg's (lo, hi, full_lo, full_hi) from query_cta_key_blocks, within the CTA's
  range (an empty range may lie outside it)."""
  if isinstance(cta_lo, int):
    return per_block[0]
  return tuple(jnp.clip(jnp.where(wg == 0, a, b), cta_lo, cta_hi)
               for a, b in zip(*per_block))

def masked_ranges(step, carry, lo, hi, full_lo, full_hi, *, dense: bool):
  """step(i, carry, masked=...) for i in [lo, hi): unmasked on [full_lo, full_hi) (the
  blocks that see each other whole; everywhere when dense), masked on the rest. The whole
  range may start inside [full_lo, full_hi) (lo > full_lo): the unmasked part is cut there."""
  if dense:
    return lax.fori_loop(lo, hi, functools.partial(step, masked=False), carry)
  upper = max if all(isinstance(x, int) for x in (lo, full_lo, full_hi)) else jnp.maximum
  full_lo = upper(full_lo, lo)
  full_hi = upper(full_hi, full_lo)
  masked = functools.partial(step, masked=True)
  carry = lax.fori_loop(lo, full_lo, masked, carry)
  carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
  return lax.fori_loop(full_hi, hi, masked, carry)

def visit_key_blocks(step, skip, carry, bounds, cta_lo, cta_hi, *, dense: bool, start=None):
  """A compute warpgroup's loop over the CTA's key blocks [cta_lo, cta_hi): skip(j, None)
  for the blocks only the other query block sees, step(j, carry, masked=...) for its own,
  unmasked where it sees the whole block; start() runs before its first own block."""
  lo, hi, full_lo, full_hi = bounds
  lax.fori_loop(cta_lo, lo, skip, None)
  if start is not None:
    if dense:
      start()
    else:
      pl.when(lo < hi)(start)
  carry = masked_ranges(step, carry, lo, hi, full_lo, full_hi, dense=dense)
  lax.fori_loop(hi, cta_hi, skip, None)
  return carry

def stream_key_blocks(k_ref, v_ref, kv_seg_ref, b, kv_head, cta_lo, cta_hi, block_kv: int,
                      stages, smem, ready, free, *, separate_rings: bool = False,
                      base=None) -> None:
  """The memory warpgroup of the kernels that stream keys past resident queries: key blocks
  [cta_lo, cta_hi) of K, V (and the key segment ids, when kv_seg_ref is given) into the
  `smem` = (k, v[, ids]) ring with barriers `ready` (the same order), refilling a slot once
  both compute warpgroups arrived on every barrier of `free` = (k_free, v_free).

  `stages`: the ring's slots, or (K's, V's) for two rings of different depths, each refilled
  once its own free barrier is passed (the ids share K's slots). `separate_rings`: two rings
  even of equal depths, for kernels that release a block's K long before its V.

  `base`: (persistent kernels) the blocks the ring took before these, which it continues:
  block i goes into the slot of global position base + i, after the block that position −
  depth held has been freed."""
  k_stages, v_stages = stages if isinstance(stages, tuple) else (stages, stages)
  k_free, v_free = free
  n = cta_hi - cta_lo
  k_which = [0] + ([2] if kv_seg_ref is not None else [])  # with two rings: the ids in K's

  def copies(i, slot, which):
    keys = pl.ds((cta_lo + i) * block_kv, block_kv)
    srcs = (k_ref.at[b, keys, kv_head], v_ref.at[b, keys, kv_head])
    if kv_seg_ref is not None:
      srcs += (kv_seg_ref.at[b, keys],)
    for w in which:
      plgpu.copy_gmem_to_smem(srcs[w], smem[w].at[slot], ready[w].at[slot])

  if base is not None:
    if k_stages == v_stages and not separate_rings:
      rings = [(k_stages, range(len(smem)), free)]
    else:
      rings = [(k_stages, k_which, (k_free,)), (v_stages, [1], (v_free,))]

    # Each ring's wait sits under one condition with its own copy, as in the grid's two
    # rings below: the slot's first fill copies at once, a refill once the slot is freed.
    @pl.loop(0, n)
    def _(i):
      for depth, which, barriers in rings:
        slot = hopper.rem(base + i, depth)

        def refill(barriers=barriers, slot=slot, which=which):
          for barrier in barriers:
            plgpu.barrier_wait(barrier.at[slot])
          copies(i, slot, which)

        pl.when(base + i >= depth)(refill)
        pl.when(base + i < depth)(functools.partial(copies, i, slot, which))
    return
  if k_stages == v_stages and not separate_rings:
    hopper.fill_ring(functools.partial(copies, which=range(len(smem))), n, k_stages, free)
    return
  # Two rings, the shallower first (its block is needed sooner): each is filled, then the
  # slot that block i leaves is refilled with block i + depth. Every wait sits under one
  # condition with its own copy; a conditional wait of one ring after an unconditional copy of
  # the other handed the compute warpgroups zeros for a V block.
  rings = sorted([(k_stages, k_which, k_free), (v_stages, [1], v_free)],
                key=lambda ring: ring[0])
  for depth, which, _ in rings:
    for i in range(depth):
      hopper.when(i < n, functools.partial(copies, i, i, which))

  @pl.loop(0, n)
  def _(i):
    for depth, which, barrier in rings:

      @pl.when(i + depth < n)
      def _(depth=depth, which=which, barrier=barrier):
        slot = hopper.rem(i, depth)
        plgpu.barrier_wait(barrier.at[slot])
        copies(i + depth, slot, which)

def release_key_block(ready, free, take_turn=None) -> None:
  """A compute warpgroup passes over a key block only the CTA's other query block sees: it
  waits for the block's loads (`ready`: barriers of its slots) and releases them (`free`),
  and takes its two ping-pong turns."""
  for barrier in ready:
    plgpu.barrier_wait(barrier)
  for barrier in free:
    plgpu.barrier_arrive(barrier)
  if take_turn is not None:
    take_turn()
    take_turn()
