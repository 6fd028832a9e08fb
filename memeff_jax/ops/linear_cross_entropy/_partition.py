"""Linear cross-entropy on Auto meshes: the mean or summed loss as a custom_vjp whose forward
runs per shard through `custom_partitioning`, so that under `jax.jit` with sharded inputs XLA
does not gather the tokens or the weight onto every device (it cannot partition a Pallas
call).

The tokens partition (data parallelism: each shard its tokens' loss, dW and the bias's
gradient summed over the token shards); W's vocabulary partitions over axes that do not
shard the tokens (vocab parallelism, _vocab_parallel); D is replicated (W sharded on D is
gathered by XLA before the call). The forward computes the gradients too, as the chunked
implementations do for a summed loss (G is made with the loss), and the backward scales
them by the cotangent: the custom_vjp stays outermost, and a call that is not
differentiated runs the loss alone. On one device, and inside `jax.shard_map`,
`custom_partitioning` inlines the function.
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


def _rule(layout: str, with_grads: bool):
  def rule(mesh, value_types, result_types):
    ops = [ArrayMapping("n", "d"),
           ArrayMapping("d", "v") if layout == "dv" else ArrayMapping("v", "d")]
    if len(value_types) == 5:  # a bias
      ops.append(ArrayMapping("v"))
    ops += [ArrayMapping("n"), ArrayMapping("n")]  # labels, valid
    results = (ArrayMapping(),) + (tuple(ops[:len(value_types) - 2]) if with_grads else ())
    return SdyShardingRule(tuple(ops), results, need_replication_factors=("d",))
  return rule


def _partition(layout: str, with_grads: bool, local):
  """The per-shard computation and shardings from the inputs' shardings."""
  def partition(mesh, arg_shapes, result_shape):
    x, w = arg_shapes[0], arg_shapes[1]
    tokens = _divides(mesh, _auto.axes((tuple(x.sharding.spec) + (None,))[0]), x.shape[0])
    w_spec = tuple(w.sharding.spec) + (None, None)
    v_dim = 1 if layout == "dv" else 0
    vocab = _divides(mesh, _auto.axes(w_spec[v_dim]), w.shape[v_dim])
    if set(vocab) & set(tokens):
      vocab = ()
    ns = lambda *dims: NamedSharding(mesh, _auto.spec(*dims))
    w_s = ns((), vocab) if layout == "dv" else ns(vocab, ())
    has_bias = len(arg_shapes) == 5
    args = [ns(tokens, ()), w_s] + [ns(vocab)] * has_bias + [ns(tokens), ns(tokens)]
    outs = (ns(),) + (tuple(args[:len(args) - 2]) if with_grads else ())

    def per_shard(x, w, *rest):
      b = rest[0] if has_bias else None
      labels, valid = rest[-2:]
      return local(x, w, b, labels, valid, tokens=tokens, vocab=vocab)

    return mesh, per_shard, outs, tuple(args)
  return partition


def reduced_loss(x, w, b, labels, valid, *, reduction: str, weight_layout: str, loss_fn,
                 name: str):
  """The mean or summed loss over counted tokens, partitioned over the tokens and W's
  vocabulary on Auto meshes. loss_fn(x, w, b, labels, valid, vocab_axis, reduction) -> the
  single-device loss of a shard (vocab_axis: the mesh axes W's vocabulary is sharded over,
  or None). With the tokens sharded, a mean is each shard's sum over the global count. name:
  the implementation, for the error a second-order gradient raises."""
  def shard_loss(x, w, b, labels, valid, tokens, vocab):
    if tokens and reduction == "mean":
      count = jax.lax.psum(jax.numpy.sum(valid, dtype=jax.numpy.float32), tokens)
      return loss_fn(x, w, b, labels, valid, vocab or None, "sum") / jax.numpy.maximum(count, 1.0)
    return loss_fn(x, w, b, labels, valid, vocab or None, reduction)

  def local(x, w, b, labels, valid, *, tokens, vocab):
    loss = shard_loss(x, w, b, labels, valid, tokens, vocab)
    return (jax.lax.psum(loss, tokens) if tokens else loss,)

  def local_with_grads(x, w, b, labels, valid, *, tokens, vocab):
    f = lambda x, w, b: shard_loss(x, w, b, labels, valid, tokens, vocab)
    if b is None:
      loss, (dx, dw) = jax.value_and_grad(lambda x, w: f(x, w, None), argnums=(0, 1))(x, w)
      shared = (dw,)
    else:
      loss, (dx, dw, db) = jax.value_and_grad(f, argnums=(0, 1, 2))(x, w, b)
      shared = (dw, db)
    if vocab:  # each vocabulary slice's share of dx
      dx = jax.lax.psum(dx, vocab)
    if tokens:  # dW and the bias's gradient: summed over the token shards
      loss, shared = jax.lax.psum((loss, shared), tokens)
    return (loss, dx, *shared)

  def partitioned(with_grads: bool):
    fn = local_with_grads if with_grads else local
    inner = lambda x, w, *rest: fn(x, w, *((rest[0],) if len(rest) == 3 else (None,)),
                                   *rest[-2:], tokens=(), vocab=())
    return _auto.partitioned(inner, _partition(weight_layout, with_grads, fn),
                             _rule(weight_layout, with_grads))

  operands = lambda x, w, b, labels, valid: (x, w) + (() if b is None else (b,)) + (labels,
                                                                                  valid)

  @jax.custom_vjp
  def loss(x, w, b, labels, valid):
    return partitioned(False)(*operands(x, w, b, labels, valid))[0]

  def fwd(x, w, b, labels, valid):
    x, w = _checks.first_order_only(name, x, w)
    out = partitioned(True)(*operands(x, w, b, labels, valid))
    return out[0], out[1:]

  def bwd(grads, ct):
    scaled = tuple((g * ct).astype(g.dtype) for g in grads)
    return (*scaled, *((None,) if len(scaled) == 2 else ()), None, None)

  loss.defvjp(fwd, bwd)
  return loss(x, w, b, labels, valid)
