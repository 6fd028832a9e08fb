"""Hopper attention in Pallas Mosaic GPU: the forward here, the backward in mosaic_gpu_backward.

One CTA per (batch, query head, 2·block_q query rows) runs three warpgroups:

  memory warpgroup    streams K and V blocks of block_kv keys through a ring of `stages`
                      shared-memory slots by TMA; a slot is refilled once both compute
                      warpgroups have released it
  compute warpgroups  one per block_q query rows (Q stays in shared memory): per key block
                      s = Q Kᵀ by WGMMA into registers, the online softmax in the exp2
                      domain (FlashAttention-2's recurrence; above D = 128 acc is rescaled
                      only where a row's maximum rose by 2^8: lazy_rescale), then
                      acc += P V by WGMMA with P read from registers

With `pingpong` the two compute warpgroups take turns on the tensor cores (as in
FlashAttention-3, Shah et al. 2024, §3.1): a shared barrier lets one issue its matmuls only
after the other has finished its softmax, so one's exponentials run under the other's
WGMMAs. With `overlap` (FlashAttention-3's intra-warpgroup pipelining, §3.2, the default
at D = 128 and 256 without a window or segment ids, short causal calls at D = 128 aside,
and at D = 192 causal) each warpgroup instead issues block j's QKᵀ together with block
j−1's PV and computes block j's softmax while that PV runs. The output and the float32
log-sum-exp ([B, Hq, T], natural log, as the other implementations save it) leave through
shared memory by TMA.

Masks: a CTA streams only the key blocks its rows can see. The causal and sliding-window
band gives each query block a range of key blocks, of which the ones it sees whole run
unmasked; segment ids narrow the range further by per-block ranges of the ids
(_mosaic.segment_block_ranges, computed by XLA and read by the kernel as scalars), and a
block runs unmasked only where both blocks hold one id, the same (inside a document). Blocks
that only the CTA's other query block sees are released without compute. A row that sees no
key ends with output 0 and log-sum-exp -inf.

Served: bf16/f16, head dims of _padding.HEAD_DIMS, multiples of 16 from 48 to 128 and of 32
up to 256 (rows in 128-, 64- or 32-byte swizzles, the widest that divides a row), T a
multiple of 2·block_q and S of block_kv, any mask, logit softcap, GQA/MQA by indexing the
key/value head; other lengths run padded (in place where T and S are whole 8-row tiles), and
other head dims from 33 to 255 on zero-padded copies (_padding; with `implementation=None`
only where that beats pallas_triton). Anything else (float32, head dims of 32 and under or
over 256) raises NotImplementedError with the reason, and `implementation=None` falls
through to pallas_triton. The backward is mosaic_gpu_backward's one-pass kernel: whole with
its dq reductions in a fixed order (dq_ordered), or in arrival order where
deterministic=False allows it and that measured faster; for dK and dV alone otherwise,
beside mosaic_gpu_dq's dq kernel; or pallas_triton's dq and dk/dv kernels where a
backward_config asks for them. All run on the saved output and log-sum-exp. GPU only (sm90):
jax 0.10.2's Mosaic GPU interpreter cannot run `plgpu.kernel` meshes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from memeff_jax.kernels import hopper
from memeff_jax.ops import _dispatch
from memeff_jax.ops import _vma
from memeff_jax.ops.flash_attention import _common
from memeff_jax.ops.flash_attention import _mosaic
from memeff_jax.ops.flash_attention import _padding
from memeff_jax.ops.flash_attention import mosaic_gpu_backward
from memeff_jax.ops.flash_attention import mosaic_gpu_dq
from memeff_jax.ops.flash_attention import pallas_triton
from memeff_jax.ops.flash_attention._common import AttentionOptions
from memeff_jax.ops.flash_attention.masks import MaskSpec
from memeff_jax.ops.flash_attention.mosaic_gpu_backward import MosaicBackwardConfig
from memeff_jax.ops.flash_attention.mosaic_gpu_dq import MosaicDqConfig

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None


# The most keys for which a causal call's forward runs persistent with ping-pong
# (MosaicConfig.for_call).
SHORT_CAUSAL_KEYS = 2048
# At D = 128, the most keys a query's band spans (MaskSpec.span) for which a causal or
# windowed call's forward runs persistent with tiles taken at run time (MosaicConfig.for_call).
SHORT_WALK_KEYS = 6144
# The least work per SM for which those calls and the short causal ones (at D = 96 and 128)
# run persistent: query tiles of 128 rows, and key blocks of 128 × 128 visible pairs.
PERSISTENT_MIN_TILES_PER_SM = 2
PERSISTENT_MIN_BLOCKS_PER_SM = 24
# The key block of calls without a mask at D = 48 and 64 (MosaicConfig.for_call).
WIDE_KEY_BLOCK = 256
# How far (log2 units) a row's maximum may rise before the online softmax moves to it
# (MosaicConfig.lazy_rescale): p then stays below 2^8, far inside bf16's and f16's range.
RESCALE_THRESHOLD = 8.0


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Tiles of the forward kernel.

  Attributes:
    block_q: query rows per compute warpgroup (a CTA holds two such blocks).
    block_kv: keys per pipeline step.
    stages: K/V slots in shared memory (at most what fits: 2 at D = 128, 6 at D = 64).
      Without the overlap a walk of more than one key block needs two (support_error).
    pingpong: alternate the two compute warpgroups on the tensor cores.
    overlap: FlashAttention-3's intra-warpgroup overlap: a step issues block j's QKᵀ and
      block j−1's PV together and computes block j's softmax while PV runs (P of the
      previous block is carried in registers). K and V then stream through separate rings,
      since a block's V is released a step after its K. Excludes pingpong (which measured
      slower with it: the turns hold back the warpgroup whose PV is in flight).
    persistent: one CTA per SM (num_sms, else the device's count), each looping over its
      share of the query tiles (dealt in launch order by their key blocks:
      hopper.greedy_schedule; with dynamic, taken at run time). The K/V ring runs on across
      tiles, the next tile's Q loads during the epilogue (causal calls without segment ids
      and without the overlap: as soon as the tile's last QKᵀ has read Q), and the output
      leaves through a buffer of its own (2·block_q·D more shared memory, which may cost a
      K/V stage at D > 128).
    num_sms: (persistent) the CTAs to launch; None reads the device's SM count.
    dynamic: (persistent) each CTA takes its next tile at run time, the first in launch
      order that no CTA has taken (an atomic count in global memory, which the memory
      warpgroup reads once it has issued the current tile's loads), in place of the static
      deal, whose estimate knows the band's key blocks but not those segment ids leave: as
      the hardware deals a grid's CTAs, by the work they really take. Same tiles, same
      arithmetic: the same bits.
    lazy_rescale: the online softmax keeps a row's running maximum until the row's scores
      rise past it by RESCALE_THRESHOLD (FlashAttention-4's conditional rescale), and the
      accumulator is rescaled only by warps whose rows moved
      (hopper.rows_scaled_where_needed), a branch in place of D/block_kv multiplies per
      score. It pays where that is 2.5 or more (D > 128 on 64-key blocks) and costs more
      than it saves at 1 (D = 128) and 0.5 (D = 64), where the branch splits the softmax's
      instructions (figures: the design doc's lazy rescale rows).
  """

  block_q: int = 64
  block_kv: int = 128
  stages: int = 2
  pingpong: bool = True
  overlap: bool = False
  persistent: bool = False
  num_sms: int | None = None
  dynamic: bool = False
  lazy_rescale: bool = False

  @classmethod
  def for_head_dim(cls, d: int) -> "MosaicConfig":
    """128-key blocks up to D = 128; 64-key blocks above (registers and shared memory), with
    lazy_rescale."""
    return cls() if d <= 128 else cls(block_kv=64, lazy_rescale=True)

  @classmethod
  def for_call(cls, d: int, mask: MaskSpec, s: int, t: int = 0,
               heads: int = 0) -> "MosaicConfig":
    """for_head_dim(d) for a call of `heads` query heads (B·Hq; 0: not known) of t queries
    each over s keys. "No mask" includes a key bound (MaskSpec.keys: a padded call's padded
    keys), which masks one key block. Head dims without settings of their own take those of
    the next one that has them (_padding.settings_dim: 48 and 80 those of 64 and 96; 112, 160
    and 224 those of 128, 192 and 256). What each choice measured: the design doc's "Which
    forward a call runs".

    - The intra-warpgroup overlap in place of ping-pong at D = 128, 192 and 256 under no mask
      or a causal one. Masked blocks run without it, so windows and segment ids keep
      ping-pong; at D = 64 and 96 ping-pong is as fast.
    - Persistent where a query tile's walk is short enough that loading the next tile's Q and
      keeping the K/V ring running through a tile's epilogue pays: causal calls of at most
      SHORT_CAUSAL_KEYS keys at D = 96 and 128 (with ping-pong) where each SM has the work
      _fills_sms asks, D = 64 causal, and D = 64, 96 and 128 without a mask (tiles dealt
      before the launch). Not at D = 192 and 256, where the output's buffer would cost a K/V
      stage or, at D = 192 causal, measured no faster.
    - Tiles taken at run time (dynamic) at D = 128: causal calls with segment ids at any
      length (a tile's walk ends at its document's start, which no static deal knows), the
      short causal calls, and causal calls and sliding windows whose band spans at most
      SHORT_WALK_KEYS keys, where _fills_sms holds.
    - A third K/V stage without a mask at D = 96 and 192, where one fits beside Q (and at
      D = 96 the persistent output's buffer); four at D = 48 without a mask where S takes
      no 256-key blocks.
    - WIDE_KEY_BLOCK keys a step (two stages) at D = 48 and 64 without a mask where they
      divide S: the softmax of a 64 × 256 block, not the short QKᵀ and PV WGMMAs, sets the
      pace there, and a wider step halves the steps' fixed costs. Under a causal mask they
      cost more masked work than they save. Padding plans at 128-key blocks (S = 257 pads to
      384, not 512); a padded S that 256 divides takes them, the last cut by the key bound.
    """
    config = cls.for_head_dim(d)
    if d in (48, 64) and mask.sees_all_keys and s % WIDE_KEY_BLOCK == 0:
      config = dataclasses.replace(config, block_kv=WIDE_KEY_BLOCK, stages=2)
    elif d == 48 and mask.sees_all_keys:
      config = dataclasses.replace(config, stages=4)
    d = _padding.settings_dim(d)
    if d == 128 and mask.segments and mask.is_causal_band:
      return dataclasses.replace(config, persistent=True, dynamic=True)
    if (d in (96, 128) and mask.is_causal and s <= SHORT_CAUSAL_KEYS
        and _fills_sms(mask, t, s, heads)):
      return dataclasses.replace(config, persistent=True, dynamic=d == 128)
    if d in (128, 192, 256) and (mask.sees_all_keys or mask.is_causal):
      config = dataclasses.replace(config, overlap=True, pingpong=False,
                                   persistent=d == 128 and mask.sees_all_keys)
    if (d == 128 and not (mask.sees_all_keys or mask.segments)
        and mask.span(s) <= SHORT_WALK_KEYS and _fills_sms(mask, t, s, heads)):
      config = dataclasses.replace(config, persistent=True, dynamic=True)
    if (d == 64 and mask.is_causal) or (d in (64, 96) and mask.sees_all_keys):
      config = dataclasses.replace(config, persistent=True)
    if d in (96, 192) and mask.sees_all_keys:
      config = dataclasses.replace(config, stages=3)
    return config


def _fills_sms(mask: MaskSpec, t: int, s: int, heads: int) -> bool:
  """Whether `heads` heads of a [t, s] band give each SM at least PERSISTENT_MIN_TILES_PER_SM
  query tiles of 128 rows and PERSISTENT_MIN_BLOCKS_PER_SM key blocks' worth of visible
  pairs (128 × 128), as a persistent forward needs to pay for its fixed costs."""
  sms = hopper.sm_count()
  return (heads * -(-t // 128) >= PERSISTENT_MIN_TILES_PER_SM * sms
          and heads * mask.visible_pairs(t, s) >= PERSISTENT_MIN_BLOCKS_PER_SM * sms * 128**2)


def support_error(q_shape, k_shape, dtype, opts: AttentionOptions,
                  config: MosaicConfig) -> str | None:
  """Why the kernel cannot serve this call, or None when it can."""
  _, t, _, d = q_shape
  s = k_shape[1]
  if (why := hopper.dtype_error(dtype)) is not None:
    return why
  if d not in _padding.HEAD_DIMS:
    return f"serves head dims {', '.join(map(str, _padding.HEAD_DIMS))}, got D={d}"
  if t % (2 * config.block_q):
    return f"needs T a multiple of {2 * config.block_q}, got T={t}"
  if s % config.block_kv:
    return f"needs S a multiple of {config.block_kv}, got S={s}"
  if opts.scale <= 0:
    return f"needs scale > 0, got {opts.scale}"
  if config.overlap and config.pingpong:
    return "overlap and pingpong exclude each other"
  if config.num_sms is not None and not (config.persistent and config.num_sms >= 1):
    return f"num_sms={config.num_sms} needs persistent and at least one CTA"
  if config.dynamic and not config.persistent:
    return "dynamic needs persistent"
  fits = _fitting_stages(config, d, jnp.dtype(dtype).itemsize)
  if fits < 1:
    return (f"block_kv={config.block_kv} at D={d} leaves no room in shared memory for a K/V "
            f"stage{' beside the persistent output buffer' if config.persistent else ''}")
  stages = _stages(config, s, d, jnp.dtype(dtype).itemsize)
  if not config.overlap and s > config.block_kv and stages < 2:
    # A step waits for the next block's K before it releases its own slot, which one slot
    # would have to hold both: the walk would deadlock.
    return (f"needs two K/V stages to walk S={s} in blocks of {config.block_kv} without "
            f"overlap; stages={config.stages}, block_kv={config.block_kv} at D={d}"
            f"{' with the persistent output buffer' if config.persistent else ''} leave "
            f"room for {stages}")
  return None


_SMEM_RESERVE = 4_096  # barriers, reduction scratch, alignment


def _fitting_stages(cfg: MosaicConfig, d: int, itemsize: int) -> int:
  """The most K/V stages that fit in shared memory beside Q (and with persistent the
  output's buffer) and the log-sum-exp."""
  fixed = (2 + 2 * cfg.persistent) * cfg.block_q * d * itemsize + 2 * cfg.block_q * 4
  fixed += _SMEM_RESERVE
  return (hopper.SMEM_BYTES - fixed) // (2 * cfg.block_kv * d * itemsize)


def _stages(cfg: MosaicConfig, s: int, d: int, itemsize: int) -> int:
  """The K/V stages a walk over S = s keys runs: cfg.stages, at most its key blocks and
  what fits."""
  return min(cfg.stages, s // cfg.block_kv, _fitting_stages(cfg, d, itemsize))


class _Tile(NamedTuple):
  """One CTA's work: two query blocks (rows qi·2·block_q ..) of head h of batch row b, and
  the key blocks they visit (query_cta_key_blocks)."""
  b: jax.Array
  h: jax.Array
  qi: jax.Array
  per_block: list
  cta_lo: jax.Array
  cta_hi: jax.Array

  @property
  def n_blocks(self):
    return self.cta_hi - self.cta_lo


class _Scratch(NamedTuple):
  """The forward's shared memory and barriers, allocated in this order: the two compute
  warpgroups' Q tiles and row statistics, the K and V rings, with `persistent` the output's
  own tiles (None otherwise), then the barriers and the segment ids' buffers."""
  q_smem: Any
  k_smem: Any
  v_smem: Any
  lse_smem: Any
  o_smem: Any
  q_ready: Any  # per warpgroup: its Q tile landed
  k_ready: Any  # per slot: a key block's K landed
  v_ready: Any  # ... its V
  k_free: Any  # per slot, 2 arrivals: both warpgroups are done with K
  v_free: Any  # ... with V
  turn: Any  # 2 arrivals: pingpong's turns
  seg: Any  # _mosaic.SegmentScratch with segment ids, else None
  tiles: Any  # with config.dynamic: 2 int32 slots of taken tiles, their ready and free barriers


def _forward_kernel(q_ref, k_ref, v_ref, seg_refs, schedule, o_ref, lse_ref, q_smem, k_smem,
                    v_smem, lse_smem, o_smem, q_ready, k_ready, v_ready, k_free, v_free, turn,
                    seg: _mosaic.SegmentScratch | None, tiles, *, config: MosaicConfig,
                    mask: MaskSpec, scale: float, softcap: float | None, group: int,
                    head_group: int, lengths: tuple[int, int]):
  """With config.persistent the grid is one axis, "cta", o_smem is the output's own buffer
  (else the output leaves through Q's), and the tiles come from `schedule`, the
  hopper.greedy_schedule tables (each CTA's tiles by launch position, and how many), or
  with config.dynamic from `tiles`: a ring of two tile slots in shared memory with its
  ready and free barriers, the global count the memory warpgroup takes tiles from, and the
  number of CTAs. Tiles are taken in launch order, `head_group` heads' interleaved
  (_mosaic.query_cta_at). `lengths`: the T and S the kernel runs at (_Static.lengths), which
  may reach past the ends of q_ref and k_ref."""
  bq, bkv = config.block_q, config.block_kv
  t, s = lengths
  d = q_ref.shape[-1]
  dtype = q_ref.dtype
  n_q_ctas = t // (2 * bq)
  wg = lax.axis_index("wg")
  stages = config.stages
  segments = mask.segments
  # Rows that see no key at all (window, segments) end with l = 0: guard the exponents.
  may_be_empty = mask.rows_may_be_empty

  n_blocks = s // bkv
  # Every CTA reads every key block (up to the key bound): static loop bounds.
  static_range = mask.sees_all_keys
  ready = (k_ready, v_ready) + ((seg.kv_ready,) if segments else ())  # a key block's loads

  take_turn = functools.partial(hopper.take_turn, turn)

  n_h = q_ref.shape[2]
  n_tiles = q_ref.shape[0] * n_h * n_q_ctas

  def at_launch(idx):
    """(b, h, qi) of the tile at launch position idx (_mosaic.query_cta_at)."""
    head, qi = _mosaic.query_cta_at(mask, q_ref.shape[0] * n_h, n_q_ctas, head_group, idx)
    return hopper.div(head, n_h), hopper.rem(head, n_h), qi

  def tile_at(b, h, qi):
    return _Tile(b, h, qi, *_mosaic.query_cta_key_blocks(
        mask, seg_refs[2] if segments else None, b, qi, bq, bkv, n_blocks))

  # The grid position, read before the warpgroups split.
  cta = lax.axis_index("cta") if config.persistent else None
  grid_position = None if config.persistent else at_launch(
      (lax.axis_index("b") * n_h + lax.axis_index("h")) * n_q_ctas + lax.axis_index("q"))

  def scheduled(r):
    """config.persistent: (b, h, qi) of this CTA's r-th tile."""
    return at_launch(schedule[0][cta, r])

  def following(r, *, wait: bool):
    """config.dynamic: the launch position of this CTA's tile after its r-th (n_tiles or
    more for none), which the memory warpgroup takes once it has issued tile r's loads. A
    compute warpgroup waits for it once a tile (wait=True), then reads it again as it likes
    until release_following."""
    slots, ready, _, _, _ = tiles

    def read(i):
      def run():
        if wait:
          plgpu.barrier_wait(ready.at[i])
        return slots[i]
      return run

    return lax.cond(hopper.rem(r + 1, 2) == 0, read(0), read(1))

  def release_following(r):
    """config.dynamic: a compute warpgroup is done with following(r)'s slot."""
    free = tiles[2]
    lax.cond(hopper.rem(r + 1, 2) == 0, lambda: plgpu.barrier_arrive(free.at[0]),
             lambda: plgpu.barrier_arrive(free.at[1]))

  def take_following(r):
    """config.dynamic, on the memory warpgroup: takes the CTA's tile after its r-th from the
    global count into a slot of a two-slot ring, for all three warpgroups to read."""
    slots, ready, free, counter, ctas = tiles

    def take(i):
      def run():
        # The slot's last value (tile r − 1, taken in tile r − 2) released by the compute
        # side at the end of tile r − 2.
        pl.when(r >= 2)(lambda: plgpu.barrier_wait(free.at[i]))
        hopper.take_work_item(counter, slots, i, ctas)
        plgpu.barrier_arrive(ready.at[i])
        plgpu.barrier_wait(ready.at[i])  # the warpgroup's other threads read it too
        return slots[i]
      return run

    return lax.cond(hopper.rem(r + 1, 2) == 0, take(0), take(1))

  def each_tile(fn):
    """fn(r, tile, base) → base' for this CTA's tiles in order: its grid position's one, or
    with config.persistent its schedule's; with config.dynamic fn returns (base', the launch
    position of the CTA's next tile), and the loop ends at n_tiles. base: the key blocks
    streamed before the tile (the K/V ring's global position), a loop carry; None on the
    grid. A concrete 0 would not do: closed over by a WGMMA's run_state, a constant scalar
    has no lowering under jax 0.11's warpgroup semantics."""
    if not config.persistent:  # base None: the ring starts at the CTA's first block
      fn(0, tile_at(*grid_position), None)
      return
    if not config.dynamic:
      lax.fori_loop(0, schedule[1][cta], lambda r, base: fn(r, tile_at(*scheduled(r)), base),
                    jnp.int32(0))
      return

    def body(carry):
      r, idx, base = carry
      base, nxt = fn(r, tile_at(*at_launch(idx)), base)
      return r + 1, nxt, base

    lax.while_loop(lambda carry: carry[1] < n_tiles, body, (jnp.int32(0), cta, jnp.int32(0)))

  def advanced(base, tile: _Tile, nxt):
    """What fn returns to each_tile after `tile`: None on the grid, else the ring's position
    past the tile's key blocks (with config.dynamic, and nxt: the CTA's next launch
    position)."""
    if base is None:
      return None
    return (base + tile.n_blocks, nxt) if config.dynamic else base + tile.n_blocks

  @pl.when(wg < 2)
  def _compute():
    # The backward's register split: at (232, 40) ptxas spilled more and the forward ran
    # slower (the design doc's registers row).
    plgpu.set_max_registers(hopper.WARPGROUP_REGISTERS[0], action="increase")
    q_tile = q_smem.at[wg]
    # The output leaves through its own buffer when persistent (Q's then takes the next
    # tile's rows while this one's epilogue runs), else through Q's.
    o_tile = o_smem.at[wg] if config.persistent else q_tile

    def first_row(qi):  # this warpgroup's first query row in query CTA qi
      return (2 * qi + wg) * bq

    def load_q(b, h, qi):  # the tile's queries, and their document ids where segments
      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(first_row(qi), bq), h], q_tile,
                              q_ready.at[wg])
      if segments:
        plgpu.copy_gmem_to_smem(seg_refs[0].at[b, pl.ds(first_row(qi), bq)],
                                seg.q_ids.at[wg], seg.q_ready.at[wg])

    if config.persistent:
      if config.dynamic:
        load_q(*at_launch(cta))
      else:
        pl.when(schedule[1][cta] > 0)(lambda: load_q(*scheduled(0)))

    def run_tile(r, tile: _Tile, base):
      b, h, cta_lo, cta_hi = tile.b, tile.h, tile.cta_lo, tile.cta_hi
      row = first_row(tile.qi)
      bounds = _mosaic.my_key_blocks(tile.per_block, cta_lo, cta_hi, wg)
      hi = bounds[1]
      if not config.persistent:
        load_q(b, h, tile.qi)
      if segments:
        plgpu.barrier_wait(seg.q_ready.at[wg])
        q_ids = hopper.load(seg.q_ids.at[wg], plgpu.Layout.WGMMA.reduce(1))
      plgpu.barrier_wait(q_ready.at[wg])

      c = scale * hopper.LOG2E  # scores in the exp2 domain: p = 2^(s·c - m)
      m = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
      l = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      acc = plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)

      if config.pingpong:  # warpgroup 1 starts half a turn behind warpgroup 0
        pl.when(wg == 1)(take_turn)

      # Persistent: the next tile's Q (with config.dynamic at the launch position the
      # memory warpgroup takes once it has issued this tile's loads). Under a causal mask
      # without segment ids (and without the overlap) the warpgroup refills Q's slot in the
      # step of its last key block, once that block's QKᵀ has read it, so that Q lands under
      # the block's softmax and PV: a short walk's next Q, issued in the epilogue, is still
      # in flight when the next tile starts. Elsewhere Q is loaded after the walk: with
      # segment ids that condition in the step made ptxas spill more and slowed the
      # forward, and without a mask walks are long. Either way it runs once a tile, after
      # the tile's last key block has landed, which the memory warpgroup loads before it
      # takes the next tile: the wait for that is short and never on the other warpgroup.
      def load_next_q():
        if config.dynamic:
          nxt = following(r, wait=True)
          pl.when(nxt < n_tiles)(lambda: load_q(*at_launch(nxt)))
        else:
          pl.when(r + 1 < schedule[1][cta])(lambda: load_q(*scheduled(r + 1)))

      early_q = (config.persistent and not config.overlap and mask.is_causal_band
                 and not segments)

      def slot_of(j):
        """Key block j's slot in the ring (global position base + j − cta_lo)."""
        return hopper.rem(j - cta_lo if base is None else base + j - cta_lo, stages)

      def visible(j, scores):
        """Key block j's scores on this warpgroup's rows, -inf where the mask hides them."""
        kv_ids = None
        if segments:
          plgpu.barrier_wait(seg.kv_ready.at[slot_of(j)])
          kv_ids = hopper.load(seg.kv_ids.at[slot_of(j)], plgpu.Layout.WGMMA.reduce(0))
        ok = _mosaic.visible(mask, scores.shape, 1, j * bkv, row,
                             q_ids if segments else None, kv_ids)
        return jnp.where(ok, scores, -jnp.inf)

      def online_softmax(j, slot, scores, m, l, *, masked):
        """Block j's P (input dtype) on the running maximum m → m_new, the new row sums,
        and α = 2^(m − m_new) for the accumulator; releases K's slot once its scores (and
        key ids) have been read."""
        if not segments:
          plgpu.barrier_arrive(k_free.at[slot])
        if softcap is not None:  # z = cap·tanh(s/cap), already in the exp2 domain
          scores = jnp.tanh(scores * (scale / softcap)) * (softcap * hopper.LOG2E)
        if masked:
          scores = visible(j, scores)
        elif segments:  # unread, but every load's barrier is waited on (its phase)
          plgpu.barrier_wait(seg.kv_ready.at[slot])
        if segments:  # the slot's key ids have been read too
          plgpu.barrier_arrive(k_free.at[slot])
        if softcap is None:  # scale the row maximum, not the whole tile
          m_new = jnp.maximum(m, scores.max(axis=1) * c)
          z = scores * c
        else:
          m_new = jnp.maximum(m, scores.max(axis=1))
          z = scores
        if config.lazy_rescale:  # keep m unless a row's maximum rose past the threshold
          m_new = jnp.where(m_new > m + RESCALE_THRESHOLD, m_new, m)
        # A row with no visible key yet has m_new = -inf: subtract 0 instead (p = 0, α = 0).
        m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new) if may_be_empty else m_new
        p = jnp.exp2(z - lax.broadcast_in_dim(m_sub, scores.shape, [0]))
        alpha = jnp.exp2(m - m_sub)
        return p.astype(dtype), m_new, l * alpha + p.sum(axis=1), alpha

      def rescale(acc, alpha):
        if config.lazy_rescale:
          return hopper.rows_scaled_where_needed(acc, alpha)
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

      def block_scores(slot):
        """QKᵀ of the key block in `slot` (then the ping-pong turn), waited for."""
        def qk(s_ref):
          plgpu.wgmma(s_ref, q_tile, k_smem.at[slot].T)
          if config.pingpong:
            take_turn()
          return s_ref[...]

        return pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))

      def step(j, carry, *, masked):
        acc, m, l = carry
        slot = slot_of(j)
        scores = block_scores(slot)
        if early_q:
          pl.when(j == hi - 1)(load_next_q)
        p, m_new, l, alpha = online_softmax(j, slot, scores, m, l, masked=masked)
        acc = rescale(acc, alpha)
        if config.pingpong:
          plgpu.barrier_arrive(turn)  # softmax done: the other warpgroup may issue
        plgpu.barrier_wait(v_ready.at[slot])
        if config.pingpong:
          plgpu.barrier_wait(turn)  # and now it is our turn on the tensor cores

        def pv(acc_ref):
          plgpu.wgmma(acc_ref, p, v_smem.at[slot])

          @pl.when(j + 1 < hi)  # the next K lands while this WGMMA runs
          def _():
            plgpu.barrier_wait(k_ready.at[slot_of(j + 1)])

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l

      def skip(j, _):
        slot = slot_of(j)
        _mosaic.release_key_block([r.at[slot] for r in ready],
                                  [k_free.at[slot], v_free.at[slot]],
                                  take_turn if config.pingpong else None)

      def first_k():
        plgpu.barrier_wait(k_ready.at[slot_of(bounds[0])])

      def overlapped_blocks(acc, m, l):
        """visit_key_blocks with FlashAttention-3's intra-warpgroup overlap
        (config.overlap): block lo's QKᵀ and softmax, then per block j QKᵀ_j and PV_{j−1}
        issued together and block j's softmax computed while PV_{j−1} runs, then block
        hi−1's PV."""
        lo, hi, full_lo, full_hi = bounds
        zeros = lambda shape: plgpu.layout_cast(jnp.zeros(shape, jnp.float32),
                                                plgpu.Layout.WGMMA)

        def first(masked):
          def run():
            slot = slot_of(lo)
            plgpu.barrier_wait(k_ready.at[slot])
            return online_softmax(lo, slot, block_scores(slot), m, l, masked=masked)[:3]
          return run

        def no_blocks():
          return zeros((bq, bkv)).astype(dtype), m, l

        def step(j, carry, *, masked):
          acc, m, l, p_prev = carry
          slot, prev = slot_of(j), slot_of(j - 1)
          plgpu.barrier_wait(k_ready.at[slot])
          plgpu.barrier_wait(v_ready.at[prev])

          def issue_both(refs):
            s_ref, o_ref, p_ref, m_ref, l_ref, alpha_ref = refs
            plgpu.wgmma(s_ref, q_tile, k_smem.at[slot].T)
            plgpu.wgmma(o_ref, p_prev, v_smem.at[prev])
            # PV_{j−1} may still run, except on a masked block: the mask's registers then
            # made ptxas serialize every WGMMA of the kernel (ptxas warning C7513).
            scores = plgpu.wgmma_accumulator_load(s_ref, wait_n=0 if masked else 1)
            p_ref[...], m_ref[...], l_ref[...], alpha_ref[...] = online_softmax(
                j, slot, scores, m, l, masked=masked)

          _, acc, p, m, l, alpha = pl.run_state(issue_both)(
              (plgpu.ACC.init(zeros((bq, bkv))), plgpu.ACC.init(acc), p_prev, m, l, m))
          plgpu.barrier_arrive(v_free.at[prev])
          return rescale(acc, alpha), m, l, p

        def last(acc, p):
          def run():
            prev = slot_of(hi - 1)
            plgpu.barrier_wait(v_ready.at[prev])

            def pv(o_ref):
              plgpu.wgmma(o_ref, p, v_smem.at[prev])

            out = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[prev])
            return out
          return run

        lax.fori_loop(cta_lo, lo, skip, None)
        # Under a window or segment ids a warpgroup may own no block: its first and last
        # blocks then go under a lax.cond (every causal row sees key 0).
        if may_be_empty:
          p, m, l = lax.cond(lo < hi, first(masked=True), no_blocks)
        else:
          lo_is_whole = static_range and bounds[2] <= lo < bounds[3]
          p, m, l = first(masked=not lo_is_whole)()
        # Blocks lo+1.. (none when lo == hi), each masked where visit_key_blocks masks it.
        acc, m, l, p = _mosaic.masked_ranges(step, (acc, m, l, p), lo + 1, hi, full_lo,
                                             full_hi, dense=mask.is_dense)
        acc = lax.cond(lo < hi, last(acc, p), lambda: acc) if may_be_empty else last(acc, p)()
        lax.fori_loop(hi, cta_hi, skip, None)
        return acc, m, l

      if config.overlap:
        acc, m, l = overlapped_blocks(acc, m, l)
      else:
        acc, m, l = _mosaic.visit_key_blocks(step, skip, (acc, m, l), bounds, cta_lo, cta_hi,
                                             dense=mask.is_dense, start=first_k)
      if config.pingpong:  # warpgroup 0 takes the turn warpgroup 1 took at the start
        pl.when(wg == 0)(take_turn)
      if early_q:  # a warpgroup with no key block has not loaded it
        pl.when(bounds[0] >= hi)(load_next_q)
      elif config.persistent:  # Q is read: it loads during the epilogue
        load_next_q()

      if may_be_empty:  # no visible key: output 0, log-sum-exp -inf
        inv = jnp.where(l > 0, 1.0 / l, 0.0)
        lse = jnp.where(l > 0, m * hopper.LN2 + jnp.log(l), -jnp.inf)
      else:
        inv, lse = 1.0 / l, m * hopper.LN2 + jnp.log(l)
      acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
      if config.persistent:  # the last tile's stores have read the buffers
        hopper.wait_stores_read()
      o_tile[...] = acc.astype(dtype)
      lse_smem.at[wg][...] = lse
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_tile, o_ref.at[b, pl.ds(row, bq), h])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, pl.ds(row, bq)])
      nxt = None
      if config.dynamic:  # load_next_q has waited for it
        nxt = following(r, wait=False)
        release_following(r)
      return advanced(base, tile, nxt)

    each_tile(run_tile)
    hopper.wait_stores_read()

  @pl.when(wg == 2)
  def _memory():
    plgpu.set_max_registers(hopper.WARPGROUP_REGISTERS[1], action="decrease")

    def stream(r, tile: _Tile, base):
      # Masked CTAs may stream fewer blocks.
      _mosaic.stream_key_blocks(k_ref, v_ref, seg_refs[1] if segments else None, tile.b,
                                hopper.div(tile.h, group), tile.cta_lo, tile.cta_hi, bkv,
                                stages,
                                (k_smem, v_smem) + ((seg.kv_ids,) if segments else ()),
                                ready, (k_free, v_free), separate_rings=config.overlap,
                                base=base)
      # The next tile is taken only now, `stages` key blocks before this one ends: taken as
      # a tile began, a CTA held its next tile for the whole walk while CTAs that finished
      # sooner took later ones, so that tiles started out of launch order.
      nxt = take_following(r) if config.dynamic else None
      return advanced(base, tile, nxt)

    each_tile(stream)


_TILE_OVERHEAD = 2  # a forward tile's cost beyond its key blocks, in key blocks (a guess)


def _static_schedule(cfg: MosaicConfig, mask: MaskSpec, heads: int, n_q_ctas: int, s: int,
                     ctas: int, head_group: int):
  """hopper.greedy_schedule's tables for a persistent forward without `dynamic`: the tiles
  in launch order (_mosaic.query_cta_at's), dealt by their key blocks (the band's: segment
  ids are not known here)."""
  with hopper.host_constants():
    band = dataclasses.replace(mask, segments=False)
    qi = jnp.arange(n_q_ctas, dtype=jnp.int32)
    _, lo, hi = _mosaic.query_cta_key_blocks(band, None, 0, qi, cfg.block_q, cfg.block_kv,
                                             s // cfg.block_kv)
    blocks = jnp.broadcast_to(jnp.asarray(hi) - jnp.asarray(lo), (n_q_ctas,))  # per qi
    _, at = _mosaic.query_cta_at(mask, heads, n_q_ctas, head_group,
                                 jnp.arange(heads * n_q_ctas, dtype=jnp.int32))
    costs = [int(x) for x in blocks[at]]
  return hopper.greedy_schedule(costs, ctas, _TILE_OVERHEAD)


def _forward(st: "_Static", q, k, v, q_seg, kv_seg):
  if st.padding is not None:  # the kernels run at padded lengths (on copies or in place)
    return _padding.forward(st.padding, functools.partial(_forward, st.padded()),
                            q, k, v, q_seg, kv_seg)
  cfg = st.config
  b, _, hq, d = q.shape
  hkv = k.shape[2]
  t, s = st.lengths or (q.shape[1], k.shape[1])
  stages = max(1, _stages(cfg, s, d, jnp.dtype(q.dtype).itemsize))
  cfg = dataclasses.replace(cfg, stages=stages)
  layout = hopper.swizzled_tiles(hopper.row_swizzle(d, q.dtype))
  mask = st.opts.mask
  segments = mask.segments
  if segments:
    ranges = _mosaic.segment_block_ranges(q_seg, kv_seg, cfg.block_q, cfg.block_kv)
    seg_args = (q_seg, kv_seg, ranges)
  else:
    seg_args = ()
  n_q_ctas = t // (2 * cfg.block_q)
  # Not on D = 256's settings (D = 224 and 256): there launching heads together measured
  # slower at B4 T4k, level at B2 and faster at T2k, so the head-by-head order stays.
  head_group = 1 if _padding.settings_dim(d) == 256 else _mosaic.interleaved_heads(
      mask, b * hq, n_q_ctas, cfg.num_sms or hopper.sm_count())
  if cfg.persistent:
    ctas = hopper.persistent_ctas(cfg.num_sms, b * hq * n_q_ctas)
    schedule_args = () if cfg.dynamic else _static_schedule(cfg, mask, b * hq, n_q_ctas, s,
                                                             ctas, head_group)
    grid, grid_names = (ctas,), ("cta",)
  else:
    schedule_args = ()
    grid, grid_names = (b, hq, n_q_ctas), ("b", "h", "q")

  def body(q_ref, k_ref, v_ref, *refs):
    n_seg = 3 if segments else 0
    n_sched = len(schedule_args)
    seg_refs = refs[:n_seg] if segments else None
    schedule = refs[n_seg:n_seg + n_sched] or None
    o_ref, lse_ref = refs[n_seg + n_sched:]

    def kernel(scratch: _Scratch):
      if cfg.dynamic:  # the ring of taken tiles, the global count, the CTAs
        scratch = scratch._replace(tiles=(*scratch.tiles, pl.get_global(
            plgpu.SemaphoreType.REGULAR((1,))), ctas))
      _forward_kernel(q_ref, k_ref, v_ref, seg_refs, schedule, o_ref, lse_ref,
                      **scratch._asdict(), config=cfg, mask=mask, scale=st.opts.scale,
                      softcap=st.opts.logit_softcap, group=hq // hkv,
                      head_group=head_group, lengths=(t, s))

    barrier = plgpu.Barrier
    pl.run_scoped(kernel, _Scratch(
        q_smem=plgpu.SMEM((2, cfg.block_q, d), q.dtype, transforms=layout),
        k_smem=plgpu.SMEM((stages, cfg.block_kv, d), k.dtype, transforms=layout),
        v_smem=plgpu.SMEM((stages, cfg.block_kv, d), v.dtype, transforms=layout),
        lse_smem=plgpu.SMEM((2, cfg.block_q), jnp.float32),
        o_smem=(plgpu.SMEM((2, cfg.block_q, d), q.dtype, transforms=layout)
                if cfg.persistent else None),
        q_ready=barrier(num_barriers=2), k_ready=barrier(num_barriers=stages),
        v_ready=barrier(num_barriers=stages),
        k_free=barrier(num_arrivals=2, num_barriers=stages),
        v_free=barrier(num_arrivals=2, num_barriers=stages), turn=barrier(num_arrivals=2),
        seg=(_mosaic.SegmentScratch.shapes(cfg.block_q, cfg.block_kv, stages)
             if segments else None),
        tiles=((plgpu.SMEM((2,), jnp.int32), barrier(num_barriers=2),
                barrier(num_arrivals=2, num_barriers=2)) if cfg.dynamic else None)),
      collective_axes="wg")

  # pl.kernel rather than plgpu.kernel: it takes the cost estimate remat.fit counts.
  out, lse = pl.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype),  # rows past q's end are dropped
                jax.ShapeDtypeStruct((b, hq, t), jnp.float32)),
      mesh=plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=3, thread_name="wg"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      cost_estimate=_common.cost_estimate(st.opts, q, k, 2),
      name="flash_attention_fwd_mosaic",
  )(q, k, v, *seg_args, *schedule_args)
  return out, lse


def _backward(st: "_Static", res, cts):
  if st.padding is not None:  # the kernels run at padded lengths (on copies or in place)
    return _padding.backward(st.padding, functools.partial(_backward, st.padded()), res, cts)
  if st.backward is None:
    return pallas_triton.backward_pass(st.triton, res, cts)
  if st.backward.with_dq:
    return mosaic_gpu_backward.backward(st.opts, st.backward, res, cts, lengths=st.lengths)
  # Deterministic: dK and dV from the one-pass kernel without dq (one CTA per key block),
  # dq from a kernel with one CTA per query block (mosaic_gpu_dq's, else pallas_triton's),
  # sharing Δ.
  d_out, d_lse = cts
  delta = _common.softmax_delta(res.out, d_out, d_lse)
  stats = mosaic_gpu_backward.row_stats(st.opts, res, delta)
  _, dk, dv, _, _ = mosaic_gpu_backward.backward(st.opts, st.backward, res, cts, stats=stats,
                                                 lengths=st.lengths)
  if st.dq is not None:
    dq = mosaic_gpu_dq.dq(st.opts, st.dq, res, d_out, stats, lengths=st.lengths)
  else:
    dq = pallas_triton.dq_pass(st.triton, res, d_out, delta)
  return dq, dk, dv, None, None


@dataclasses.dataclass(frozen=True)
class _Static:
  opts: AttentionOptions
  config: MosaicConfig
  # The backward: the Mosaic kernel whole (backward.with_dq), pallas_triton's kernels
  # (backward None), or the Mosaic kernel for dK and dV (with_dq=False) beside a dq kernel:
  # mosaic_gpu_dq's with `dq`, else pallas_triton's (`triton`).
  backward: MosaicBackwardConfig | None
  triton: pallas_triton.TritonPlan | None
  dq: MosaicDqConfig | None = None
  # Where the kernels do not take the call's lengths or head dim: the sizes they run padded
  # to. `opts` are then the call's, and the kernels' fields above the padded call's.
  padding: _padding.Padding | None = None
  # The T and S the kernels run at where they read and write the call's arrays in place,
  # past their ends (_padding.Padding.in_place); None: the arrays' own.
  lengths: tuple[int, int] | None = None

  def padded(self) -> "_Static":
    """The static of the padded call that `padding` describes."""
    pad = self.padding
    return dataclasses.replace(self, opts=pad.options(self.opts), padding=None,
                               lengths=(pad.t, pad.s) if pad.in_place else None)


_attention = _common.attention_vjp(_vma.unchecked(_forward), _vma.unchecked(_backward),
                                    "pallas_mosaic_gpu")


def hopper_available() -> str | None:
  """Why no Hopper GPU can run the kernels, or None (kernels.hopper.unavailable)."""
  return hopper.unavailable()


@dataclasses.dataclass(frozen=True)
class PallasMosaicGpu:
  """Mosaic GPU forward and backward (Hopper).

  `config=None` uses MosaicConfig.for_call. `backward_config` picks the backward: a
  MosaicBackwardConfig runs the Mosaic kernel (mosaic_gpu_backward) with those tiles, a
  pallas_triton.BlockConfig runs pallas_triton's dq and dk/dv kernels, and None runs the
  Mosaic backward (tiles from MosaicBackwardConfig.tuned) where it serves the call (see
  mosaic_gpu_backward.support_error) and pallas_triton's elsewhere.

  The Mosaic backward sums dq over key blocks by TMA reductions in the order the CTAs
  arrive, which is not bitwise reproducible, unless it orders them (dq_ordered): only such
  a kernel runs whole for calls with deterministic=True (flash_attention's default). For
  them None means MosaicBackwardConfig.for_deterministic: the ordered kernel where the tuning
  table names one and no dq_config is given, else the Mosaic kernel for dK and dV alone
  (`with_dq=False`: one CTA per key block, no reductions) beside a dq kernel with one CTA
  per query block; a MosaicBackwardConfig must then have with_dq=False or dq_ordered. With
  deterministic=False None means MosaicBackwardConfig.for_nondeterministic: arrival order
  only where the table names it (the default table nowhere: the ordered kernels measured
  as fast or faster) or where there is no ordered kernel (see its docstring).
  `dq_config` picks that dq kernel: a MosaicDqConfig runs mosaic_gpu_dq's, a
  pallas_triton.BlockConfig pallas_triton's, and None mosaic_gpu_dq's where it serves the
  call (the head dims of _padding.HEAD_DIMS), pallas_triton's elsewhere.

  `pad` says which calls whose lengths or head dim the kernels do not take run on padded
  copies (_padding): "always" every one, "where_faster" (flash_attention's default order)
  only those whose padding adds less work than pallas_triton's kernels lose; the others
  raise Unsupported, so that pallas_triton serves them (every one where JAX has no Pallas
  Triton).
  """

  config: MosaicConfig | None = None
  backward_config: MosaicBackwardConfig | pallas_triton.BlockConfig | None = None
  dq_config: MosaicDqConfig | pallas_triton.BlockConfig | None = None
  pad: str = "always"
  name: str = "pallas_mosaic_gpu"

  def __post_init__(self):
    if self.pad not in ("always", "where_faster"):
      raise ValueError(f"pad must be 'always' or 'where_faster', got {self.pad!r}")

  def __call__(self, q, k, v, q_seg, kv_seg, *, opts: AttentionOptions):
    return _attention(self, self._static(q, k, opts), q, k, v, q_seg, kv_seg)

  def backward(self, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, *, opts: AttentionOptions):
    """(dq, dk, dv) from saved out and lse [B, Hq, T], without a forward pass."""
    res = _common.Residuals(q, k, v, q_seg, kv_seg, out, lse)
    return _vma.unchecked(_backward)(self._static(q, k, opts), res, (d_out, d_lse))[:3]

  def _static(self, q, k, opts: AttentionOptions) -> _Static:
    """The kernels and tiles of a call with q's and k's shapes, for the padded call where
    the kernels do not take its lengths or head dim (_padding)."""
    padding = self.padding(q.shape, k.shape, opts.mask)
    if padding is None:
      return self._static_as_is(q, k, opts)
    (t, d), s = q.shape[1::2], k.shape[1]
    b, _, hq, _ = q.shape
    padded = self._static_as_is(
        jax.ShapeDtypeStruct((b, padding.t, hq, padding.d), q.dtype),
        jax.ShapeDtypeStruct((k.shape[0], padding.s, k.shape[2], padding.d), k.dtype),
        padding.options(opts))
    # The Mosaic kernels read and write past the ends of the call's arrays where TMA takes
    # their rows (whole 8-row tiles) and no pallas_triton kernel (a backward or dq) runs.
    in_place = (padding.d == d and t % hopper.TMA_ROWS == 0 and s % hopper.TMA_ROWS == 0
                and padded.backward is not None and padded.triton is None)
    padding = padding._replace(in_place=in_place)
    # Those that padding does not pay for go to pallas_triton, where this JAX has it.
    if (self.pad == "where_faster" and not padding.pays(t, s)
        and pallas_triton.plgpu is not None):
      raise _dispatch.Unsupported(
          f"pallas_mosaic_gpu: T={t}, S={s} would run padded to {padding.t}, {padding.s} "
          f"(D={d} at {padding.d}, {'in place' if in_place else 'on copies'}), "
          f"{padding.work(t, s):.2f}× the work, more than pallas_triton's kernels lose there "
          f"({padding.slowdown()}×)")
    return dataclasses.replace(padded, opts=opts, padding=padding)

  def padding(self, q_shape, k_shape, mask: MaskSpec) -> _padding.Padding | None:
    """How a call of these shapes runs padded (_padding.plan with this config's tiles at the
    padded head dim, and S a multiple of the backward's CTA keys), or None: as it is."""
    d = q_shape[-1]
    config = self.config or MosaicConfig.for_call(_padding.head_dim(d), mask, k_shape[1])
    return _padding.plan(q_shape[1], k_shape[1], d, mask, config.block_q, config.block_kv,
                         2 * mosaic_gpu_backward.BLOCK_KV)

  def _static_as_is(self, q, k, opts: AttentionOptions) -> _Static:
    b, t, hq, d = q.shape
    config = self.config or MosaicConfig.for_call(d, opts.mask, k.shape[1], t, b * hq)
    why = hopper_available() or support_error(q.shape, k.shape, q.dtype, opts, config)
    if why is not None:
      raise _dispatch.Unsupported(f"pallas_mosaic_gpu: {why}")
    bwd = self.backward_config
    det = opts.deterministic
    if det and isinstance(bwd, MosaicBackwardConfig) and bwd.with_dq and not bwd.dq_ordered:
      raise _dispatch.Unsupported(
          "pallas_mosaic_gpu: the Mosaic backward with dq (backward_config="
          "MosaicBackwardConfig(with_dq=True)) adds dq by TMA reductions in arrival order and "
          "is not deterministic; call flash_attention with deterministic=False to run it, or "
          "ask for the reductions in a fixed order (dq_ordered=True)")
    if bwd is None or isinstance(bwd, MosaicBackwardConfig):
      mosaic = bwd
      if mosaic is None:
        # dq's reductions in a fixed order, or dK and dV only (no reductions) beside a dq
        # kernel, always so when one is asked for (dq_config); with deterministic=False in
        # arrival order where that measured faster (for_nondeterministic).
        mask, d, gqa = opts.mask, q.shape[-1], q.shape[2] > k.shape[2]
        if self.dq_config is not None:
          mosaic = MosaicBackwardConfig.tuned(d, mask.is_causal, gqa, with_dq=False)
        else:
          # A causal window at D = 128 takes the causal sections (under GQA one CTA per
          # query head), which measured faster than those without a mask. A key block walks
          # the queries the window spans, however long the call; the causal sections' `_long`
          # variants serve windows at any span (for_deterministic).
          causal = mask.is_causal_band or (mask.right == 0 and d == 128)
          walk = q.shape[1] if mask.left is None else min(
              q.shape[1], mask.left + 2 * mosaic_gpu_backward.BLOCK_KV)
          mosaic = (MosaicBackwardConfig.for_deterministic if det
                    else MosaicBackwardConfig.for_nondeterministic)(
              d, causal, gqa, t=walk, s=k.shape[1], segments=mask.segments,
              seen=mask.span(k.shape[1]))
        # Under GQA: CTAs enough to fill the GPU where key blocks and key heads are few.
        mosaic = mosaic_gpu_backward.split_group(
            mosaic, q.shape[0], q.shape[2], k.shape[2], k.shape[1],
            uneven=opts.mask.is_causal_band or opts.mask.segments)
      # dq_buffers is a most: one dQ slot where two do not fit beside the segment ids.
      mosaic = mosaic_gpu_backward.fit_shared_memory(mosaic, q.shape[-1], q.dtype,
                                                     opts.mask.segments)
      why = mosaic_gpu_backward.support_error(q.shape, k.shape, q.dtype, opts, mosaic)
      if why is None and not mosaic.with_dq:
        return self._with_dq_kernel(q, k, opts, _Static(opts, config, mosaic, None))
      self._no_dq_kernel(why or "the Mosaic backward computes dq itself (" + (
          "dq_ordered" if mosaic.dq_ordered else "deterministic=False") + ")")
      if why is None:
        return _Static(opts, config, mosaic, None)
      if bwd is not None:
        raise _dispatch.Unsupported(f"pallas_mosaic_gpu: {why}")
      bwd = None  # the Triton backward's own choice of tiles
    self._no_dq_kernel("pallas_triton's backward computes dq itself")
    triton = pallas_triton.PallasTriton(config=bwd).plan(q, opts)
    return _Static(opts, config, None, triton)

  def _no_dq_kernel(self, why: str) -> None:
    """A dq_config asked for where no separate dq kernel runs is an error, not ignored."""
    if self.dq_config is not None:
      raise _dispatch.Unsupported(
          f"pallas_mosaic_gpu: dq_config={self.dq_config} needs the dK/dV-only Mosaic "
          f"backward of a deterministic call, which this call does not run: {why}")

  def _with_dq_kernel(self, q, k, opts: AttentionOptions, st: _Static) -> _Static:
    """st with the dq kernel that runs beside the dK/dV-only Mosaic backward."""
    dq = self.dq_config
    if not isinstance(dq, pallas_triton.BlockConfig):
      mosaic = dq or MosaicDqConfig.for_head_dim(q.shape[-1])
      why = mosaic_gpu_dq.support_error(q.shape, k.shape, q.dtype, mosaic, opts.mask.segments)
      if why is None:
        return dataclasses.replace(st, dq=mosaic)
      if dq is not None:
        raise _dispatch.Unsupported(f"pallas_mosaic_gpu: {why}")
      dq = None  # pallas_triton's own choice of tiles
    triton = pallas_triton.PallasTriton(config=dq).plan(q, opts)
    return dataclasses.replace(st, triton=triton)
