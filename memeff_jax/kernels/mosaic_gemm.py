"""A Hopper GEMM in Pallas Mosaic GPU whose accumulate into C costs no extra pass.

    out = C + op(A) @ op(B)     op(A): [M, K], op(B): [K, N], accumulated in float32

`linear_cross_entropy` adds each token chunk's dW into a running sum. cuBLAS (through XLA)
reads C only in the epilogue, after the tile's main loop, so that read is not hidden. Here
the C tile is requested by TMA when a tile starts and lands in shared memory while the main
loop runs; the epilogue adds it to the float32 accumulator and rounds once. Or, with
`add="tma"`, the epilogue's TMA stores reduce-add the tile into C in L2, so C is never read
into the SMs at all.

Structure: a persistent kernel, one CTA per SM walking the output tiles, two compute
warpgroups and one memory warpgroup feeding them A and B through a ring of TMA slots, in one
of three schedules (`GemmConfig.schedule`):

  cooperative  the two compute warpgroups each own half of a CTA tile (side by side along N
               or M) and run its epilogue together (`plgpu.emit_pipeline_warp_specialized`)
  pingpong     each owns every other tile of the CTA's walk, so one warpgroup's epilogue
               runs under the other's main loop (`_ring_kernel`)
  ring         as cooperative, but through `_ring_kernel`'s one ring of slots across all of
               the CTA's tiles: the next tile's operands land during an epilogue, whatever
               the depth of the ring

CTAs may run in pairs that share one operand's blocks by TMA multicast (`cluster`).
Operands may be stored transposed (`trans_a`: A is [K, M] in memory; `trans_b`: B is
[N, K]); WGMMA reads 16-bit operands of either major-ness straight from shared memory, so
no transposed copy is ever made.

C is updated in place: pass it as a `jax.Ref` (see `gemm_into`) and the kernel writes the
sum over it, so a running sum of 1 GiB costs no second buffer. GPU only: jax 0.10.2's Mosaic
GPU interpreter cannot run `plgpu.kernel` meshes, so there is no interpret mode (the
kernels' lowering is checked on the CPU).

Epilogue options for the loss: `row_stats=c` also returns each row's partial log-sum-exps
over the first c columns (fused_lse), or with `row_stats_into` stores them as bfloat16
words in rows of an array that are scratch until a later kernel writes them; `exp_out=True`
stores exp(product) and each tile's row sums of it (exp_logits), or with `store=False` the
sums alone (the loss without gradients); `row_scale` multiplies each row of the float32
product by a factor before it is rounded; `GemmConfig.tail_n` fills the last wave of tiles
with narrower ones; `enabled=flag` (gemm_into, or gemm without row_stats) runs no tile
where the traced flag is false (a conditional product, or an in-place conditional update,
that lax.cond would copy).
docs/design/hopper_gemm.md has the design's measurements.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from memeff_jax.kernels import hopper

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None


# gemm(..., exp_out=True) stores exp(min(product, EXP_CLAMP)): e^64 and a vocabulary's sum
# of them stay far inside float32 and bfloat16 (whose range reaches e^88).
EXP_CLAMP = 64.0


def _exponentials(acc, softcap: float | None):
  """exp_out's epilogue on a float32 tile: (the exponentials its partials sum, the values
  it stores). Without a cap both are exp(min(acc, EXP_CLAMP)); with a cap c they are
  y = exp(min(ẑ, EXP_CLAMP)) for ẑ = c·tanh(acc / c), and y·(1 − tanh²) to store."""
  if softcap is None:
    y = jnp.exp2(jnp.minimum(acc, EXP_CLAMP) * hopper.LOG2E)
    return y, y
  # tanh(u) = 1 − 2 / (1 + e^2u), from exp2 and a division, keeps float32's precision where
  # approx_math's tanh (tanh.approx.f32, 2^-11 relative) would move ẑ by up to c·2^-11.
  # e^2u saturates at 2^64, where tanh is 1 in float32.
  t = 1.0 - 2.0 / (1.0 + jnp.exp2(jnp.minimum(acc * (2.0 * hopper.LOG2E / softcap), 64.0)))
  y = jnp.exp2(jnp.minimum(softcap * t, EXP_CLAMP) * hopper.LOG2E)
  return y, y * ((1.0 - t) * (1.0 + t))


@dataclasses.dataclass(frozen=True)
class GemmConfig:
  """Tiles and schedule.

  Attributes:
    tile_m, tile_n: one compute warpgroup's output tile (M a multiple of 64).
    tile_k: K per pipeline step.
    max_concurrent_steps: depth of the A/B pipeline in shared memory.
    wg_split: "n" puts the two warpgroups' tiles side by side along N (CTA tile
      tile_m × 2·tile_n), "m" along M (the cooperative and ring schedules).
    minor: which tile coordinate the persistent walk advances fastest ("m" or "n").
    band: width of the walk's bands along the minor coordinate (hopper.snake).
    num_sms: CTAs to launch; None reads the device's SM count.
    schedule: "cooperative" (both compute warpgroups work on one CTA tile, then both run
      its epilogue) or "pingpong" (each owns every other tile of the CTA's walk, so one
      warpgroup's epilogue runs under the other's main loop) or "ring" (as cooperative,
      with no drain of the A/B pipeline between tiles); see _ring_kernel.
    cluster: None, or "m" / "n": CTAs run in clusters of two whose tiles sit side by side
      along M (sharing B's blocks) or N (sharing A's), and the shared block is loaded once
      by TMA multicast into both CTAs' shared memory: a quarter less operand traffic from L2
      per tile pair. num_sms must then be even.
    epilogue_rows: "pingpong" and "ring", GEMMs without C only: store each warpgroup's
      tile through a buffer of this many rows (a divisor of tile_m), in pieces; the shared
      memory saved makes room for another slot (None: the whole tile at once).
    tail_n: "pingpong" and "ring" without clusters: fill the last wave. Each CTA keeps to
      one row block (as with row_stats); the whole CTA tiles of a row block are dealt out
      in equal numbers to its CTAs, and the columns left over go in narrower tiles (each
      warpgroup's tail_n wide, a multiple of 32 dividing tile_n, of 64 unless trans_b), so
      that no CTA runs a whole tile more than another. At Llama-3's logits ([512, 4,096] @
      [4,096, 128,256], CTA tiles 128 × 256, 132 SMs) 33 CTAs share a row block's 501
      tiles: 15 each and 6 left, which without a tail are a 16th wave of 6 CTAs in 33; with
      tail_n=64 they are 12 tiles of 128 columns, half a wave, with 32 24 tiles of 64, a
      quarter. None: no tail, the walk as `minor`/`band` say.
  """

  tile_m: int = 128
  tile_n: int = 64
  tile_k: int = 64
  max_concurrent_steps: int = 4
  wg_split: str = "n"
  minor: str = "n"
  band: int = 1
  num_sms: int | None = None
  schedule: str = "cooperative"
  cluster: str | None = None
  epilogue_rows: int | None = None
  tail_n: int | None = None

  def __post_init__(self):
    if self.schedule not in ("cooperative", "pingpong", "ring"):
      raise ValueError(
          f"schedule must be 'cooperative', 'pingpong' or 'ring', got {self.schedule!r}")
    if self.cluster not in (None, "m", "n"):
      raise ValueError(f"cluster must be None, 'm' or 'n', got {self.cluster!r}")
    for name in ("wg_split", "minor"):
      if getattr(self, name) not in ("m", "n"):
        raise ValueError(f"{name} must be 'm' or 'n', got {getattr(self, name)!r}")
    least = 1 if self.schedule == "cooperative" else 2
    if self.max_concurrent_steps < least:
      # The pingpong and ring warpgroups free a step's slot only once the next step's WGMMA
      # is issued (one group in flight), so a single slot would deadlock their walk.
      raise ValueError(f"the {self.schedule!r} schedule needs max_concurrent_steps >= {least}, "
                       f"got {self.max_concurrent_steps}")
    if self.schedule == "pingpong" and self.wg_split != "n":
      raise ValueError("wg_split splits a CTA tile between the warpgroups; in 'pingpong' each "
                       "owns whole tiles, so it takes no wg_split")
    if self.schedule == "cooperative" and self.epilogue_rows:
      raise ValueError("epilogue_rows is an option of the 'pingpong' and 'ring' schedules, "
                       f"got {self}")
    if self.epilogue_rows is not None and (self.epilogue_rows % 64
                                           or self.tile_m % self.epilogue_rows):
      raise ValueError(f"epilogue_rows must be a multiple of 64 dividing tile_m={self.tile_m}, "
                       f"got {self.epilogue_rows}")
    if self.tail_n is not None and (self.schedule == "cooperative" or self.cluster
                                    or self.tail_n % 32 or self.tile_n % self.tail_n
                                    or self.tail_n == self.tile_n):
      raise ValueError("tail_n is a multiple of 32 dividing tile_n (and below it), for the "
                       f"'pingpong' and 'ring' schedules without clusters, got {self}")
    if self.cluster and self.num_sms is not None and self.num_sms % 2:
      raise ValueError(f"a cluster of two needs an even num_sms, got {self.num_sms}")

  def cta_tile(self) -> tuple[int, int]:
    if self.schedule == "pingpong":
      return self.tile_m, self.tile_n
    return (self.tile_m * (2 if self.wg_split == "m" else 1),
            self.tile_n * (2 if self.wg_split == "n" else 1))

  def cluster_tile(self) -> tuple[int, int]:
    """The output tile of one cluster (of one CTA without clusters)."""
    cm, cn = self.cta_tile()
    return cm * (2 if self.cluster == "m" else 1), cn * (2 if self.cluster == "n" else 1)

  def cluster_size(self) -> int:
    return 2 if self.cluster else 1


def _cluster_layout(config: GemmConfig):
  """(cta_origin, a_axes, b_axes): cta_origin(mi, ni) is the first row and column of this
  CTA's tile in cluster tile (mi, ni); a_axes / b_axes are the collective axes of A's and B's
  copies (a pair along M shares B's blocks, along N A's: loaded once, multicast to both)."""
  clm, cln = config.cluster_tile()
  cm, cn = config.cta_tile()
  cta = lax.axis_index("cluster") if config.cluster else 0

  def cta_origin(mi, ni):
    return (mi * clm + (cta * cm if config.cluster == "m" else 0),
            ni * cln + (cta * cn if config.cluster == "n" else 0))

  return (cta_origin, ("cluster",) if config.cluster == "n" else (),
          ("cluster",) if config.cluster == "m" else ())


def shape_error(m: int, n: int, k: int, config: GemmConfig) -> str | None:
  """Why (m, n, k) cannot run with `config`, or None when it can.

  The "pingpong" and "ring" schedules take any N: the last column of tiles reaches past the
  end, where TMA loads zeros and stores nothing (so a tile width need not divide N, e.g.
  144-wide tiles for an N whose tile count should fill the GPU's waves)."""
  cm, cn = config.cluster_tile()
  ragged_n = config.schedule != "cooperative"
  for name, size, tile in (("M", m, cm), ("N", n, cn), ("K", k, config.tile_k)):
    if size % tile and not (name == "N" and ragged_n):
      return f"{name}={size} is not a multiple of the tile {tile}"
  return None


def cta_tiles(config: GemmConfig, m: int, n: int) -> int:
  """The CTA tiles of an [m, n] output (the last column of them partial where the tile
  width does not divide n)."""
  cm, cn = config.cta_tile()
  return (m // cm) * -(-n // cn)


def narrowed_to_fill_waves(config: GemmConfig, m: int, n: int, *, trans_b: bool,
                           sms: int | None = None, min_width: int = 144) -> GemmConfig:
  """config with a narrower CTA tile where that finishes an [m, n] output sooner.

  A persistent launch runs its tiles in waves of ctas(config) at a time, and with K and the
  tile's rows fixed a tile takes time in proportion to its width: of the widths from the
  CTA tile's own down to min_width, in steps of 16 columns, the one with the fewest waves ×
  width (wave_span) runs, the widest of equals. An output of a few tiles gains most:
  [1,024, 3,584] in 128 × 256 tiles is 112 tiles for 132 SMs, one wave at 85%; 224 columns
  make 128 tiles, one wave, 12% shorter. Below 144 columns a tile reads too many operand
  bytes per product: loss's dx on 128 × 128 tiles, filling the waves to 97%, was slower than
  cuBLAS's at Llama-3-8B's and Mistral-7B's heads (the LCE design doc). The narrower tile
  keeps the schedule and wg_split where its halves stay whole swizzle groups (16 columns for
  a transposed B, read by rows; 64 otherwise), else a "ring" CTA splits along M instead
  (two 64-row halves of the tile's rows, each warpgroup the whole width). The "cooperative"
  schedule, which needs tiles dividing N, clusters and tail_n keep their tiles.
  """
  if config.schedule == "cooperative" or config.cluster or config.tail_n:
    return config
  cm, cn = config.cta_tile()
  group = 16 if trans_b else 64

  def shaped(width):  # config with CTA tiles `width` wide, or None where none can be
    if config.schedule == "pingpong":
      forms = [dict(tile_n=width)]
    else:
      forms = [dict(wg_split="n", tile_n=width // 2), dict(wg_split="m", tile_m=cm // 2,
                                                          tile_n=width)]
      if config.wg_split == "m":
        forms.reverse()
    for form in forms:
      try:
        candidate = dataclasses.replace(config, **form)
      except ValueError:  # e.g. epilogue_rows not dividing the halved rows
        continue
      if candidate.tile_n % group == 0 and candidate.tile_m % 64 == 0:
        return candidate
    return None

  best = config
  for width in range(cn - 16, min_width - 1, -16):
    candidate = shaped(width)
    if candidate is not None and wave_span(candidate, m, n, sms) < wave_span(best, m, n, sms):
      best = candidate
  return best


def wave_span(config: GemmConfig, m: int, n: int, sms: int | None = None,
              tile_cost: int = 0) -> int:
  """How long a persistent launch of `config` takes over an [m, n] output, in columns of
  main loop at fixed K: its waves of ctas(config) tiles, each the CTA tile's width plus
  `tile_cost` columns' worth of work that every tile does whatever its width (its
  epilogue, the pipeline's fill)."""
  return -(-cta_tiles(config, m, n) // ctas(config, sms)) * (config.cta_tile()[1] + tile_cost)


def _swizzled(minor_elems: int, dtype) -> tuple:
  swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
  elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _wg_operands(a_smem, b_smem, wg, split: str | None, config: GemmConfig, trans_a: bool,
                 trans_b: bool):
  """Warpgroup wg's [tm, tk] slice of A and [tk, tn] slice of B, as WGMMA reads them, from
  one slot of A and B (sliced as stored, then transposed). split: the CTA tile's halves
  ("m" or "n", config.wg_split), or None where the warpgroup uses the whole slot."""
  tm, tn = config.tile_m, config.tile_n
  if split == "m":
    a_smem = a_smem.at[:, pl.ds(wg * tm, tm)] if trans_a else a_smem.at[pl.ds(wg * tm, tm)]
  if split == "n":
    b_smem = b_smem.at[pl.ds(wg * tn, tn)] if trans_b else b_smem.at[:, pl.ds(wg * tn, tn)]
  return (a_smem.T if trans_a else a_smem), (b_smem.T if trans_b else b_smem)


def _kernel(a_gmem, b_gmem, c_gmem, out_gmem, *, config: GemmConfig, trans_a: bool,
            trans_b: bool, reduce: bool = False):
  """One CTA: walk tiles, pipeline A/B into shared memory, WGMMA, epilogue with C (or, with
  `reduce`, a store that TMA adds to what out_gmem holds)."""
  m, n = out_gmem.shape
  k = a_gmem.shape[0] if trans_a else a_gmem.shape[1]
  tm, tn, tk = config.tile_m, config.tile_n, config.tile_k
  cm, cn = config.cta_tile()
  clm, cln = config.cluster_tile()
  m_tiles, n_tiles = m // clm, n // cln
  dtype, out_dtype = a_gmem.dtype, out_gmem.dtype
  cta_origin, a_shared, b_shared = _cluster_layout(config)

  # A block [cm, tk] (or [tk, cm] stored transposed), B block [tk, cn] (or [cn, tk]).
  a_block, a_index = ((tk, cm), lambda kk: (kk, 0)) if trans_a else ((cm, tk), lambda kk: (0, kk))
  b_block, b_index = ((cn, tk), lambda kk: (0, kk)) if trans_b else ((tk, cn), lambda kk: (kk, 0))

  # Consecutive tiles of one CTA run as one "pipeline of pipelines" (no drain and refill of
  # the A/B pipeline between tiles) when its depth divides the number of K steps.
  chained = (k // tk) % config.max_concurrent_steps == 0

  def pipeline(body, context, state=None):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k // tk,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec(a_block, a_index, transforms=_swizzled(a_block[1], dtype),
                            memory_space=plgpu.SMEM, collective_axes=a_shared),
            plgpu.BlockSpec(b_block, b_index, transforms=_swizzled(b_block[1], dtype),
                            memory_space=plgpu.SMEM, collective_axes=b_shared),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=config.max_concurrent_steps,
        compute_context=context,
        pipeline_state=state,
    )

  ignore = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
      tile_smem=plgpu.SMEM((2, tm, tn), out_dtype, transforms=_swizzled(tn, out_dtype)),
      c_barrier=plgpu.Barrier(num_barriers=2),
      collective_axes="wg",
  )
  def _scope(allocs, tile_smem, c_barrier):
    wg = lax.axis_index("wg")

    @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
    def _tiles(info):
      (lin,) = info.index
      mi, ni = hopper.snake(lin, (m_tiles, n_tiles), 0 if config.minor == "m" else 1,
                            config.band)
      cta_m, cta_n = cta_origin(mi, ni)
      wm = cta_m + (wg * tm if config.wg_split == "m" else 0)
      wn = cta_n + (wg * tn if config.wg_split == "n" else 0)
      out_tile = out_gmem.at[pl.ds(wm, tm), pl.ds(wn, tn)]
      smem = tile_smem.at[wg]

      def context(run_pipeline):
        # The last tile's store must have left shared memory before it is refilled.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if c_gmem is not None:  # lands while the main loop runs
          plgpu.copy_gmem_to_smem(c_gmem.at[pl.ds(wm, tm), pl.ds(wn, tn)], smem,
                                  c_barrier.at[wg])

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
        def _acc(acc_ref):
          run_pipeline(acc_ref)
          acc = acc_ref[...]
          if c_gmem is not None:
            plgpu.barrier_wait(c_barrier.at[wg])
            acc = acc + smem[...].astype(jnp.float32)
          smem[...] = acc.astype(out_dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(smem, out_tile, reduction_op="add" if reduce else None)

      def mma(_, a_smem, b_smem, acc_ref):
        plgpu.wgmma(acc_ref, *_wg_operands(a_smem, b_smem, wg, config.wg_split, config,
                                           trans_a, trans_b))
        plgpu.wgmma_wait(0)
        return acc_ref

      state = None  # a CTA with a single tile stays at START; the kernel ends after it
      if chained:
        last = info.num_local_steps - 1
        state = jnp.where(info.local_index == 0, int(plgpu.PipelinePipeline.START),
                          jnp.where(info.local_index == last,
                                    int(plgpu.PipelinePipeline.STOP),
                                    int(plgpu.PipelinePipeline.STEADY)))
      a_rows = pl.ds(cta_m, cm)
      b_cols = pl.ds(cta_n, cn)
      pipeline(mma, context, state)(
          a_gmem.at[:, a_rows] if trans_a else a_gmem.at[a_rows, :],
          b_gmem.at[b_cols, :] if trans_b else b_gmem.at[:, b_cols],
          allocations=allocs,
      )

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _ring_kernel(a_gmem, b_gmem, c_gmem, out_gmem, *, config: GemmConfig, trans_a: bool,
                 trans_b: bool, sms: int, reduce: bool = False, stats_gmem=None,
                 stats_cols: int | None = None, stats_words: bool = False,
                 exp_out: bool = False, softcap: float | None = None, enabled=None,
                 scale_gmem=None):
  """The schedules with one ring of A/B slots across all of a CTA's tiles ("pingpong",
  "ring"): the CTA walks its tiles j = 0, 1, 2, ..., and the memory warpgroup streams their K
  steps in walk order through `max_concurrent_steps` slots, so the next tile's first steps
  land while the last tile's epilogue runs (no drain and refill between tiles, whatever the
  depth).

    pingpong  compute warpgroup j % 2 owns tile j, so one warpgroup's epilogue runs under
              the other's main loop
    ring      both compute warpgroups work on every tile, each on its half (`wg_split`),
              and run its epilogue together

  In the ring schedule both compute warpgroups wait on every slot's arrival and release
  every slot once their WGMMA has read it, and a slot is refilled once both have passed it.
  In ping-pong each warpgroup waits on and releases only its own tiles' slots: a slot has
  one `ready` barrier per warpgroup, and the memory warpgroup's copies for tile j arrive on
  warpgroup j % 2's, so each warpgroup sees every phase of its own barriers in order
  whatever number of K steps a tile takes, and its epilogue holds up none of the other's
  main loop (docs/design/hopper_gemm.md has the figures). C is requested when a
  tile's main loop starts and lands in shared memory while it runs. With `reduce` (c_gmem is
  then None) each tile is stored by a TMA reduce-add into what out_gmem holds.

  With `stats_gmem` (see gemm's row_stats) or `config.tail_n` every CTA keeps to one row
  block: CTA w takes row block w mod m_tiles and every (walkers / m_tiles)-th column tile
  from w div m_tiles (the CTAs of one column tile still run side by side, sharing B's block
  in L2), so that each compute warpgroup can carry its rows' running maximum and sum of
  exponentials from tile to tile, and store them once at the end as one log-sum-exp. With
  tail_n the walk has two phases: the whole tiles that divide evenly among a row block's
  CTAs, then the columns left over in tiles tail_n wide per warpgroup (see GemmConfig).
  With `exp_out` (and stats) the tiles stored are exp(min(product, EXP_CLAMP)), and each
  warpgroup tile stores its rows' sums of those float32 exponentials at once, in
  the row of stats_gmem that is its column strip (cols // tile_n): no running statistics,
  so the walk is the ordinary one over all CTAs (see gemm); with `softcap` too, those of
  the capped product, and the tiles hold them times the cap's derivative (_exponentials).
  With exp_out and `out_gmem` None the tiles are not stored at all, only their sums.
  `enabled` (a traced int32, or None) multiplies every CTA's tile count: 0 makes the launch
  a no-op. With `scale_gmem`
  (float32 [M], see gemm's row_scale) each row of the product is multiplied by its entry
  in the epilogue, in float32, before C is added and the tile rounded.
  """
  m, k = a_gmem.shape[::-1] if trans_a else a_gmem.shape
  n = b_gmem.shape[0] if trans_b else b_gmem.shape[1]
  tm, tn, tk = config.tile_m, config.tile_n, config.tile_k
  cm, cn = config.cta_tile()
  stages = config.max_concurrent_steps
  clm, cln = config.cluster_tile()
  m_tiles, n_tiles = m // clm, -(-n // cln)  # the last column of tiles may be partial
  k_steps = k // tk
  dtype = a_gmem.dtype
  out_dtype = dtype if out_gmem is None else out_gmem.dtype
  div, rem = hopper.div, hopper.rem
  pingpong = config.schedule == "pingpong"
  split = None if pingpong else config.wg_split  # ping-pong: each warpgroup owns whole tiles
  # Ping-pong: slot s's copies for warpgroup w's tiles arrive on ready[w · stages + s]. A
  # warpgroup's next phase of one of its barriers is always its next tile step there: the
  # copy after it into the same slot waits on that step's release (`free`, the owner's
  # arrival alone). The warpgroups take turns (`turn`): one issues a tile's WGMMAs once the
  # other has issued all of its last tile's, so that their main loops do not interleave
  # and each one's epilogue runs under the other's main loop.
  def ready_at(slot, owner):
    return slot + owner * stages if pingpong else slot
  walker, walkers = lax.axis_index("sm"), sms // config.cluster_size()  # clusters (or CTAs)
  cta_origin, a_shared, b_shared = _cluster_layout(config)
  per_tile = stats_gmem is not None and exp_out  # each tile's sums stored as they come
  stats = stats_gmem is not None and not per_tile  # statistics carried across the walk

  class Phase(NamedTuple):
    """A run of the CTA's walk: `count` tiles (traced), each warpgroup's `width` columns
    wide, tile j's first row and column at origin(j); no tile reaches column `end` or
    past it."""
    width: int
    count: jax.Array
    origin: object
    end: int

  if stats or config.tail_n is not None:  # one row block per CTA
    # walker = col0 · m_tiles + row_block
    per_row = walkers // m_tiles
    row_block, col0 = rem(walker, m_tiles), div(walker, m_tiles)
    active = walker < per_row * m_tiles

    def share(tiles):  # this CTA's part of `tiles` dealt round-robin to the row block's CTAs
      return jnp.where(active, div(jnp.maximum(tiles - col0, 0) + per_row - 1, per_row), 0)

    whole = n_tiles if config.tail_n is None else n // cn // per_row * per_row
    phases = [Phase(tn, share(whole), lambda j: cta_origin(row_block, col0 + j * per_row),
                    whole * cn)]
    if config.tail_n is not None:
      tail_cn = cn // tn * config.tail_n
      tail_tiles = -(-(n - whole * cn) // tail_cn)
      phases.append(Phase(config.tail_n, share(tail_tiles),
                          lambda j: (row_block * cm, whole * cn + (col0 + j * per_row) * tail_cn),
                          whole * cn + tail_tiles * tail_cn))
  else:
    tiles = m_tiles * n_tiles  # walker, walker + walkers, ...
    phases = [Phase(tn, div(tiles - walker + walkers - 1, walkers),
                    lambda j: cta_origin(*hopper.snake(
                        walker + j * walkers, (m_tiles, n_tiles), 0 if config.minor == "m" else 1,
                        config.band)),
                    n_tiles * cln)]

  if enabled is not None:
    phases = [p._replace(count=p.count * enabled) for p in phases]

  def walk(tile, carry):
    """Runs tile(phase, j, i, carry) over the CTA's tiles, i counting across phases."""
    start = 0
    for phase in phases:
      carry = lax.fori_loop(0, phase.count,
                            lambda j, c, p=phase, s=start: tile(p, j, s + j, c), carry)
      start = start + phase.count
    return carry

  a_block = (tk, cm) if trans_a else (cm, tk)
  b_block = (cn, tk) if trans_b else (tk, cn)
  er = config.epilogue_rows or tm

  def _counted(y, cols, phase, other):
    """y with the columns from stats_cols on set to `other` (the column indices one row,
    broadcast along y's rows: hopper.index_vector)."""
    if stats_cols < phase.end:
      col = lax.broadcast_in_dim(hopper.index_vector(y.shape, 1), y.shape, [1])
      y = jnp.where(col < stats_cols - cols, y, other)
    return y

  def _row_stats(carry, y, cols, phase):
    """The running (max, Σ exp) of this warpgroup's rows, in the exp2 domain, after a tile
    y of the rounded output (the logits the caller will read), in float32."""
    m, s = carry
    y = _counted(y, cols, phase, -jnp.inf)
    m_new = jnp.maximum(m, y.max(axis=1) * hopper.LOG2E)  # (LOG2E > 0 keeps the maximum)
    m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with no column yet
    p = jnp.exp2(y * hopper.LOG2E - lax.broadcast_in_dim(m_sub, y.shape, [0]))
    return m_new, s * jnp.exp2(m - m_sub) + p.sum(axis=1)

  def body(a_smem, b_smem, c_smem, ready, free, c_ready, *turn):
    wg = lax.axis_index("wg")
    turn = turn[0] if turn else None
    c_tail = b_tail = None
    if config.tail_n is not None:  # two views of one buffer: whole tiles' and the tail's
      c_smem, c_tail = c_smem
      if not trans_b:
        b_smem, b_tail = b_smem

    def b_part(slot, width):
      """The B block in `slot` of a tile `width` wide per warpgroup (a prefix of the slot)."""
      if width == tn:
        return b_smem.at[slot]
      if trans_b:  # [cn, tk]: its first rows
        return b_smem.at[slot].at[pl.ds(0, cn // tn * width)]
      return b_tail.at[slot].at[pl.ds(0, tk)]  # [tk, cn]: columns, through the other view

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")

      def tile(phase, j, i, carry):
        width = phase.width
        first = i * k_steps  # this tile's first step in the ring's sequence
        rows, cols = phase.origin(j)
        if not pingpong:
          rows += wg * tm if config.wg_split == "m" else 0
          cols += wg * width if config.wg_split == "n" else 0
        out_tile = (pl.ds(rows, tm), pl.ds(cols, width))
        buf = c_smem.at[wg] if width == tn else c_tail.at[wg].at[pl.ds(0, er)]
        wg_config = dataclasses.replace(config, tile_n=width, tail_n=None)

        def own():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last store has read c_smem
          if c_gmem is not None:
            plgpu.copy_gmem_to_smem(c_gmem.at[out_tile], buf, c_ready.at[wg])
          if scale_gmem is not None:  # loaded now, used after the main loop
            scale = hopper.load(scale_gmem.at[pl.ds(rows, tm)], plgpu.Layout.WGMMA.reduce(1),
                                 optimized=False)

          def main_loop(acc_ref):
            if pingpong:  # the other has issued its last tile's WGMMAs (none first)
              pl.when(i > 0)(lambda: plgpu.barrier_wait(turn.at[wg]))

            @pl.loop(0, k_steps)
            def _(kk):
              slot = rem(first + kk, stages)
              plgpu.barrier_wait(ready.at[ready_at(slot, wg)])
              plgpu.wgmma(acc_ref, *_wg_operands(a_smem.at[slot], b_part(slot, width),
                                                 wg, split, wg_config, trans_a, trans_b))
              # One WGMMA group left running: the step before has been read, so its slot
              # is released (the tensor cores never wait on this warpgroup; two slots held).
              plgpu.wgmma_wait(1)

              @pl.when(kk > 0)
              def _():
                plgpu.barrier_arrive(free.at[rem(first + kk - 1, stages)])

            if pingpong:
              plgpu.barrier_arrive(turn.at[1 - wg])
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(free.at[rem(first + k_steps - 1, stages)])
            return acc_ref[...]

          acc = pl.run_scoped(main_loop, plgpu.ACC((tm, width), jnp.float32))
          if scale_gmem is not None:
            acc = acc * lax.broadcast_in_dim(scale, acc.shape, [0])
          if c_gmem is not None:
            plgpu.barrier_wait(c_ready.at[wg])
            acc = acc + buf[...].astype(jnp.float32)
          if exp_out:  # float32 exponentials for the statistics, rounded for the stores
            y, stored = _exponentials(acc, softcap)
            out = None if out_gmem is None else stored.astype(out_dtype)
          else:
            out = acc.astype(out_dtype)  # rounded once, for the stores and the statistics
            y = out.astype(jnp.float32)
          for r0 in range(0, tm, er) if out is not None else ():  # through a buffer of er rows
            if r0:
              plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            buf[...] = out if er == tm else out[r0:r0 + er]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(buf, out_gmem.at[pl.ds(rows + r0, er), pl.ds(cols, width)],
                                    reduction_op="add" if reduce else None)
          if per_tile:  # straight from registers, as the statistics below
            def store_sums(masked):
              s = (_counted(y, cols, phase, 0.0) if masked else y).sum(axis=1)
              stats_gmem.at[div(cols, tn), pl.ds(rows, tm)][...] = s

            if stats_cols < phase.end:
              # Only the tiles reaching past stats_cols mask their columns (one compare and
              # select per entry less in every other tile).
              # A cluster's second CTA may hold a tile wholly past N, whose strip has no row.
              ragged = cols + width > stats_cols
              pl.when(ragged & (cols < n))(lambda: store_sums(True))
              pl.when(jnp.logical_not(ragged))(lambda: store_sums(False))
            else:
              pl.when(cols < n)(lambda: store_sums(False))
          return _row_stats(carry, y, cols, phase) if stats else carry

        if not pingpong:
          return own()

        if stats:  # the owner's rows' running statistics go on, the other's stay
          return lax.cond(rem(i, 2) == wg, own, lambda: carry)
        pl.when(rem(i, 2) == wg)(own)
        return carry

      if not stats:
        walk(tile, None)
        plgpu.wait_smem_to_gmem(0)
        return
      row_vector = lambda value: plgpu.layout_cast(jnp.full((tm,), value, jnp.float32),
                                                   plgpu.Layout.WGMMA.reduce(1))
      run_max, run_sum = walk(tile, (row_vector(-jnp.inf), row_vector(0.0)))
      lse = run_max * hopper.LN2 + jnp.log(run_sum)  # -inf where no column was seen
      per_cta = _stats_per_cta(config)
      part = col0 * per_cta + (wg if per_cta == 2 else 0)
      rows = row_block * cm + (wg * tm if split == "m" else 0)
      plgpu.wait_smem_to_gmem(0)

      @pl.when(active)
      def _():  # straight from registers: shared memory has no 1 KiB to spare
        if not stats_words:
          stats_gmem.at[part, pl.ds(rows, tm)][...] = lse
          return
        # Three bfloat16 words that sum to lse exactly (see StatsWords), at flat positions
        # (k · P + part) · M + rows of the window.
        parts, d = per_row * per_cta, stats_gmem.shape[1]
        hi = lse.astype(jnp.bfloat16)
        rest = jnp.where(lse == -jnp.inf, 0.0, lse - hi.astype(jnp.float32))
        mid = rest.astype(jnp.bfloat16)
        lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
        for k, word in enumerate((hi, mid, lo)):
          flat = (k * parts + part) * m + rows
          stats_gmem.at[div(flat, d), pl.ds(rem(flat, d), tm)][...] = word

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")

      def tile(phase, j, i, _):
        rows, cols = phase.origin(j)
        width = cn // tn * phase.width  # the B block's columns
        owner = rem(i, 2)
        if reduce:
          # The running sum's tile, into L2 while the tile's main loop runs, so that the
          # epilogue's TMA reduce-add finds it there (prefetching the next tile's instead
          # was slower; the LCE design doc has the figures).
          plgpu.async_prefetch(out_gmem.at[pl.ds(rows, cm), pl.ds(cols, width)])

        @pl.loop(0, k_steps)
        def _(kk):
          step = i * k_steps + kk
          slot = rem(step, stages)

          @pl.when(step >= stages)
          def _():
            plgpu.barrier_wait(free.at[slot])

          ks = pl.ds(kk * tk, tk)
          a_src = a_gmem.at[ks, pl.ds(rows, cm)] if trans_a else a_gmem.at[pl.ds(rows, cm), ks]
          b_src = (b_gmem.at[pl.ds(cols, width), ks] if trans_b
                   else b_gmem.at[ks, pl.ds(cols, width)])
          plgpu.copy_gmem_to_smem(a_src, a_smem.at[slot], ready.at[ready_at(slot, owner)],
                                  collective_axes=a_shared)
          plgpu.copy_gmem_to_smem(b_src, b_part(slot, phase.width),
                                  ready.at[ready_at(slot, owner)],
                                  collective_axes=b_shared)

      # One warp streams the slots; the warpgroup's other three wait at the end instead of
      # taking every barrier and copy with it (a quarter of the warp instructions issued
      # for the memory warpgroup).
      @hopper.on_each_warp
      def _():
        @pl.when(lax.axis_index("warp") == 0)
        def _():
          walk(tile, None)
          # The other CTA of a cluster arrives on this one's slots until its last release:
          # stay until every slot's last phase has completed.
          if config.cluster:
            total = sum(p.count for p in phases) * k_steps

            @pl.loop(jnp.maximum(total - stages, 0), total)
            def _(step):
              plgpu.barrier_wait(free.at[rem(step, stages)])

  # Each warpgroup's epilogue buffer. With a tail, a second view of the same bytes, each
  # warpgroup's part [er · tn / tail_n, tail_n] (a tail tile's rows are its first er): a
  # TMA store needs its tile contiguous in shared memory, which a column slice of the first
  # view is not. Each warpgroup keeps to its own bytes in both views.
  # B's slots stored [tk, cn] likewise (a tail block [tk, tail_cn] is then a slot's prefix).
  arrivals = 1 if pingpong else 2  # per CTA, on each slot's `free`
  c_buffer = plgpu.SMEM((2, er, tn), out_dtype, transforms=_swizzled(tn, out_dtype))
  b_slots = plgpu.SMEM((stages, *b_block), dtype, transforms=_swizzled(b_block[1], dtype))
  if config.tail_n is not None:
    c_buffer = plgpu.RefUnion(c_buffer, plgpu.SMEM(
        (2, er * tn // config.tail_n, config.tail_n), out_dtype,
        transforms=_swizzled(config.tail_n, out_dtype)))
    if not trans_b:
      tail_cn = cn // tn * config.tail_n
      b_slots = plgpu.RefUnion(b_slots, plgpu.SMEM(
          (stages, tk * cn // tail_cn, tail_cn), dtype, transforms=_swizzled(tail_cn, dtype)))
  pl.run_scoped(
      body,
      plgpu.SMEM((stages, *a_block), dtype, transforms=_swizzled(a_block[1], dtype)),
      b_slots,
      c_buffer,
      # ready: A and B landed (per warpgroup in ping-pong)
      plgpu.Barrier(num_arrivals=2, num_barriers=stages * (2 if pingpong else 1)),
      # free: both warpgroups (of both CTAs of a cluster) passed
      (plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=arrivals,
                            num_barriers=stages)
       if config.cluster else plgpu.Barrier(num_arrivals=arrivals, num_barriers=stages)),
      plgpu.Barrier(num_barriers=2),  # C landed, per warpgroup
      *([plgpu.Barrier(num_barriers=2)] if pingpong else []),  # turn: this one's to wait
      collective_axes="wg",
  )


TMA_ROWS = hopper.TMA_ROWS  # an array read or written through Rows windows has whole tiles


class Rows(NamedTuple):
  """The `block`-th block of `size` rows of a 2-D array (or `jax.Ref`), used where it lies.

  As a GEMM operand or output it stands for `array[block * size:(block + 1) * size]`
  without the copy XLA makes of a slice it hands to a kernel: the kernel adds the block's
  first row to its TMA coordinates. A loop over token chunks then holds no chunk-sized copy
  of its input (nor of the chunk's output, which `gemm_into` writes straight into the whole
  array). `block` may be traced; `size` is static, at most the array's first axis (the
  axis as stored: with trans_a, A's first axis is K). Windows start at multiples of `size`
  because Mosaic GPU's layout inference must know that a TMA copy's offset is a multiple of
  the shared-memory tiling; a traced block index read in the kernel times the static size
  says so. The caller keeps the window inside the array (the last rows of an array that
  `size` does not divide are in no window), whose rows are a multiple of TMA_ROWS.
  """

  array: jax.Array
  block: jax.Array | int
  size: int

  @property
  def shape(self) -> tuple[int, int]:
    return (self.size, self.array.shape[1])

  @property
  def dtype(self):
    return self.array.dtype


def ctas(config: GemmConfig, sms: int | None = None) -> int:
  """The CTAs a persistent launch of `config` runs (one per SM): config.num_sms, else
  `sms`, else the default device's SM count (hopper.sm_count), rounded down to whole
  clusters."""
  if config.num_sms is not None:
    sms = config.num_sms
  elif sms is None:
    sms = hopper.sm_count()
  return sms - sms % config.cluster_size()


def _stats_per_cta(config: GemmConfig) -> int:
  """Partial log-sum-exps one CTA stores per row of its row block: one per compute
  warpgroup (each saw its own columns, or its own tiles in ping-pong), or one where the
  ring schedule splits the CTA tile along M (each warpgroup has rows of its own)."""
  return 1 if config.schedule == "ring" and config.wg_split == "m" else 2


def row_stats_rows(m: int, config: GemmConfig) -> int:
  """How many partial log-sum-exps per output row `gemm(..., row_stats=...)` returns: one
  per (CTA, warpgroup) that visits the row."""
  per_row = ctas(config) // (m // config.cta_tile()[0])
  return per_row * _stats_per_cta(config)


def _launch(operands, out_type, config: GemmConfig, *, trans_a: bool, trans_b: bool,
            into: bool, accumulate: bool = True, add: str = "epilogue",
            name: str = "mosaic_gemm", stats_cols: int | None = None,
            stats_into: bool = False, exp_out: bool = False, softcap: float | None = None,
            store: bool = True, enabled=None, row_scale=None):
  """A persistent launch: one CTA per SM, two compute and one memory warpgroup. With `into`
  the last operand is C, which the kernel updates in place (out_type is then ()): C plus
  the product with `accumulate` (added as `add` says, see gemm_into), the product alone
  without. With `stats_cols` out_type is (product, partial log-sum-exps) (see gemm), or,
  with `stats_into`, the product alone, the partials going into the last operand's window
  as words (gemm's row_stats_into); with exp_out and not `store`, the partials alone.
  Operands may be `Rows`. `enabled` (a traced scalar, ring schedules) makes the launch do
  nothing where it is 0; `row_scale` (float32 [M], ring schedules) scales the product's
  rows (see gemm). The kernel is named after `name` in profiles (Mosaic GPU names it after
  the body function)."""
  sms = ctas(config)
  if (((stats_cols is not None and not exp_out) or config.tail_n is not None)
      and operands[0].shape[1 if trans_a else 0] // config.cta_tile()[0] > sms):
    raise ValueError(f"row_stats and tail_n keep each CTA to one row block: M has more row "
                     f"blocks than the {sms} CTAs ({config})")
  windows = [op if isinstance(op, Rows) else None for op in operands]
  blocks = [jnp.asarray(w.block, jnp.int32) for w in windows if w is not None]
  if enabled is not None:
    if config.schedule not in ("pingpong", "ring"):
      raise ValueError(f"enabled needs the 'pingpong' or 'ring' schedule, got {config}")
    blocks.append(jnp.asarray(enabled, jnp.int32))
  scales = () if row_scale is None else (row_scale,)

  # body's refs: the operands', row_scale's, the windows' block indices and enabled (0-d),
  # the outputs'
  def body(*refs):
    first_block = len(operands) + len(scales)
    block_refs = iter(refs[first_block:first_block + len(blocks)])
    op_refs = [ref if w is None else ref.at[pl.ds(next(block_refs)[...] * w.size, w.size)]
               for ref, w in zip(refs, windows)]
    a_ref, b_ref = op_refs[:2]
    stats_out = stats_cols is not None and not stats_into  # partials as an output
    stats_ref = op_refs[2] if stats_into else refs[-1] if stats_out else None
    out_ref = op_refs[2] if into else refs[-2 if stats_out else -1] if store else None
    reduce = into and accumulate and add == "tma"
    c_ref = out_ref if into and accumulate and not reduce else None
    if config.schedule in ("pingpong", "ring"):
      _ring_kernel(a_ref, b_ref, c_ref, out_ref, config=config, trans_a=trans_a,
                   trans_b=trans_b, sms=sms, reduce=reduce, stats_gmem=stats_ref,
                   stats_cols=stats_cols, stats_words=stats_into, exp_out=exp_out,
                   softcap=softcap,
                   enabled=None if enabled is None else next(block_refs)[...],
                   scale_gmem=refs[len(operands)] if scales else None)
    else:
      _kernel(a_ref, b_ref, c_ref, out_ref, config=config, trans_a=trans_a, trans_b=trans_b,
              reduce=reduce)

  body.__name__ = body.__qualname__ = name
  cluster = dict(cluster=(2,), cluster_names=("cluster",)) if config.cluster else {}
  return plgpu.kernel(
      body,
      out_type=out_type,
      grid=(sms // config.cluster_size(),), grid_names=("sm",), **cluster,
      num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(  # approx_math: row_stats' exp2 and log (MUFU)
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=True),
  )(*[op.array if isinstance(op, Rows) else op for op in operands], *scales, *blocks)


def _check(a, b, c, trans_a, trans_b, config, accumulate=True, add="epilogue", out_dtype=None):
  """(m, n, k) of op(a) @ op(b), after checking the operands, C (or the output's dtype,
  `out_dtype`, where there is no C) and that the config's buffers fit shared memory."""
  for name, op in (("a", a), ("b", b), ("c", c)):
    if isinstance(op, Rows) and (op.array.ndim != 2 or op.array.shape[0] < op.size
                                 or op.array.shape[0] % TMA_ROWS):
      raise ValueError(f"{name}: Rows of size {op.size} must be rows of a 2-D array at least "
                       f"that long, of a multiple of {TMA_ROWS} rows (TMA's tiles), got one "
                       f"of shape {tuple(op.array.shape)}")
    if op is not None and len(op.shape) != 2:
      raise ValueError(f"{name} must be 2-D, got {name} {tuple(op.shape)}")
  if a.dtype != b.dtype or jnp.dtype(a.dtype).itemsize != 2:
    raise TypeError(f"a and b must share a 16-bit dtype, got {a.dtype} and {b.dtype}")
  m, k = a.shape[::-1] if trans_a else a.shape
  k2, n = b.shape[::-1] if trans_b else b.shape
  if k != k2:
    raise ValueError(f"contracting sizes differ: op(a) is [{m}, {k}], op(b) is [{k2}, {n}] "
                     f"(trans_a={trans_a}, trans_b={trans_b})")
  if c is not None and tuple(c.shape) != (m, n):
    raise ValueError(f"c must be [{m}, {n}], got {tuple(c.shape)}")
  if add not in ("epilogue", "tma"):
    raise ValueError(f"add must be 'epilogue' or 'tma', got {add!r}")
  if (c is not None and accumulate and add == "epilogue"
      and config.epilogue_rows not in (None, config.tile_m)):
    raise ValueError(f"epilogue_rows={config.epilogue_rows} serves GEMMs that read no C "
                     "(gemm, or gemm_into with accumulate=False or add='tma')")
  if config.tail_n is not None and config.tail_n % 64 and not trans_b:
    raise ValueError(f"tail_n={config.tail_n} (not a multiple of 64) needs B stored [N, K] "
                     "(trans_b=True): a [K, N] block is cut into columns 64 at a time")
  if (why := shape_error(m, n, k, config)) is not None:
    raise ValueError(f"mosaic gemm: {why} ({config})")
  if c is not None and jnp.dtype(c.dtype).itemsize != 2:
    raise TypeError(f"c must be 16-bit, got {c.dtype}")
  _check_smem(config, a.dtype, c.dtype if c is not None else out_dtype)
  return m, n, k


# Shared memory a CTA may hold on Hopper (227 KiB), and what the ring schedules' barriers
# and Mosaic GPU's own scratch are given beside the buffers.
SMEM_BYTES = 227 * 1024
_SMEM_SPARE = 1024


def smem_bytes(config: GemmConfig, dtype, out_dtype) -> int | None:
  """The shared memory of the "pingpong" and "ring" schedules' buffers (None for the
  cooperative one, whose pipeline helper allocates its own): the A/B slots and the two
  warpgroups' epilogue buffers."""
  if config.schedule == "cooperative":
    return None
  cm, cn = config.cta_tile()
  slots = config.max_concurrent_steps * (cm + cn) * config.tile_k * jnp.dtype(dtype).itemsize
  epilogue = 2 * (config.epilogue_rows or config.tile_m) * config.tile_n
  return slots + epilogue * jnp.dtype(out_dtype).itemsize


def _check_smem(config: GemmConfig, dtype, out_dtype):
  used = smem_bytes(config, dtype, out_dtype)
  if used is not None and used + _SMEM_SPARE > SMEM_BYTES:
    raise ValueError(
        f"the tiles take {used:,} bytes of shared memory ({config.max_concurrent_steps} A/B "
        f"slots and a {config.epilogue_rows or config.tile_m}-row epilogue buffer per "
        f"warpgroup, {jnp.dtype(out_dtype).name} out), over the {SMEM_BYTES - _SMEM_SPARE:,} "
        f"a CTA can give them: use fewer slots or epilogue_rows ({config})")


def _check_scale(row_scale, m: int, config: GemmConfig):
  """row_scale as the kernel takes it: float32 [M]."""
  if row_scale is None:
    return None
  if config.schedule not in ("pingpong", "ring"):
    raise ValueError(f"row_scale needs the 'pingpong' or 'ring' schedule, got {config}")
  if tuple(row_scale.shape) != (m,):
    raise ValueError(f"row_scale must be [{m}] (one factor per output row), got "
                     f"{tuple(row_scale.shape)}")
  if not jnp.issubdtype(row_scale.dtype, jnp.floating):
    raise TypeError(f"row_scale must be floating point, got {row_scale.dtype}")
  return jnp.asarray(row_scale, jnp.float32)


def gemm(a, b, *, trans_a: bool = False, trans_b: bool = False, out_dtype=None,
         config: GemmConfig = GemmConfig(), name: str = "mosaic_gemm",
         row_stats: int | None = None, row_stats_into: Rows | None = None,
         exp_out: bool = False, softcap: float | None = None, store: bool = True,
         row_scale=None, enabled=None):
  """op(a) @ op(b) accumulated in float32, returned in `out_dtype` (default a's dtype).
  a and b are arrays or `Rows` of arrays; `name` names the kernel in profiles.

  With `row_stats=c` it returns (out, partials) instead: partials [P, M] float32 holds, for
  P = row_stats_rows(M, config) visitors of each row, the log-sum-exp of that row's entries
  among the first c columns, as rounded into `out`, over the tiles one warpgroup visited
  (-inf where it saw none), so logsumexp(partials, axis=0) is each row's log-sum-exp over
  those c columns. The epilogue computes them while the tile is in registers: a softmax
  over the rows of `out` then reads `out` once instead of twice ("ring" or "pingpong"
  schedule, no CTA clusters; in ping-pong each warpgroup's epilogue, statistics included,
  runs under the other's main loop).

  With `row_stats_into`, a `Rows` window [M, D] of a bfloat16 `jax.Ref` (D a multiple or a
  divisor of M), the partials are stored in the window as words, so that they take no
  memory of their own where the window is scratch (in linear_cross_entropy, dx's rows of
  the chunk, which its dx GEMM writes afterwards); gemm then returns (out, StatsWords), the
  words as a view of the window's array.

  With `exp_out` (row_stats only, no tail_n, no row_stats_into) `out` holds
  exp(min(product, EXP_CLAMP)) instead of the product, and partials [cdiv(N, tile_n), M]
  hold each row's sum of those float32 exponentials over each strip of tile_n columns
  (not their logs: a plain sum over the strips then gives the row's sum, which EXP_CLAMP
  keeps far inside float32), stored by each tile as it is done, so that the tiles are
  walked as without row_stats, by every CTA (linear_cross_entropy's exp_logits, which
  checks that no row it uses came near the clamp). With `softcap=c` as well the
  exponentials are those of the capped product ẑ = c·tanh(product / c), the partials sum
  them, and `out` holds each one times ẑ's derivative, 1 − tanh²(product / c): the
  gradient of a softcapped softmax up to a factor per row (linear_cross_entropy's
  logit_softcap). With `store=False` as well nothing but the partials is written, and gemm
  returns them alone: the row sums without an [M, N] output (linear_cross_entropy's loss
  without gradients).

  With `row_scale` (float [M], without row_stats) it returns diag(row_scale) op(a) @ op(b):
  each row of the float32 product times its factor, then rounded once ("ring" and
  "pingpong" schedules).

  `enabled` (a traced bool or int scalar, without row_stats, "ring" and "pingpong"
  schedules) runs no tile where it is false: `out` is then left as allocated, undefined (a
  product needed only in some calls, without lax.cond)."""
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  m, n, _ = _check(a, b, None, trans_a, trans_b, config, out_dtype=out_dtype)
  out_type = jax.ShapeDtypeStruct((m, n), out_dtype)
  row_scale = _check_scale(row_scale, m, config)
  if softcap is not None and not (exp_out and softcap > 0):
    raise ValueError(f"softcap is a positive cap of exp_out's product, got softcap={softcap} "
                     f"with exp_out={exp_out}")
  if not store and not exp_out:
    raise ValueError("store=False is an option of exp_out (whose row sums are then the "
                     "output); a plain product is always stored")
  if row_stats is None:
    if exp_out:
      raise ValueError("exp_out is an option of row_stats")
    return _launch((a, b), out_type, config, trans_a=trans_a, trans_b=trans_b, into=False,
                   name=name, row_scale=row_scale, enabled=enabled)
  if enabled is not None:
    raise ValueError("enabled is an option of a plain product (no row_stats): statistics "
                     "are always computed")
  if row_scale is not None:
    raise ValueError("row_scale and row_stats do not combine: the statistics would be of "
                     "the unscaled product")
  if config.schedule == "cooperative" or (config.cluster and not exp_out):
    raise ValueError("row_stats needs the 'ring' or 'pingpong' schedule, without clusters "
                     f"unless exp_out, got {config}")
  if not 0 < row_stats <= n:
    raise ValueError(f"row_stats must count columns in [1, {n}], got {row_stats}")
  if exp_out and (row_stats_into is not None or config.tail_n is not None):
    raise ValueError("exp_out stores its partials per tile, as an array: it takes neither "
                     f"row_stats_into nor tail_n (got {config})")
  if row_stats_into is not None:
    if (why := stats_window_error(row_stats_into, m, config)) is not None:
      raise ValueError(why)
    out = _launch((a, b, row_stats_into), out_type, config, trans_a=trans_a,
                  trans_b=trans_b, into=False, name=name, stats_cols=row_stats,
                  stats_into=True)
    return out, _stats_words(row_stats_into, m, config)
  parts = -(-n // config.tile_n) if exp_out else row_stats_rows(m, config)
  stats_type = jax.ShapeDtypeStruct((parts, m), jnp.float32)
  launch = functools.partial(_launch, (a, b), config=config, trans_a=trans_a, trans_b=trans_b,
                             into=False, name=name, stats_cols=row_stats, exp_out=exp_out,
                             softcap=softcap)
  if not store:
    return launch(stats_type, store=False)
  return tuple(launch((out_type, stats_type)))


class StatsWords(NamedTuple):
  """Partial log-sum-exps that gemm(row_stats_into=...) stored as bfloat16 words (and
  returns as this view of them).

  Partial p of row r is words[start + p, r] + words[start + count + p, r] +
  words[start + 2·count + p, r], summed in float32: exactly the float32 value (hi, then what
  hi leaves, then what both leave: 3 × 8 significant bits; 0 words below a -inf).
  """

  words: jax.Array  # [R, M] bfloat16: the window's whole array reshaped (no copy)
  start: jax.Array  # int32 scalar: the window's first row of words
  count: int  # P = row_stats_rows(M, config)


def stats_window_error(window, m: int, config: GemmConfig) -> str | None:
  """Why `window` cannot take gemm's row_stats_into for M=m, or None when it can."""
  if not isinstance(window, Rows) or window.array.dtype != jnp.bfloat16:
    return (f"row_stats_into must be Rows of a bfloat16 array or jax.Ref, got "
            f"{type(window).__name__} of {getattr(window, 'dtype', None)}")
  size, d = window.shape
  words = 3 * row_stats_rows(m, config) * m
  if ((d % m and m % d) or d % config.tile_m or words > size * d
      or window.array.shape[0] * d % m):
    return (f"row_stats_into: a window [{size}, {d}] of an array of {window.array.shape[0]} "
            f"rows cannot hold the partials' {words} words in rows of {m} (its width must be "
            f"a multiple or a divisor of M={m} and a multiple of tile_m={config.tile_m}, and "
            f"the array a whole number of rows of {m} words)")
  return None


def _stats_words(window: Rows, m: int, config: GemmConfig) -> StatsWords:
  """The words that the kernel stored in `window`, read after it from the window's array
  as a [R, M] view of it (a reshape, no copy)."""
  array = window.array[...]
  size, d = window.shape
  return StatsWords(array.reshape(-1, m), jnp.asarray(window.block, jnp.int32) * (size * d // m),
                    row_stats_rows(m, config))


def gemm_into(c_ref, a, b, *, trans_a: bool = False, trans_b: bool = False,
              accumulate: bool = True, add: str = "epilogue",
              config: GemmConfig = GemmConfig(), name: str = "mosaic_gemm",
              enabled=None, row_scale=None) -> None:
  """c_ref[...] += op(a) @ op(b), in place. `add` says how C is added:

    "epilogue"  C's tile is read into shared memory while the tile's main loop runs, summed
                with the float32 product and rounded once to C's dtype
    "tma"       the product is rounded to C's dtype and stored by a TMA reduce-add
                (cp.reduce.async.bulk.tensor), which adds it to C in L2: C never enters the
                SM, at the cost of a second rounding

  With accumulate=False, c_ref[...] = op(a) @ op(b) (C is not read). `c_ref` is a
  `jax.Ref` (jax.new_ref) or `Rows` of one; a and b arrays or `Rows`; `name` names the
  kernel in profiles. `enabled`, a traced bool or int scalar ("pingpong" and "ring"
  schedules), leaves C as it is where false: the kernel runs no tile (a conditional update
  without lax.cond, which would copy C). `row_scale` (float [M], "pingpong" and "ring")
  multiplies the product's rows before C is added: c_ref[...] (+)= diag(row_scale) op(a)
  @ op(b), in float32 before the product is rounded."""
  m, _, _ = _check(a, b, c_ref, trans_a, trans_b, config, accumulate, add)
  _launch((a, b, c_ref), (), config, trans_a=trans_a, trans_b=trans_b, into=True,
          accumulate=accumulate, add=add, name=name, enabled=enabled,
          row_scale=_check_scale(row_scale, m, config))
