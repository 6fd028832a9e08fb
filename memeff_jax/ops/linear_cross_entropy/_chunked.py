"""The token-chunk loop and the custom_vjp shared by `chunked_xla` and `pallas_mosaic_gpu`.

Both implementations walk the tokens in chunks of `token_chunk` and hand each chunk to a
*chunk backend*, which owns everything that touches the chunk's logits:

  backend.stats(x_c, w, bias, labels_c)                     -> Stats of the chunk
  backend.grads(x_c, w, bias, labels_c, a_c, e_c, lse_c,
                dw_acc, db_acc, need)                       -> (Stats, dx_c, dw_acc, db_acc)

`grads` computes G (see _common) for the chunk and applies the two matmuls that consume it,
accumulating dW and db into the running sums it is given. Nothing of size [N, V] exists.
With a token_loss, a_c in the forward pass is a _common.TokenCoefficients, which `grads`
resolves into the coefficients once it has the chunk's statistics.
Where the entropy's cotangent h is not zero, `grads` is also given `entropy=(h_c, μ_c)`
(the backward pass, with μ from the forward's statistics). With `LossOptions.entropy` the
Stats carry μ.

A backend with `first_chunk_writes_dw = True` is given dw_acc=None for the first chunk,
which runs before the loop, and returns that chunk's dW as the running sum (no zero-filled
dW to add to).

A backend whose kernels read or write at an offset names in `takes_rows(n_tokens, chunk)`
which of "x" and "dx" it takes as windows. For "x" it is given a whole chunk's x_c as
`Rows(x, i, C)`, the i-th chunk of x unsliced; for "dx", where dx is wanted,
`dx_into=Rows(dx, i, C)`: it writes the chunk's rows of dx in place and returns the whole
dx. The loop then holds no chunk-sized copy of x or dx next to the chunk's logits. Where C
does not divide the tokens, the rest are one ragged chunk of arrays, padded to a multiple
of the backend's `row_multiple` rows (kernels that run whole row tiles), which `Static`'s
`tail_backend` may serve with settings of its own (see run_chunks).

Vocab parallel (`Static.vocab`, see _vocab_parallel): W is this shard's slice of the
vocabulary and the backend's options name the slice. It is given the labels local to the
slice, and `grads` a `vocab=` (VocabShards) whose merge turns the chunk's statistics into
the whole vocabulary's before G is made; `stats` is merged here. Each shard's dx is its
slice's share (summed by cotangents_like under check_vma, else by the caller).

Gradients in the forward pass. For reduction "mean"/"sum" the loss's cotangent is a single
scalar, so the forward pass computes the gradients for a cotangent of 1 while the chunk's
logits are at hand (three matmuls in all) and the backward pass only scales them. For
"none", or when the log-sum-exp / z-loss / entropy outputs get a cotangent, the backward
pass runs the chunks again with the real cotangents. Token weights are known in the forward
pass, so a weighted mean/sum keeps the three matmuls: they scale each token's coefficients;
so does a token_loss, whose factor −f'(ℓ) per token is known with the chunk's statistics.

A mean/sum loss without the auxiliary outputs (`opts.aux_outputs` False) is reduced inside
the loop: each chunk adds its tokens' share to a scalar and makes its gradient coefficients
from the labels' validity, so nothing of size [N] in float32 is held (at 16k tokens that is
the 4-byte statistics, coefficients and log-sum-exp: ~0.4 MB next to a 128 MB chunk).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from memeff_jax.ops import _checks
from memeff_jax.ops import _vma
from memeff_jax.ops.linear_cross_entropy import _common
from memeff_jax.ops.linear_cross_entropy._common import LossOptions, Stats
from memeff_jax.ops.linear_cross_entropy._vocab_parallel import VocabShards
from memeff_jax.kernels.mosaic_gemm import Rows


class Static(NamedTuple):
  """Hashable, static half of a call."""

  backend: Any  # a frozen dataclass with .stats / .grads / .dw_dtype(weight), .implementation
  opts: LossOptions  # the whole vocabulary's (the backend's name its slice's, vocab parallel)
  token_chunk: int
  vocab: VocabShards | None = None  # W's vocabulary sharded over these axes
  tail_backend: Any = None  # the ragged chunk's, where it differs (see run_chunks)
  # Chunks per group whose dW the backend adds up in its dtype, the groups' sums added up
  # in float32 (see run_chunks); None: one group.
  dw_group: int | None = None


class Residuals(NamedTuple):
  x: jax.Array
  weight: jax.Array
  bias: jax.Array | None
  labels: jax.Array  # [N] int32, or [N, 2] int32 words of int64 ids (_common.int32_labels)
  valid: jax.Array
  weights: jax.Array | None  # float32 [N] token weights ([N, 1 + k]: _common.split_weights)
  lse: jax.Array | None  # float32 [N]; None for a loss reduced in the loop
  mean_logit: jax.Array | None  # float32 [N] μ = Σ_v p ẑ, for the entropy's gradient
  losses: tuple | None  # the unweighted (loss[n], z-loss term[n]) where weights get gradients
  log_prob: jax.Array | None  # float32 [N] ℓ, for a token_loss's gradients in the backward
  dx: jax.Array | None  # gradients for a unit loss cotangent (mean/sum only)
  dweight: jax.Array | None
  dbias: jax.Array | None


def blocked_loop(total: int, block: int, body, carry):
  """Runs body(start, size, carry) over [0, total) in blocks; the last one may be short.

  Full blocks go through a fori_loop (one compiled body); a ragged tail is one more call
  with a smaller static size, so no input needs padding or copying.
  """
  n_full = total // block
  if n_full:
    carry = jax.lax.fori_loop(0, n_full, lambda i, c: body(i * block, block, c), carry)
  if total % block:
    carry = body(n_full * block, total % block, carry)
  return carry


def balanced_chunk(n_tokens: int, max_chunk: int, min_exact: int | None = None) -> int:
  """The smallest chunk (a multiple of 128 when max_chunk is) that needs as few chunks; or,
  where the tokens are not a whole number of those, a smaller chunk that divides them:
  with `min_exact` None one that makes one chunk more, else the largest of at least
  `min_exact` tokens and half the chunk.

  E.g. 16,000 tokens with room for 1,024: 15 chunks of 1,024 and a ragged one of 640 (see
  run_chunks), 1,000 being no whole number of 128-row tiles. 16,384 with room for 2,560: 8
  chunks of 2,048 rather than 7 of 2,432, whose 38 K steps would fill the Mosaic dW GEMM's
  ping-pong slots unevenly and send it to the ring (GPT-2's head). With room for 3,968 and min_exact
  1,024: 8 chunks of 2,048 rather than 5 of 3,328 (Mistral-7B's head: faster, and half the
  memory). The figures: the design doc's "GPT-2's small D" and "V ≈ 32k".
  """
  if max_chunk >= n_tokens:
    return n_tokens
  n_chunks = -(-n_tokens // max_chunk)
  tile = 128 if max_chunk % 128 == 0 else 1
  chunk = -(-n_tokens // n_chunks)
  chunk = min(-(-chunk // tile) * tile, max_chunk)
  if n_tokens % chunk:  # a ragged chunk would remain
    if min_exact is None:
      exact, rest = divmod(n_tokens, n_chunks + 1)
      if not rest and exact % tile == 0:
        return exact
    else:
      for exact in range(chunk - tile, max(min_exact, chunk // 2) - 1, -tile):
        if n_tokens % exact == 0:
          return exact
  return chunk


class Reduced(NamedTuple):
  """A mean/sum loss reduced inside the chunk loop (no per-token outputs wanted)."""

  valid: jax.Array  # bool [N]: the counted tokens
  scale: jax.Array  # float32 scalar: d(loss) / d(loss[n]) of a counted token of weight 1
  grads: bool  # also the gradients for a unit cotangent (a = scale·valid·weights, e = 0)
  weights: jax.Array | None = None  # as Residuals.weights; None: all 1


def run_chunks(static: Static, x, w, bias, labels, *, a=None, e=None, lse=None,
               need=(True, True, True), reduced: Reduced | None = None, needed=None,
               entropy=None):
  """Stats for all tokens, and with coefficients (a, e) also dx, dW and db; `entropy`
  (h, μ), each float32 [N], adds the entropy's share to G (see _common.block_grad).

  With `reduced` the first result is the reduced loss (a float32 scalar) instead of the
  [N] statistics, and the coefficients come from reduced (a and e must be None).
  `needed` (bool [N], or None): tokens whose statistics must be exact even where their
  coefficients are 0 (counted tokens of weight 0), which a backend's `grads` is then given.

  The tokens are N // C whole chunks of C = token_chunk, run by one compiled loop body so
  that the running dW is updated in place, and, where C does not divide N, the rest: one
  ragged chunk, which runs first, before the loop (by `static.tail_backend` where given),
  padded with zero rows to a multiple of the backend's `row_multiple` (default 1). Padded
  rows are invalid tokens with zero coefficients: they add nothing and their outputs are
  dropped. With `static.dw_group` G and more chunks than G, the chunks run in groups of G
  (the ragged chunk in the first): each group's dW is added up in the backend's dtype and
  then into a float32 sum, rounded to W's dtype once at the end, so no 16-bit sum spans
  more than G chunks.
  """
  backend, chunk, opts = static.backend, static.token_chunk, static.opts
  tail_backend = static.tail_backend or backend
  n, d = x.shape
  n_full, rest = divmod(n, chunk)
  multiple = getattr(tail_backend, "row_multiple", 1)
  padded_rest = -(-rest // multiple) * multiple
  with_grads = a is not None or (reduced is not None and reduced.grads)
  need_dx, need_dw, need_db = need
  need_db = need_db and bias is not None
  peel = with_grads and need_dw and getattr(backend, "first_chunk_writes_dw", False)
  rows = getattr(backend, "takes_rows", lambda *_: ())(n, chunk) if n_full else ()
  # μ where the entropy is wanted and the statistics are made (not given: lse).
  stats0 = (jnp.zeros((), jnp.float32) if reduced is not None else Stats(
      *(jnp.zeros((n,), jnp.float32) for _ in range(3 + (opts.entropy and lse is None)))))
  # Written in place chunk by chunk, every row once (the chunks tile the tokens): no fill.
  dx0 = (jax.lax.empty if "dx" in rows else jnp.zeros)((n, d), x.dtype)
  carry = (
      stats0,
      dx0 if with_grads and need_dx else None,
      jnp.zeros(w.shape, backend.dw_dtype(w)) if with_grads and need_dw and not peel else None,
      jnp.zeros(bias.shape, jnp.float32) if with_grads and need_db else None,
  )
  carry = _vma.varying_like(carry, x, w, bias, labels, a, e, lse, reduced)
  kernels = _vma.unchecked if getattr(backend, "runs_kernels", False) else lambda f: f
  vocab = static.vocab
  if vocab is not None:  # the labels' ids within this shard's slice of the vocabulary
    offset = vocab.offset(backend.opts.vocab_size)
  local = (lambda labels_c: labels_c) if vocab is None else (lambda labels_c: labels_c - offset)
  parallel = {} if vocab is None else {"vocab": vocab}
  apart = opts.smoothing_apart and opts.label_smoothing
  if apart:  # Σ_v ẑ[n, v] = x[n] · w_sum (no cap, no bias: see smoothing_terms)
    # Vocab parallel: the slice's column sums, whose shares of dx and Σ ẑ the shards add up.
    w_sum = jnp.sum(w, axis=1 if opts.weight_layout == "dv" else 0, dtype=jnp.float32)

  def step(carry, backend, start, size: int, window=None):
    """The chunk of `size` tokens from `start`: a whole chunk (`window`, its traced index,
    where the backend takes x and dx as windows) or the ragged one (`start` static, padded
    to padded_rest rows)."""
    stats, dx, dw, db = carry
    if size == chunk:
      part = lambda t: jax.lax.dynamic_slice_in_dim(t, start, size, axis=0)
    else:
      part = lambda t: jnp.pad(t[start:], [(0, padded_rest - size)] + [(0, 0)] * (t.ndim - 1))
    whole = window is not None
    x_c = Rows(x, window, size) if whole and "x" in rows else part(x)
    labels_c = _common.int32_labels(part(labels))
    args_c = None
    if reduced is not None:
      counted = part(reduced.valid)
      weights_c, args_c = _common.split_weights(
          None if reduced.weights is None else part(reduced.weights), opts)
      scale_c = _common.weighted(reduced.scale, weights_c)
    if with_grads:
      if reduced is not None:
        a_c = jnp.where(counted, scale_c, 0.0)
        if opts.token_loss is not None:  # times −f'(ℓ), once the backend has ℓ
          a_c = _common.TokenCoefficients(a_c, args_c)
        e_c = jnp.zeros_like(_common.base(a_c))
      else:
        a_c, e_c = jax.tree.map(part, a), part(e)
      into = {"dx_into": Rows(dx, window, size)} if whole and "dx" in rows and need_dx else {}
      exact = {} if needed is None else {"needed": part(needed)}
      if entropy is not None:
        exact["entropy"] = tuple(map(part, entropy))
      chunk_stats, dx_c, dw, db = kernels(backend.grads)(
          x_c, w, bias, local(labels_c), a_c, e_c, None if lse is None else part(lse),
          dw, db, (need_dx, need_dw, need_db), **into, **exact, **parallel)
      if into:
        dx = dx_c
      elif need_dx:
        dx = jax.lax.dynamic_update_slice_in_dim(dx, dx_c[:size].astype(dx.dtype), start,
                                                 axis=0)
    else:
      chunk_stats = kernels(backend.stats)(x_c, w, bias, local(labels_c))
      if vocab is not None:
        chunk_stats = vocab.merge(Stats(*chunk_stats))
    if apart:
      logit_sum = jnp.einsum("cd,d->c", part(x), w_sum, preferred_element_type=jnp.float32)
      if vocab is not None:
        logit_sum = vocab.sum(logit_sum)
      chunk_stats = Stats(*chunk_stats)._replace(logit_sum=logit_sum)
    if reduced is not None:
      per_token, _ = _common.token_loss(Stats(*chunk_stats), labels_c, counted, opts, args_c)
      stats = stats + _common.reduced_sum(per_token, counted, scale_c)
    else:
      stats = Stats(*(None if s is None else
                      jax.lax.dynamic_update_slice_in_dim(s, c[:size], start, axis=0)
                      for s, c in zip(stats, chunk_stats)))
    return stats, dx, dw, db

  first = 0
  if rest:  # before the loop, at its own size (with peel, it writes dW)
    carry = step(carry, tail_backend, n_full * chunk, rest)
  elif peel:
    carry, first = step(carry, backend, 0, chunk, window=0), 1
  whole = lambda i, c: step(c, backend, i * chunk, chunk, window=i)
  group = static.dw_group if with_grads and need_dw else None
  if group is not None and n_full + bool(rest) > group:
    carry = _grouped(carry, whole, first, n_full, group, group - bool(rest), peel, w.dtype)
  elif first < n_full:
    carry = jax.lax.fori_loop(first, n_full, whole, carry)
  if apart and with_grads:
    a_all = a if reduced is None else jnp.where(reduced.valid, _common.weighted(
        reduced.scale, _common.split_weights(reduced.weights, opts)[0]), 0.0)
    carry = smoothing_terms(carry, x, w_sum, a_all, opts)
  return carry


def _grouped(carry, whole, first: int, n_full: int, group: int, head: int, peel: bool,
             dtype):
  """run_chunks' whole chunks [first, n_full) in groups: the first group's end at chunk
  `head`, the others `group` chunks long (the last may be shorter). whole(i, carry) runs
  chunk i. Each group's dW starts afresh (written by its first chunk where `peel`, else from
  zeros) and is added into a float32 sum after its last chunk; dW is returned in `dtype`."""
  stats, dx, dw, db = jax.lax.fori_loop(first, head, whole, carry)
  shape, group_dtype = dw.shape, dw.dtype

  def one(start, size, carry):
    stats, dx, db, total = carry
    inner = (stats, dx, None if peel else jnp.zeros(shape, group_dtype), db)
    if peel:  # dW written by the group's first chunk
      inner = whole(start, inner)
    stats, dx, dw, db = jax.lax.fori_loop(start + peel, start + size, whole, inner)
    return stats, dx, db, total + dw.astype(jnp.float32)

  groups, last = divmod(n_full - head, group)
  carry = (stats, dx, db, dw.astype(jnp.float32))
  if groups:
    carry = jax.lax.fori_loop(0, groups, lambda g, c: one(head + g * group, group, c), carry)
  if last:
    carry = one(n_full - last, last, carry)
  stats, dx, db, total = carry
  return stats, dx, total.astype(dtype), db


def smoothing_terms(carry, x, w_sum, a, opts: LossOptions):
  """Adds label smoothing's uniform share of G, −a[n] ε / V in every entry, which the chunks
  left out (opts.smoothing_apart), to dx and dW: dx[n] −= a[n] ε / V · Σ_v W[:, v], and
  every column of dW −= ε / V · Σ_n a[n] x[n]. One pass over each, where a pass over every
  chunk's [C, V] buffer would have added it to G; each takes one more rounding there."""
  stats, dx, dw, db = carry
  k = a.astype(jnp.float32) * (opts.label_smoothing / opts.smoothing_vocab)
  if dx is not None:
    dx = (dx.astype(jnp.float32) - k[:, None] * w_sum[None, :]).astype(dx.dtype)
  if dw is not None:
    u = jnp.einsum("n,nd->d", k, x, preferred_element_type=jnp.float32)
    u = u[:, None] if opts.weight_layout == "dv" else u[None, :]
    dw = (dw.astype(jnp.float32) - u).astype(dw.dtype)
  return stats, dx, dw, db


def _reduced_in_loop(opts: LossOptions) -> bool:
  return opts.reduction != "none" and not opts.aux_outputs


def _value(p):
  return getattr(p, "value", p)


def _perturbed(p) -> bool:
  return bool(getattr(p, "perturbed", True)) and _value(p) is not None


def _nonzero(ct):
  return None if isinstance(ct, SymbolicZero) or ct is None else ct


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunked_loss(static: Static, x, w, bias, labels, valid, weights=None):
  """(loss, lse, z-loss term, entropy) of the chunked computation, each token's loss times
  its weight (`weights` float32 [N], None: 1; [N, 1 + k] with a token_loss, its arguments
  after the weights); see module docstring. With a loss reduced in the loop
  (`_reduced_in_loop`) the last three are None, the entropy without LossOptions.entropy."""
  if _reduced_in_loop(static.opts):
    scale = _common.valid_scale(valid, static.opts.reduction)
    loss, *_ = run_chunks(static, x, w, bias, labels,
                          reduced=Reduced(valid, scale, grads=False, weights=weights))
    return _alike(static, (loss, None, None, None))
  stats, *_ = run_chunks(static, x, w, bias, labels)
  return _alike(static, _common.finish(stats, _common.int32_labels(labels), valid, static.opts,
                                       weights))


def _alike(static: Static, out):
  """The outputs, which every shard of a vocabulary axis computes alike, typed so."""
  return out if static.vocab is None else static.vocab.invariant(out)


def _fwd(static: Static, x, w, bias, labels, valid, weights):
  need = (_perturbed(x), _perturbed(w), _perturbed(bias))
  weighs = _perturbed(weights)  # the token weights get gradients: keep the tokens' losses
  x, w, bias, labels, valid, weights = map(_value, (x, w, bias, labels, valid, weights))
  x, w, bias = _checks.first_order_only(static.backend.implementation, x, w, bias)
  opts = static.opts
  needed = None if weights is None else valid  # counted tokens of weight 0 among them
  token_weights, args = _common.split_weights(weights, opts)
  if opts.reduction == "none":
    stats, *_ = run_chunks(static, x, w, bias, labels)
    grads = (None, None, None)
  elif _reduced_in_loop(opts) and not weighs:  # gradients for a unit cotangent, no [N] stats
    scale = _common.valid_scale(valid, opts.reduction)
    loss, *grads = run_chunks(static, x, w, bias, labels, need=need,
                              reduced=Reduced(valid, scale, grads=True, weights=weights),
                              needed=needed)
    return _alike(static, (loss, None, None, None)), Residuals(
        x, w, bias, labels, valid, weights, None, None, None, None, *grads)
  else:  # scalar loss: gradients now, for a unit cotangent.
    r = _common.token_scale(valid, opts.reduction, token_weights)
    a = r if opts.token_loss is None else _common.TokenCoefficients(r, args)
    stats, *grads = run_chunks(static, x, w, bias, labels, a=a, e=jnp.zeros_like(r),
                               need=need, needed=needed)
  ids = _common.int32_labels(labels)
  out = _alike(static, _common.finish(stats, ids, valid, opts, weights))
  if _reduced_in_loop(opts):  # as chunked_loss returns it
    out = (out[0], None, None, None)
  losses = (_alike(static, _common.token_loss(stats, ids, valid, opts, args)) if weighs
            else None)
  mean_logit = None if stats.mean_logit is None else _alike(static, stats.mean_logit)
  log_prob = None  # ℓ, where the token_loss's factors are needed again
  if opts.token_loss is not None and (opts.reduction == "none" or weighs):
    log_prob = _alike(static, stats.label_logit - stats.lse)
  return out, Residuals(x, w, bias, labels, valid, weights, stats.lse, mean_logit, losses,
                        log_prob, *grads)


def _entropy(static: Static, res: Residuals):
  """The tokens' entropies from the residuals, where a token_loss takes them (else None);
  typed alike on every shard of a vocabulary axis, as the statistics they come from are."""
  if static.opts.token_loss is None or not static.opts.entropy:
    return None
  return _alike(static, res.lse - res.mean_logit)


def _scale(t, g, like):
  if t is None or g is None:
    return None
  return (t.astype(jnp.float32) * g).astype(like.dtype)


def _add(t, u):
  if t is None:
    return u
  return t if u is None else (t.astype(jnp.float32) + u.astype(jnp.float32)).astype(t.dtype)


def _bwd(static: Static, res: Residuals, cts):
  g_loss, g_lse, g_z, g_ent = map(_nonzero, cts)
  dweights = None
  if res.losses is not None:  # from the cotangents as given: shares are summed by the caller
    dweights = _common.weight_grads(res.losses, res.valid, g_loss, g_z, static.opts)
    if static.opts.token_loss is not None:  # and the token_loss's arguments'
      token_weights, args = _common.split_weights(res.weights, static.opts)
      ct = (jnp.zeros_like(dweights) if g_loss is None else
            g_loss * _common.token_scale(res.valid, static.opts.reduction, token_weights))
      dargs = _common.token_loss_arg_grads(res.log_prob, _entropy(static, res), args, ct,
                                           static.opts)
      dweights = jnp.concatenate([dweights[:, None], dargs], axis=1)
  if static.vocab is not None:
    g_loss, g_lse, g_z, g_ent = static.vocab.cotangents(g_loss, g_lse, g_z, g_ent)
  res, g_loss, g_lse, g_z, g_ent = _checks.first_order_only(
      static.backend.implementation, res, g_loss, g_lse, g_z, g_ent)
  opts = static.opts
  need = (True, True, res.bias is not None)
  entropy = None if g_ent is None else (g_ent.astype(jnp.float32), res.mean_logit)
  if opts.reduction == "none":
    a, e, h = _common.coefficients(res.valid, res.lse, g_loss, g_lse, g_z, opts, res.weights,
                                   res.log_prob, _entropy(static, res))
    if h is not None:  # a token_loss of the entropy: its share of the entropy's cotangent
      entropy = (h if entropy is None else entropy[0] + h, res.mean_logit)
    _, dx, dw, db = run_chunks(static, res.x, res.weight, res.bias, res.labels,
                               a=a, e=e, lse=res.lse, need=need, entropy=entropy)
  else:
    dx, dw, db = (_scale(t, g_loss, like) for t, like in
                  ((res.dx, res.x), (res.dweight, res.weight), (res.dbias, res.bias)))
    if g_lse is not None or (g_z is not None and opts.z_loss) or entropy is not None:
      # The auxiliary outputs were differentiated: one more pass for their share.
      a, e, _ = _common.coefficients(res.valid, res.lse, None, g_lse, g_z, opts, res.weights)
      _, dx2, dw2, db2 = run_chunks(static, res.x, res.weight, res.bias, res.labels,
                                    a=a, e=e, lse=res.lse, need=need, entropy=entropy)
      dx, dw, db = _add(dx, dx2), _add(dw, dw2), _add(db, db2)
  cast = lambda t, like: None if t is None or like is None else t.astype(like.dtype)
  grads = (cast(dx, res.x), cast(dw, res.weight), cast(db, res.bias), dweights)
  dx, dw, db, dweights = _vma.cotangents_like(grads, (res.x, res.weight, res.bias,
                                                      res.weights))
  return dx, dw, db, None, None, dweights


chunked_loss.defvjp(_fwd, _bwd, symbolic_zeros=True)
