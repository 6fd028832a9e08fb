"""Linear cross-entropy on Auto meshes: the loss as a custom_vjp whose forward and backward
run per shard through `custom_partitioning`, so that under `jax.jit` with sharded inputs XLA
does not gather the tokens or the weight onto every device (it cannot partition a Pallas
call).

The tokens partition (data parallelism: each shard its tokens' loss, dW and the bias's
gradient summed over the token shards); W's vocabulary partitions too (vocab parallelism,
_vocab_parallel). Where the tokens' last (minor) axes also shard the vocabulary (sequence
parallelism, Megatron's: the hidden states sharded over the tensor axis), the call takes
the tokens gathered over those axes (XLA all-gathers x, [N, D], never W) and dx leaves it
reduce-scattered over them. D is replicated in the call (W sharded on D is gathered by XLA
before it). Where W's D is sharded over token axes (FSDP),
dW leaves the call reduce-scattered over those axes into W's own sharding: no device holds
the whole summed dW. The forward computes the gradients too, as
the chunked implementations do for a summed loss (G is made with the loss), and the backward
scales them by the cotangent: the custom_vjp stays outermost, and a call that is not
differentiated runs the loss alone. Per-token outputs (reduction="none", or return_aux's
log-sum-exps and z-loss terms) get their gradients in the backward instead, from their
cotangents (per_token_loss). Token weights, where given, are one more operand sharded like
the labels ([N, 1 + k] with a token_loss's arguments), and get their gradients with the others.
"""

from __future__ import annotations

import jax
from jax.experimental.custom_partitioning import ArrayMapping
from jax.experimental.custom_partitioning import SdyShardingRule
from jax.sharding import NamedSharding

from memeff_jax.ops import _auto
from memeff_jax.ops import _checks


def _divides(mesh, axes: tuple, size: int) -> tuple:
  """`axes` if their shards split `size` evenly, else () (replicated: never a padded shard)."""
  return axes if size % _auto.size(mesh, axes) == 0 else ()


def _has_bias(n_operands: int, mode: str, k: int = 1, weighted: bool = False) -> bool:
  """Whether a partitioned call's operands (x, w[, b], labels, valid[, weights][, cts]) hold
  a bias. `mode` says what the call returns: the reduced loss ("loss"), with its gradients
  ("grads"), `k` per-token outputs ("tokens": the losses, or with the auxiliary outputs the
  losses, log-sum-exps, z-loss terms and entropies), or the gradients for their cotangents, `k` more
  [N] operands ("vjp"). `weighted`: the operands hold token weights."""
  return n_operands - (k if mode == "vjp" else 0) - weighted == 5


def _rule(layout: str, mode: str, k: int, weighted: bool):
  def rule(mesh, value_types, result_types):
    ops = [ArrayMapping("n", "d"),
           ArrayMapping("d", "v") if layout == "dv" else ArrayMapping("v", "d")]
    if _has_bias(len(value_types), mode, k, weighted):
      ops.append(ArrayMapping("v"))
    # The token weights ([N], or [N, 1 + k] with a token_loss's arguments) after the others.
    weights = ()
    if weighted:
      weights = (ArrayMapping(*"nk"[:len(value_types[len(ops) + 2].shape)]),)
    grads = (*ops, *weights)
    ops += [ArrayMapping("n")] * 2 + list(weights) + [ArrayMapping("n")] * (k * (mode == "vjp"))
    results = {"loss": (ArrayMapping(),), "grads": (ArrayMapping(), *grads),
               "tokens": (ArrayMapping("n"),) * k, "vjp": grads}[mode]
    columns = ("k",) if weights and len(weights[0]) == 2 else ()
    return SdyShardingRule(tuple(ops), results, need_replication_factors=("d",) + columns)
  return rule


def _partition(layout: str, mode: str, k: int, weighted: bool, local):
  """The per-shard computation and shardings from the inputs' shardings."""
  def partition(mesh, arg_shapes, result_shape):
    x, w = arg_shapes[0], arg_shapes[1]
    tokens = _divides(mesh, _auto.axes((tuple(x.sharding.spec) + (None,))[0]), x.shape[0])
    w_spec = tuple(w.sharding.spec) + (None, None)
    v_dim = 1 if layout == "dv" else 0
    vocab = _divides(mesh, _auto.axes(w_spec[v_dim]), w.shape[v_dim])
    shared = tuple(a for a in tokens if a in vocab)  # sequence parallel: gathered in the call
    if shared and tokens[len(tokens) - len(shared):] == shared:
      tokens = tokens[:len(tokens) - len(shared)]
    elif shared:  # the tokens' order over the axes would change: W replicated instead
      vocab, shared = (), ()
    # FSDP: the token axes that also shard W's D, where they split D evenly.
    fsdp = tuple(a for a in _auto.axes(w_spec[1 - v_dim]) if a in tokens)
    fsdp = _divides(mesh, fsdp, w.shape[1 - v_dim]) if mode in ("grads", "vjp") else ()
    ns = lambda *dims: NamedSharding(mesh, _auto.spec(*dims))
    w_dims = lambda d_axes: (d_axes, vocab) if layout == "dv" else (vocab, d_axes)
    has_bias = _has_bias(len(arg_shapes), mode, k, weighted)
    params = [ns(tokens, ()), ns(*w_dims(()))] + [ns(vocab)] * has_bias
    args = params + [ns(tokens)] * (2 + weighted + k * (mode == "vjp"))
    grads = ([ns(tokens + shared, ()), ns(*w_dims(fsdp))] + [ns(vocab)] * has_bias
             + [ns(tokens)] * weighted)
    outs = {"loss": (ns(),), "grads": (ns(), *grads), "tokens": (ns(tokens),) * k,
            "vjp": tuple(grads)}[mode]

    def per_shard(x, w, *rest):
      b = rest[0] if has_bias else None
      return local(x, w, b, *rest[has_bias:], tokens=tokens, vocab=vocab,
                   scatter=(fsdp, 1 - v_dim), sequence=shared)

    return mesh, per_shard, outs, tuple(args)
  return partition


def _partitioned(layout: str, mode: str, local, k: int = 1, weighted: bool = False):
  """local(x, w, b, labels, valid, weights[, cts], tokens=, vocab=, scatter=, sequence=) as a
  custom_partitioning call of the operands (x, w[, b], labels, valid[, weights][, cts])
  (weights None where not `weighted`); k: see _has_bias."""
  def inner(x, w, *rest):
    has_bias = _has_bias(2 + len(rest), mode, k, weighted)
    return _local(local, weighted, x, w, rest[0] if has_bias else None, *rest[has_bias:],
                  tokens=(), vocab=(), scatter=((), 0), sequence=())

  def per_shard(x, w, b, *rest, **axes):
    return _local(local, weighted, x, w, b, *rest, **axes)

  return _auto.partitioned(inner, _partition(layout, mode, k, weighted, per_shard),
                           _rule(layout, mode, k, weighted))


def _local(local, weighted: bool, x, w, b, labels, valid, *rest, **axes):
  """local's call with its weights argument (None where the operands hold none)."""
  weights, cts = (rest[0], rest[1:]) if weighted else (None, rest)
  return local(x, w, b, labels, valid, weights, *cts, **axes)


def _operands(x, w, b, labels, valid, weights, *cts):
  return ((x, w) + (() if b is None else (b,)) + (labels, valid)
          + (() if weights is None else (weights,)) + cts)


def _dx_summed(dx, vocab: tuple, sequence: tuple):
  """Each vocabulary slice's share of dx summed over `vocab`; reduce-scattered into token
  shards over `sequence`, the vocabulary axes the call gathered the tokens over."""
  rest = tuple(a for a in vocab if a not in sequence)
  if rest:
    dx = jax.lax.psum(dx, rest)
  if sequence:
    dx = jax.lax.psum_scatter(dx, sequence, scatter_dimension=0, tiled=True)
  return dx


def _value_and_grads(f, x, w, b, weights):
  """(f(x, w, b, weights), (dx, dw, db, dweights)); db and dweights None where b and
  weights are (None is an empty pytree: it gets no gradient)."""
  return jax.value_and_grad(lambda args: f(*args))((x, w, b, weights))


def _present(*arrays) -> tuple:
  """The arrays that are not None: a partitioned call's results, whose bias and token
  weights' gradients exist only where those operands do."""
  return tuple(a for a in arrays if a is not None)


def _cotangents(grads, b, weights):
  """The custom_vjp's cotangents of (x, w, b, labels, valid, weights) from a partitioned
  call's gradients (dx, dw[, db][, dweights]) (_present's inverse: None where b or weights
  is None, and for the labels and valid)."""
  dx, dw, *rest = grads
  db = rest.pop(0) if b is not None else None
  return dx, dw, db, None, None, rest.pop(0) if weights is not None else None


def token_group(rounded_tokens, x, w, scatter: tuple) -> int | None:
  """The token group size a shard's FSDP gradients take (see reduced_loss's rounded_tokens),
  or None where its tokens (x's rows) go in one piece: no FSDP, no limit, or no more tokens
  than it. scatter: (the FSDP axes, W's D dimension)."""
  axes, d_dim = scatter
  group = rounded_tokens(w.shape[1 - d_dim]) if rounded_tokens and axes else None
  return group if group and x.shape[0] > group else None


def token_slices(n: int, group: int) -> list[slice]:
  """n tokens in equal groups of at most `group` (the last one may be shorter)."""
  size = -(-n // -(-n // group))
  return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def _token_groups(n: int, group: int, rows_grads, x, w, b, tokens: tuple, scatter: tuple,
                  scale=1.0):
  """A shard's gradients from its tokens in groups of at most `group` (FSDP: see
  reduced_loss's rounded_tokens). rows_grads(rows) -> (value, dx, dW, db, dweights) of the
  tokens `rows` (db and dweights None without a bias or token weights); each group's dW (and
  db) is summed over the token shards as it comes (_summed) and added up in float32. Returns
  (Σ value, dx, dW, db, dweights), all times `scale`, the gradients in their inputs' dtypes
  (dweights float32)."""
  f32 = jax.numpy.float32
  total, dxs, dws, dw, db = 0.0, [], [], 0.0, 0.0
  for rows in token_slices(n, group):
    value, dx_g, dw_g, db_g, dweights_g = rows_grads(rows)
    dw_g, db_g = _summed(dw_g, db_g, tokens, scatter)
    total, dw = total + value, dw + dw_g.astype(f32)
    db = db if db_g is None else db + db_g.astype(f32)
    dxs.append(dx_g)
    dws.append(dweights_g)
  dx = (jax.numpy.concatenate(dxs).astype(f32) * scale).astype(x.dtype)
  dweights = None if dws[0] is None else jax.numpy.concatenate(dws) * scale
  return (total * scale, dx, (dw * scale).astype(w.dtype),
          None if b is None else (db * scale).astype(b.dtype), dweights)


def _summed(dw, db, tokens: tuple, scatter: tuple):
  """(dW, db): dW and the bias's gradient (or None) summed over the token shards: dW
  reduce-scattered over the axes `scatter` = (axes, D's dimension) names and summed over the
  other token axes; the bias's gradient summed over all of them."""
  axes, d_dim = scatter
  rest = tuple(a for a in tokens if a not in axes)
  if axes:
    dw = jax.lax.psum_scatter(dw, axes, scatter_dimension=d_dim, tiled=True)
  if rest:
    dw = jax.lax.psum(dw, rest)
  if db is not None and tokens:
    db = jax.lax.psum(db, tokens)
  return dw, db


def reduced_loss(x, w, b, labels, valid, weights, *, reduction: str, weight_layout: str,
                 loss_fn, name: str, rounded_tokens=None):
  """The mean or summed loss over counted tokens, partitioned over the tokens and W's
  vocabulary on Auto meshes. loss_fn(x, w, b, labels, valid, weights, vocab_axis, reduction)
  -> the single-device (loss, lse, z-loss term, entropy) of a shard (vocab_axis: the mesh
  axes W's vocabulary is sharded over, or None; the last three may be None; weights: the
  token weights, or None). With the tokens sharded, a mean is each shard's sum over the
  global count. name: the implementation, for the error a second-order gradient raises.

  rounded_tokens(v_local) -> the most tokens whose dW the implementation adds up in W's
  16-bit dtype (beyond them it holds a float32 dW), or None. Where W's D is sharded over
  token axes (FSDP) and a shard has more tokens, they are taken in groups of at most that
  many (_token_groups): each group's dW is reduce-scattered as it comes and added to a
  float32 shard of dW, so no device holds a whole float32 dW."""
  weighted = weights is not None

  def shard_loss(x, w, b, labels, valid, weights, tokens, vocab):
    if tokens and reduction == "mean":
      count = jax.lax.psum(jax.numpy.sum(valid, dtype=jax.numpy.float32), tokens)
      total = loss_fn(x, w, b, labels, valid, weights, vocab or None, "sum")[0]
      return total / jax.numpy.maximum(count, 1.0)
    return loss_fn(x, w, b, labels, valid, weights, vocab or None, reduction)[0]

  def local(x, w, b, labels, valid, weights, *, tokens, vocab, scatter, sequence):
    del scatter, sequence
    loss = shard_loss(x, w, b, labels, valid, weights, tokens, vocab)
    return (jax.lax.psum(loss, tokens) if tokens else loss,)

  def local_with_grads(x, w, b, labels, valid, weights, *, tokens, vocab, scatter, sequence):
    group = token_group(rounded_tokens, x, w, scatter)
    if group:
      loss, dx, dw, db, dweights = grouped_grads(x, w, b, labels, valid, weights, group,
                                                 tokens, vocab, scatter)
    else:
      f = lambda x, w, b, weights: shard_loss(x, w, b, labels, valid, weights, tokens, vocab)
      loss, (dx, dw, db, dweights) = _value_and_grads(f, x, w, b, weights)
      dw, db = _summed(dw, db, tokens, scatter)
      if tokens:
        loss = jax.lax.psum(loss, tokens)
    return _present(loss, _dx_summed(dx, vocab, sequence), dw, db, dweights)

  def grouped_grads(x, w, b, labels, valid, weights, group, tokens, vocab, scatter):
    """local_with_grads in token groups of at most `group` (see _token_groups)."""
    count = jax.numpy.sum(valid, dtype=jax.numpy.float32)
    count = jax.lax.psum(count, tokens) if tokens else count
    scale = 1.0 / jax.numpy.maximum(count, 1.0) if reduction == "mean" else 1.0

    def rows_grads(rows):
      f = lambda x, w, b, weights: loss_fn(x, w, b, labels[rows], valid[rows], weights,
                                           vocab or None, "sum")[0]
      loss_g, grads = _value_and_grads(f, x[rows], w, b, token_rows(weights, rows))
      return (loss_g, *grads)

    loss, *grads = _token_groups(x.shape[0], group, rows_grads, x, w, b, tokens, scatter,
                                 scale)
    return (jax.lax.psum(loss, tokens) if tokens else loss, *grads)

  @jax.custom_vjp
  def loss(x, w, b, labels, valid, weights):
    return _partitioned(weight_layout, "loss", local, weighted=weighted)(
        *_operands(x, w, b, labels, valid, weights))[0]

  def fwd(x, w, b, labels, valid, weights):
    x, w = _checks.first_order_only(name, x, w)
    out = _partitioned(weight_layout, "grads", local_with_grads, weighted=weighted)(
        *_operands(x, w, b, labels, valid, weights))
    return out[0], out[1:]

  def bwd(grads, ct):
    return _cotangents(tuple((g * ct).astype(g.dtype) for g in grads), b, weights)

  loss.defvjp(fwd, bwd)
  return loss(x, w, b, labels, valid, weights)


def token_rows(t, rows):
  """t[rows] of a per-token array that may be None."""
  return None if t is None else t[rows]


def per_token_loss(x, w, b, labels, valid, weights, *, weight_layout: str, loss_fn, name: str,
                   outputs: int = 1, rounded_tokens=None):
  """The first `outputs` of loss_fn's per-token results (reduction="none": the [N] losses,
  log-sum-exps, z-loss terms and entropies), partitioned over the tokens and W's vocabulary on Auto
  meshes: the forward runs loss_fn (as reduced_loss takes it, returning that triple) per
  shard; the backward runs its vjp per shard for the outputs' cotangents (the shard's
  forward run again, as under rematerialization), dx summed over the vocabulary slices
  (_dx_summed), dW and the bias's gradient over the token shards, under FSDP in token groups
  as reduced_loss takes them (`rounded_tokens`). A tuple of `outputs` arrays."""
  weighted = weights is not None

  def shard(x, w, b, labels, valid, weights, vocab):
    return tuple(loss_fn(x, w, b, labels, valid, weights, vocab or None, "none")[:outputs])

  def local(x, w, b, labels, valid, weights, *, tokens, vocab, scatter, sequence):
    del tokens, scatter, sequence
    return shard(x, w, b, labels, valid, weights, vocab)

  def local_vjp(x, w, b, labels, valid, weights, *cts, tokens, vocab, scatter, sequence):
    def rows_grads(rows):
      f = lambda args: shard(args[0], args[1], args[2], labels[rows], valid[rows], args[3],
                             vocab)
      grads, = jax.vjp(f, (x[rows], w, b, token_rows(weights, rows)))[1](
          tuple(ct[rows] for ct in cts))
      return (0.0, *grads)

    group = token_group(rounded_tokens, x, w, scatter)
    if group:
      _, dx, dw, db, dweights = _token_groups(x.shape[0], group, rows_grads, x, w, b, tokens,
                                              scatter)
    else:
      _, dx, dw, db, dweights = rows_grads(slice(None))
      dw, db = _summed(dw, db, tokens, scatter)
    return _present(_dx_summed(dx, vocab, sequence), dw, db, dweights)

  @jax.custom_vjp
  def loss(x, w, b, labels, valid, weights):
    return tuple(_partitioned(weight_layout, "tokens", local, outputs, weighted)(
        *_operands(x, w, b, labels, valid, weights)))

  def fwd(x, w, b, labels, valid, weights):
    x, w = _checks.first_order_only(name, x, w)
    return loss(x, w, b, labels, valid, weights), (x, w, b, labels, valid, weights)

  def bwd(res, cts):
    x, w, b, labels, valid, weights = res
    return _cotangents(_partitioned(weight_layout, "vjp", local_vjp, outputs, weighted)(
        *_operands(x, w, b, labels, valid, weights, *cts)), b, weights)

  loss.defvjp(fwd, bwd)
  return loss(x, w, b, labels, valid, weights)
