"""Math shared by every linear cross-entropy implementation.

Notation (per token n, vocabulary entry v):

  z[n, v]   = x[n] · w[:, v] + b[v]                  raw logit
  ẑ[n, v]   = c · tanh(z / c)  (c = logit_softcap)   capped logit, or z when no cap
  lse[n]    = log Σ_v exp(ẑ[n, v])
  q[n, v]   = (1 - ε) [v = y_n] + ε / V               target distribution (label smoothing ε)
  ce[n]     = lse[n] - Σ_v q[n, v] ẑ[n, v]
            = lse[n] - (1 - ε) ẑ[n, y_n] - ε / V Σ_v ẑ[n, v]
  loss[n]   = valid[n] · ω[n] · (ce[n] + λ lse[n]²)   λ = z_loss, ω = token_weights (or 1)
  μ[n]      = Σ_v p[n, v] ẑ[n, v],  H[n] = lse[n] − μ[n]   p = softmax(ẑ); H: the entropy

With a `token_loss` f, ce[n] is f(ℓ[n], *args[n]) instead, ℓ = ẑ[n, y_n] − lse[n] the label's
log-probability (no label smoothing or z-loss then): ce = −ℓ is f(ℓ) = −ℓ. Its gradient is
the cross-entropy's with a[n] times −∂f/∂ℓ, a factor known once the token's statistics are
(`TokenCoefficients`). With LossOptions.entropy f takes the entropy too, f(ℓ, H, *args), and
its gradient adds the entropy's with h[n] = a[n] ∂f/∂H.

The gradient with respect to the raw logits, for per-token coefficients a (on the loss),
e (extra weight on the softmax, e.g. from a differentiated log-sum-exp output) and h (the
entropy's cotangent), is

  G[n, v] = (b[n] p[n, v] - a[n] q[n, v] - h[n] p[n, v] (ẑ[n, v] - μ[n]))
            · (1 - (ẑ[n, v] / c)²),                        b = a (1 + 2 λ lse) + e.

Every implementation computes exactly this; they differ only in how much of z they hold at
once.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

REDUCTIONS = ("mean", "sum", "none")
WEIGHT_LAYOUTS = ("dv", "vd")


@dataclasses.dataclass(frozen=True)
class LossOptions:
  """Static options of one call; hashable so it can be a custom_vjp nondiff argument."""

  vocab_size: int
  weight_layout: str = "dv"
  reduction: str = "mean"
  label_smoothing: float = 0.0
  z_loss: float = 0.0
  logit_softcap: float | None = None
  # Whether the per-token log-sum-exp and z-loss term (return_aux) are wanted. Without them
  # the chunked implementations reduce a mean/sum loss inside their chunk loop and hold no
  # [N] statistics.
  aux_outputs: bool = True
  # Vocab parallel: a shard's options name its slice's size in vocab_size and the whole
  # vocabulary's here, over which label smoothing spreads ε; None: vocab_size is the whole.
  whole_vocab: int | None = None
  # Label smoothing's uniform share of G, −a ε / V in every entry, left out of block_grad:
  # the chunk loop adds it to dx and dW once for all tokens (_chunked.run_chunks), so that
  # G is a factor per row times the exponentials (pallas_mosaic_gpu's exp_logits).
  smoothing_apart: bool = False
  # Whether each token's entropy is wanted (linear_cross_entropy's `entropy`): the
  # statistics then carry μ = Σ_v p ẑ, and G may take the entropy's cotangent.
  entropy: bool = False
  # linear_cross_entropy's `token_loss`: f(log_prob, *args) -> the token's loss, on scalars
  # (vmapped over the tokens); f(log_prob, entropy, *args) with `entropy`. Its args are the
  # columns after the first of the [N, 1 + k] token weights the implementations are given
  # (split_weights).
  token_loss: Callable | None = None

  @property
  def smoothing_vocab(self) -> int:
    """V of label smoothing's ε / V: the whole vocabulary's size."""
    return self.whole_vocab or self.vocab_size


class Stats(NamedTuple):
  """Per-token statistics of the (capped) logits, all float32 [N]."""

  lse: jax.Array  # log-sum-exp
  label_logit: jax.Array  # ẑ[n, y_n]; 0 where y_n is outside [0, V)
  logit_sum: jax.Array  # Σ_v ẑ[n, v]; only meaningful with label smoothing
  mean_logit: jax.Array | None = None  # μ = Σ_v p[n, v] ẑ[n, v]; with LossOptions.entropy


def int32_labels(labels: jax.Array) -> jax.Array:
  """Class ids as int32 from labels as implementations receive them: [N] int32 as they are,
  or [N, 2] int32 words (low, high) of int64 ids (api.Int64Labels), where an id outside the
  int32 range becomes INT32_MIN: outside [0, V), so that token's loss is NaN as for any
  other out-of-range label (which tokens are ignored was decided on all 64 bits)."""
  if labels.ndim == 1:
    return labels
  low, high = labels[:, 0], labels[:, 1]
  return jnp.where(high == (low >> 31), low, jnp.iinfo(jnp.int32).min)


# ----------------------------------------------------------------------------------------
# Matmuls in either weight layout. `w` is [D, V] ("dv") or [V, D] ("vd").
# ----------------------------------------------------------------------------------------


def logits_dot(x, w, layout: str, out_dtype) -> jax.Array:
  """[C, D] x w -> [C, V]."""
  dims = (((1,), (0,)), ((), ())) if layout == "dv" else (((1,), (1,)), ((), ()))
  return jax.lax.dot_general(x, w, dims, preferred_element_type=out_dtype)


def dx_dot(g, w, layout: str, out_dtype) -> jax.Array:
  """[C, V] x w -> [C, D]  (g @ wᵀ for "dv", g @ w for "vd")."""
  dims = (((1,), (1,)), ((), ())) if layout == "dv" else (((1,), (0,)), ((), ()))
  return jax.lax.dot_general(g, w, dims, preferred_element_type=out_dtype)


def dw_dot(x, g, layout: str, out_dtype) -> jax.Array:
  """[C, D], [C, V] -> dW in the weight's layout ([D, V] or [V, D])."""
  if layout == "dv":
    return jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())), preferred_element_type=out_dtype)
  return jax.lax.dot_general(g, x, (((0,), (0,)), ((), ())), preferred_element_type=out_dtype)


def vocab_of(w, opts) -> int:
  """The number of vocabulary columns `w` holds (a shard's slice, vocab parallel)."""
  return int(w.shape[1] if opts.weight_layout == "dv" else w.shape[0])


def vocab_slice(w, start, size: int, layout: str):
  """Columns [start, start + size) of the vocabulary, in the weight's layout."""
  axis = 1 if layout == "dv" else 0
  return jax.lax.dynamic_slice_in_dim(w, start, size, axis=axis)


# ----------------------------------------------------------------------------------------
# Element-wise pieces, written for blocks so the Pallas kernel can call them unchanged.
# ----------------------------------------------------------------------------------------


def cap_logits(z: jax.Array, cap: float | None) -> jax.Array:
  return z if cap is None else cap * jnp.tanh(z / cap)


def floored(zc):
  """ẑ with −inf raised to −1e30, for the products p·ẑ of the entropy: a logit of −inf (a
  bias masking an entry) has p = 0, and 0·ẑ must be 0 there, not NaN."""
  return jnp.maximum(zc, -1e30)


def block_stats(zc, cols, labels, vocab_size: int, *, padded: bool = True,
                logit_sum: bool = True, extremes: bool = True, weighted_sum: bool = False):
  """Partial statistics of one block of capped logits.

  Args:
    zc: [R, Vb] float32 capped logits of vocabulary columns `cols`.
    cols: [Vb] int32 absolute column ids (ids ≥ vocab_size are padding).
    labels: [R] int32, or None where no row's label is among `cols` (label logit 0).
    padded: whether `cols` may hold padding ids; False skips masking them.
    logit_sum: whether to sum ẑ (label smoothing needs it); else that output is 0.
    extremes: whether to find the max and Σ exp (else both are None: the log-sum-exp is
      known from elsewhere).
    weighted_sum: whether to sum exp(ẑ − max)·ẑ (the entropy needs it; with extremes);
      else that output is 0.

  Returns:
    (max, Σ exp(ẑ − max), label logit, Σ ẑ, Σ exp(ẑ − max)·ẑ), each [R] float32.
  """
  in_vocab = (cols < vocab_size)[None, :] if padded else None
  m = s = None
  zeros = jnp.zeros((zc.shape[0],), jnp.float32)
  label_logit = logit_total = weighted_total = zeros
  if extremes:
    masked = zc if in_vocab is None else jnp.where(in_vocab, zc, -jnp.inf)
    m = jnp.max(masked, axis=1)
    p = jnp.exp(masked - m[:, None])
    s = jnp.sum(p, axis=1)
    if weighted_sum:  # p is 0 in padding
      zf = floored(zc if in_vocab is None else jnp.where(in_vocab, zc, 0.0))
      weighted_total = jnp.sum(p * zf, axis=1)
  if labels is not None:
    label_logit = jnp.sum(jnp.where(cols[None, :] == labels[:, None], zc, 0.0), axis=1)
  if logit_sum:
    logit_total = jnp.sum(zc if in_vocab is None else jnp.where(in_vocab, zc, 0.0), axis=1)
  return m, s, label_logit, logit_total, weighted_total


def combine_stats(a, b):
  """Merges two block_stats results over disjoint column sets."""
  m_a, s_a, y_a, t_a, u_a = a
  m_b, s_b, y_b, t_b, u_b = b
  m = jnp.maximum(m_a, m_b)
  scale_a, scale_b = jnp.exp(m_a - m), jnp.exp(m_b - m)
  return m, s_a * scale_a + s_b * scale_b, y_a + y_b, t_a + t_b, u_a * scale_a + u_b * scale_b


def softmax_weighted_sum(zc, cols, lse, vocab_size: int, *, padded: bool = True):
  """Σ p·ẑ over one block's columns, p = exp(ẑ − lse) with each row's log-sum-exp known
  (block_stats' Σ exp(ẑ − max)·ẑ where the max is not at hand), [R] float32."""
  zf = floored(zc)
  if padded:
    zf = jnp.where((cols < vocab_size)[None, :], zf, -1e30)
  return jnp.sum(jnp.exp(zf - lse[:, None]) * zf, axis=1)


def stats_of(acc, opts: LossOptions) -> Stats:
  """Stats from a combine_stats accumulation over a whole (slice of the) vocabulary."""
  m, s, label_logit, logit_sum, u = acc
  return Stats(m + jnp.log(s), label_logit, logit_sum, u / s if opts.entropy else None)


def grad_scale(a, e, lse, opts: LossOptions):
  """b of G = b·p − a·q: a (1 + 2λ lse) + e, or a + e without a z-loss (never 0·lse)."""
  if not opts.z_loss:
    return a + e
  return a * (1.0 + 2.0 * opts.z_loss * lse) + e


def block_grad(zc, cols, labels, lse, a, e, opts: LossOptions, *, padded: bool = True,
               probs=None, entropy=None):
  """G for one block of capped logits (float32 [R, Vb]); zero in padding columns.

  G = b·p − a·q − h·p·(ẑ − μ) with p = exp(ẑ − lse) (or `probs`, p computed already), q =
  (1 − ε)·onehot(label) + ε/V (without the ε/V where opts.smoothing_apart), and `entropy`
  = (h, μ) [R] each, or None for h = 0; labels=None means no row's label is among `cols`,
  and `padded` as in block_stats.
  """
  eps = opts.label_smoothing
  b = grad_scale(a, e, lse, opts)
  p = jnp.exp(zc - lse[:, None]) if probs is None else probs
  if entropy is None:
    g = b[:, None] * p
  else:
    h, mu = entropy
    g = p * (b[:, None] - h[:, None] * (floored(zc) - mu[:, None]))
  if eps and not opts.smoothing_apart:
    g = g - (a * (eps / opts.smoothing_vocab))[:, None]
  if labels is not None:
    hit = cols[None, :] == labels[:, None]
    g = jnp.where(hit, g - (a * (1.0 - eps))[:, None], g)
  if opts.logit_softcap is not None:
    g = g * (1.0 - jnp.square(zc / opts.logit_softcap))
  return jnp.where((cols < opts.vocab_size)[None, :], g, 0.0) if padded else g


# ----------------------------------------------------------------------------------------
# From statistics to the three outputs, and from output cotangents to coefficients.
# ----------------------------------------------------------------------------------------


def valid_scale(valid: jax.Array, reduction: str) -> jax.Array:
  """d(reduced loss) / d(loss[n]) of a counted token: 1 / count for mean, else 1 (float32)."""
  if reduction == "mean":
    return 1.0 / jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)
  return jnp.float32(1.0)


def weighted(t, weights):
  """t times the token weights (float32 [N] or, None, all 1: t itself)."""
  return t if weights is None else t * weights


def token_scale(valid: jax.Array, reduction: str, weights=None) -> jax.Array:
  """r[n]: d(reduced loss) / d(unweighted loss[n]): valid/count for mean, valid otherwise,
  times the token's weight (float32)."""
  return weighted(valid.astype(jnp.float32) * valid_scale(valid, reduction), weights)


def token_loss(stats: Stats, labels, valid, opts: LossOptions, args=None):
  """(loss[n], z-loss term[n]) from per-token statistics, before the token weights; 0 where a
  token is not counted. `args`: the token_loss's [N, k] arguments (with opts.token_loss)."""
  in_range = (labels >= 0) & (labels < opts.vocab_size)
  label_logit = jnp.where(in_range, stats.label_logit, jnp.nan)  # optax: NaN, never finite
  if opts.token_loss is not None:  # f at 0 where not counted: no NaN from there, even in grads
    safe = lambda t: None if t is None else jnp.where(
        valid if t.ndim == 1 else valid[:, None], t, 0.0)
    inputs = _token_inputs(safe(label_logit - stats.lse), safe(entropy_of(stats, opts)),
                           safe(args))
    value = jax.vmap(_scalar_fn(opts))(*inputs)
    return jnp.where(valid, value, 0.0), jnp.zeros_like(value)
  eps = opts.label_smoothing
  ce = stats.lse - (1.0 - eps) * label_logit
  if eps:
    ce = ce - eps / opts.smoothing_vocab * stats.logit_sum
  # Without a z-loss the term is 0, not 0·lse² (NaN where lse overflowed).
  zterm = opts.z_loss * jnp.square(stats.lse) if opts.z_loss else jnp.zeros_like(stats.lse)
  return jnp.where(valid, ce + zterm, 0.0), jnp.where(valid, zterm, 0.0)


def reduced_sum(per_token, valid, scale):
  """Σ over counted tokens of scale · per_token (scale a scalar, or r of token_scale)."""
  # Σ r·loss rather than sum()/count: uncounted tokens hold 0, so this is the same number.
  return jnp.sum(jnp.where(valid, per_token * scale, 0.0))


def entropy_of(stats: Stats, opts: LossOptions):
  """Each token's entropy H = lse − μ (float32 [N]), or None without opts.entropy."""
  return stats.lse - stats.mean_logit if opts.entropy else None


def finish(stats: Stats, labels, valid, opts: LossOptions, weights=None):
  """(loss, lse, z-loss term, entropy) from per-token statistics, weighted by the token
  weights (None: 1; [N, 1 + k] with opts.token_loss, see split_weights) and reduced as
  `opts.reduction` says; the entropy None without opts.entropy."""
  weights, args = split_weights(weights, opts)
  per_token, zterm = token_loss(stats, labels, valid, opts, args)
  entropy = entropy_of(stats, opts)
  if opts.reduction == "none":
    return weighted(per_token, weights), stats.lse, weighted(zterm, weights), entropy
  r = weighted(valid_scale(valid, opts.reduction), weights)
  return reduced_sum(per_token, valid, r), stats.lse, jnp.sum(zterm * r), entropy


def weight_grads(losses, valid, g_loss, g_z, opts: LossOptions):
  """d(outputs)/d(token weights) for the outputs' cotangents (None: zero): the unweighted
  per-token `losses` = (loss[n], z-loss term[n]) of token_loss, each scaled as finish
  reduces it (each loss is linear in its token's weight)."""
  r = token_scale(valid, opts.reduction)
  dw = jnp.zeros_like(r)
  for ct, t in zip((g_loss, g_z), losses):
    if ct is not None:
      dw = dw + ct * r * t
  return dw


def coefficients(valid, lse, g_loss, g_lse, g_z, opts: LossOptions, weights=None,
                 log_prob=None, entropy=None):
  """Per-token (a, e, h) of block_grad for output cotangents (None means a zero cotangent),
  with the token weights (None: 1); with a token_loss, a is times its factor at each token's
  `log_prob` (and `entropy`), and h is the share of the entropy's cotangent that f adds where
  it takes the entropy (else None)."""
  weights, args = split_weights(weights, opts)
  r = token_scale(valid, opts.reduction, weights)
  h = None
  if g_loss is None:
    a = jnp.zeros_like(r)
  elif opts.token_loss is None:
    a = g_loss * r
  else:
    a, h = resolve(TokenCoefficients(g_loss * r, args), log_prob, entropy, opts)
  e = jnp.zeros_like(r) if g_lse is None else g_lse.astype(jnp.float32)
  if g_z is not None and opts.z_loss:
    e = e + 2.0 * opts.z_loss * lse * g_z * r
  return a, e, h


# ----------------------------------------------------------------------------------------
# A token_loss f(ℓ, *args) in place of the cross-entropy −ℓ.
# ----------------------------------------------------------------------------------------


def split_weights(weights, opts: LossOptions):
  """(token weights [N] or None, token_loss args [N, k] or None) of the weights the
  implementations are given: with opts.token_loss an [N, 1 + k] array, the weights first."""
  if opts.token_loss is None or weights is None:
    return weights, None
  return weights[:, 0], weights[:, 1:]


def _columns(args):
  return () if args is None else tuple(args[:, i] for i in range(args.shape[1]))


def _scalar_fn(opts: LossOptions):
  """opts.token_loss of one token, in float32."""
  return lambda log_prob, *args: jnp.asarray(opts.token_loss(log_prob, *args), jnp.float32)


def _token_inputs(log_prob, entropy, args):
  """f's per-token inputs: ℓ, the entropy where f takes it (not None), then the args."""
  return (log_prob,) + (() if entropy is None else (entropy,)) + _columns(args)


def token_loss_arg_grads(log_prob, entropy, args, ct, opts: LossOptions):
  """[N, k] float32: ct[n] · ∂f/∂args[n] (ct the per-token cotangent of f's values), 0
  where ct is; `entropy` None unless f takes it."""
  inputs = _token_inputs(log_prob, entropy, args)
  first = len(inputs) - args.shape[1]
  grads = jax.vmap(jax.grad(_scalar_fn(opts), argnums=tuple(range(first, len(inputs)))))(
      *inputs)
  return jnp.where(ct[:, None] != 0, jnp.stack(grads, axis=1) * ct[:, None], 0.0)


class TokenCoefficients(NamedTuple):
  """The loss coefficients a of a chunk whose token_loss needs its statistics first: a =
  r · (−∂f/∂ℓ), ℓ = label logit − lse, where a backend has them (resolve); 0 where r is."""

  r: jax.Array  # [C] float32: d(reduced loss) / d(f's value) of each token
  args: jax.Array  # [C, k] float32: the token_loss's arguments


def resolve(a, log_prob, entropy, opts: LossOptions):
  """(a, h): the coefficients a as an array (`a` itself, or a TokenCoefficients' from the
  tokens' log-probabilities and, where f takes them (opts.entropy), entropies), and the
  entropy cotangent h = r ∂f/∂H that f adds (None where it takes no entropy)."""
  if not isinstance(a, TokenCoefficients):
    return a, None
  with_entropy = opts.entropy
  inputs = _token_inputs(log_prob, entropy if with_entropy else None, a.args)
  slopes = jax.vmap(jax.grad(_scalar_fn(opts), argnums=(0, 1) if with_entropy else 0))(*inputs)
  d_log_prob, d_entropy = slopes if with_entropy else (slopes, None)
  counted = lambda t: jnp.where(a.r != 0, a.r * t, 0.0)
  return counted(-d_log_prob), None if d_entropy is None else counted(d_entropy)


def resolve_stats(a, stats: Stats, opts: LossOptions):
  """resolve from a chunk's statistics: (a, entropy) with entropy the (h, μ) block_grad
  takes for f's share of it, or None."""
  entropy = entropy_of(stats, opts)
  a, h = resolve(a, stats.label_logit - stats.lse, entropy, opts)
  return a, None if h is None else (h, stats.mean_logit)


def base(a):
  """The coefficients before the token_loss's factor (nonzero where the resolved may be)."""
  return a.r if isinstance(a, TokenCoefficients) else a
