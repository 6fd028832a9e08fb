"""Hopper attention dq kernel in Pallas Mosaic GPU: the deterministic backward's dq where
the one-pass kernel's ordered reductions do not serve (head dims other than 128, GQA).

The one-pass backward (mosaic_gpu_backward) adds each key block's dQ into a float32 dq by
TMA reductions, in arrival order unless dq_ordered. Where no `_ordered` tuning section
names the ordered kernel, the deterministic backward runs that kernel for dK and dV alone
(`with_dq=False`) and this one for dq: the forward's structure, with the queries' rows
resident and the keys streamed, so one CTA owns every dq row it writes and sums the key
blocks in a fixed order.

One CTA per (batch, query head, 2·64 query rows) runs three warpgroups:

  memory warpgroup    streams K and V blocks of block_kv keys through a ring of `stages`
                      shared-memory slots by TMA (the forward's ring)
  compute warpgroups  one per 64 query rows; Q, dO and the rows' lse₂ and Δ stay on chip.
                      Per key block, by WGMMA:

                        S  = Q Kᵀ     P  = 2^(S·c − lse₂)
                        dP = dO Vᵀ    dS = P ∘ (dP − Δ)
                        dQ += dS K    (dS from registers)

                      and at the end dQ·scale leaves in the input dtype through shared
                      memory, with no float32 buffer and no reduction.

With `pingpong` the compute warpgroups take turns on the tensor cores as in the forward.
Masks, segment ids, softcap and the skipping of blocks are the forward's
(_mosaic.query_cta_key_blocks); a row that sees no key gets dq 0 (its lse₂ is 0, see
mosaic_gpu_backward.row_stats). Three matmuls per step, against four for the dK/dV kernel:
seven for the pair against five for the one-pass kernel.
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
from memeff_jax.ops.flash_attention import _common
from memeff_jax.ops.flash_attention import _mosaic
from memeff_jax.ops.flash_attention import _padding
from memeff_jax.ops.flash_attention._common import AttentionOptions
from memeff_jax.ops.flash_attention.masks import MaskSpec

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

BLOCK_Q = 64  # query rows per compute warpgroup; a CTA holds two such blocks
_SMEM_RESERVE = 2_048  # barriers and alignment


@dataclasses.dataclass(frozen=True)
class MosaicDqConfig:
  """Tiles of the dq kernel.

  The defaults measured fastest at the headline shape (against 64-key blocks and ping-pong;
  the design doc's dq-kernel row).

  Attributes:
    block_kv: keys per pipeline step (64 or 128). S and dP are block_kv columns wide beside
      the 64 × D float32 dQ accumulator in the compute warpgroups' registers.
    stages: K slots in shared memory, and V slots unless v_stages says otherwise (fewer
      when they do not fit).
    v_stages: V slots, where they differ from K's. A step reads V only for dP = dO Vᵀ, at
      its start, and K until dQ += dS K at its end: one V slot is refilled while the rest
      of the step runs, and the shared memory of a second V slot buys a second K slot
      (at D = 256, where two of each do not fit).
    pingpong: the compute warpgroups take turns issuing WGMMAs.
  """

  block_kv: int = 128
  stages: int = 2
  v_stages: int | None = None
  pingpong: bool = False

  def ring_depths(self) -> tuple[int, int]:
    """(K slots, V slots)."""
    return self.stages, self.stages if self.v_stages is None else self.v_stages

  @classmethod
  def for_head_dim(cls, d: int) -> "MosaicDqConfig":
    """128-key blocks up to D = 128; above, 64-key blocks (registers), two K slots and one V
    slot (shared memory; faster than one slot of each; one K slot where segment ids need
    the room)."""
    return cls(block_kv=64, stages=2, v_stages=1) if d > 128 else cls()


def support_error(q_shape, k_shape, dtype, config: MosaicDqConfig,
                  segments: bool = False) -> str | None:
  """Why the dq kernel cannot serve this call (with segment ids if `segments`), or None."""
  _, t, _, d = q_shape
  s = k_shape[1]
  if (why := hopper.dtype_error(dtype)) is not None:
    return why
  if d not in _padding.HEAD_DIMS:
    return (f"dq kernel serves head dims {', '.join(map(str, _padding.HEAD_DIMS))}, "
            f"got D={d}")
  if config.block_kv not in (64, 128):
    return f"dq kernel takes block_kv 64 or 128, got {config.block_kv}"
  if d > 128 and config.block_kv != 64:
    return f"dq kernel needs block_kv 64 above D=128 (registers), got {config.block_kv}"
  if t % (2 * BLOCK_Q):
    return f"dq kernel needs T a multiple of {2 * BLOCK_Q}, got T={t}"
  if s % config.block_kv:
    return f"dq kernel needs S a multiple of {config.block_kv}, got S={s}"
  if min(config.ring_depths()) < 1:
    return f"dq kernel needs at least one stage, got {config}"
  if _fitting_stages(config, d, jnp.dtype(dtype).itemsize, segments) < 1:
    return f"{config} does not fit in shared memory at D={d}"
  return None


def _fitting_stages(config: MosaicDqConfig, d: int, itemsize: int, segments: bool) -> int:
  """The most K stages (K/V stages without v_stages) that fit in shared memory beside Q,
  dO, the row statistics, config.v_stages V slots and the segment ids (the queries', and
  the keys' in K's slots)."""
  fixed = 2 * (2 * BLOCK_Q * d * itemsize) + 2 * 2 * BLOCK_Q * 4 + _SMEM_RESERVE
  block = config.block_kv * d * itemsize
  ids = config.block_kv * 4 if segments else 0
  if segments:  # the query ids, and the padding of both id buffers to 1 kB (swizzle alignment)
    fixed += 2 * BLOCK_Q * 4 + 2 * 1_024
  if config.v_stages is None:
    return (hopper.SMEM_BYTES - fixed) // (2 * block + ids)
  return (hopper.SMEM_BYTES - fixed - config.v_stages * block) // (block + ids)


class _Scratch(NamedTuple):
  """The dq kernel's shared memory and barriers, allocated in this order: the two compute
  warpgroups' Q, dO and row-statistics tiles, the K and V rings, the barriers, the segment
  ids' buffers."""
  q_smem: Any
  do_smem: Any
  stats_smem: Any
  k_smem: Any
  v_smem: Any
  q_ready: Any  # per warpgroup: its Q tile landed
  do_ready: Any  # ... its dO
  stats_ready: Any  # ... its row statistics
  k_ready: Any  # per K slot: a key block's K landed
  v_ready: Any  # per V slot: its V
  k_free: Any  # per K slot, 2 arrivals: both warpgroups are done with K
  v_free: Any  # per V slot, ...
  turn: Any  # 2 arrivals: pingpong's turns
  seg: Any  # _mosaic.SegmentScratch with segment ids, else None


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, stats_ref, seg_refs, dq_ref,
               q_smem, do_smem, stats_smem, k_smem, v_smem,
               q_ready, do_ready, stats_ready, k_ready, v_ready, k_free, v_free, turn,
               seg: _mosaic.SegmentScratch | None, *, config: MosaicDqConfig, mask: MaskSpec,
               scale: float, softcap: float | None, group: int, s: int):
  """s: the keys it runs at (see dq)."""
  bq, bkv = BLOCK_Q, config.block_kv
  stages, v_stages = config.ring_depths()
  dtype = q_ref.dtype
  b, h, qi = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("q")
  wg = lax.axis_index("wg")
  segments = mask.segments
  per_block, cta_lo, cta_hi = _mosaic.query_cta_key_blocks(
      mask, seg_refs[2] if segments else None, b, qi, bq, bkv, s // bkv)

  ready = (k_ready, v_ready) + ((seg.kv_ready,) if segments else ())  # a key block's loads

  take_turn = functools.partial(hopper.take_turn, turn)

  @pl.when(wg < 2)
  def _compute():
    plgpu.set_max_registers(232, action="increase")
    row = (2 * qi + wg) * bq
    rows = pl.ds(row, bq)
    bounds = _mosaic.my_key_blocks(per_block, cta_lo, cta_hi, wg)
    q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_tile, q_ready.at[wg])
    plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_tile, do_ready.at[wg])
    plgpu.copy_gmem_to_smem(stats_ref.at[b, h, :, rows], stats_smem.at[wg], stats_ready.at[wg])
    row_layout = plgpu.Layout.WGMMA.reduce(1)  # a vector along S's rows (queries)
    if segments:
      plgpu.copy_gmem_to_smem(seg_refs[0].at[b, rows], seg.q_ids.at[wg], seg.q_ready.at[wg])
      plgpu.barrier_wait(seg.q_ready.at[wg])
      q_ids = hopper.load(seg.q_ids.at[wg], row_layout)
    plgpu.barrier_wait(stats_ready.at[wg])
    lse2 = hopper.load(stats_smem.at[wg, 0], row_layout)
    delta = hopper.load(stats_smem.at[wg, 1], row_layout)
    plgpu.barrier_wait(q_ready.at[wg])
    plgpu.barrier_wait(do_ready.at[wg])
    zeros = lambda shape: plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)

    if config.pingpong:  # warpgroup 1 starts half a turn behind warpgroup 0
      pl.when(wg == 1)(take_turn)

    def slots(j):
      """Key block j's K slot (also its ids') and V slot."""
      return hopper.rem(j - cta_lo, stages), hopper.rem(j - cta_lo, v_stages)

    def step(j, dq, *, masked):
      slot, v_slot = slots(j)
      plgpu.barrier_wait(k_ready.at[slot])
      plgpu.barrier_wait(v_ready.at[v_slot])

      def scores(refs):
        s_ref, dp_ref = refs
        plgpu.wgmma(s_ref, q_tile, k_smem.at[slot].T)
        plgpu.wgmma(dp_ref, do_tile, v_smem.at[v_slot].T)
        if config.pingpong:
          take_turn()

      st, dp = pl.run_state(scores)((plgpu.ACC.init(zeros((bq, bkv))),
                                     plgpu.ACC.init(zeros((bq, bkv)))))
      plgpu.barrier_arrive(v_free.at[v_slot])
      z, tanh = _mosaic.exp2_scores(st, scale, softcap)
      if masked:
        kv_ids = None
        if segments:
          plgpu.barrier_wait(seg.kv_ready.at[slot])
          kv_ids = hopper.load(seg.kv_ids.at[slot], plgpu.Layout.WGMMA.reduce(0))
        ok = _mosaic.visible(mask, z.shape, 1, j * bkv, row,
                             q_ids if segments else None, kv_ids)
        z = jnp.where(ok, z, -jnp.inf)
      elif segments:  # unread, but every load's barrier is waited on (its phase)
        plgpu.barrier_wait(seg.kv_ready.at[slot])
      p = jnp.exp2(z - lax.broadcast_in_dim(lse2, z.shape, [0]))
      if softcap is not None:
        p = p * (1.0 - tanh * tanh)
      ds = (p * (dp - lax.broadcast_in_dim(delta, z.shape, [0]))).astype(dtype)
      if config.pingpong:
        plgpu.barrier_arrive(turn)  # elementwise work done: the other warpgroup may issue
        plgpu.barrier_wait(turn)  # and now it is our turn on the tensor cores

      def ds_k(acc_ref):
        plgpu.wgmma(acc_ref, ds, k_smem.at[slot])

      dq = pl.run_state(ds_k)(plgpu.ACC.init(dq))
      plgpu.barrier_arrive(k_free.at[slot])  # with segment ids, the slot's key ids too
      return dq

    def skip(j, _):
      slot, v_slot = slots(j)
      ready_j = [k_ready.at[slot], v_ready.at[v_slot]]
      if segments:
        ready_j.append(seg.kv_ready.at[slot])
      _mosaic.release_key_block(ready_j, [k_free.at[slot], v_free.at[v_slot]],
                                take_turn if config.pingpong else None)

    dq = _mosaic.visit_key_blocks(step, skip, zeros((bq, q_ref.shape[-1])), bounds, cta_lo,
                                  cta_hi, dense=mask.is_dense)
    if config.pingpong:  # warpgroup 0 takes the turn warpgroup 1 took at the start
      pl.when(wg == 0)(take_turn)
    q_tile[...] = (dq * scale).astype(dtype)  # every WGMMA reading Q has completed
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[b, rows, h])
    hopper.wait_stores_read()

  @pl.when(wg == 2)
  def _memory():
    plgpu.set_max_registers(40, action="decrease")
    _mosaic.stream_key_blocks(k_ref, v_ref, seg_refs[1] if segments else None, b,
                              hopper.div(h, group), cta_lo, cta_hi, bkv, (stages, v_stages),
                              (k_smem, v_smem) + ((seg.kv_ids,) if segments else ()),
                              ready, (k_free, v_free))


def dq(opts: AttentionOptions, config: MosaicDqConfig, res: _common.Residuals, d_out, stats,
       lengths: tuple[int, int] | None = None):
  """dq [B, T, Hq, D] in q's dtype, from the residuals, the output cotangent and
  mosaic_gpu_backward.row_stats (lse₂ and Δ, [B, Hq, 2, T]). `lengths`: the T and S the
  kernel runs at, as mosaic_gpu_backward.backward takes them."""
  q, k, v = res.q, res.k, res.v
  b, _, hq, d = q.shape
  hkv = k.shape[2]
  t, s = lengths or (q.shape[1], k.shape[1])
  stats = _mosaic.stats_to(stats, t)
  bq, bkv = BLOCK_Q, config.block_kv
  if config.v_stages is not None:
    config = dataclasses.replace(config, v_stages=max(1, min(config.v_stages, s // bkv)))
  stages = max(1, min(config.stages, s // bkv,
                      _fitting_stages(config, d, jnp.dtype(q.dtype).itemsize,
                                      opts.mask.segments)))
  config = dataclasses.replace(config, stages=stages)
  v_stages = config.ring_depths()[1]
  mask = opts.mask
  tiles = hopper.swizzled_tiles(hopper.row_swizzle(d, q.dtype))
  if mask.segments:
    q_seg, kv_seg = res.q_segment_ids, res.kv_segment_ids
    ranges = _mosaic.segment_block_ranges(q_seg, kv_seg, bq, bkv)
    seg_args = (q_seg, kv_seg, ranges)
  else:
    seg_args = ()

  def body(q_ref, k_ref, v_ref, do_ref, stats_ref, *refs):
    seg_refs, (dq_ref,) = (refs[:3], refs[3:]) if mask.segments else (None, refs)

    def kernel(scratch: _Scratch):
      _dq_kernel(q_ref, k_ref, v_ref, do_ref, stats_ref, seg_refs, dq_ref,
                 **scratch._asdict(), config=config, mask=mask, scale=opts.scale,
                 softcap=opts.logit_softcap, group=hq // hkv, s=s)

    barrier = plgpu.Barrier
    pl.run_scoped(kernel, _Scratch(
        q_smem=plgpu.SMEM((2, bq, d), q.dtype, transforms=tiles),
        do_smem=plgpu.SMEM((2, bq, d), q.dtype, transforms=tiles),
        stats_smem=plgpu.SMEM((2, 2, bq), jnp.float32),
        k_smem=plgpu.SMEM((stages, bkv, d), k.dtype, transforms=tiles),
        v_smem=plgpu.SMEM((v_stages, bkv, d), v.dtype, transforms=tiles),
        q_ready=barrier(num_barriers=2), do_ready=barrier(num_barriers=2),
        stats_ready=barrier(num_barriers=2), k_ready=barrier(num_barriers=stages),
        v_ready=barrier(num_barriers=v_stages),
        k_free=barrier(num_arrivals=2, num_barriers=stages),
        v_free=barrier(num_arrivals=2, num_barriers=v_stages), turn=barrier(num_arrivals=2),
        seg=_mosaic.SegmentScratch.shapes(bq, bkv, stages) if mask.segments else None),
        collective_axes="wg")

  return pl.kernel(
      body,
      out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
      mesh=plgpu.Mesh(grid=(b, hq, t // (2 * bq)), grid_names=("b", "h", "q"),
                      num_threads=3, thread_name="wg"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      cost_estimate=_common.cost_estimate(opts, q, k, 3),
      name="flash_attention_dq_mosaic",
  )(q, k, v, d_out, stats, *seg_args)
