"""Attention on Auto meshes: the forward and backward computations as `custom_partitioning`s, so
that under `jax.jit` with sharded inputs XLA runs them per shard instead of gathering
everything onto every device (it cannot partition a Pallas call by itself).

The batch and the heads partition: each shard computes its batch rows and query heads with
the single-device code. The key heads shard with the query heads where every shard gets
whole GQA groups (Hkv divisible by the shards); one key head (MQA) stays whole, and then the
backward sums its dk and dv over the query-head shards. Where T == S the sequence partitions
too, q's and k's alike: each shard then runs context parallelism (_context.forward and
backward, with the call's AttentionOptions.context: order and strategy), its pairs through
the implementation that made the call (falling through to chunked_xla where a slice does not
suit it). The head dim is replicated. The Shardy rules say as much:
`b t (k g) d, b t k d, b t k e -> b t (k g) e, b (k g) t` (T ≠ S: `b s k d` for the keys, t
and s replicated), with d and e needing replication. It has no batching rule:
`jax.custom_batching.custom_vmap` folds a vmapped axis into the batch. The custom_vjp stays
outermost (attention_vjp): its forward and backward rules call these. Calls on one device,
inside shard_map and under jax_enable_x64 are not partitioned (_auto.available).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import ArrayMapping
from jax.experimental.custom_partitioning import CompoundFactor
from jax.experimental.custom_partitioning import SdyShardingRule
from jax.sharding import NamedSharding

from memeff_jax.ops import _auto
from memeff_jax.ops.flash_attention import _common
from memeff_jax.ops.flash_attention import _context


def _heads(q_shape, k_shape) -> tuple:
  """(query-head mapping, key-head factor, factor sizes) of the rules: (k g) over k for GQA,
  independent factors for one key head (a compound may not hold a factor of size 1)."""
  hq, hkv = q_shape[2], k_shape[2]
  if hkv == 1 and hq > 1:
    return "h", "k", {}
  if hq != hkv:
    return CompoundFactor("k", "g"), "k", {"g": hq // hkv}
  return "k", "k", {}


def _operands(q, k) -> tuple[list, dict, tuple]:
  """(q, k, v mappings, factor sizes, factors needing replication): the keys' sequence is
  q's factor where T == S (so both shard alike), its own replicated factor otherwise."""
  qh, kh, sizes = _heads(q, k)
  s = "t" if q[1] == k[1] else "s"
  ops = [ArrayMapping("b", "t", qh, "d"), ArrayMapping("b", s, kh, "d"),
         ArrayMapping("b", s, kh, "e")]
  return ops, sizes, ("d", "e") if s == "t" else ("t", "d", "s", "e")


def _forward_rule(mesh, value_types, result_types):
  q, k = value_types[0].shape, value_types[1].shape
  ops, sizes, replicated = _operands(q, k)
  qh, s = ops[0][2], ops[1][1]
  if len(value_types) == 5:  # segment ids
    ops += [ArrayMapping("b", "t"), ArrayMapping("b", s)]
  return SdyShardingRule(tuple(ops), (ArrayMapping("b", "t", qh, "e"), ArrayMapping("b", qh, "t")),
                         need_replication_factors=replicated, **sizes)


def _backward_rule(mesh, value_types, result_types):
  q, k = value_types[0].shape, value_types[1].shape
  ops, sizes, replicated = _operands(q, k)
  qh, s = ops[0][2], ops[1][1]
  if len(value_types) == 9:
    ops += [ArrayMapping("b", "t"), ArrayMapping("b", s)]
  ops += [ArrayMapping("b", "t", qh, "e"), ArrayMapping("b", qh, "t"),  # out, lse
          ArrayMapping("b", "t", qh, "e"), ArrayMapping("b", qh, "t")]  # their cotangents
  return SdyShardingRule(tuple(ops), tuple(ops[:3]), need_replication_factors=replicated,
                         **sizes)


def _sequence(mesh, q, k) -> tuple:
  """The mesh axes q's sequence is sharded over where the call runs context parallel: T == S,
  k's sequence sharded alike, both lengths divisible; () otherwise."""
  spec_q = tuple(q.sharding.spec) + (None,) * 4
  spec_k = tuple(k.sharding.spec) + (None,) * 4
  seq = _auto.axes(spec_q[1])
  n = _auto.size(mesh, seq)
  if not seq or q.shape[1] != k.shape[1] or _auto.axes(spec_k[1]) != seq or q.shape[1] % n:
    return ()
  return seq


def _context_where(static, mesh, seq: tuple, q, k) -> dict:
  """_context's arguments for q and k (global shapes) sharded on the sequence over `seq`; a
  clear error where the order cannot hold."""
  opts = static.opts
  order, strategy = opts.context
  n = _auto.size(mesh, seq)
  _context.check_lengths(order, q.shape[1] // n, k.shape[1] // n)
  return dict(axis=seq[0] if len(seq) == 1 else seq, shards=n,
              window=(opts.mask.left, opts.mask.right), order=order, strategy=strategy)


def _pair_calls(impl, static):
  """(attend, attend_backward) of _context: the public calls with the call's options, through
  `impl` (chunked_xla where a slice does not suit it)."""
  from memeff_jax.ops.flash_attention import api  # pylint: disable=import-outside-toplevel
  opts = static.opts
  kw = dict(scale=opts.scale, logit_softcap=opts.logit_softcap,
            deterministic=opts.deterministic, implementation=(impl, "chunked_xla"))

  def attend(q, k, v, q_seg, kv_seg, window):
    return api.flash_attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                               sliding_window=window, return_lse=True, **kw)

  def attend_backward(q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, window):
    return api.flash_attention_backward(q, k, v, out, lse, d_out, d_lse, q_segment_ids=q_seg,
                                        kv_segment_ids=kv_seg, sliding_window=window, **kw)

  return attend, attend_backward


def _plan(mesh, q_sharding, batch_size: int, hq: int, hkv: int):
  """(batch axes, query-head axes, key-head axes, the axes dk/dv are summed over) from q's
  sharding: a dimension shards only where its shards are equal, heads only where every
  shard gets whole GQA groups (or all share one key head)."""
  spec = tuple(q_sharding.spec) + (None,) * 4
  batch, heads = _auto.axes(spec[0]), _auto.axes(spec[2])
  if batch_size % _auto.size(mesh, batch):  # never a padded shard: replicated instead
    batch = ()
  n = _auto.size(mesh, heads)
  if hq % n:
    return batch, (), (), ()
  if hkv % n == 0:
    return batch, heads, heads, ()
  if hkv == 1:
    return batch, heads, (), heads
  return batch, (), (), ()


def _forward_partition(impl, static, forward, mesh, arg_shapes, result_shape):
  q, k = arg_shapes[0], arg_shapes[1]
  batch, qh, kh, _ = _plan(mesh, q.sharding, q.shape[0], q.shape[2], k.shape[2])
  seq = _sequence(mesh, q, k)
  ns = lambda *dims: NamedSharding(mesh, _auto.spec(*dims))
  q_s, kv_s = ns(batch, seq, qh, ()), ns(batch, seq, kh, ())
  args = [q_s, kv_s, kv_s] + [ns(batch, seq)] * (len(arg_shapes) - 3)
  outs = (q_s, ns(batch, qh, seq))
  if seq:
    where = _context_where(static, mesh, seq, q, k)
    attend, _ = _pair_calls(impl, static)

    def per_shard(q, k, v, *segs):
      q_seg, kv_seg = segs or (None, None)
      out, lse = _context.forward(attend, q, k, v, q_seg, kv_seg, **where)
      return out, jnp.swapaxes(lse, 1, 2)  # [B, T, H] -> the implementations' [B, H, T]
  else:
    _no_context(static)

    def per_shard(q, k, v, *segs):
      return forward(static, q, k, v, *(segs or (None, None)))

  return mesh, per_shard, outs, tuple(args)


def _no_context(static):
  """Context options name a sequence sharding the call does not have: an error, not ignored."""
  if static.opts.context != _context.DEFAULT:
    order, strategy = static.opts.context
    raise ValueError(f"context_order={order!r}, context_strategy={strategy!r} are for q, k and "
                     "v sharded alike on the sequence (T == S), which this call's are not")


def _backward_partition(impl, static, backward, mesh, arg_shapes, result_shape):
  q, k = arg_shapes[0], arg_shapes[1]
  batch, qh, kh, summed = _plan(mesh, q.sharding, q.shape[0], q.shape[2], k.shape[2])
  seq = _sequence(mesh, q, k)
  ns = lambda *dims: NamedSharding(mesh, _auto.spec(*dims))
  q_s, kv_s, lse_s = ns(batch, seq, qh, ()), ns(batch, seq, kh, ()), ns(batch, qh, seq)
  segs = len(arg_shapes) == 9
  args = [q_s, kv_s, kv_s] + [ns(batch, seq)] * (2 * segs) + [q_s, lse_s, q_s, lse_s]
  if seq:
    where = _context_where(static, mesh, seq, q, k)
    _, attend_backward = _pair_calls(impl, static)
  else:
    _no_context(static)

  def per_shard(q, k, v, *rest):
    q_seg, kv_seg = rest[:2] if segs else (None, None)
    out, lse, d_out, d_lse = rest[-4:]
    if seq:
      t_first = lambda a: jnp.swapaxes(a, 1, 2)  # the implementations' [B, H, T] -> [B, T, H]
      dq, dk, dv = _context.backward(attend_backward, q, k, v, q_seg, kv_seg, out, t_first(lse),
                                     d_out, t_first(d_lse), **where)
    else:
      dq, dk, dv = backward(static, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse)
    if summed:  # one key head shared by the query-head shards
      dk, dv = jax.lax.psum((dk, dv), summed)
    return dq, dk, dv

  return mesh, per_shard, (q_s, kv_s, kv_s), tuple(args)


def _fold_vmap(fn):
  """fn(*arrays) under custom_vmap: a vmapped axis is folded into every array's leading
  (batch) axis, fn called once, and unfolded from the outputs'."""
  wrapped = jax.custom_batching.custom_vmap(fn)

  @wrapped.def_vmap
  def _rule(axis_size, in_batched, *args):
    def fold(x, batched):
      if not batched:
        x = jax.numpy.broadcast_to(x, (axis_size,) + x.shape)
      return x.reshape((axis_size * x.shape[1],) + x.shape[2:])

    flat = [fold(x, b) for x, b in zip(args, in_batched)]
    outs = wrapped(*flat)
    unfold = lambda y: y.reshape((axis_size, y.shape[0] // axis_size) + y.shape[1:])
    return tuple(unfold(y) for y in outs), tuple(True for _ in outs)

  return wrapped


def partitioned_forward(forward):
  """forward(static, q, k, v, q_seg, kv_seg) -> (out, lse), called as (impl, static, q, k,
  v, q_seg, kv_seg), partitioned over the batch, heads and sequence of an Auto mesh."""
  def call(impl, static, q, k, v, q_seg, kv_seg):
    if not _auto.available(q, k, v):
      _no_context(static)
      return forward(static, q, k, v, q_seg, kv_seg)
    part = _auto.partitioned(
        lambda q, k, v, *segs: forward(static, q, k, v, *(segs or (None, None))),
        functools.partial(_forward_partition, impl, static, forward), _forward_rule)
    segs = () if q_seg is None else (q_seg, kv_seg)
    return _fold_vmap(part)(q, k, v, *segs)
  return call


def partitioned_backward(backward):
  """backward(static, residuals, cotangents) -> (dq, dk, dv, None, None), called as (impl,
  static, residuals, cotangents), its dq, dk, dv partitioned over the batch, heads and
  sequence of an Auto mesh."""
  def flat_backward(static, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse):
    return tuple(backward(static, _common.Residuals(q, k, v, q_seg, kv_seg, out, lse),
                          (d_out, d_lse))[:3])

  def call(impl, static, res, cts):
    if not _auto.available(res.q, res.k, res.v, *cts):
      return backward(static, res, cts)
    d_out, d_lse = cts
    segs = () if res.q_segment_ids is None else (res.q_segment_ids, res.kv_segment_ids)

    def local(q, k, v, *rest):
      q_seg, kv_seg = rest[:2] if segs else (None, None)
      return flat_backward(static, q, k, v, q_seg, kv_seg, *rest[-4:])

    part = _auto.partitioned(local, functools.partial(_backward_partition, impl, static,
                                                      flat_backward), _backward_rule)
    dq, dk, dv = _fold_vmap(part)(res.q, res.k, res.v, *segs, res.out, res.lse, d_out, d_lse)
    return dq, dk, dv, None, None
  return call
