"""The softmax pass of pallas_mosaic_gpu's chunks in XLA: triton_softmax.softmax_pass's
contract, for a JAX without Pallas Triton.

JAX deprecates the Triton backend of Pallas (jax 0.11 warns so at every lowering of a
Triton kernel). The Hopper loss needs the softmax pass only for the options its exponential
epilogue does not take (bias, softcap, label smoothing, float16, the backward of
reduction="none") and for a chunk whose exponentials leave the safe range; without Pallas
Triton these run here, and the loss keeps its Mosaic GEMMs.

Two sweeps over the chunk's columns in blocks of BLOCK_V, as the kernel's: the first finds
each row's statistics, the second writes G over the logits block by block
(dynamic_update_slice on the loop's buffer, which XLA updates in place: a whole-array G was
a second [C, V] buffer). With `enabled` the pass is the body of a loop that runs once where
it is true and not at all where it is false, so a chunk that needs no pass pays one loop
test, not a pass or a copy of the buffer (lax.cond's branches would each return one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from memeff_jax.kernels import mosaic_gemm
from memeff_jax.ops.linear_cross_entropy import _chunked
from memeff_jax.ops.linear_cross_entropy import _common
from memeff_jax.ops.linear_cross_entropy._common import LossOptions

BLOCK_V = 32_768  # columns per step: few loop steps a chunk, float32 temporaries in fusions


def _partial_lse(partials, rows: int) -> jax.Array:
  """Each row's log-sum-exp from [P, rows] float32 partials or mosaic_gemm.StatsWords."""
  if isinstance(partials, mosaic_gemm.StatsWords):
    words = jnp.reshape(partials.words, (-1, rows))
    p = sum(jax.lax.dynamic_slice_in_dim(words, partials.start + k * partials.count,
                                         partials.count).astype(jnp.float32)
            for k in range(3))
  else:
    p = partials.astype(jnp.float32)
  m = jnp.max(p, axis=0)
  return m + jnp.log(jnp.sum(jnp.exp(p - m[None, :]), axis=0))


def softmax_pass(logits, labels, a=None, e=None, lse=None, *, opts: LossOptions, partials=None,
                 enabled=None, entropy=None):
  """triton_softmax.softmax_pass in XLA: the same arguments but the kernel's tiles, the same
  results (G zero in padding columns, where the kernel leaves the logits' zeros)."""
  rows, width = logits.shape
  with_grad = a is not None
  if partials is not None and (not with_grad or lse is not None or opts.logit_softcap):
    raise ValueError("partials serve the gradient pass of uncapped logits whose log-sum-exp "
                     "is not given")
  vocab, smoothing = opts.vocab_size, bool(opts.label_smoothing)
  n_stats = 3 + opts.entropy
  padded = width != vocab
  labels = labels.astype(jnp.int32)
  sweep = lambda step, carry: _chunked.blocked_loop(width, min(BLOCK_V, width), step, carry)

  def capped(z, start, size):
    z = jax.lax.dynamic_slice_in_dim(z, start, size, axis=1).astype(jnp.float32)
    return _common.cap_logits(z, opts.logit_softcap), start + jnp.arange(size, dtype=jnp.int32)

  def run(logits):
    zeros = jnp.zeros((rows,), jnp.float32)
    if lse is not None:  # the backward pass: statistics known, not returned
      row_lse = lse.astype(jnp.float32)
      stats = (row_lse,) + (zeros,) * (n_stats - 1)
    elif partials is None:
      def stats_step(start, size, acc):
        zc, cols = capped(logits, start, size)
        return _common.combine_stats(acc, _common.block_stats(
            zc, cols, labels, vocab, padded=padded, logit_sum=smoothing,
            weighted_sum=opts.entropy))

      m, s, label_logit, logit_sum, u = sweep(stats_step, (jnp.full((rows,), -jnp.inf),)
                                              + (zeros,) * 4)
      stats = tuple(_common.stats_of((m, s, label_logit, logit_sum, u), opts))[:n_stats]
      row_lse = stats[0]
    else:  # the log-sum-exp from the partials; Σ p ẑ then needs no running max
      row_lse = _partial_lse(partials, rows)

      def stats_step(start, size, acc):
        zc, cols = capped(logits, start, size)
        _, _, y, t, _ = _common.block_stats(zc, cols, labels, vocab, padded=padded,
                                            logit_sum=smoothing, extremes=False)
        u = (_common.softmax_weighted_sum(zc, cols, row_lse, vocab, padded=padded)
             if opts.entropy else 0.0)
        return acc[0] + y, acc[1] + t, acc[2] + u

      stats = (row_lse, *sweep(stats_step, (zeros,) * 3))[:n_stats]
    if not with_grad:
      return stats
    ent = None if entropy is None else tuple(t.astype(jnp.float32) for t in entropy)

    def grad_step(start, size, buf):
      zc, cols = capped(buf, start, size)
      g = _common.block_grad(zc, cols, labels, row_lse, a.astype(jnp.float32),
                             e.astype(jnp.float32), opts, padded=padded, entropy=ent)
      return jax.lax.dynamic_update_slice_in_dim(buf, g.astype(buf.dtype), start, axis=1)

    return (sweep(grad_step, logits),) + stats

  if enabled is None:
    return run(logits)
  out = (logits,) * with_grad + (jnp.zeros((rows,), jnp.float32),) * n_stats
  return jax.lax.fori_loop(0, jnp.where(enabled, 1, 0),
                           lambda _, out: run(out[0] if with_grad else logits), out)
