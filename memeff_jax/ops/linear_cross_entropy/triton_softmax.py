"""The softmax pass of the loss's chunks: one Pallas (Triton) kernel over a chunk's logits.

Sweep 1 finds each row's log-sum-exp, label logit and Σ ẑ (online, block by block, as
FlashAttention's softmax: Dao et al. 2022, Alg. 1); sweep 2 overwrites the logits in place
with G = ∂loss/∂z (_common's formula), so the logits and G share one buffer. With partial
log-sum-exps from the logits GEMM's epilogue (fused_lse) there is no sweep 1. Runs on any
NVIDIA GPU, and in the Pallas interpreter for tests.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from memeff_jax.kernels import hopper
from memeff_jax.kernels import mosaic_gemm
from memeff_jax.ops.linear_cross_entropy import _common
from memeff_jax.ops.linear_cross_entropy._common import LossOptions

try:  # The Triton flavour of Pallas; its module moved between releases.
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
  plgpu = None


@dataclasses.dataclass(frozen=True)
class SoftmaxKernelConfig:
  """Tile of the softmax-gradient kernel: `block_rows` tokens × `block_v` vocab entries.

  `l2_hints` marks sweep 1's loads evict-last and sweep 2's evict-first, so that sweep 2
  finds the row in L2 rather than HBM.
  """

  block_rows: int = 1
  block_v: int = 8192
  num_warps: int = 8
  num_stages: int = 2
  l2_hints: bool = True



def _softmax_grad_kernel(labels_ref, a_ref, e_ref, lse_in_ref, partials_ref, entropy_refs,
                         logits_ref, grad_ref, lse_ref, label_logit_ref, logit_sum_ref,
                         mean_logit_ref, *, opts: LossOptions, block_rows: int, block_v: int,
                         l2_hints: bool, program):
  """One program (number `program`): `block_rows` tokens, all V vocabulary entries, two
  sweeps of block_v.

  Refs are whole arrays (no BlockSpecs: V need not be a power of two); the loads of a
  ragged last block (and of rows past the end) are masked.
  a/e/lse_in/grad refs are None when the call only wants statistics, lse_in is None when
  sweep 1 must find the log-sum-exp itself. Follows FlashAttention's online softmax
  (Dao et al. 2022, Alg. 1) for sweep 1. With partials_ref ([P, rows] partial log-sum-exps
  from the logits GEMM's epilogue) there is no sweep 1: the log-sum-exp is theirs, and
  sweep 2 also gathers the label logit and Σ ẑ. With opts.entropy the statistics include
  μ = Σ p ẑ (mean_logit_ref); entropy_refs, (h, μ) refs or None, add the entropy's
  cotangent to G.
  """
  n_rows = logits_ref.shape[0]
  vocab = opts.vocab_size
  row0 = program * block_rows
  rows = row0 + jnp.arange(block_rows, dtype=jnp.int32)
  row_ok = rows < n_rows
  row_slice = pl.ds(row0, block_rows)
  labels = plgpu.load(labels_ref.at[row_slice], mask=row_ok, other=-1)
  # Blocks below n_full lie inside the vocabulary and take no column mask; the one after
  # them (if V is not a multiple of block_v) does. Only a block that holds some row's label
  # compares columns with labels (a branch per block), and Σ ẑ is summed only for label
  # smoothing: the elementwise work per logit is what bounds this kernel.
  n_full, ragged = divmod(vocab, block_v)
  rows_ragged = n_rows % block_rows != 0
  smoothing = bool(opts.label_smoothing)
  zeros = jnp.zeros((block_rows,), jnp.float32)

  def load(j, eviction_policy, padded):
    cols = j * block_v + jnp.arange(block_v, dtype=jnp.int32)
    mask = None
    if padded:
      mask = row_ok[:, None] & (cols < vocab)[None, :]
    elif rows_ragged:
      mask = jnp.broadcast_to(row_ok[:, None], (block_rows, block_v))
    kw = {} if mask is None else dict(mask=mask, other=0.0)
    z = plgpu.load(logits_ref.at[row_slice, pl.ds(j * block_v, block_v)],
                   eviction_policy=eviction_policy, **kw)  # [block_rows, block_v]
    return cols, mask, _common.cap_logits(z.astype(jnp.float32), opts.logit_softcap)

  def holds_label(j):
    inside = (labels >= j * block_v) & (labels < (j + 1) * block_v)
    return jnp.sum(inside.astype(jnp.int32)) > 0  # (Pallas Triton lowers no reduce_or)

  def by_label(j, compute):
    """compute(labels) in a block that holds a label, compute(None) elsewhere."""
    return jax.lax.cond(holds_label(j), lambda: compute(labels), lambda: compute(None))

  from_partials = partials_ref is not None
  if from_partials:
    if isinstance(partials_ref, tuple):  # mosaic_gemm.StatsWords: three bf16 words each
      words_ref, start_ref, n_parts = partials_ref
      pieces = [(words_ref, start_ref[0] + k * n_parts, -jnp.inf if k == 0 else 0.0)
                for k in range(3)]
    else:  # traced start: the load may reach past the partials' end
      n_parts = partials_ref.shape[0]
      pieces = [(partials_ref, program * 0, -jnp.inf)]
    parts = jnp.arange(pl.next_power_of_2(n_parts), dtype=jnp.int32)
    mask = (parts < n_parts)[:, None] & row_ok[None, :]
    p = sum(plgpu.load(ref.at[pl.ds(start, parts.shape[0]), row_slice], mask=mask,
                       other=other).astype(jnp.float32) for ref, start, other in pieces)
    m = jnp.max(p, axis=0)
    m = jnp.where(row_ok, m, 0.0)  # rows past the end: no -inf - -inf
    lse = m + jnp.log(jnp.sum(jnp.exp(p - m[None, :]), axis=0))
    label_logit = logit_sum = mean_logit = zeros
  elif lse_in_ref is None:
    def sweep1(j, acc, padded=False):
      cols, _, zc = load(j, "evict_last" if l2_hints else None, padded)  # sweep 2 rereads it
      stats = by_label(j, lambda lab: _common.block_stats(
          zc, cols, lab, vocab, padded=padded, logit_sum=smoothing, weighted_sum=opts.entropy))
      return _common.combine_stats(acc, stats)

    init = (jnp.full((block_rows,), -jnp.inf, jnp.float32),) + (zeros,) * 4
    acc = jax.lax.fori_loop(0, n_full, sweep1, init)
    if ragged:  # a traced start: the masked block may reach past the array's end
      acc = sweep1(jnp.int32(n_full), acc, padded=True)
    lse, label_logit, logit_sum, mean_logit = _common.stats_of(acc, opts)
  else:
    lse = plgpu.load(lse_in_ref.at[row_slice], mask=row_ok, other=0.0)
    label_logit = logit_sum = mean_logit = zeros

  if grad_ref is not None:
    a = plgpu.load(a_ref.at[row_slice], mask=row_ok, other=0.0)
    e = plgpu.load(e_ref.at[row_slice], mask=row_ok, other=0.0)
    entropy = None
    if entropy_refs is not None:
      entropy = tuple(plgpu.load(ref.at[row_slice], mask=row_ok, other=0.0)
                      for ref in entropy_refs)

    def sweep2(j, carry, padded=False):
      cols, mask, zc = load(j, "evict_first" if l2_hints else None, padded)

      def grad(lab):
        g = _common.block_grad(zc, cols, lab, lse, a, e, opts, padded=padded, entropy=entropy)
        if not from_partials:
          return g
        _, _, y, t, _ = _common.block_stats(zc, cols, lab, vocab, padded=padded,
                                            logit_sum=smoothing, extremes=False)
        u = (_common.softmax_weighted_sum(zc, cols, lse, vocab, padded=padded)
             if opts.entropy else 0.0)
        return g, (carry[0] + y, carry[1] + t, carry[2] + u)

      if from_partials:
        g, carry = by_label(j, grad)
      else:
        g = by_label(j, grad)
      kw = {} if mask is None else dict(mask=mask)
      plgpu.store(grad_ref.at[row_slice, pl.ds(j * block_v, block_v)],
                  g.astype(grad_ref.dtype), **kw)
      return carry

    carry = jax.lax.fori_loop(0, n_full, sweep2, (label_logit, logit_sum, mean_logit))
    if ragged:
      carry = sweep2(jnp.int32(n_full), carry, padded=True)
    if from_partials:
      label_logit, logit_sum, mean_logit = carry

  plgpu.store(lse_ref.at[row_slice], lse, mask=row_ok)
  plgpu.store(label_logit_ref.at[row_slice], label_logit, mask=row_ok)
  plgpu.store(logit_sum_ref.at[row_slice], logit_sum, mask=row_ok)
  if mean_logit_ref is not None:
    plgpu.store(mean_logit_ref.at[row_slice], mean_logit, mask=row_ok)


def softmax_pass(logits, labels, a=None, e=None, lse=None, *, opts: LossOptions,
                 config: SoftmaxKernelConfig, interpret: bool = False, partials=None,
                 enabled=None, entropy=None):
  """Runs the kernel over one chunk's logits.

  Args:
    logits: [C, V] raw logits (compute dtype).
    labels: [C] int32.
    a, e: [C] float32 gradient coefficients (see _common); None for statistics only.
    lse: [C] float32 known log-sum-exp (the backward pass), or None to compute it.
    partials: [P, C] float32 partial log-sum-exps of the logits over disjoint column sets
      (mosaic_gemm.gemm's row_stats; only with a and e, without lse and softcap), or the
      same as mosaic_gemm.StatsWords (row_stats_into): the kernel then reads the logits
      once.
    enabled: a traced bool; where false the kernel does nothing: the buffer keeps what it
      held and the statistics are undefined (a conditional pass without lax.cond, which
      would copy the buffer).
    entropy: (h, μ), [C] float32 each: the entropy's cotangent and Σ p ẑ, added to G (with
      a and e); None for h = 0.

  Returns:
    Without a/e: (lse, label_logit, logit_sum), and mean_logit (μ) with opts.entropy. With
    them: G [C, V] in the logits' dtype, written over the logits' buffer, then those.
  """
  n_rows, vocab = logits.shape
  with_grad = a is not None
  if partials is not None and (not with_grad or lse is not None or opts.logit_softcap):
    raise ValueError("partials serve the gradient pass of uncapped logits whose log-sum-exp "
                     "is not given")
  block_v = min(config.block_v, pl.next_power_of_2(vocab))
  f32 = jax.ShapeDtypeStruct((n_rows,), jnp.float32)
  out_shape = (([jax.ShapeDtypeStruct(logits.shape, logits.dtype)] if with_grad else [])
               + [f32] * (3 + opts.entropy))
  inputs = [labels.astype(jnp.int32)]
  if with_grad:
    inputs += [a.astype(jnp.float32), e.astype(jnp.float32)]
  if lse is not None:
    inputs.append(lse.astype(jnp.float32))
  words = isinstance(partials, mosaic_gemm.StatsWords)
  if words:
    inputs += [partials.words, jnp.reshape(partials.start, (1,)).astype(jnp.int32)]
  elif partials is not None:
    inputs.append(partials.astype(jnp.float32))
  if entropy is not None:
    inputs += [t.astype(jnp.float32) for t in entropy]
  if enabled is not None:
    inputs.append(jnp.reshape(enabled, (1,)).astype(jnp.int32))
  inputs.append(logits)
  n_in = len(inputs)

  def kernel(*refs):
    ins, outs = list(refs[:n_in]), list(refs[n_in:])
    program = pl.program_id(0)  # read outside the `when` (interpret mode needs that)
    if enabled is not None:
      enabled_ref = ins.pop(-2)
      pl.when(enabled_ref[0] != 0)(lambda: body(ins, outs, program))
    else:
      body(ins, outs, program)

  def body(ins, outs, program):
    labels_ref = ins.pop(0)
    a_ref, e_ref = (ins.pop(0), ins.pop(0)) if with_grad else (None, None)
    lse_in_ref = ins.pop(0) if lse is not None else None
    partials_ref = ins.pop(0) if partials is not None else None
    if words:
      partials_ref = (partials_ref, ins.pop(0), partials.count)
    entropy_refs = (ins.pop(0), ins.pop(0)) if entropy is not None else None
    logits_ref = ins.pop(0)
    grad_ref = outs.pop(0) if with_grad else None
    if not opts.entropy:
      outs.append(None)  # no mean_logit output
    _softmax_grad_kernel(labels_ref, a_ref, e_ref, lse_in_ref, partials_ref, entropy_refs,
                         logits_ref, grad_ref, *outs,
                         opts=opts, block_rows=config.block_rows, block_v=block_v,
                         l2_hints=config.l2_hints, program=program)

  call = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(pl.cdiv(n_rows, config.block_rows),),
      input_output_aliases={n_in - 1: 0} if with_grad else {},
      interpret=interpret,
      name="linear_cross_entropy_softmax_grad" if with_grad else "linear_cross_entropy_lse",
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
  )
  return tuple(hopper.without_x64(call)(*inputs))
