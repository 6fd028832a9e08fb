"""Hopper attention backward in Pallas Mosaic GPU: one pass over the scores for dq, dk and dv.

FlashAttention-2/3's backward: a CTA owns 128 keys of one key head, keeps K, V and
the float32 dK, dV accumulators on chip, and streams every query block of the heads that
share that key head. Per query block it runs the five matmuls the gradient needs, with no
recomputed product (two separate dq and dk/dv kernels need seven):

  Sᵀ  = K Qᵀ          Pᵀ = 2^(Sᵀ·c − lse₂)        (the forward's log-sum-exp, log2 domain)
  dPᵀ = V dOᵀ         dSᵀ = Pᵀ ∘ (dPᵀ − Δ)         (Δ = rowsum(dO ∘ O) − d_lse)
  dV += Pᵀ dO         dK += dSᵀ Q                  (Pᵀ, dSᵀ from registers)
  dQ  = dS K          added into a float32 dq in global memory by a TMA reduction (in
                      arrival order, or in a fixed one with dq_ordered; with dq_rounded
                      scaled and added into dq in the input dtype)

Warpgroups:

  memory warpgroup    TMA-loads K and V once, then streams Q, dO and the two row
                      statistics (lse₂, Δ) through a ring of `stages` slots; a slot is
                      refilled once both compute warpgroups have released it
  compute warpgroups  one per 64 keys, 64 query rows per step (128 at D = 48 to 80). dSᵀ
                      goes to shared memory for dQ = dS K. With `dq_split` (D = 64 and
                      128) the two warpgroups share their dSᵀ and each computes half of
                      dQ's columns over all 128 keys, which halves the float32 traffic of
                      the reduction (dSᵀ is exchanged first and dQ issued with dV and dK,
                      its store and reduction running under them); without it each adds
                      the dQ of its own keys. With `pingpong` they take turns issuing
                      WGMMAs, as in the forward.

The softmax scale is applied once at the end (to dK, and to dq when it is cast back to the
input dtype). Masks as in the forward, transposed: a CTA visits only the query blocks that
see any of its keys (by the band, then by segment-id ranges), and masks those that do not
see all of them (with segment ids, all but those holding the keys' one id). Served:
bf16/f16, the head dims of _padding.HEAD_DIMS (48, 80 and 112 without dq_split, whose halves
would not fill a 32-byte swizzle group; those over 128 with column_split: each warpgroup
owns half of the columns of dK, dV and dQ; without dq, D = 160 and 192 also at full
width, 192 with 32 query rows a step), T a multiple of 64, S of 128 (of 64 with
column_split), any mask, logit softcap. configs/tuning/flash_attention.toml picks the
settings per head dim, causal and GQA; docs/design/flash_attention.md has what each
variant measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from memeff_jax import _tuning
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

BLOCK_Q = 64  # query rows per pipeline step (MosaicBackwardConfig.block_q may widen it)
BLOCK_KV = 64  # keys per compute warpgroup; a CTA holds two such blocks
_SMEM_RESERVE = 1_024  # barriers and alignment
_SEG_RESERVE = 256  # the segment ids' barriers and alignment
# dq_rounded_per_block: the steps' adders counts are a ring of this many times the Q/dO
# stages, so that a count outlives its step's slot by a step (dq_stagger's warpgroup 0
# stores each step's dQ in the next); each count comes in a copy of _ADDERS_COPY int32 (a
# copy moves a multiple of 128 bytes; see _adders_table).
_ADDERS_RING = 2
_ADDERS_COPY = 32
# Queries from which a deterministic causal call takes its section's `_long` variant (as a
# causal window does at any span; long_walk_queries): a key block's walk (up to T / BLOCK_Q
# steps) is long enough that staggered warpgroups on two dQ slots pay (see the tuning table's
# `_long` sections); shorter walks run one slot, unstaggered.
LONG_WALK_QUERIES = 4096
# Queries from which such a call takes its section's `_longest` variant where the table has one
# (an H100's: a third Q/dO stage on one dQ slot, whose walks wait on HBM for Q and dO more than
# an H200's do; see the tuning table).
LONGEST_WALK_QUERIES = 16384
# Queries from which a causal call with segment ids takes D = 128's causal sections (one CTA
# per query head under GQA) rather than those without a mask (see for_deterministic).
CAUSAL_DOCUMENTS_QUERIES = 8192
# Key blocks (adders into a query block's dq) up to which deterministic calls add dq in the
# input dtype (dq_rounded): there bf16's error stays within 1.4× the float32 sum's, the
# bound the loss's bf16 dW also keeps.
ROUNDED_DQ_MAX_ADDERS = 16
# The head dims up to which a call with deterministic=False and no ordered kernel (D = 48,
# 80, 112) runs the whole kernel in arrival order rather than the dK/dV-only kernel beside
# the dq kernel: at D = 112 the pair measured faster.
WHOLE_ARRIVAL_MAX_D = 80
# The head dims above 128 whose dK/dV-only kernel (with_dq=False) keeps a warpgroup's dK and
# dV of 64 keys whole in its registers, and the most query rows a step takes there (beside
# dK and dV, the step's float32 Sᵀ and dPᵀ of 64 keys × block_q queries). Other head dims
# above 128, and every one with dq, split dK and dV by columns (column_split).
FULL_WIDTH_BLOCK_Q = {160: 64, 192: 32}
# Waves of CTAs (one per SM) below which a GQA call splits each key head's group of query
# heads between more CTAs (MosaicBackwardConfig.group_splits, split_group), and the waves
# it splits them into where the key blocks' walks differ in length (the design doc's
# group_splits row: MQA's one CTA per key block left most SMs idle).
SPLIT_WAVES = 2
UNEVEN_SPLIT_WAVES = 8
# Query heads per key head up to which gqa_per_query_head's ordered kernel adds each head's
# share of dK and dV into the outputs in the input dtype; larger groups store them as
# partials (group_splits), as cuDNN does: the error of dK added in order grows with the
# group, that of the partials' float32 sum does not (figures in the design doc).
ORDERED_SHARES_MAX_GROUP = 4
# dq_paired's model of a CTA's time, in steps: what its second key block costs beyond its
# steps (K and V loaded once the first key block's dK and dV are stored).
PAIRED_SWITCH_STEPS = 1


@dataclasses.dataclass(frozen=True)
class MosaicBackwardConfig:
  """Settings of the backward kernel.

  Each compute warpgroup owns 64 keys (WGMMA's M), and the dK and dV accumulators (64 × D
  float32 each) leave few registers for the score tiles, which are 64 keys × block_q queries.

  Attributes:
    block_q: query rows per pipeline step: 64; 128 at D ≤ 64, or at D ≤ 80 without dq (dQ =
      dS K as two WGMMAs of 64 rows, WGMMA's M; the 64 × 128 Sᵀ and dPᵀ tiles then take
      the registers that D = 128's dK and dV take); or 80 or 96 without dq; or 32 without
      dq, where full-width dK and dV leave room for no more (D = 192). Wider steps
      give the Sᵀ and dPᵀ WGMMAs a larger N and the dV and dK WGMMAs a longer K for the same
      per-step waits and turns (FlashAttention-3's backward takes 80 at D = 128); T need
      not be a multiple of it: the last step's rows past T load as zeros, which add nothing
      to dK or dV, and their dQ rows are not stored.
    stages: Q/dO slots in shared memory (3 fit at D = 128 only with dq_split or without dq,
      4 without dq; with dq_split one dQ slot and no segment ids). More than 2 is a most:
      fit_shared_memory takes the third away where it does not fit.
    dq_split: the two compute warpgroups each compute half of dQ's columns (D = 64 or 128).
      A step exchanges dSᵀ first, then issues dQ = dS K with dV and dK and stores dQ while
      those two run (issued after dV and dK, with its own wait, the tensor cores idled
      meanwhile: see the design doc). The hand-offs through shared memory that an mbarrier
      announces (dSᵀ to the other warpgroup, a dQ tile to the memory warpgroup) fence each
      thread's writes and let its own arrival publish them (hopper.fence_smem), without
      plgpu.commit_smem's warpgroup barrier.
    pingpong: the compute warpgroups take turns issuing their WGMMAs, so that one's softmax
      and stores run under the other's matmuls (not with dq_split: its exchange of dSᵀ
      would wait on a turn the other warpgroup cannot give).
    gqa_per_query_head: under GQA, one CTA per query head rather than per key head, so the
      grid has Hq/Hkv times more, shorter CTAs. In arrival order dK and dV are added into
      float32 [B, S, Hkv, D] buffers by TMA reductions (as dq is; not with dq_split, whose
      dQ tiles are too small to carry a dK tile). With dq_ordered each CTA adds its query
      head's share of dK and dV into the outputs by TMA reductions in the input dtype, in
      the order of the group's query heads (the first stores; a counter per key block and
      warpgroup says when the last one's adds have landed): the kernel of one query head
      per key head, deterministic, with no buffer beside the outputs. Each add rounds, so
      split_group turns groups past ORDERED_SHARES_MAX_GROUP into partials (group_splits).
    column_split: a CTA of 64 keys whose two compute warpgroups each own half of the
      columns of dK, dV and dQ; both compute the whole Sᵀ and dPᵀ (7 matmul units of
      64·64·D/2 per warpgroup against 5 of 64·64·D). It keeps dK and dV in registers at
      D = 256, where 64 keys of full width do not fit. A step issues dQ, dV and dK
      together, dQ first, and stores dQ while the other two run (as dq_split does).
    scores_split: (column_split) the warpgroups split Sᵀ and dPᵀ by the step's query halves
      instead of both computing them whole (5 matmul units per warpgroup against 7), and
      exchange their halves of Pᵀ and dSᵀ through shared memory (two slots each), where
      dV, dK and dQ read them. A half is 32 queries, stored as columns of the exchange
      slots: the operand tiles take 64-byte swizzles.
    with_dq: False computes dK and dV only (four matmuls per step, no float32 dq, no
      reductions): each key block has one CTA, so the result is deterministic, and dq comes
      from elsewhere (pallas_mosaic_gpu's deterministic backward: mosaic_gpu_dq's kernel, or
      pallas_triton's).
    dq_ordered: (dq_split or column_split) the key CTAs add into each query block's dq in
      one fixed order, descending key block, so that dq is bitwise reproducible. The
      compute warpgroups only leave their dQ tiles in shared memory; the memory warpgroup,
      between its loads, waits for a counter in global memory (one per query block and
      head) to reach the CTA's rank, sends both tiles to their reduction, and adds one to
      the counter once they have landed. The first adder stores, so the float32 dq needs no
      zeroing. The CTAs of a key head launch in that same order (last key block first), so
      a CTA only waits on one launched before it, never on one without an SM (CUDA starts
      a grid's CTAs in order). The memory warpgroup's warp 1 sends dQ in its own loop, so
      that a wait for a counter never holds up warp 0's loads.
    dq_buffers: (dq_ordered) dQ tile slots, 1 or 2: with 2 the compute warpgroups may leave
      a step's tiles while the last step's still wait for their turn. A most, like the
      forward's stages: at D = 128 a call with segment ids gets one (fit_shared_memory).
    dq_rotate: (dq_ordered) without a mask, key block j starts its walk over the query
      blocks at block j · (n_q // n_kv) (then wraps around), and a query block's adders take
      their turns in the order they visit it (then launch order). In lockstep, no two key
      blocks reach a query block at the same step, so no one waits for the chain of those
      before it (which in the plain walk grows by a reduction's latency per rank). A CTA
      may then wait on one launched after it, which must find an SM: rotated walks apply
      only where a key head has at most ROTATE_MAX_KV CTAs (T ≤ 8,192 at D = 128), and
      only without a mask (masked walks keep their order).
    dq_stagger: (dq_split) the compute warpgroups run half a step apart, so that one's
      softmax runs while the other's WGMMAs keep the tensor cores busy, instead of both
      computing Pᵀ and dSᵀ at once. dQ = dS K needs both warpgroups' dSᵀ of a step:
      warpgroup 1, behind, issues its step's dQ as before, warpgroup 0 issues the last
      step's (whose dSᵀ warpgroup 1 wrote half a step ago) with its step's dV and dK, and
      the last step's at the key block's end. The same registers (a dQ beside dK and dV,
      nothing carried across steps), the same WGMMAs on the same operands: the same bits.
      A dSᵀ slot is rewritten once both dQs reading it are done (barrier ds_free). The
      warpgroups take turns issuing their dQ, dV and dK WGMMAs, warpgroup 0 first (in a
      free-running stagger nothing keeps warpgroup 1 from drifting back into lockstep); Sᵀ
      and dPᵀ go out as soon as a warpgroup reaches them, so that each one's softmax runs
      under the other's dQ, dV, dK and next Sᵀ, dPᵀ.
    dq_heavy_first: (dq_ordered, walks not rotated) the key blocks launch in grid order,
      the first key block (under a causal mask the longest walk) first, as in arrival
      order, rather than last first; the adders keep their order (descending key block),
      so a CTA then waits on ones launched after it (for their dq), which must find an SM:
      it applies where a key head has at most ROTATE_MAX_KV CTAs, as dq_rotate does. See the
      design doc for why the launch order matters under a causal mask.
    dq_rounded: (dq_ordered) dq is added in the input dtype: each key block scales its dQ
      tiles and rounds them before its reduction (the first stores), so there is no float32
      dq beside the outputs (B·T·Hq·D·4 bytes) and no pass over it after the kernel, and
      the reductions move half the bytes. One rounding per adder: dq's error against a
      float32 reference grows with the adders, 1.09×, 1.18×, 1.31× and 1.51× that of the
      float32 sum at 4, 8, 16 and 32 of them (bf16, a numerical model of the kernel's
      sums), so for_deterministic turns it on only up to ROUNDED_DQ_MAX_ADDERS.
    dq_rounded_per_block: (dq_ordered, not dq_rounded) dq_rounded per query block, chosen at
      run time from the key blocks that add into it (with segment ids only the run knows
      them): a block with at most ROUNDED_DQ_MAX_ADDERS is added rounded into dq, the others
      into float32 sums beside it, which _finish_dq then scales and rounds into dq (zeros
      where no key block adds) without reading the rounded blocks. for_deterministic takes
      it with segment ids where the band lets more key blocks add into a block: packed
      short documents then skip the float32 pass, as dq_rounded does.
    early_softmax: a step waits for its Sᵀ alone and computes Pᵀ while its dPᵀ WGMMA still
      runs, instead of waiting for both (the same bits). Measured faster only where nothing
      else fills the tensor cores meanwhile: D = 96 and 128 causal without dq_stagger, and
      beside segment ids on one dQ slot (for_deterministic; see the design doc).
    group_splits: (not gqa_per_query_head) CTAs per key block and key head, each walking its
      share of the group's query heads (shares differ by at most one head where the splits do
      not divide the group; never more CTAs than query heads). Each stores its dK and dV, in
      the input dtype, into its slice of [group_splits, B, S, Hkv, D] partials, which XLA
      then sums in float32 in one fixed order: deterministic, with one rounding more per
      partial. A call whose key blocks and heads leave SMs idle takes more (split_group),
      e.g. MQA: B4 T2048 H71/1 has 64 key blocks for 132 SMs, each walking 71 query heads.
    dq_paired: (dq_ordered; causal calls with T = S and an even number of key blocks) one
      CTA per pair of key blocks, in place of one per key block, where the grid of key
      blocks would take more than one wave and the pairs fit on the SMs at once
      (_paired_splits): a CTA walks key block n − 1 − j (the shortest walk), then j (the
      longest, from the last query block down), so every CTA has the same work, all start
      together and none waits for an SM. Each query block's adders take their turns in the
      order a lockstep model of the CTAs reaches it (_paired_schedule). The group's query
      heads split between the most CTAs that fit (group_splits: one split per query head,
      or fewer). Gemma-2B's MQA backward (B1 T8k H8/1, D = 256) is the call it serves: the
      grid's last key blocks there run alone on the SMs while the rows after the first
      launch. Not with gqa_per_query_head, pingpong, dq_stagger or dq_rounded_per_block
      (which serves segment ids).
  """

  stages: int = 2
  block_q: int = BLOCK_Q
  dq_split: bool = True
  pingpong: bool = False
  gqa_per_query_head: bool = False
  column_split: bool = False
  scores_split: bool = False
  with_dq: bool = True
  dq_ordered: bool = False
  dq_buffers: int = 1
  dq_rotate: bool = False
  dq_stagger: bool = False
  dq_heavy_first: bool = False
  dq_rounded: bool = False
  dq_rounded_per_block: bool = False
  group_splits: int = 1
  early_softmax: bool = False
  dq_paired: bool = False

  @classmethod
  def for_deterministic(cls, d: int, causal: bool, gqa: bool = False, t: int = 0,
                        s: int = 0, segments: bool = False,
                        seen: int = 0) -> "MosaicBackwardConfig":
    """The Mosaic backward of deterministic calls whose key blocks walk t queries (T, or a window's
    span) and S = s keys (0: not known), of which one query sees at most `seen` (a window's
    left + right + 1; 0: all s): the whole kernel with dq_ordered where the tuning table has a
    `d<D>[_causal]_ordered` section (`d<D>[_causal]_gqa_ordered` for GQA calls, whose schedule
    differs; from long_walk_queries(d) queries on, and under a window, that section's `_long`
    variant where there is one, from long_walk_queries(d, longest=True) without segment ids its
    `_longest` where there is one), with dq_rounded where at most ROUNDED_DQ_MAX_ADDERS key
    blocks add into a query block (block_adders), else with segment ids dq_rounded_per_block;
    else the dK/dV-only kernel (tuned(with_dq=False)), which runs beside a dq kernel. A head
    dim without a section of its own takes those of _section_dims.

    causal: a causal band (pallas_mosaic_gpu passes causal windows at D = 128 too), with or
    without segment ids. A causal call with segment ids takes D = 128's causal sections from
    CAUSAL_DOCUMENTS_QUERIES queries on, and those without a mask below and at other head dims
    (not measured with segment ids; D = 64 has no causal GQA section with dq). Its walks end at
    their documents' starts, which only the run knows: short documents favour one CTA per key
    head walking its whole group, long ones causal GQA's CTA per query head (the design doc's
    "Packed documents" has both at four packings). Without GQA the two choices give the same
    kernel beside segment ids (fit_shared_memory), which there computes Pᵀ early
    (early_softmax)."""
    if segments and (t < CAUSAL_DOCUMENTS_QUERIES or _section_dim(d) != 128):
      causal = False
    table = _tuning.lookup("flash_attention", "pallas_mosaic_gpu_backward")
    suffix = ("_causal" if causal else "") + ("_gqa" if gqa else "") + "_ordered"
    # A causal window runs the `_long` sections' kernel at any span (the design doc's "Causal
    # windows and long walks").
    window = 0 < seen < (s or seen + 1)
    # With segment ids the walks end at their documents' starts, however long T is: no
    # `_longest`.
    longest = not segments and t >= long_walk_queries(d, longest=True)
    found = ((longest and _section(table, d, suffix + "_longest"))
             or ((t >= long_walk_queries(d) or window) and _section(table, d, suffix + "_long"))
             or _section(table, d, suffix))
    if found:
      config = cls(**{**found, "dq_ordered": True})
      adders = block_adders(s, seen, config.cta_keys(), config.block_q)
      config = dataclasses.replace(
          config, dq_rounded=0 < adders <= ROUNDED_DQ_MAX_ADDERS,
          dq_rounded_per_block=segments and adders > ROUNDED_DQ_MAX_ADDERS)
      if (segments and fit_shared_memory(config, d, jnp.bfloat16, True).dq_buffers
          < config.dq_buffers):
        # One dQ slot beside the ids, unstaggered: nothing else fills the tensor cores during
        # the softmax, so Pᵀ goes under dPᵀ's WGMMA (the design doc's "Packed documents").
        config = dataclasses.replace(config, early_softmax=True)
      return config
    return cls.tuned(d, causal, gqa, with_dq=False)

  @classmethod
  def for_nondeterministic(cls, d: int, causal: bool, gqa: bool = False, t: int = 0,
                           s: int = 0, segments: bool = False,
                           seen: int = 0) -> "MosaicBackwardConfig":
    """The Mosaic backward of calls with deterministic=False (arguments as for_deterministic):
    dq's reductions in arrival order where the tuning table names that kernel for the call
    (a `d<D>[_causal][_gqa]` section, for where it measured faster than the ordered one:
    the default table has none); else the ordered kernel of for_deterministic, which
    nondeterminism allows as well; else (no ordered kernel at this head dim) up to
    WHOLE_ARRIVAL_MAX_D the whole kernel in arrival order rather than the dK/dV-only kernel
    beside a dq kernel."""
    table = _tuning.lookup("flash_attention", "pallas_mosaic_gpu_backward")
    found = _section(table, d, ("_causal" if causal else "") + ("_gqa" if gqa else ""))
    if found:
      return cls(**found)
    ordered = cls.for_deterministic(d, causal, gqa, t=t, s=s, segments=segments, seen=seen)
    if ordered.with_dq or d > WHOLE_ARRIVAL_MAX_D:
      return ordered
    return cls.tuned(d, causal, gqa)

  def cta_keys(self) -> int:
    return BLOCK_KV if self.column_split else 2 * BLOCK_KV

  def out_cols(self, d: int) -> int:
    """Columns of dK and dV each compute warpgroup owns."""
    return d // 2 if self.column_split else d

  def dq_cols(self, d: int) -> int:
    """Columns of dQ each compute warpgroup adds per step."""
    return d // 2 if (self.dq_split or self.column_split) else d

  @classmethod
  def tuned(cls, d: int, causal: bool, gqa: bool = False,
            with_dq: bool = True) -> "MosaicBackwardConfig":
    """configs/tuning/flash_attention.toml's `d<D>[_causal][_gqa]` section for this GPU kind
    (without `_gqa` where that has none; a head dim without one of its own takes those of
    _section_dims), else dq_split where it applies (D = 96 and 128) and the column-split
    kernel with split scores above D = 128.

    with_dq=False (the dK/dV-only kernel of deterministic calls): a `_dkv` section
    (`d<D>[_causal][_gqa]_dkv`, then `d<D>[_causal]_dkv`, then `d<D>_dkv`) where there is
    one, else the section above without dq_split, scores_split, gqa_per_query_head and
    dq_stagger (which only the kernel with dq serves)."""
    table = _tuning.lookup("flash_attention", "pallas_mosaic_gpu_backward")
    section = lambda suffix: _section(table, d, suffix)
    mask = "_causal" if causal else ""
    if not with_dq:
      found = ((gqa and section(mask + "_gqa_dkv")) or section(mask + "_dkv")
               or section("_dkv"))
      if found:
        return cls(**found, with_dq=False)
      return dataclasses.replace(cls.tuned(d, causal, gqa), dq_split=False, scores_split=False,
                                 gqa_per_query_head=False, dq_stagger=False, with_dq=False)
    found = (gqa and section(mask + "_gqa")) or section(mask)
    if found:
      return cls(**found)
    if d > 128:
      return cls(dq_split=False, column_split=True, stages=1, scores_split=True)
    return cls(dq_split=_section_dim(d) == 128)


def block_adders(s: int, seen: int, cta_keys: int, block_q: int) -> int:
  """The most key blocks of cta_keys that add into one query block's dq, of s keys where a
  query sees at most `seen` (0: all): a block of block_q queries sees an interval of at most
  seen + block_q - 1 keys, which meets at most ceil((n - 1) / cta_keys) + 1 key blocks."""
  if not seen or seen >= s:
    return s // cta_keys
  return min(s // cta_keys, -(-(seen + block_q - 2) // cta_keys) + 1)


def split_group(config: MosaicBackwardConfig, batch: int, hq: int, hkv: int, s: int,
                uneven: bool, sms: int | None = None) -> MosaicBackwardConfig:
  """config with the group_splits a call takes: the config's own (the tuning table's, at
  most one per query head of the group), more where the call's CTAs (one per key block,
  key head and batch row) fill fewer than SPLIT_WAVES waves of the SMs (sms, else the
  device's). `uneven`: the key blocks walk different numbers of query blocks (a causal
  band, segment ids), which more, shorter CTAs balance: then splits enough for
  UNEVEN_SPLIT_WAVES waves. Else each split's walk is as long as another's, and the splits
  are the fewest that take the fewest waves × query heads per CTA. A group past
  ORDERED_SHARES_MAX_GROUP that the config walks one CTA per query head adding into the
  outputs in order (gqa_per_query_head, dq_ordered) takes one split per query head instead."""
  group = hq // hkv
  if config.gqa_per_query_head and config.dq_ordered and group > ORDERED_SHARES_MAX_GROUP:
    return dataclasses.replace(config, gqa_per_query_head=False, group_splits=group)
  if config.gqa_per_query_head or group == 1:
    return config
  splits = min(config.group_splits, group)
  ctas = batch * hkv * (s // config.cta_keys())
  sms = sms or hopper.sm_count()
  if 0 < ctas < SPLIT_WAVES * sms:
    if uneven:
      splits = max(splits, min(group, -(-UNEVEN_SPLIT_WAVES * sms // ctas)))
    else:
      span = lambda n: (-(-ctas * n // sms) * -(-group // n), n)
      splits = max(splits, min(range(1, group + 1), key=span))
  return dataclasses.replace(config, group_splits=splits)


def _section_dims(d: int) -> tuple[int, ...]:
  """The head dims whose tuning sections a call of head dim d takes, the first found first:
  its own, then at D = 224 (the column-split kernel) those of D = 256; D = 96 those of
  D = 128 (dq_split's halves fit its 32-byte swizzle groups; at D = 112 they would not, so
  it keeps none). D = 160 and 192, whose dK/dV-only kernel keeps full width
  (FULL_WIDTH_BLOCK_Q), keep their own only."""
  if d > 128 and d not in FULL_WIDTH_BLOCK_Q:
    return (d,) if d == 256 else (d, 256)
  return (96, 128) if d == 96 else (d,)


def long_walk_queries(d: int, longest: bool = False) -> int:
  """Queries from which a deterministic causal call of head dim d takes its section's `_long`
  variant (with `longest`, its `_longest`): LONG_WALK_QUERIES (LONGEST_WALK_QUERIES), and
  twice as many at D = 96, which runs D = 128's sections but lost with the stagger at B4 T4k
  H32 (the design doc's "Causal windows and long walks")."""
  queries = LONGEST_WALK_QUERIES if longest else LONG_WALK_QUERIES
  return 2 * queries if d == 96 else queries


def _section_dim(d: int) -> int:
  """The last head dim of _section_dims(d): 256 for the column-split head dims, 128 for
  D = 96 and 128, else d."""
  return _section_dims(d)[-1]


def _section(table: dict, d: int, suffix: str) -> dict | None:
  """The first tuning section `d<D><suffix>` of _section_dims(d)."""
  return next((table[key] for m in _section_dims(d) if (key := f"d{m}{suffix}") in table),
              None)


def support_error(q_shape, k_shape, dtype, opts: AttentionOptions,
                  config: MosaicBackwardConfig) -> str | None:
  """Why the backward kernel cannot serve this call, or None when it can."""
  _, t, _, d = q_shape
  s = k_shape[1]
  if (why := hopper.dtype_error(dtype)) is not None:
    return why
  if d not in _padding.HEAD_DIMS:
    return f"backward serves head dims {', '.join(map(str, _padding.HEAD_DIMS))}, got D={d}"
  if d > 128 and not config.column_split and (config.with_dq or config.block_q
                                               > FULL_WIDTH_BLOCK_Q.get(d, 0)):
    fits = " and ".join(f"D={m} with block_q ≤ {q}" for m, q in FULL_WIDTH_BLOCK_Q.items())
    return (f"D={d} needs column_split (dK and dV of 64 keys at full width fit in registers "
            f"only without dq, at {fits}), got {config}")
  if config.column_split and d <= 128:
    return f"column_split serves D over 128, got D={d}"
  if config.column_split and config.dq_split:
    return "column_split and dq_split exclude each other"
  if config.dq_split and d % 32:
    return (f"dq_split needs D a multiple of 32 (dQ's halves in 32-byte swizzle groups), "
            f"got D={d}")
  if config.scores_split and not (config.column_split and config.with_dq
                                  and not config.pingpong):
    return "scores_split needs column_split with dq, and not pingpong"
  if config.scores_split and opts.mask.segments:  # 112 bytes short at D = 256
    return "scores_split does not fit in shared memory beside segment ids"
  if config.dq_split and config.pingpong:
    return "pingpong and dq_split exclude each other"
  if config.dq_split and config.gqa_per_query_head and not config.dq_ordered:
    return "gqa_per_query_head and dq_split exclude each other in arrival order"
  if not config.with_dq and (config.dq_split or config.gqa_per_query_head):
    return "with_dq=False excludes dq_split and gqa_per_query_head"
  if config.group_splits < 1:
    return f"group_splits must be at least 1, got {config.group_splits}"
  if config.group_splits > 1 and config.gqa_per_query_head:
    return "group_splits and gqa_per_query_head exclude each other (one CTA per query head)"
  if config.dq_ordered and not (config.with_dq and (config.dq_split or config.column_split)):
    return "dq_ordered needs dq (with_dq) added by column halves (dq_split or column_split)"
  if (config.dq_buffers != 1 or config.dq_rotate or config.dq_heavy_first
      or config.dq_rounded or config.dq_rounded_per_block) and not config.dq_ordered:
    return ("dq_buffers, dq_rotate, dq_heavy_first, dq_rounded and dq_rounded_per_block "
            "belong to dq_ordered")
  if config.dq_paired and not config.dq_ordered:
    return "dq_paired belongs to dq_ordered"
  if config.dq_paired and (config.gqa_per_query_head or config.pingpong or config.dq_stagger
                           or config.dq_rounded_per_block):
    return ("dq_paired excludes gqa_per_query_head, pingpong, dq_stagger and "
            "dq_rounded_per_block")
  if config.dq_rounded and config.dq_rounded_per_block:
    return "dq_rounded (every query block) and dq_rounded_per_block exclude each other"
  if config.dq_stagger and not (config.dq_split and config.with_dq):
    return "dq_stagger needs dq_split (with dq)"
  if config.dq_buffers not in (1, 2):
    return f"dq_buffers must be 1 or 2, got {config.dq_buffers}"
  if config.stages < 1:
    return f"needs at least one stage, got {config}"
  if config.block_q not in (32, 64, 80, 96, 128):
    return f"block_q must be 32, 64, 80, 96 or 128, got {config.block_q}"
  if config.with_dq and config.block_q % BLOCK_Q:
    return (f"block_q={config.block_q} needs with_dq=False (dQ's WGMMA takes a multiple of "
            f"{BLOCK_Q} rows)")
  if config.block_q == 128 and (d > (64 if config.with_dq else 80) or config.column_split):
    return (f"block_q=128 needs D ≤ 64, or 80 without dq (its Sᵀ and dPᵀ tiles beside dK "
            f"and dV fill the registers), got D={d}")
  if t % BLOCK_Q:
    return f"backward needs T a multiple of {BLOCK_Q}, got T={t}"
  if s % config.cta_keys():
    return f"backward needs S a multiple of {config.cta_keys()}, got S={s}"
  if (need := _smem_bytes(config, d, jnp.dtype(dtype).itemsize, opts.mask.segments)
      ) > hopper.SMEM_BYTES:
    return (f"{config} needs {need} bytes of shared memory at D={d}"
            f"{' with segment ids' if opts.mask.segments else ''}, more than "
            f"{hopper.SMEM_BYTES}")
  return None


def fit_shared_memory(config: MosaicBackwardConfig, d: int, dtype,
                      segments: bool) -> MosaicBackwardConfig:
  """config with one dQ slot where its second does not fit beside the segment ids' buffers
  (D = 128 with dq_buffers=2 has 1 KB to spare, the ids take as much), and then without
  dq_stagger: with one slot warpgroup 1's dQ waits for the send of the last step's, whose
  tile warpgroup 0 leaves only in this step, which made the staggered walk the slower one.
  A third Q/dO stage that still does not fit goes next."""
  itemsize = jnp.dtype(dtype).itemsize
  if config.scores_split and segments:
    config = dataclasses.replace(config, scores_split=False)
  if config.dq_buffers > 1 and _smem_bytes(config, d, itemsize, segments) > hopper.SMEM_BYTES:
    config = dataclasses.replace(config, dq_buffers=1, dq_stagger=False)
  if config.stages > 2 and _smem_bytes(config, d, itemsize, segments) > hopper.SMEM_BYTES:
    config = dataclasses.replace(config, stages=2)
  return config


def _ds_buffers(config: MosaicBackwardConfig) -> int:
  """dSᵀ slots: shared between the warpgroups, a slot is rewritten only two steps later."""
  return 2 if (config.dq_split or config.scores_split) else 1


def _ds_shape(config: MosaicBackwardConfig) -> tuple[int, int, int]:
  """dSᵀ slots (with scores_split, and as many Pᵀ slots); one 8 × 64 tile (unused) without
  dq."""
  if config.scores_split:
    return (_ds_buffers(config), BLOCK_KV, config.block_q)
  return (_ds_buffers(config), 2 * BLOCK_KV, config.block_q) if config.with_dq else (1, 8, 64)


def _dq_tile_shape(config: MosaicBackwardConfig, d: int) -> tuple[int, int, int]:
  """The float32 dQ tiles on their way to the reduction (also dK and dV's with
  gqa_per_query_head; with dq_rounded their bytes hold the tiles in the input dtype); a
  token 8 × 8 without dq."""
  return ((2 * config.dq_buffers, config.block_q, config.dq_cols(d)) if config.with_dq
          else (2, 8, 8))


def _dq_tile_transforms(config: MosaicBackwardConfig, d: int, dtype=jnp.float32) -> tuple:
  """The dQ tiles (in `dtype`) in the widest swizzle that divides a tile row's bytes: 128
  bytes for float32 tiles of 32, 64 or 128 columns, 64 for dq_split's 48 at D = 96 (in the
  input dtype, with dq_rounded, 32 there). Row-major, a WGMMA accumulator's stores to a 64-
  or 128-column float32 tile put a warp's rows in the same shared-memory banks (Mosaic GPU
  finds no conflict-free plan without a swizzle); swizzled they are conflict-free, and the
  TMA reductions read the tiles as they are."""
  if not config.with_dq:
    return ()
  return hopper.swizzled_tiles(hopper.row_swizzle(config.dq_cols(d), dtype), dtype)


def _dq_scratch(config: MosaicBackwardConfig, d: int, dtype):
  """The dQ tile slots in shared memory: float32, or with dq_rounded in the input dtype,
  each tile in rows 0..block_q of a slot twice as tall (the float32 tile's bytes). With
  dq_rounded_per_block a union of both views of the same bytes (see _DqViews); each is read
  only through the view it was written through."""
  slots, rows, cols = _dq_tile_shape(config, d)
  rounded = plgpu.SMEM((slots, 2 * rows, cols), dtype,
                       transforms=_dq_tile_transforms(config, d, dtype))
  tiles = rounded if config.dq_rounded else plgpu.SMEM(
      (slots, rows, cols), jnp.float32, transforms=_dq_tile_transforms(config, d))
  return plgpu.RefUnion(tiles, rounded) if config.dq_rounded_per_block else tiles


class _DqViews(NamedTuple):
  """The dQ slots' views: the tiles (float32, or in the input dtype with dq_rounded); with
  dq_rounded_per_block the rounded tiles of the blocks that take them, as dq_rounded's."""
  tiles: Any
  rounded: Any = None

  @classmethod
  def of(cls, config: MosaicBackwardConfig, scratch) -> "_DqViews":
    return cls(*scratch) if config.dq_rounded_per_block else cls(scratch)


def _operand_swizzle(block_q: int, d: int, half: int | None = None) -> int:
  """The widest swizzle (bytes) whose group of rows divides block_q, for the K, V, Q and dO
  tiles: dV = Pᵀ dO and dK = dSᵀ Q contract over the Q/dO tiles' block_q rows in swizzle / 2
  steps, and the Sᵀ = K Qᵀ and dPᵀ = V dOᵀ WGMMAs need K and V in the same swizzle. With
  dq_split or column_split, `half` = D / 2: dQ = dS K reads K's columns by halves (and
  column_split's dK, dV the Q and dO tiles'), each whole swizzle groups (64 bytes at D = 64
  and 192, 32 at D = 96); a row of D columns too (64 bytes at D = 96)."""
  return next(sw for sw in (128, 64, 32)
              if block_q % (sw // 2) == 0 and (2 * d) % sw == 0
              and (half is None or (2 * half) % sw == 0))


def _seg_len(block_q: int) -> int:
  """Query segment ids loaded per step: block_q rounded up to 32 (a copy moves a multiple
  of 128 bytes); the ids past the block are not read."""
  return -(-block_q // 32) * 32


def _smem_bytes(config: MosaicBackwardConfig, d: int, itemsize: int, segments: bool) -> int:
  bq = config.block_q
  seg_ids = 4 * (config.cta_keys() + config.stages * _seg_len(bq)) + _SEG_RESERVE
  return (2 * config.cta_keys() * d * itemsize  # K, V
          + config.stages * (2 * bq * d * itemsize + 2 * bq * 4)  # Q, dO, lse₂, Δ
          + (1 + config.scores_split) * math.prod(_ds_shape(config)) * itemsize  # dSᵀ (Pᵀ)
          + math.prod(_dq_tile_shape(config, d)) * 4
          + (seg_ids if segments else 0)
          + (_ADDERS_RING * config.stages * 4 * _ADDERS_COPY
             if config.dq_rounded_per_block else 0)
          + _SMEM_RESERVE)


def _query_blocks(mask: MaskSpec, cta_key, cta_keys: int, n_q: int, bq: int, seg_range=None):
  """(first, last, full_lo, full_hi): the query blocks [first, last) that see any of the keys
  cta_key..cta_key+cta_keys-1, of which [full_lo, full_hi) see all of them (no mask).
  seg_range: the keys' row of segment_block_ranges (the query blocks sharing a segment id
  with them, and those sharing their one id). Scalars in the kernel; arrays of key blocks
  for _reduction_ranks. Keys reaching past the key bound (mask.keys) are masked with every
  query block they see: the padded keys stay hidden, and their gradients come out zero."""
  if mask.sees_all_keys:
    bounds = 0, n_q, 0, n_q
  else:
    bounds = _mosaic.band_blocks(mask.right, mask.left, cta_key, cta_keys, n_q, bq)
    if seg_range is not None:
      bounds = _mosaic.segment_bounds(bounds, seg_range)
  if mask.keys is None:
    return bounds
  first, last, full_lo, full_hi = bounds
  return first, last, full_lo, jnp.where(cta_key + cta_keys <= mask.keys, full_hi, full_lo)


ROTATE_MAX_KV = 64  # dq_rotate's bound on a key head's CTAs: half an H100's SMs


def _rotates(config: MosaicBackwardConfig, mask: MaskSpec, n_kv: int) -> bool:
  return (config.dq_ordered and config.dq_rotate and mask.sees_all_keys
          and n_kv <= ROTATE_MAX_KV)


def _heavy_first(config: MosaicBackwardConfig, mask: MaskSpec, n_kv: int) -> bool:
  """Whether dq_ordered's key blocks launch first key block first (dq_heavy_first)."""
  return (config.dq_ordered and config.dq_heavy_first and not _rotates(config, mask, n_kv)
          and n_kv <= ROTATE_MAX_KV)


def _paired_splits(config: MosaicBackwardConfig, mask: MaskSpec, batch: int, hq: int,
                   hkv: int, t: int, s: int, sms: int) -> int | None:
  """dq_paired: the group splits of the call's pairs (the most that leave at most one pair
  per SM, among those that divide the group), or None where the call runs the grid of key
  blocks instead: its mask is not causal with T = S, its key blocks are odd, even one split
  has more pairs than SMs, or the grid (one CTA per key block and split of the config's)
  takes one wave anyway."""
  n_kv, group = s // config.cta_keys(), hq // hkv
  if not (config.dq_paired and mask.is_causal and t == s and n_kv % 2 == 0
          and batch * hkv * min(config.group_splits, group) * n_kv > sms):
    return None
  fits = [n for n in range(1, group + 1)
          if group % n == 0 and batch * hkv * n * (n_kv // 2) <= sms]
  return max(fits, default=None)


def _group_share(member, group: int, splits: int, div=operator.floordiv):
  """(lo, hi): the query heads of a key head's group (of `group`) that split `member` of
  `splits` walks. div: for Python ints, or hopper's for the kernel's int32 scalars."""
  return div(member * group, splits), div((member + 1) * group, splits)


class _PairedDeal(NamedTuple):
  """dq_paired's CTAs: one per pair of key blocks (per batch row, key head and split of its
  group, key blocks n − 1 − j then j), in that order."""
  hkv: int
  splits: int
  group: int
  n_kv: int

  def item(self, c, r: int, div=operator.floordiv, rem=operator.mod):
    """CTA c's r-th key block (r = 0, 1; the second walks its query blocks from the last
    down): (b, kv_head, kvi, head0, heads, part), `part` its split (the dK and dV partials
    it stores). div and rem: for Python ints, or hopper's for the kernel's int32 scalars."""
    unit, j = div(c, self.n_kv // 2), rem(c, self.n_kv // 2)
    b, part = div(unit, self.hkv * self.splits), rem(unit, self.splits)
    kv_head = rem(div(unit, self.splits), self.hkv)
    kvi = j if r else self.n_kv - 1 - j
    lo, hi = _group_share(part, self.group, self.splits, div)
    return b, kv_head, kvi, kv_head * self.group + lo, hi - lo, part


@functools.lru_cache(maxsize=32)
def _paired_schedule(mask: MaskSpec, batch: int, hq: int, hkv: int, splits: int, n_kv: int,
                     n_q: int, cta_keys: int, bq: int):
  """(deal, ctas, ranks): dq_paired's _PairedDeal, its CTAs, and ranks [B, Hq, n_kv, n_q]
  (NumPy int32): key block kv's turn among the adders into head h's query block qb, by the
  step at which the CTAs would reach it in lockstep (the second key block
  PAIRED_SWITCH_STEPS later), ties to the lower CTA. Each CTA's steps come in the model's
  time order, so every turn waits only on steps the model puts earlier: with every CTA
  resident (one per SM), no deadlock."""
  deal = _PairedDeal(hkv, splits, hq // hkv, n_kv)
  ctas = batch * hkv * splits * (n_kv // 2)
  with hopper.host_constants():
    first, last = (np.broadcast_to(np.asarray(x, np.int32), (n_kv,)) for x in
                   _query_blocks(mask, np.arange(n_kv) * cta_keys, cta_keys, n_q, bq)[:2])
  visits = []  # (query block key, key block, time, CTA) per step, as arrays per head
  for c in range(ctas):
    time = 0
    for r in range(2):
      b, _, kvi, head0, heads, _ = deal.item(c, r)
      time += r * PAIRED_SWITCH_STEPS
      blocks = np.arange(first[kvi], last[kvi])
      blocks = blocks[::-1] if r else blocks
      for head in range(head0, head0 + heads):
        visits.append(((b * hq + head) * n_q + blocks, np.full_like(blocks, kvi),
                       time + np.arange(len(blocks)), np.full_like(blocks, c)))
        time += len(blocks)
  block, kvi, time, cta = (np.concatenate(x) for x in zip(*visits))
  order = np.lexsort((cta, time, block))  # by query block, then time, then CTA
  sorted_blocks = block[order]
  turn = np.arange(len(order)) - np.searchsorted(sorted_blocks, sorted_blocks)
  ranks = np.zeros((batch * hq * n_q, n_kv), np.int32)
  ranks[block[order], kvi[order]] = turn
  ranks = ranks.reshape(batch, hq, n_q, n_kv).transpose(0, 1, 3, 2)
  return deal, ctas, np.ascontiguousarray(ranks)


def _rotation(kv, n_kv: int, n_q: int):
  """dq_rotate: the query block that key block kv's walk starts at (kv an int32 scalar in
  the kernel or an array)."""
  return lax.rem(kv * max(n_q // n_kv, 1), jnp.int32(n_q))


# 128-query steps with two dQ slots fit in shared memory only without the reduction scratch.
_SCRATCH_PARAM = plgpu is not None and "reduction_scratch_bytes" in {
    f.name for f in dataclasses.fields(plgpu.CompilerParams)}


def _reduction_ranks(mask: MaskSpec, batch: int, n_kv: int, cta_keys: int, n_q: int, bq: int,
                     ranges=None, rotate: bool = False):
  """(ranks [B, n_kv, n_q], adders [B, n_q]) int32 for dq_ordered: per key block and query
  block, how many key blocks add into that query block's dq before this one, and per query
  block how many add at all. In the plain walks later key blocks (launched first) add
  first; with `rotate` (dq_rotate, no mask), those that visit the block at an earlier step,
  then those launched first. ranges: the backward's segment_block_ranges ([B, n_kv, 4]),
  with segment ids."""
  kv = jnp.arange(n_kv, dtype=jnp.int32)
  qb = jnp.arange(n_q, dtype=jnp.int32)
  if rotate:
    visit = lax.rem(qb[None] - _rotation(kv, n_kv, n_q)[:, None] + n_q, jnp.int32(n_q))
    turn = visit * n_kv + (n_kv - 1 - kv)[:, None]  # [n_kv, n_q], distinct per query block
    ranks = (turn[None, :, :] < turn[:, None, :]).sum(axis=1, dtype=jnp.int32)
    return (jnp.broadcast_to(ranks, (batch, n_kv, n_q)),
            jnp.full((batch, n_q), n_kv, jnp.int32))
  seg = None if ranges is None else [ranges[..., i] for i in range(4)]
  first, last, _, _ = _query_blocks(mask, kv * cta_keys, cta_keys, n_q, bq, seg)
  first, last = (jnp.broadcast_to(jnp.asarray(x, jnp.int32), (batch, n_kv))[..., None]
                 for x in (first, last))
  adds = ((first <= qb) & (qb < last)).astype(jnp.int32)  # [B, n_kv, n_q]
  return jnp.cumsum(adds[:, ::-1], axis=1)[:, ::-1] - adds, adds.sum(axis=1)


def _dq_order(mask: MaskSpec, batch: int, n_kv: int, cta_keys: int, n_q: int, bq: int, t: int,
              ranges=None, rotate: bool = False):
  """(ranks, adders, written) for dq_ordered: _reduction_ranks' tables, and where dq was
  written ([B, T, 1, 1] bool; None where every query block has an adder). Without segment
  ids all three depend on the shapes alone: computed while tracing, they are constants of
  the program rather than a handful of small kernels in every call."""
  static = ranges is None
  with hopper.host_constants() if static else contextlib.nullcontext():
    ranks, adders = _reduction_ranks(mask, batch, n_kv, cta_keys, n_q, bq, ranges,
                                     rotate=rotate)
    written = jnp.repeat(adders > 0, bq, axis=1)[:, :t, None, None]
    if not static:
      return ranks, adders, written
    # As NumPy constants, which carry no mesh (see host_constants).
    return (np.asarray(ranks), np.asarray(adders),
            None if bool(jnp.all(adders > 0)) else np.asarray(written))


class _Item(NamedTuple):
  """One key block's work: a CTA's whole grid position, or one of dq_paired's items."""
  b: jax.Array
  h: jax.Array  # the grid's head: the key head, or with gqa_per_query_head the query head
  kvi: jax.Array  # the key block
  first: jax.Array  # query blocks [first, last) see its keys, [full_lo, full_hi) all of them
  last: jax.Array
  full_lo: jax.Array
  full_hi: jax.Array
  heads: int | jax.Array  # query heads it walks, per_head query blocks each
  kv_head: jax.Array
  head0: jax.Array  # the first of them (the next ones follow it)
  rot: jax.Array | None  # dq_rotate: the query block its walk starts at
  part: int | jax.Array = 0  # group_splits: its split (the dK and dV partials it stores)
  descending: bool = False  # dq_paired's second key block: walks from the last block down

  @property
  def per_head(self):
    return self.last - self.first

  def block(self, j):
    """The query block of its walk's j-th step in a head."""
    return self.last - 1 - j if self.descending else self.first + j

  def unmasked(self):
    """The steps [lo, hi) of its walk in a head that see all of its keys."""
    lo, hi = self.full_lo - self.first, self.full_hi - self.first
    return (self.per_head - hi, self.per_head - lo) if self.descending else (lo, hi)

  @property
  def n_steps(self):
    return self.heads * self.per_head


class _Scratch(NamedTuple):
  """The kernel's shared memory and barriers, allocated in this order (a field the call does
  not use is None). Shared memory: K and V (the CTA's keys), the Q, dO and row-statistics
  ring of `stages` slots, the dSᵀ slots, the float32 dQ tile slots (with
  dq_rounded_per_block a (float32, input-dtype) pair of views of the same bytes, see
  _dq_scratch)."""
  k_smem: Any
  v_smem: Any
  q_smem: Any
  do_smem: Any
  stats_smem: Any
  ds_smem: Any
  dq_smem: Any
  k_ready: Any  # K landed
  v_ready: Any  # V landed
  q_ready: Any  # per slot: Q landed
  do_ready: Any  # per slot: dO landed
  stats_ready: Any  # per slot: the row statistics landed
  q_free: Any  # per slot, 2 arrivals: both compute warpgroups are done with Q
  do_free: Any  # per slot, 2 arrivals: ... with dO
  ds_ready: Any  # per dSᵀ slot, 2 arrivals: both warpgroups' rows written
  pair: Any  # 2 arrivals: the compute warpgroups meet (pingpong's turns, K read to the end)
  kv_seg: Any = None  # segment ids: the CTA's keys'
  q_seg: Any = None  # ... per slot, the step's queries'
  kv_seg_ready: Any = None
  q_seg_ready: Any = None
  adders: Any = None  # dq_rounded_per_block, a ring: each step's query block's adders count
  adders_ready: Any = None
  dq_full: Any = None  # dq_ordered, per dQ slot, 2 arrivals: both warpgroups' tiles written
  dq_free: Any = None  # ... per dQ slot: read by their reductions
  ds_free: Any = None  # dq_stagger, per dSᵀ slot, 2 arrivals: both dQs reading it are done
  lead: Any = None  # ... warpgroup 0's first scores are done: warpgroup 1 may start
  turns: Any = None  # ... per warpgroup: its turn at the dQ, dV and dK WGMMAs
  pt_smem: Any = None  # scores_split: Pᵀ's slots, as dSᵀ's
  kv_free: Any = None  # dq_paired, 2 arrivals: both compute warpgroups are done with K and V

  @classmethod
  def shapes(cls, config: MosaicBackwardConfig, d: int, dtype, segments: bool,
             paired: bool = False):
    """The _Scratch of allocation types for pl.run_scoped."""
    bq, stages, keys = config.block_q, config.stages, config.cta_keys()
    # dQ = dS K: dS's slots in K's swizzle (the halves of a 64-column K need 64 bytes, as do
    # column_split's 96-column halves at D = 192; so do scores_split's 32-query halves of the
    # Pᵀ and dSᵀ slots, and the tiles they meet).
    halves = config.dq_split or config.column_split
    operand_tiles = hopper.swizzled_tiles(_operand_swizzle(
        bq // 2 if config.scores_split else bq, d, d // 2 if halves else None))
    barrier, pair = plgpu.Barrier, dict(num_arrivals=2)
    optional = {}
    if segments:
      optional.update(kv_seg=plgpu.SMEM((keys,), jnp.int32),
                      q_seg=plgpu.SMEM((stages, _seg_len(bq)), jnp.int32),
                      kv_seg_ready=barrier(), q_seg_ready=barrier(num_barriers=stages))
    if config.dq_rounded_per_block:
      ring = _ADDERS_RING * stages
      optional.update(adders=plgpu.SMEM((ring, _ADDERS_COPY), jnp.int32),
                      adders_ready=barrier(num_barriers=ring))
    if config.dq_ordered:
      optional.update(dq_full=barrier(**pair, num_barriers=config.dq_buffers),
                      dq_free=barrier(num_barriers=config.dq_buffers))
    if config.dq_stagger:
      optional.update(ds_free=barrier(**pair, num_barriers=2), lead=barrier(),
                      turns=barrier(num_barriers=2))
    if config.scores_split:
      optional.update(pt_smem=plgpu.SMEM(_ds_shape(config), dtype, transforms=operand_tiles))
    if paired:
      optional.update(kv_free=barrier(**pair))
    return cls(
        k_smem=plgpu.SMEM((keys, d), dtype, transforms=operand_tiles),
        v_smem=plgpu.SMEM((keys, d), dtype, transforms=operand_tiles),
        q_smem=plgpu.SMEM((stages, bq, d), dtype, transforms=operand_tiles),
        do_smem=plgpu.SMEM((stages, bq, d), dtype, transforms=operand_tiles),
        stats_smem=plgpu.SMEM((stages, 2, bq), jnp.float32),
        ds_smem=plgpu.SMEM(_ds_shape(config), dtype, transforms=operand_tiles),
        dq_smem=_dq_scratch(config, d, dtype),
        k_ready=barrier(), v_ready=barrier(),
        q_ready=barrier(num_barriers=stages), do_ready=barrier(num_barriers=stages),
        stats_ready=barrier(num_barriers=stages),
        q_free=barrier(**pair, num_barriers=stages), do_free=barrier(**pair, num_barriers=stages),
        ds_ready=barrier(**pair, num_barriers=2), pair=barrier(**pair),
        **optional)


def _backward_kernel(q_ref, k_ref, v_ref, do_ref, stats_ref, zero_ref, seg_refs,
                     dq_ref, dk_ref, dv_ref, sc: _Scratch, *,
                     config: MosaicBackwardConfig, mask: MaskSpec, scale: float,
                     softcap: float | None, group: int, rotate: bool, lengths: tuple[int, int],
                     heavy_first: bool = False, order=None, per_block=None, work=None):
  """`group` query heads per key head; with config.gqa_per_query_head, grid axis "h" is the
  query head and dk_ref/dv_ref are float32 [B, S, Hkv, D] accumulators (arrival order) or
  the outputs (dq_ordered), else "h" is the key head. zero_ref: int32 zeros (see key_tiles).
  sc: the shared memory and barriers. order: with config.dq_ordered, the _reduction_ranks
  table and the [B · Hq · n_q] counters the reductions wait on (with gqa_per_query_head
  also [B · Hkv · n_kv · 2] counters, per key block and warpgroup, that dK and dV's adds
  wait on). per_block: with config.dq_rounded_per_block, _reduction_ranks'
  adders per query block (_adders_table), the float32 sums that the blocks with more than
  ROUNDED_DQ_MAX_ADDERS take (dq_ref then takes the rounded ones), and the dQ slots' view
  of rounded tiles. work: with dq_paired, the _PairedDeal (the rank table is then
  _paired_schedule's, per query head). lengths: the T and S it runs at (see backward)."""
  bq, bkv, stages = config.block_q, BLOCK_KV, config.stages
  per_query_head = config.gqa_per_query_head and group > 1
  splits = min(config.group_splits, group)
  (t, s), d = lengths, q_ref.shape[-1]
  dtype = q_ref.dtype
  wg = lax.axis_index("wg")
  cta_keys = config.cta_keys()
  n_kv, kv_heads = s // cta_keys, k_ref.shape[2]
  split = config.column_split
  n_q = -(-t // bq)  # the last block may reach past T (see MosaicBackwardConfig.block_q)
  segments = mask.segments
  def item_at(b, h, kvi):
    """The work of grid position (b, h, kvi)."""
    if config.dq_ordered and not heavy_first:  # the last key block launches first
      kvi = n_kv - 1 - kvi
    seg_range = [seg_refs[2][b, kvi, i] for i in range(4)] if segments else None
    bounds = _query_blocks(mask, kvi * cta_keys, cta_keys, n_q, bq, seg_range)
    member = 0
    if per_query_head:  # this CTA's one query head, and its key head
      heads, kv_head, head0 = 1, hopper.div(h, group), h
    elif splits > 1:  # its share of its key head's query heads
      kv_head, member = hopper.div(h, splits), hopper.rem(h, splits)
      lo, hi = _group_share(member, group, splits, hopper.div)
      heads, head0 = hi - lo, kv_head * group + lo
    else:  # every query head of this key head
      heads, kv_head, head0 = group, h, h * group
    # dq_rotate: where this key block's walk starts (per_head = n_q: no mask).
    rot = _rotation(kvi, n_kv, n_q) if rotate else None
    return _Item(b, h, kvi, *bounds, heads, kv_head, head0, rot, member)

  def paired_item(r: int):
    """dq_paired: this CTA's r-th item (0 or 1)."""
    b, kv_head, kvi, head0, heads, part = work.item(lax.axis_index("cta"), r, hopper.div,
                                                    hopper.rem)
    bounds = _query_blocks(mask, kvi * cta_keys, cta_keys, n_q, bq)
    return _Item(b, kv_head, kvi, *bounds, heads, kv_head, head0, None, part, r == 1)

  # The CTA's items (one; dq_paired's two), computed here: the warps' code (with jax 0.11's
  # warpgroup lowering) has no selects or clamps for the band's bounds, and inside the
  # memory warpgroup's per-warp code only the warp axis may be named.
  if work is None:
    items = [item_at(*(lax.axis_index(a) for a in ("b", "h", "kv")))]
  else:  # unrolled: under a loop over items the compute warpgroups spilled
    items = [paired_item(r) for r in range(2)]

  def each_item(fn, base):
    """fn(item, base) for this CTA's items in order, base the global step the item's first
    takes (each fn returns the next one's)."""
    for it in items:
      base = fn(it, base)
    return base

  def dq_slot(i):
    """dq_ordered: global step i's dQ tile slot, and that slot's dq_full and dq_free
    barriers."""
    if config.dq_buffers == 1:
      return 0, sc.dq_full, sc.dq_free
    slot = hopper.rem(i, config.dq_buffers)
    return slot, sc.dq_full.at[slot], sc.dq_free.at[slot]

  def adders_slot(gi):
    """dq_rounded_per_block: global step gi's entry in the ring of adders counts."""
    return hopper.rem(gi, _ADDERS_RING * stages)

  def step_adders(gi):
    """dq_rounded_per_block: how many key blocks add into global step gi's query block, from
    the ring that the memory warpgroup fills beside the step's Q and dO. Loaded from global
    memory where the dQ tile is stored instead, the count held each step's store up for the
    load's latency."""
    ring = adders_slot(gi)
    plgpu.barrier_wait(sc.adders_ready.at[ring])
    return sc.adders[ring, 0]

  def block_index(it, head, qb):
    """Query block qb of `head` in the item's batch row, as an index into the
    [B · Hq · n_q] semaphores (dq_ordered's counters)."""
    return (it.b * q_ref.shape[2] + head) * n_q + qb

  def step_block(it, i):
    """(query head, query block) of the item's pipeline step i: all blocks of one head, then
    the next (with dq_rotate from block `rot` on, wrapping around)."""
    j = hopper.rem(i, it.per_head)
    if it.rot is not None:
      j = hopper.rem(j + it.rot, it.per_head)
    if per_query_head:
      return it.h, it.block(j)
    return it.head0 + hopper.div(i, it.per_head), it.block(j)

  @pl.when(wg < 2)
  def _compute():
    # At (232, 40) ptxas spilled about twice as much and the kernel ran 1–3% slower.
    plgpu.set_max_registers(hopper.WARPGROUP_REGISTERS[0], action="increase")
    # This warpgroup's keys (rows of K, V, dK, dV) and its columns of dK, dV and dQ.
    key_row = 0 if split else wg * bkv
    k_mine, v_mine = sc.k_smem.at[pl.ds(key_row, bkv)], sc.v_smem.at[pl.ds(key_row, bkv)]
    oc = config.out_cols(d)
    my_cols = pl.ds(wg * oc, oc) if split else pl.ds(0, d)
    col_layout = plgpu.Layout.WGMMA.reduce(0)  # a vector along Sᵀ's columns (queries)
    zeros = lambda shape: plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
    half = d // 2

    def take_turn():  # both warpgroups arrive; neither passes until the other has
      if config.pingpong:
        plgpu.barrier_arrive(sc.pair)
        plgpu.barrier_wait(sc.pair)

    def key_tiles(z):
      """This step's view of the warpgroup's K and V rows and its dQ columns of K, at an
      offset z read from global memory (always 0). Taken once, outside the step loop, the
      WGMMA descriptors of their K-steps are loop-invariant: LLVM hoists them (8 64-bit
      values per operand, up to 48 registers) and ptxas spills, its local loads the kernel's
      first stall reason under ncu. An offset the compilers cannot prove constant keeps each
      operand one base, its K-steps added to it at the WGMMA. The steps carry z: each loads
      the next one's, so that the load's latency is not on the way to the first WGMMA."""
      rows = pl.ds(pl.multiple_of(key_row + z, bkv), bkv)
      # (wg + z)·half, not a multiple_of hint: Mosaic GPU proves the swizzle alignment of a
      # column offset from its arithmetic only.
      dq_cols = pl.ds((wg + z) * half, half)  # with dq_split
      return sc.k_smem.at[rows], sc.v_smem.at[rows], sc.k_smem.at[:, dq_cols]

    def hand_off(barrier):
      """Publishes this thread's shared-memory writes to the async proxy of whoever waits
      on `barrier`, and arrives there (a fence per thread, no warpgroup barrier)."""
      hopper.fence_smem()
      plgpu.barrier_arrive(barrier)

    def meet(barrier):
      """hand_off, then wait at `barrier` for the other warpgroup's half of the same slots."""
      hand_off(barrier)
      plgpu.barrier_wait(barrier)

    def share_ds(i, dst):
      """Step i's dSᵀ slot, with this warpgroup's rows written (with column_split, both
      write the same dSᵀ); with dq_split, once the other warpgroup has written its rows."""
      ds_buf = sc.ds_smem.at[hopper.rem(i, _ds_buffers(config))]
      ds_buf.at[pl.ds(wg * bkv, bkv)][...] = dst
      if config.dq_split:
        meet(sc.ds_ready.at[hopper.rem(i, 2)])
      else:
        plgpu.commit_smem()
      return ds_buf

    def wait_turn():
      """dq_stagger: before the dQ, dV, dK group, this warpgroup's turn."""
      if config.dq_stagger:
        plgpu.barrier_wait(sc.turns.at[wg])

    def pass_turn():
      """dq_stagger: after issuing the group, the other warpgroup's turn."""
      if config.dq_stagger:
        plgpu.barrier_arrive(sc.turns.at[1 - wg])

    if config.dq_stagger:  # warpgroup 0 issues first
      pl.when(wg == 1)(lambda: plgpu.barrier_arrive(sc.turns.at[0]))

    def staggered_ds(i, gi, dst):
      """dq_stagger: writes this warpgroup's rows of step gi's dSᵀ (once both dQs of step
      gi − 2 have read the slot) and returns (the index of the dSᵀ slot this warpgroup's
      dQ reads now, how many steps back that dQ is, whether there is one): warpgroup 1 its
      step's, with warpgroup 0's rows (written half a step earlier); warpgroup 0 the last
      step's, whose rows warpgroup 1 wrote half a step ago, except on the key block's first
      step."""
      b = hopper.rem(gi, 2)
      pl.when(gi >= 2)(lambda: plgpu.barrier_wait(sc.ds_free.at[b]))
      sc.ds_smem.at[b, pl.ds(wg * bkv, bkv)][...] = dst
      hand_off(sc.ds_ready.at[b])
      lag = 1 - wg
      read = hopper.rem(gi - lag + 2, 2)
      has_dq = i >= lag
      pl.when(has_dq)(lambda: plgpu.barrier_wait(sc.ds_ready.at[read]))
      return read, lag, has_dq

    def split_dq(ds_buf, k_cols):
      """dq_split: this warpgroup's columns of dQ = dS (all 2·bkv keys) K, waited for."""
      def mm(acc_ref):
        plgpu.wgmma(acc_ref, ds_buf.T, k_cols)
        return acc_ref[...]

      return pl.run_scoped(mm, plgpu.ACC((bq, half), jnp.float32))

    def run_item(it: _Item, base):
      """The item's steps (global steps base, base + 1, ...), then its dK and dV."""
      my_key = it.kvi * cta_keys + key_row
      plgpu.barrier_wait(sc.k_ready)
      plgpu.barrier_wait(sc.v_ready)
      if segments:
        plgpu.barrier_wait(sc.kv_seg_ready)
        key_ids = hopper.load(sc.kv_seg.at[pl.ds(key_row, bkv)], plgpu.Layout.WGMMA.reduce(1))

      if config.pingpong:  # warpgroup 1 starts one turn behind warpgroup 0
        pl.when(wg == 1)(take_turn)

      def visible(slot, qb, shape, q0=0):
        """Which keys (rows of Sᵀ) the queries q0.. of block qb (columns) see."""
        query_ids = None
        if segments:
          plgpu.barrier_wait(sc.q_seg_ready.at[slot])
          query_ids = hopper.load(sc.q_seg.at[slot, pl.ds(q0, shape[1])], col_layout)
        return _mosaic.visible(mask, shape, 0, my_key, qb * bq + q0,
                               key_ids if segments else None, query_ids)

      def store_dq(i, gi, dq, cols):
        """Adds step i's dQ (this warpgroup's columns `cols`) into dq by a TMA reduction;
        with dq_ordered, leaves it for the memory warpgroup's (see send_dq)."""
        if config.dq_ordered:
          slot, full, free = dq_slot(gi)
          tile = slot * 2 + wg
          plgpu.barrier_wait(free)  # the slot's last tiles have been read
          if config.dq_rounded:  # scaled here, in place of the pass after the kernel
            sc.dq_smem.at[tile, pl.ds(0, bq)][...] = (dq * scale).astype(dtype)
          elif per_block is not None:  # so too where few key blocks add into this block
            adders = step_adders(gi)

            @pl.when(adders <= ROUNDED_DQ_MAX_ADDERS)
            def _():
              per_block[2].at[tile, pl.ds(0, bq)][...] = (dq * scale).astype(dtype)

            @pl.when(adders > ROUNDED_DQ_MAX_ADDERS)
            def _():
              sc.dq_smem.at[tile][...] = dq
          else:
            sc.dq_smem.at[tile][...] = dq
          hand_off(full)
          return
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last reduction has read the tile
        sc.dq_smem.at[wg][...] = dq
        plgpu.commit_smem()
        head, qb = step_block(it, i)
        plgpu.copy_smem_to_gmem(sc.dq_smem.at[wg],
                                dq_ref.at[it.b, pl.ds(qb * bq, bq), head, cols],
                                reduction_op="add")

      def end_step(slot):
        """After a step's last WGMMA on Q and dO: its Q/dO slot released to the memory
        warpgroup."""
        plgpu.barrier_arrive(sc.do_free.at[slot])
        plgpu.barrier_arrive(sc.q_free.at[slot])

      def split_grads(i, gi, slot, q_tile, do_tile, k_cols, pt, dst, dk, dv):
        """The rest of dq_split's step i after Pᵀ and dSᵀ: dSᵀ exchanged through
        shared memory, then dQ, dV and dK issued together, and dQ stored and sent to its
        reduction while dV and dK run. k_cols: K's columns of this warpgroup's half of dQ."""
        col = pl.multiple_of(wg * half, half)  # this warpgroup's columns of dQ
        if config.dq_stagger:
          read, lag, has_dq = staggered_ds(i, gi, dst)
          ds_buf = sc.ds_smem.at[read]
        else:
          ds_buf, lag, has_dq = share_ds(gi, dst), 0, None
        wait_turn()

        def grads(refs):
          dq_acc, dv_ref, dk_ref = refs
          plgpu.wgmma(dq_acc, ds_buf.T, k_cols)
          plgpu.wgmma(dv_ref, pt, do_tile)
          plgpu.wgmma(dk_ref, dst, q_tile)
          pass_turn()
          dq = plgpu.wgmma_accumulator_load(dq_acc, wait_n=2)  # dV and dK still run
          if has_dq is None:
            store_dq(i, gi, dq, pl.ds(col, half))
          else:  # warpgroup 0's first step has no last step's dQ (a dQ of stale dSᵀ, dropped)
            @pl.when(has_dq)
            def _():
              store_dq(i - lag, gi - lag, dq, pl.ds(col, half))
              plgpu.barrier_arrive(sc.ds_free.at[read])

        _, dv, dk = pl.run_state(grads)((plgpu.ACC.init(zeros((bq, half))), plgpu.ACC.init(dv),
                                         plgpu.ACC.init(dk)))
        end_step(slot)
        return dk, dv

      def split_cols_grads(i, gi, slot, q_tile, do_tile, k_step, pt, dst, ds_buf, dk, dv):
        """The rest of column_split's step i after Pᵀ and dSᵀ: dQ, dV and dK issued together
        on this warpgroup's columns, dQ first, so that its store (and, with dq_ordered, the
        wait for a free dQ slot) runs under dV and dK rather than after them."""
        if ds_buf is None:  # without scores_split, each warpgroup's own copy of dSᵀ
          ds_buf = share_ds(gi, dst).at[pl.ds(wg * bkv, bkv)]

        def grads(refs):
          dq_acc, dv_ref, dk_ref = refs
          plgpu.wgmma(dq_acc, ds_buf.T, k_step.at[:, my_cols])
          plgpu.wgmma(dv_ref, pt, do_tile.at[:, my_cols])
          plgpu.wgmma(dk_ref, dst, q_tile.at[:, my_cols])
          take_turn()
          dq = plgpu.wgmma_accumulator_load(dq_acc, wait_n=2)  # dV and dK still run
          store_dq(i, gi, dq, my_cols)

        _, dv, dk = pl.run_state(grads)((plgpu.ACC.init(zeros((bq, oc))), plgpu.ACC.init(dv),
                                         plgpu.ACC.init(dk)))
        end_step(slot)
        take_turn()  # pingpong: a step's second turn, as when dQ was issued on its own
        return dk, dv

      def step(i, carry, *, masked):
        dk, dv, z = carry
        z_next = zero_ref[0]  # the next step's offset (key_tiles)
        return (*step_grads(i, dk, dv, z, masked=masked), z_next)

      def step_grads(i, dk, dv, z, *, masked):
        gi = base + i  # the step's place in the CTA's pipeline: its slots
        slot = hopper.rem(gi, stages)
        _, qb = step_block(it, i)
        q_tile, do_tile = sc.q_smem.at[slot], sc.do_smem.at[slot]
        k_step, v_step, k_cols = key_tiles(z)
        plgpu.barrier_wait(sc.q_ready.at[slot])
        plgpu.barrier_wait(sc.do_ready.at[slot])
        plgpu.barrier_wait(sc.stats_ready.at[slot])

        # scores_split: this warpgroup's half of the step's queries (columns of Sᵀ)
        nq = bq // 2 if config.scores_split else bq
        q0 = pl.multiple_of(wg * nq, nq) if config.scores_split else 0
        qs = pl.ds(q0, nq)

        def scores(refs):
          s_ref, dp_ref = refs
          plgpu.wgmma(s_ref, k_step, (q_tile.at[qs] if config.scores_split else q_tile).T)
          plgpu.wgmma(dp_ref, v_step, (do_tile.at[qs] if config.scores_split else do_tile).T)
          take_turn()

        def probabilities(st):
          zt, tanh = _mosaic.exp2_scores(st, scale, softcap)
          if masked:
            zt = jnp.where(visible(slot, qb, zt.shape, q0), zt, -jnp.inf)
          elif segments:  # unread, but every load's barrier is waited on (its phase)
            plgpu.barrier_wait(sc.q_seg_ready.at[slot])
          # Each row statistic is loaded just before its use: with dK, dV, Sᵀ and dPᵀ live,
          # the 16 registers of a column vector decide whether the warpgroup spills.
          lse2 = hopper.load(sc.stats_smem.at[slot, 0, qs], col_layout)
          pt = jnp.exp2(zt - lax.broadcast_in_dim(lse2, st.shape, [1]))
          p_ds = pt if softcap is None else pt * (1.0 - tanh * tanh)
          return pt, p_ds

        if config.dq_stagger:  # warpgroup 1 starts once warpgroup 0's first scores are done
          pl.when((i == 0) & (wg == 1))(lambda: plgpu.barrier_wait(sc.lead))
        if config.early_softmax:
          def scores_early(s_ref, dp_ref):
            scores((s_ref, dp_ref))
            st = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # dPᵀ still runs
            pt, p_ds = probabilities(st)
            return pt, p_ds, dp_ref[...]

          pt, p_ds, dpt = pl.run_scoped(scores_early, plgpu.ACC((bkv, nq), jnp.float32),
                                        plgpu.ACC((bkv, nq), jnp.float32))
        else:
          st, dpt = pl.run_state(scores)((plgpu.ACC.init(zeros((bkv, nq))),
                                          plgpu.ACC.init(zeros((bkv, nq)))))
        if config.dq_stagger:
          pl.when((i == 0) & (wg == 0))(lambda: plgpu.barrier_arrive(sc.lead))
        if not config.early_softmax:
          pt, p_ds = probabilities(st)
        pt = pt.astype(dtype)  # dV's operand
        row_delta = hopper.load(sc.stats_smem.at[slot, 1, qs], col_layout)
        dst = (p_ds * (dpt - lax.broadcast_in_dim(row_delta, dpt.shape, [1]))).astype(dtype)
        if config.dq_split:
          return split_grads(i, gi, slot, q_tile, do_tile, k_cols, pt, dst, dk, dv)
        ds_buf = None
        if config.scores_split:  # the halves meet in the step's Pᵀ and dSᵀ slots
          b = hopper.rem(gi, 2)
          ds_buf, pt_buf = sc.ds_smem.at[b], sc.pt_smem.at[b]
          pt_buf.at[:, qs][...] = pt
          ds_buf.at[:, qs][...] = dst
          meet(sc.ds_ready.at[b])
          pt, dst = pt_buf, ds_buf

        if split and config.with_dq:
          return split_cols_grads(i, gi, slot, q_tile, do_tile, k_step, pt, dst, ds_buf,
                                  dk, dv)

        def grads(refs):
          dv_ref, dk_ref = refs
          plgpu.wgmma(dv_ref, pt, do_tile.at[:, my_cols] if split else do_tile)
          plgpu.wgmma(dk_ref, dst, q_tile.at[:, my_cols] if split else q_tile)
          take_turn()

        dv, dk = pl.run_state(grads)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
        end_step(slot)
        if not config.with_dq:
          return dk, dv

        ds_buf = share_ds(gi, dst).at[pl.ds(wg * bkv, bkv)]

        def mm(acc_ref):  # dQ = dS (own keys) K (own keys)
          plgpu.wgmma(acc_ref, ds_buf.T, k_step)
          take_turn()
          return acc_ref[...]

        store_dq(i, gi, pl.run_scoped(mm, plgpu.ACC((bq, oc), jnp.float32)), my_cols)
        return dk, dv

      carry = (zeros((bkv, oc)), zeros((bkv, oc)), zero_ref[0])
      if mask.is_dense:
        dk, dv, _ = lax.fori_loop(0, it.n_steps, functools.partial(step, masked=False), carry)
      elif mask.sees_all_keys:  # every step masked where the keys reach past the key bound
        whole = it.heads * (it.full_hi - it.full_lo)  # n_steps, or 0
        dk, dv, _ = _mosaic.masked_ranges(step, carry, 0, it.n_steps, 0, whole, dense=False)
      else:  # per head: the masked blocks before full_lo, the unmasked ones, the masked rest
        def head_steps(g, carry):
          start = g * it.per_head  # the head's first step
          lo, hi = it.unmasked()
          return _mosaic.masked_ranges(step, carry, start, start + it.per_head, start + lo,
                                       start + hi, dense=False)

        dk, dv, _ = lax.fori_loop(0, it.heads, head_steps, carry)

      if config.dq_stagger:  # warpgroup 0: the dQ of the key block's last step
        last = it.n_steps - 1
        ds_slot = hopper.rem(base + last, 2)

        @pl.when((wg == 0) & (last >= 0))
        def _():
          plgpu.barrier_wait(sc.ds_ready.at[ds_slot])
          dq = split_dq(sc.ds_smem.at[ds_slot], key_tiles(zero_ref[0])[2])
          store_dq(last, base + last, dq, pl.ds(0, half))  # warpgroup 0's columns
          plgpu.barrier_arrive(sc.ds_free.at[ds_slot])

      if config.pingpong:  # warpgroup 0 takes the turn warpgroup 1 took at the start
        pl.when(wg == 0)(take_turn)
      keys = pl.ds(my_key, bkv)
      if per_query_head and not config.dq_ordered:  # add this head's share into the float32
        # dK and dV, via the dQ tile (ordered: into dK and dV themselves, see put)
        for acc, acc_ref in ((dk * scale, dk_ref), (dv, dv_ref)):
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          sc.dq_smem.at[wg][...] = acc
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(sc.dq_smem.at[wg], acc_ref.at[it.b, keys, it.kv_head, my_cols],
                                  reduction_op="add")
        hopper.wait_stores_read()
        return base + it.n_steps
      plgpu.barrier_arrive(sc.pair)  # the other warpgroup has finished reading all of K
      plgpu.barrier_wait(sc.pair)
      def put(tiles):
        """Stores this warpgroup's (smem tile, dK or dV ref) pairs at the item's head; with
        dq_ordered under gqa_per_query_head, adds them into the key head's in the order of
        the group's query heads (the first stores), each after the last has landed."""
        if not per_query_head:  # (with group_splits into this CTA's partials)
          at = (it.part, it.b, keys, it.kv_head) if splits > 1 else (it.b, keys, it.kv_head)
          for tile, ref in tiles:
            plgpu.copy_smem_to_gmem(tile, ref.at[at])
          return
        member = hopper.rem(it.h, group)
        counter = order[2].at[((it.b * kv_heads + it.kv_head) * n_kv + it.kvi) * 2 + wg]
        plgpu.semaphore_wait(counter, member, decrement=False, memory_scope="gpu")
        for op, when in ((None, member == 0), ("add", member > 0)):
          @pl.when(when)
          def _(op=op):
            for tile, ref in tiles:
              plgpu.copy_smem_to_gmem(tile, ref.at[it.b, keys, it.kv_head], reduction_op=op)
        plgpu.wait_smem_to_gmem(0)  # landed: the next query head may add
        plgpu.semaphore_signal(counter, 1, memory_scope="gpu")

      if split:  # each writes its columns of the tile; then one stores dK, the other dV
        k_mine.at[:, my_cols][...] = (dk * scale).astype(dtype)
        v_mine.at[:, my_cols][...] = dv.astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_arrive(sc.pair)
        plgpu.barrier_wait(sc.pair)
        pl.when(wg == 0)(lambda: put([(k_mine, dk_ref)]))
        pl.when(wg == 1)(lambda: put([(v_mine, dv_ref)]))
      else:
        k_mine[...] = (dk * scale).astype(dtype)
        v_mine[...] = dv.astype(dtype)
        plgpu.commit_smem()
        put([(k_mine, dk_ref), (v_mine, dv_ref)])
      hopper.wait_stores_read()
      if work is not None:  # K's and V's shared memory is free for the next item's
        plgpu.barrier_arrive(sc.kv_free)
      return base + it.n_steps

    each_item(run_item, jnp.int32(0))

  @pl.when(wg == 2)
  def _memory():
    plgpu.set_max_registers(hopper.WARPGROUP_REGISTERS[1], action="decrease")

    def load_keys(it):
      keys = pl.ds(it.kvi * cta_keys, cta_keys)
      plgpu.copy_gmem_to_smem(k_ref.at[it.b, keys, it.kv_head], sc.k_smem, sc.k_ready)
      plgpu.copy_gmem_to_smem(v_ref.at[it.b, keys, it.kv_head], sc.v_smem, sc.v_ready)
      if segments:
        plgpu.copy_gmem_to_smem(seg_refs[1].at[it.b, keys], sc.kv_seg, sc.kv_seg_ready)

    def load(it, i, slot):
      head, qb = step_block(it, i)
      rows = pl.ds(qb * bq, bq)
      plgpu.copy_gmem_to_smem(q_ref.at[it.b, rows, head], sc.q_smem.at[slot], sc.q_ready.at[slot])
      plgpu.copy_gmem_to_smem(do_ref.at[it.b, rows, head], sc.do_smem.at[slot],
                              sc.do_ready.at[slot])

      plgpu.copy_gmem_to_smem(stats_ref.at[it.b, head, :, rows], sc.stats_smem.at[slot],
                              sc.stats_ready.at[slot])
      if segments:
        plgpu.copy_gmem_to_smem(seg_refs[0].at[it.b, pl.ds(qb * bq, _seg_len(bq))],
                                sc.q_seg.at[slot], sc.q_seg_ready.at[slot])
      if per_block is not None:  # (the grid item's steps are the global ones: step_adders)
        ring = adders_slot(i)
        plgpu.copy_gmem_to_smem(per_block[0].at[it.b, qb],
                                sc.adders.at[ring], sc.adders_ready.at[ring])

    def loads():
      if work is None:
        load_keys(items[0])
        hopper.fill_ring(functools.partial(load, items[0]), items[0].n_steps, stages,
                         (sc.q_free, sc.do_free))
        return

      def item_loads(it, base):
        """dq_paired: the item's loads at global steps base, base + 1, ...: its first
        steps' Q and dO (into slots the last item's last steps free) before its K and V
        (into shared memory the compute warpgroups leave after the last item's dK and dV)."""
        def keys():
          if it.descending:  # the pair's second key block
            plgpu.barrier_wait(sc.kv_free)
          load_keys(it)

        hopper.fill_ring(functools.partial(load, it), it.n_steps, stages,
                         (sc.q_free, sc.do_free), base=base, after_first=keys)
        return base + it.n_steps

      each_item(item_loads, jnp.int32(0))

    if not config.dq_ordered:
      loads()
      return

    def send_dq(it, i, gi):
      """dq_ordered, on the memory warpgroup's warp 1 (so that a wait for a counter never
      holds up warp 0's loads): the item's step i (global step gi)'s dQ tiles, once both compute
      warpgroups have left them, into dq in rank order: after the `rank` key blocks before
      this one, the first storing."""
      head, qb = step_block(it, i)
      counter = order[1].at[block_index(it, head, qb)]
      rank = (order[0][it.b, it.kvi, qb] if work is None
              else order[0][it.b, head, it.kvi, qb])
      # Loaded before the waits: a load after them would lengthen each block's chain of adds.
      adders = None if per_block is None else per_block[0][it.b, qb, 0]
      slot, full, free = dq_slot(gi)
      rows, half = pl.ds(qb * bq, bq), d // 2
      cols = lambda w: pl.ds(w * half, half)

      def send(tiles, dst, op, rounded):
        for w in range(2):
          tile = tiles.at[slot * 2 + w]
          if rounded:  # rows 0..bq of the slot
            tile = tile.at[pl.ds(0, bq)]
          plgpu.copy_smem_to_gmem(tile, dst.at[it.b, rows, head, cols(w)], reduction_op=op)

      plgpu.barrier_wait(full)
      plgpu.semaphore_wait(counter, rank, decrement=False, memory_scope="gpu")
      for op, when in ((None, rank == 0), ("add", rank > 0)):
        @pl.when(when)
        def _(op=op):
          if per_block is None:
            send(sc.dq_smem, dq_ref, op, config.dq_rounded)
            return
          pl.when(adders <= ROUNDED_DQ_MAX_ADDERS)(
              lambda: send(per_block[2], dq_ref, op, rounded=True))
          pl.when(adders > ROUNDED_DQ_MAX_ADDERS)(
              lambda: send(sc.dq_smem, per_block[1], op, rounded=False))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      plgpu.barrier_arrive(free)
      plgpu.wait_smem_to_gmem(0)  # landed: the next key block may add
      plgpu.semaphore_signal(counter, 1, memory_scope="gpu")

    @hopper.on_each_warp
    def _per_warp():
      warp = lax.axis_index("warp")
      pl.when(warp == 0)(loads)

      @pl.when(warp == 1)
      def _():
        for i in range(config.dq_buffers):  # the compute warpgroups' first dQ tiles are free
          plgpu.barrier_arrive(dq_slot(i)[2])
        def item_sends(it, base):
          pl.loop(0, it.n_steps)(lambda i: send_dq(it, i, base + i))
          return base + it.n_steps

        each_item(item_sends, jnp.int32(0))
        hopper.wait_stores_read()


def _adders_table(adders):
  """dq_rounded_per_block's adders per query block ([B, n_q]) as the kernel reads them:
  [B, n_q, _ADDERS_COPY], each count repeated, so that a block's copy (step_adders) starts
  on a 128-byte boundary: a copy of a [B, n_q] row's entries from block qb on, an unaligned
  start, stopped the kernel with an illegal instruction."""
  xp = np if isinstance(adders, np.ndarray) else jnp
  return xp.repeat(adders[..., None], _ADDERS_COPY, axis=-1)


def _finish_dq(dq, sums, adders, block_q: int, scale: float):
  """dq_rounded_per_block's pass after the kernel: dq ([B, T, Hq, D], the input dtype) with
  each query block of block_q rows that more than ROUNDED_DQ_MAX_ADDERS key blocks added
  into (adders: [B, n_q]) taken from the float32 `sums`, scaled and rounded, and each block
  without an adder zeros. A CTA per (batch row, query block, head) reads the block's adders
  and leaves the rounded blocks, which the kernel stored in dq itself, unread."""
  b, _, hq, d = dq.shape
  n_q, dtype = adders.shape[1], dq.dtype

  def body(adders_ref, sums_ref, dq_ref):
    bb, qb, head = (lax.axis_index(a) for a in ("b", "q", "h"))
    rows = pl.ds(qb * block_q, block_q)
    count = adders_ref[bb, qb]

    def kernel(sums_tile, out_tile, loaded):
      def store(tile):
        out_tile[...] = tile.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_tile, dq_ref.at[bb, rows, head])
        plgpu.wait_smem_to_gmem(0)

      @pl.when(count > ROUNDED_DQ_MAX_ADDERS)
      def _():
        plgpu.copy_gmem_to_smem(sums_ref.at[bb, rows, head], sums_tile, loaded)
        plgpu.barrier_wait(loaded)
        store(hopper.load(sums_tile, plgpu.Layout.WGMMA) * scale)

      @pl.when(count == 0)
      def _():
        store(plgpu.layout_cast(jnp.zeros((block_q, d), jnp.float32), plgpu.Layout.WGMMA))

    tiles = lambda dt: hopper.swizzled_tiles(hopper.row_swizzle(d, dt), dt)
    pl.run_scoped(kernel, plgpu.SMEM((block_q, d), jnp.float32, transforms=tiles(jnp.float32)),
                  plgpu.SMEM((block_q, d), dtype, transforms=tiles(dtype)), plgpu.Barrier())

  out = jax.new_ref(dq)  # the rounded blocks stay as the kernel stored them
  pl.kernel(body, out_type=(), mesh=plgpu.Mesh(grid=(b, n_q, hq), grid_names=("b", "q", "h")),
            compiler_params=plgpu.CompilerParams(), name="flash_attention_bwd_dq_finish",
            )(adders, sums, out)
  return out[...]


def row_stats(opts: AttentionOptions, res: _common.Residuals, delta):
  """[B, Hq, 2, T] float32: the log-sum-exp in the exp2 domain (0 for a query that sees no
  key, so that its P = 2^(-inf - 0) = 0) and Δ, as the Mosaic backward kernels load them."""
  lse2 = res.lse * hopper.LOG2E
  if opts.mask.rows_may_be_empty:
    lse2 = jnp.where(res.lse == -jnp.inf, 0.0, lse2)
  return jnp.stack([lse2, delta], axis=2)


def backward(opts: AttentionOptions, config: MosaicBackwardConfig, res: _common.Residuals,
             cts, stats=None, lengths: tuple[int, int] | None = None):
  """(dq, dk, dv, None, None) from the saved residuals and the output cotangents; dq is None
  with config.with_dq=False. `stats`: row_stats(opts, res, Δ) if the caller has it.
  `lengths`: the T and S the kernel runs at, past the ends of the arrays (whose rows there
  read as zeros and take no writes), with segment ids of those lengths; None: theirs."""
  d_out, d_lse = cts
  q, k, v = res.q, res.k, res.v
  b, _, hq, d = q.shape
  hkv = k.shape[2]
  t, s = lengths or (q.shape[1], k.shape[1])
  bq, mask = config.block_q, opts.mask
  n_q = -(-t // bq)
  n_kv = s // config.cta_keys()
  rotate = _rotates(config, mask, n_kv)
  paired = _paired_splits(config, mask, b, hq, hkv, t, s, hopper.sm_count())
  if paired is not None:
    config = dataclasses.replace(config, group_splits=paired)
  if stats is None:
    stats = row_stats(opts, res, _common.softmax_delta(res.out, d_out, d_lse))
  stats = _mosaic.stats_to(stats, t)
  if mask.segments:
    q_seg, kv_seg = res.q_segment_ids, res.kv_segment_ids
    # Query blocks reaching past T take the last id there: they add nothing (zero rows),
    # and the ranges of the blocks before them stay exact.
    ranges = _mosaic.segment_block_ranges(
        kv_seg, jnp.pad(q_seg, ((0, 0), (0, -t % bq)), mode="edge"), config.cta_keys(), bq)
    seg_args = (q_seg, kv_seg, ranges)
  else:
    seg_args, ranges = (), None
  per_query_head = config.gqa_per_query_head and hq > hkv
  splits = min(config.group_splits, hq // hkv)
  grid_heads = hq if per_query_head else hkv * splits
  written = None
  if paired is not None:  # the CTAs' items, and the ranks of their lockstep order (causal,
    # T = S, no segment ids: every query block has adders, the diagonal's key block first)
    deal, ctas, ranks = _paired_schedule(mask, b, hq, hkv, paired, n_kv, n_q,
                                         config.cta_keys(), bq)
    rank_args = (ranks,)
  elif config.dq_ordered:
    ranks, adders, written = _dq_order(mask, b, n_kv, config.cta_keys(), n_q, bq, q.shape[1],
                                       ranges, rotate=rotate)
    rank_args = (ranks, _adders_table(adders)) if config.dq_rounded_per_block else (ranks,)
  else:
    rank_args = ()
  if per_query_head and not config.dq_ordered:  # dK and dV gather the group's query heads
    dkv_acc = (jax.new_ref(jnp.zeros(k.shape, jnp.float32)),  # by TMA reductions too
               jax.new_ref(jnp.zeros(v.shape, jnp.float32)))
    out_type = ()
  else:  # (ordered, by reductions in the group's order into the outputs themselves)
    dkv_acc = ()
    parts = (splits,) if splits > 1 else ()  # group_splits: each split's partials
    out_type = (jax.ShapeDtypeStruct((*parts, *k.shape), k.dtype),
                jax.ShapeDtypeStruct((*parts, *v.shape), v.dtype))
  # The float32 dq: zeros that every key block adds into; with dq_ordered an uninitialized
  # output, which each query block's first adder stores rather than adds into (no memset).
  dq_acc = ()
  if config.dq_rounded_per_block:  # dq's rounded blocks, and the others' float32 sums
    out_type = (jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct(q.shape, jnp.float32), *out_type)
  elif config.dq_ordered:  # with dq_rounded in the input dtype, already scaled
    out_type = (jax.ShapeDtypeStruct(q.shape, q.dtype if config.dq_rounded else jnp.float32),
                *out_type)
  elif config.with_dq:
    dq_acc = (jax.new_ref(jnp.zeros(q.shape, jnp.float32)),)
  def body(q_ref, k_ref, v_ref, do_ref, stats_ref, zero_ref, *refs):
    tables = ()
    if config.dq_ordered:  # the rank table (with dq_rounded_per_block the adders' too)
      tables, refs = refs[:len(rank_args)], refs[len(rank_args):]
    seg_refs, refs = (refs[:3], refs[3:]) if mask.segments else (None, refs)
    sums_ref = None
    if config.dq_rounded_per_block:
      dq_ref, sums_ref, dk_ref, dv_ref = refs
    else:
      dq_ref, dk_ref, dv_ref = refs if config.with_dq else (None, *refs)

    def kernel(sc: _Scratch):
      views = _DqViews.of(config, sc.dq_smem)
      sc = sc._replace(dq_smem=views.tiles)
      per_block = None
      if config.dq_rounded_per_block:
        per_block = (tables[1], sums_ref, views.rounded)
      order = None
      if config.dq_ordered:  # with counters that start at zero in every call
        order = (tables[0], pl.get_global(plgpu.SemaphoreType.REGULAR((b * hq * n_q,))))
        if per_query_head:  # and per key block and warpgroup, for dK and dV
          order += (pl.get_global(plgpu.SemaphoreType.REGULAR((b * hkv * n_kv * 2,))),)
      _backward_kernel(q_ref, k_ref, v_ref, do_ref, stats_ref, zero_ref, seg_refs,
                       dq_ref, dk_ref, dv_ref, sc, config=config, mask=mask,
                       scale=opts.scale, softcap=opts.logit_softcap, group=hq // hkv,
                       rotate=rotate, heavy_first=_heavy_first(config, mask, n_kv),
                       order=order, per_block=per_block, lengths=(t, s),
                       work=None if paired is None else deal)

    pl.run_scoped(kernel, _Scratch.shapes(config, d, q.dtype, mask.segments,
                                          paired is not None),
                  collective_axes="wg")

  outs = pl.kernel(
      body,
      out_type=out_type,
      mesh=plgpu.Mesh(grid=(b, grid_heads, n_kv) if paired is None else (ctas,),
                      grid_names=("b", "h", "kv") if paired is None else ("cta",),
                      num_threads=3, thread_name="wg"),
      # No step reduces across warps: no shared-memory scratch for reductions (Mosaic GPU
      # reserves 2 KiB otherwise, which scores_split's Pᵀ slots or two dQ slots beside
      # 128-query steps leave no room for).
      compiler_params=plgpu.CompilerParams(approx_math=True, **(
          {"reduction_scratch_bytes": 0} if _SCRATCH_PARAM else {})),
      cost_estimate=_common.cost_estimate(opts, q, k, 5 if config.with_dq else 4),
      name="flash_attention_bwd_mosaic",
  )(q, k, v, d_out, stats, jnp.zeros((1,), jnp.int32), *rank_args, *seg_args, *dq_acc,
    *dkv_acc)
  dq = None
  if config.dq_rounded_per_block:
    dq, sums, *outs = outs
    dq = _finish_dq(dq, sums, adders, bq, opts.scale)
  elif config.dq_ordered:
    dq, *outs = outs
    if written is not None:  # query blocks that no key block adds into were never written
      dq = jnp.where(written, dq, jnp.zeros((), dq.dtype))
    if not config.dq_rounded:
      dq = (dq * opts.scale).astype(q.dtype)
  elif config.with_dq:
    dq = (dq_acc[0][...] * opts.scale).astype(q.dtype)
  if per_query_head and not config.dq_ordered:
    outs = tuple(acc[...].astype(k.dtype) for acc in dkv_acc)
  elif splits > 1:  # the partials summed in float32, in order
    outs = tuple(sum((part[i].astype(jnp.float32) for i in range(1, splits)),
                     part[0].astype(jnp.float32)).astype(k.dtype) for part in outs)
  return dq, *outs, None, None
