"""FlashAttention-2 in Pallas (Triton flavour): forward, dq and dk/dv kernels.

Forward (Dao 2023, Alg. 1): one program per (query block, batch, query head) walks the key
blocks the mask can reach with an online softmax and saves the float32 log-sum-exp. The
backward (Alg. 2, split as in §3.1.2) recomputes p = exp(ŝ - lse): a dq kernel over query
blocks, and a dk/dv kernel per (key block, batch, key head) that loops over the G query
heads of its group and the query blocks that can see it, so GQA needs no atomics and the
backward is deterministic. delta = rowsum(dO ∘ O) is one XLA fusion.

Blocks a causal or windowed mask hides are skipped through the loop bounds
(masks.kv_block_range / q_block_range); with segment ids, a block whose id ranges do not
overlap the query block's is skipped by a branch. Any T and S work (masked tails); head
dims that are not powers of two are padded inside the tiles (loads are masked).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from memeff_jax.kernels import hopper
from memeff_jax import _tuning
from memeff_jax.ops import _dispatch
from memeff_jax.ops import _vma
from memeff_jax.ops.flash_attention import _common
from memeff_jax.ops.flash_attention import masks
from memeff_jax.ops.flash_attention._common import AttentionOptions, Residuals

try:
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

_BIG = 2**30


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Tiles and launch settings of the three kernels."""

  block_q: int = 64
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2
  bwd_block_q: int = 64
  bwd_block_k: int = 64
  bwd_num_warps: int = 4
  bwd_num_stages: int = 2


def default_config(head_dim: int) -> BlockConfig:
  """Tiles for a head dim: configs/tuning/flash_attention.toml's `d<pow2>` section for
  this GPU kind if there is one, else a heuristic."""
  dim = pl.next_power_of_2(head_dim)
  tuned = _tuning.lookup("flash_attention", "pallas_triton").get(f"d{dim}")
  if tuned:
    return BlockConfig(**tuned)
  if dim <= 64:
    return BlockConfig(block_q=128, block_k=64, num_warps=4, num_stages=3)
  if dim <= 128:
    return BlockConfig(block_q=128, block_k=64, num_warps=8, num_stages=2)
  return BlockConfig(block_q=64, block_k=32, num_warps=8, num_stages=2,
                     bwd_block_q=32, bwd_block_k=32, bwd_num_warps=8)


@dataclasses.dataclass(frozen=True)
class PallasTriton:
  """Pallas Triton kernels. `config=None` picks tiles by head dim (and the tuning table)."""

  config: BlockConfig | None = None
  interpret: bool = False
  name: str = "pallas_triton"

  def __call__(self, q, k, v, q_seg, kv_seg, *, opts: AttentionOptions):
    return _attention(self, self.plan(q, opts), q, k, v, q_seg, kv_seg)

  def backward(self, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, *, opts: AttentionOptions):
    """(dq, dk, dv) from saved out and lse [B, Hq, T], without a forward pass."""
    res = Residuals(q, k, v, q_seg, kv_seg, out, lse)
    return _vma.unchecked(backward_pass)(self.plan(q, opts), res, (d_out, d_lse))[:3]

  def plan(self, q, opts: AttentionOptions) -> "TritonPlan":
    """The static settings of a call (NotImplementedError where the kernels cannot run)."""
    if plgpu is None:
      raise _dispatch.Unsupported("jax.experimental.pallas.triton is not importable")
    if not 16 <= q.shape[-1] <= 256:  # Triton's dot needs K ≥ 16; wider tiles spill
      raise _dispatch.Unsupported(f"pallas_triton serves head dims 16 to 256, got D={q.shape[-1]}")
    if not self.interpret and not hopper.on_nvidia_gpu():
      raise _dispatch.Unsupported(
          f"pallas_triton needs an NVIDIA GPU (default device: {jax.devices()[0].device_kind});"
          " PallasTriton(interpret=True) runs the kernels in the Pallas interpreter")
    return TritonPlan(opts, self.config or default_config(q.shape[-1]), self.interpret)


@dataclasses.dataclass(frozen=True)
class TritonPlan:
  """A call's static settings: the options, the tiles, interpret mode (PallasTriton.plan)."""
  opts: AttentionOptions
  config: BlockConfig
  interpret: bool


def _dot(a, b, *, trans_a=False, trans_b=False):
  exact = jnp.float32 in (a.dtype, b.dtype)
  return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b,
                   precision=jax.lax.Precision.HIGHEST if exact else None)


class _Tile:
  """Index bookkeeping for one (query block, key block) tile inside a kernel."""

  def __init__(self, st: TritonPlan, t: int, s: int, d: int, q_start, block_q: int):
    self.st, self.t, self.s, self.d = st, t, s, d
    self.q_idx = q_start + jnp.arange(block_q, dtype=jnp.int32)
    self.q_ok = self.q_idx < t
    self.d_ok = jnp.arange(pl.next_power_of_2(d), dtype=jnp.int32) < d

  def scores(self, q, k, k_start, block_k, q_seg, k_seg):
    """(capped scores, visible), [block_q, block_k] float32."""
    opts = self.st.opts
    s = _common.cap(_dot(q, k, trans_b=True) * opts.scale, opts.logit_softcap)
    k_idx = k_start + jnp.arange(block_k, dtype=jnp.int32)
    seen = masks.visible(opts.mask, self.q_idx, k_idx, q_seg, k_seg)
    seen = seen & self.q_ok[:, None] & (k_idx < self.s)[None, :]
    return s, seen


def _load_rows(ref, start, size, n, d_ok, other=0.0):
  """Rows [start, start + size) of a [n, Dp] ref, zero outside [0, n) × [0, D)."""
  rows_ok = start + jnp.arange(size, dtype=jnp.int32) < n
  return plgpu.load(ref.at[pl.ds(start, size), :], mask=rows_ok[:, None] & d_ok[None, :],
                    other=other)


def _store_rows(ref, start, size, value, mask, interpret):
  """Stores value into rows [start, start + size) of a [n, Dp] ref where mask holds.

  Interpreted, the column start is an int32 array rather than the `:`'s Python 0: the Pallas
  interpreter discharges the store at lowering, where a Python 0 becomes int64 under
  jax_enable_x64 beside the int32 row start, and its store (unlike its load) does not cast."""
  cols = pl.ds(jnp.zeros((), jnp.int32), ref.shape[1]) if interpret else slice(None)
  plgpu.store(ref.at[pl.ds(start, size), cols], value.astype(ref.dtype), mask=mask)


def _load_vec(ref, start, size, n, other):
  ok = start + jnp.arange(size, dtype=jnp.int32) < n
  return plgpu.load(ref.at[pl.ds(start, size)], mask=ok, other=other)


def _segments_overlap(q_seg, q_ok, k_seg, k_ok):
  """False when no query id can equal any key id (their [min, max] ranges are disjoint)."""
  q_lo = jnp.min(jnp.where(q_ok, q_seg, _BIG))
  q_hi = jnp.max(jnp.where(q_ok, q_seg, -_BIG))
  k_lo = jnp.min(jnp.where(k_ok, k_seg, _BIG))
  k_hi = jnp.max(jnp.where(k_ok, k_seg, -_BIG))
  return (q_lo <= k_hi) & (k_lo <= q_hi)


def _maybe(seg_check, fn, carry):
  """fn(carry) where seg_check is None or True, else carry unchanged (a skipped block)."""
  if seg_check is None:
    return fn(carry)
  return jax.lax.cond(seg_check, fn, lambda c: c, carry)


def _fwd_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, o_ref, lse_ref, *,
                st: TritonPlan, t: int, s: int, d: int):
  # q_ref/o_ref [T, Dp], k_ref/v_ref [S, Dp], lse_ref [T], segment refs [T] / [S] or None.
  cfg = st.config
  bq, bk = cfg.block_q, cfg.block_k
  q_start = pl.program_id(0) * bq
  tile = _Tile(st, t, s, d, q_start, bq)
  q = _load_rows(q_ref, q_start, bq, t, tile.d_ok)  # [bq, Dp]
  q_seg = None if q_seg_ref is None else _load_vec(q_seg_ref, q_start, bq, t, -1)

  def body(j, carry):
    k_start = j * bk
    k_seg = None if k_seg_ref is None else _load_vec(k_seg_ref, k_start, bk, s, -2)

    def update(carry):
      m, l, acc = carry
      k = _load_rows(k_ref, k_start, bk, s, tile.d_ok)  # [bk, Dp]
      sc, seen = tile.scores(q, k, k_start, bk, q_seg, k_seg)  # [bq, bk]
      sc = jnp.where(seen, sc, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(sc, axis=1))
      m_use = jnp.where(m_new > -jnp.inf, m_new, 0.0)
      p = jnp.exp(sc - m_use[:, None])
      alpha = jnp.exp(m - m_use)
      v = _load_rows(v_ref, k_start, bk, s, tile.d_ok)
      acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
      return m_new, l * alpha + jnp.sum(p, axis=1), acc

    check = None if k_seg is None else _segments_overlap(
        q_seg, tile.q_ok, k_seg, k_start + jnp.arange(bk) < s)
    return _maybe(check, update, carry)

  dp = pl.next_power_of_2(d)
  init = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32),
          jnp.zeros((bq, dp), jnp.float32))
  lo, hi = masks.kv_block_range(st.opts.mask, q_start, bq, s, bk)
  m, l, acc = jax.lax.fori_loop(lo, hi, body, init)
  out = acc / jnp.where(l > 0, l, 1.0)[:, None]
  _store_rows(o_ref, q_start, bq, out, tile.q_ok[:, None] & tile.d_ok[None, :],
              st.interpret)
  plgpu.store(lse_ref.at[pl.ds(q_start, bq)], _common.lse_from(m, l), mask=tile.q_ok)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, k_seg_ref,
               dq_ref, *, st: TritonPlan, t: int, s: int, d: int):
  cfg = st.config
  bq, bk = cfg.bwd_block_q, cfg.bwd_block_k
  q_start = pl.program_id(0) * bq
  tile = _Tile(st, t, s, d, q_start, bq)
  q = _load_rows(q_ref, q_start, bq, t, tile.d_ok)
  do = _load_rows(do_ref, q_start, bq, t, tile.d_ok)
  lse = _common.finite_or_zero(_load_vec(lse_ref, q_start, bq, t, 0.0))
  delta = _load_vec(delta_ref, q_start, bq, t, 0.0)
  q_seg = None if q_seg_ref is None else _load_vec(q_seg_ref, q_start, bq, t, -1)

  def body(j, dq):
    k_start = j * bk
    k_seg = None if k_seg_ref is None else _load_vec(k_seg_ref, k_start, bk, s, -2)

    def update(dq):
      k = _load_rows(k_ref, k_start, bk, s, tile.d_ok)
      v = _load_rows(v_ref, k_start, bk, s, tile.d_ok)
      sc, seen = tile.scores(q, k, k_start, bk, q_seg, k_seg)
      p = jnp.where(seen, jnp.exp(sc - lse[:, None]), 0.0)
      dp = _dot(do, v, trans_b=True)
      ds = p * (dp - delta[:, None]) * _common.cap_grad(sc, st.opts.logit_softcap)
      return dq + _dot(ds.astype(k.dtype), k)

    check = None if k_seg is None else _segments_overlap(
        q_seg, tile.q_ok, k_seg, k_start + jnp.arange(bk) < s)
    return _maybe(check, update, dq)

  lo, hi = masks.kv_block_range(st.opts.mask, q_start, bq, s, bk)
  dq = jax.lax.fori_loop(lo, hi, body, jnp.zeros((bq, pl.next_power_of_2(d)), jnp.float32))
  _store_rows(dq_ref, q_start, bq, dq * st.opts.scale, tile.q_ok[:, None] & tile.d_ok[None, :],
              st.interpret)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, k_seg_ref,
                dk_ref, dv_ref, *, st: TritonPlan, t: int, s: int, d: int, groups: int):
  # q_ref/do_ref [T, G, Dp]; lse/delta [G, T]; k/v/dk/dv [S, Dp].
  cfg = st.config
  bq, bk = cfg.bwd_block_q, cfg.bwd_block_k
  k_start = pl.program_id(0) * bk
  k_idx = k_start + jnp.arange(bk, dtype=jnp.int32)
  k_ok = k_idx < s
  d_ok = jnp.arange(pl.next_power_of_2(d), dtype=jnp.int32) < d
  k = _load_rows(k_ref, k_start, bk, s, d_ok)
  v = _load_rows(v_ref, k_start, bk, s, d_ok)
  k_seg = None if k_seg_ref is None else _load_vec(k_seg_ref, k_start, bk, s, -2)
  lo, hi = masks.q_block_range(st.opts.mask, k_start, bk, t, bq)

  def head(g, carry):
    def body(i, carry):
      q_start = i * bq
      tile = _Tile(st, t, s, d, q_start, bq)
      q_seg = None if q_seg_ref is None else _load_vec(q_seg_ref, q_start, bq, t, -1)

      def update(carry):
        dk, dv = carry
        rows = q_start + jnp.arange(bq, dtype=jnp.int32)
        mask2 = (rows < t)[:, None] & d_ok[None, :]
        q = plgpu.load(q_ref.at[pl.ds(q_start, bq), g, :], mask=mask2, other=0.0)
        do = plgpu.load(do_ref.at[pl.ds(q_start, bq), g, :], mask=mask2, other=0.0)
        lse = _common.finite_or_zero(
            plgpu.load(lse_ref.at[g, pl.ds(q_start, bq)], mask=rows < t, other=0.0))
        delta = plgpu.load(delta_ref.at[g, pl.ds(q_start, bq)], mask=rows < t, other=0.0)
        sc, seen = tile.scores(q, k, k_start, bk, q_seg, k_seg)  # [bq, bk]
        p = jnp.where(seen, jnp.exp(sc - lse[:, None]), 0.0)
        dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)  # [bk, Dp]
        dp = _dot(do, v, trans_b=True)
        ds = p * (dp - delta[:, None]) * _common.cap_grad(sc, st.opts.logit_softcap)
        dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)
        return dk, dv

      check = None if k_seg is None else _segments_overlap(q_seg, tile.q_ok, k_seg, k_ok)
      return _maybe(check, update, carry)

    return jax.lax.fori_loop(lo, hi, body, carry)

  zeros = jnp.zeros((bk, pl.next_power_of_2(d)), jnp.float32)
  dk, dv = jax.lax.fori_loop(0, groups, head, (zeros, zeros))
  mask = k_ok[:, None] & d_ok[None, :]
  _store_rows(dk_ref, k_start, bk, dk * st.opts.scale, mask, st.interpret)
  _store_rows(dv_ref, k_start, bk, dv, mask, st.interpret)


def _call(kernel, st, grid, in_specs, out_specs, out_shape, name, warps, stages, cost):
  call = pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      interpret=st.interpret, name=name, cost_estimate=cost,
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages))
  return hopper.without_x64(call)


def _forward(st: TritonPlan, q, k, v, q_seg, kv_seg):
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  g, dp, cfg = hq // hkv, pl.next_power_of_2(d), st.config
  seq = lambda n: pl.BlockSpec((None, n, None, dp), lambda i, bb, h: (bb, 0, h, 0))
  kv = pl.BlockSpec((None, s, None, dp), lambda i, bb, h: (bb, 0, h // g, 0))
  seg = lambda n: pl.BlockSpec((None, n), lambda i, bb, h: (bb, 0))
  has_seg = q_seg is not None
  in_specs = [seq(t), kv, kv] + ([seg(t), seg(s)] if has_seg else [])

  def kernel(*refs):
    q_ref, k_ref, v_ref, *rest = refs
    seg_refs, (o_ref, lse_ref) = (rest[:2], rest[2:]) if has_seg else ((None, None), rest)
    _fwd_kernel(q_ref, k_ref, v_ref, *seg_refs, o_ref, lse_ref, st=st, t=t, s=s, d=d)

  out, lse = _call(
      kernel, st, (pl.cdiv(t, cfg.block_q), b, hq), in_specs,
      [seq(t), pl.BlockSpec((None, None, t), lambda i, bb, h: (bb, h, 0))],
      [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, t), jnp.float32)],
      "flash_attention_fwd", cfg.num_warps, cfg.num_stages,
      _common.cost_estimate(st.opts, q, k, 2))(q, k, v, *((q_seg, kv_seg) if has_seg else ()))
  return out, lse


def backward_pass(st: TritonPlan, res: Residuals, cts):
  """(dq, dk, dv, None, None): the custom_vjp backward, also run by pallas_mosaic_gpu."""
  d_out, d_lse = cts
  delta = _common.softmax_delta(res.out, d_out, d_lse)  # one XLA fusion
  return dq_pass(st, res, d_out, delta), *_dkv_pass(st, res, d_out, delta), None, None


def dq_pass(st: TritonPlan, res: Residuals, d_out, delta):
  """dq alone: one program per (query block, batch, query head), recomputing P and dP."""
  q, k, v = res.q, res.k, res.v
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  g, dp, cfg = hq // hkv, pl.next_power_of_2(d), st.config
  has_seg = res.q_segment_ids is not None
  segs = (res.q_segment_ids, res.kv_segment_ids) if has_seg else ()
  seq = lambda n: pl.BlockSpec((None, n, None, dp), lambda i, bb, h: (bb, 0, h, 0))
  kv = pl.BlockSpec((None, s, None, dp), lambda i, bb, h: (bb, 0, h // g, 0))
  row = pl.BlockSpec((None, None, t), lambda i, bb, h: (bb, h, 0))
  seg = lambda n: pl.BlockSpec((None, n), lambda i, bb, h: (bb, 0))

  def dq_kernel(*refs):
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest = refs
    seg_refs, (dq_ref,) = (rest[:2], rest[2:]) if has_seg else ((None, None), rest)
    _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *seg_refs, dq_ref,
               st=st, t=t, s=s, d=d)

  return _call(dq_kernel, st, (pl.cdiv(t, cfg.bwd_block_q), b, hq),
               [seq(t), kv, kv, seq(t), row, row] + ([seg(t), seg(s)] if has_seg else []),
               seq(t), jax.ShapeDtypeStruct(q.shape, q.dtype), "flash_attention_dq",
               cfg.bwd_num_warps, cfg.bwd_num_stages, _common.cost_estimate(st.opts, q, k, 3))(
                   q, k, v, d_out, res.lse, delta, *segs)


def _dkv_pass(st: TritonPlan, res: Residuals, d_out, delta):
  """(dk, dv): one program per (key block, batch, key head), looping over the G query heads."""
  q, k = res.q, res.k
  t, hq, d = q.shape[1:]
  s, hkv = k.shape[1], k.shape[2]
  g, dp, cfg = hq // hkv, pl.next_power_of_2(d), st.config
  has_seg = res.q_segment_ids is not None
  segs = (res.q_segment_ids, res.kv_segment_ids) if has_seg else ()
  group = pl.BlockSpec((None, t, g, dp), lambda j, bb, h: (bb, 0, h, 0))
  kv2 = pl.BlockSpec((None, s, None, dp), lambda j, bb, h: (bb, 0, h, 0))
  rows = pl.BlockSpec((None, g, t), lambda j, bb, h: (bb, h, 0))
  seg2 = lambda n: pl.BlockSpec((None, n), lambda j, bb, h: (bb, 0))

  def dkv_kernel(*refs):
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest = refs
    seg_refs, (dk_ref, dv_ref) = (rest[:2], rest[2:]) if has_seg else ((None, None), rest)
    _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *seg_refs, dk_ref, dv_ref,
                st=st, t=t, s=s, d=d, groups=g)

  return _call(dkv_kernel, st, (pl.cdiv(s, cfg.bwd_block_k), q.shape[0], hkv),
               [group, kv2, kv2, group, rows, rows] + ([seg2(t), seg2(s)] if has_seg else []),
               [kv2, kv2], [jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2,
               "flash_attention_dkv", cfg.bwd_num_warps, cfg.bwd_num_stages,
               _common.cost_estimate(st.opts, q, k, 4))(
                   q, k, res.v, d_out, res.lse, delta, *segs)


_attention = _common.attention_vjp(_vma.unchecked(_forward), _vma.unchecked(backward_pass),
                                    "pallas_triton")
