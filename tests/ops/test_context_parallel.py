"""flash_attention with the sequence sharded (context parallelism) on 8 CPU devices: inside
jax.shard_map (`context_axis=`) and on Explicit meshes, values and gradients against one
device, and the compiled program's collectives."""

import collections
import functools
import re

import jax
from jax import shard_map
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import memeff_jax
from memeff_jax.ops.flash_attention import _context
from memeff_jax.ops.flash_attention import flash_attention_backward
from memeff_jax.ops.flash_attention import unzigzag
from memeff_jax.ops.flash_attention import zigzag
from memeff_jax.ops.flash_attention.masks import MaskSpec
from memeff_jax.ops.flash_attention.pallas_triton import PallasTriton


def _mesh(shape, names, kind=AxisType.Explicit):
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def _problem(seed, b=2, t=256, hq=4, hkv=2, d=32, segments=False):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, hq, d))
  k, v = (jax.random.normal(key, (b, t, hkv, d)) for key in ks[1:3])
  seg = None
  if segments:  # documents of random lengths, some crossing shard boundaries
    seg = jnp.cumsum(jax.random.bernoulli(ks[3], 0.02, (b, t)), axis=1)
  return q, k, v, seg


def _loss(f):
  def loss(q, k, v, seg):
    out, lse = f(q, k, v, seg)
    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * 0.3)
  return loss


def _value_and_grads(f, *args, argnums=(0, 1, 2)):
  """f(*args) and the gradients of _loss(f), one compiled program."""
  return jax.jit(lambda *a: (f(*a), jax.grad(_loss(f), argnums)(*a)))(*args)


def _close(got, want, tol=2e-5):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


_CASES = [dict(causal=True), dict(causal=True, sliding_window=(40, 0)),
          dict(sliding_window=(70, 20)), dict(segments=True, causal=True),
          dict(segments=True), dict(causal=True, logit_softcap=5.0, hkv=1),
          dict(sliding_window=(None, 33)), dict()]


@pytest.mark.parametrize("kw, check_vma, strategy",
                         [(kw, i % 3 != 0, "all_gather") for i, kw in enumerate(_CASES)]
                         + [(_CASES[i], i % 2 == 0, "ring") for i in (0, 2, 3, 5, 6)])
def test_in_shard_map(kw, check_vma, strategy):
  """context_axis='context' inside shard_map with the sequence over 4 shards and the batch
  over 2: every mask, GQA/MQA, softcap and the log-sum-exp, values and gradients against one
  device. all_gather (every case): K/V gathered, dK/dV reduce-scattered; ring (one case of
  each kind of mask): K/V (and dK/dV) passed round by collective-permutes, no shard holding
  the whole sequence's keys; q never moves."""
  kw = dict(kw)
  q, k, v, seg = _problem(1, hkv=kw.pop("hkv", 2), segments=kw.pop("segments", False))
  one = lambda q, k, v, seg: memeff_jax.flash_attention(q, k, v, q_segment_ids=seg,
                                                        return_lse=True, **kw)
  mesh = _mesh((2, 4), ("data", "context"), AxisType.Auto)
  spec, rows = P("data", "context"), P("data", "context")
  many = shard_map(
      lambda q, k, v, seg: memeff_jax.flash_attention(
          q, k, v, q_segment_ids=seg, return_lse=True, context_axis="context",
          context_strategy=strategy, **kw),
      mesh=mesh, in_specs=(spec, spec, spec, rows if seg is not None else None),
      out_specs=(spec, P("data", "context")), check_vma=check_vma)
  argnums = (0, 1, 2)
  want, want_grads = _value_and_grads(one, q, k, v, seg)
  both = jax.jit(lambda *a: (many(*a), jax.grad(_loss(many), argnums)(*a)))
  compiled = both.lower(q, k, v, seg).compile()
  got, grads = compiled(q, k, v, seg)
  _close(got, want)
  _close(grads, want_grads)
  text = compiled.as_text()
  hq, t = q.shape[2], q.shape[1]
  mask = MaskSpec.make(kw.get("causal", False), kw.get("sliding_window"), False)
  halo = _context.halo_rows(t // 4, t // 4, 4, (mask.left, mask.right), "contiguous")
  if strategy == "all_gather" and halo:  # only the neighbours' rows in reach pass
    assert " all-gather" not in text and " reduce-scatter" not in text
    moved = re.findall(r"\S+\[([0-9,]*)\]\S* collective-permute(?:-start)?\(", text)
    assert moved and {int(m.split(",")[1]) for m in moved} <= set(halo), moved
  elif strategy == "all_gather":
    assert " all-gather" in text and " reduce-scatter" in text
    gathered = re.findall(r"(\S+\[[0-9,]*\])\S* all-gather(?:-start)?\(", text)
    assert not [g for g in gathered if re.search(rf",{hq},{q.shape[3]}\]", g)], gathered
  else:
    assert " collective-permute" in text and " all-gather" not in text
    assert not re.search(rf"\[\d+,{t},", text), "a buffer of the whole sequence"
    moved = re.findall(r"(\S+\[[0-9,]*\])\S* collective-permute(?:-start)?\(", text)
    assert not [m for m in moved if re.search(rf",{hq},{q.shape[3]}\]", m)], moved


@pytest.mark.parametrize("strategy", _context.STRATEGIES)
def test_on_an_explicit_mesh(strategy):
  """q, k, v and segment ids sharded on the sequence over an Explicit axis (and the batch
  over another): per shard by either strategy; the output and gradients keep the inputs'
  shardings."""
  q, k, v, seg = _problem(2, segments=True)
  f = lambda q, k, v, seg, **kw: memeff_jax.flash_attention(
      q, k, v, q_segment_ids=seg, causal=True, sliding_window=(100, 0), return_lse=True, **kw)
  want, want_grads = _value_and_grads(f, q, k, v, seg)
  f = functools.partial(f, context_strategy=strategy)
  mesh = _mesh((2, 4), ("data", "context"))
  with jax.set_mesh(mesh):
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    args = (put(q, P("data", "context")), put(k, P("data", "context")),
            put(v, P("data", "context")), put(seg, P("data", "context")))
    got = jax.jit(f)(*args)
    grads = jax.jit(jax.grad(_loss(f), (0, 1, 2)))(*args)
    assert got[0].sharding.is_equivalent_to(args[0].sharding, 4)
    assert grads[1].sharding.is_equivalent_to(args[1].sharding, 4)
  _close(got, want)
  _close(grads, want_grads)


@pytest.mark.parametrize("order, strategy, kw", [
    ("contiguous", "all_gather", dict(causal=True)),
    ("zigzag", "ring", dict(causal=True)),
    ("contiguous", "ring", dict(causal=True, sliding_window=(40, 0))),
    ("contiguous", "all_gather", dict(causal=True, sliding_window=(40, 0)))])
def test_on_an_auto_mesh(order, strategy, kw):
  """jit with q, k, v and segment ids sharded on the sequence over an Auto axis (and the
  batch over another): the custom_partitioning runs context parallelism per shard, with the
  order and strategy given to flash_attention; one device's values and gradients, the
  output sequence-sharded, q never moved."""
  q, k, v, seg = _problem(7, segments=True)
  zz = (lambda a: a) if order == "contiguous" else (lambda a: zigzag(a, 4))
  unzz = (lambda a: a) if order == "contiguous" else (lambda a: unzigzag(a, 4))
  f = lambda q, k, v, seg, **c: memeff_jax.flash_attention(q, k, v, q_segment_ids=seg,
                                                           return_lse=True, **kw, **c)
  one = lambda *a: jax.tree.map(zz, f(*map(unzz, a)))
  args = tuple(map(zz, (q, k, v, seg)))
  want, want_grads = _value_and_grads(one, *args)
  mesh = _mesh((2, 4), ("data", "context"), AxisType.Auto)
  args = jax.device_put(args, NamedSharding(mesh, P("data", "context")))
  many = functools.partial(f, context_order=order, context_strategy=strategy)
  both = jax.jit(lambda *a: (many(*a), jax.grad(_loss(many), (0, 1, 2))(*a)))
  compiled = both.lower(*args).compile()
  got, grads = compiled(*args)
  _close(got, want)
  _close(grads, want_grads)
  assert got[0].sharding.spec == P("data", "context")
  text = compiled.as_text()
  moved = re.findall(r"(\S+\[[0-9,]*\])\S* (?:all-gather|collective-permute)(?:-start)?\(", text)
  assert moved and not [m for m in moved if re.search(rf",{q.shape[2]},{q.shape[3]}\]", m)]
  halo = "sliding_window" in kw  # a window within the neighbours: halos, not a gather
  assert (" all-gather" in text) == (strategy == "all_gather" and not halo)


def test_context_options_need_the_sequence_sharded():
  mesh = _mesh((8,), ("data",), AxisType.Auto)
  q = jax.device_put(jnp.ones((8, 64, 2, 16)), NamedSharding(mesh, P("data")))
  f = jax.jit(lambda q: memeff_jax.flash_attention(q, q, q, causal=True, context_order="zigzag"))
  # Raised while XLA partitions the program: it arrives wrapped in a JaxRuntimeError.
  with pytest.raises((ValueError, jax.errors.JaxRuntimeError),
                     match="are for q, k and v sharded alike on the sequence"):
    f(q)


@pytest.mark.parametrize("kw, strategy", [
    (dict(segments=True, causal=True, sliding_window=(40, 0), hkv=1), "all_gather"),
    (dict(causal=True), "ring"), (dict(segments=True, causal=True), "ring")])
def test_zigzag_order_in_shard_map(kw, strategy):
  """context_order="zigzag": the sequence reordered by `zigzag` (shard i holds chunks i and
  7 − i of 8) gives one device's output and gradients in that order."""
  kw = dict(kw)
  q, k, v, seg = _problem(3, hkv=kw.pop("hkv", 2), segments=kw.pop("segments", False))
  one = lambda q, k, v, seg: memeff_jax.flash_attention(q, k, v, q_segment_ids=seg,
                                                        return_lse=True, **kw)
  mesh = _mesh((2, 4), ("data", "context"), AxisType.Auto)
  spec = P("data", "context")
  many = shard_map(
      lambda q, k, v, seg: memeff_jax.flash_attention(
          q, k, v, q_segment_ids=seg, return_lse=True, context_axis="context",
          context_order="zigzag", context_strategy=strategy, **kw),
      mesh=mesh, in_specs=(spec, spec, spec, spec if seg is not None else None),
      out_specs=(spec, spec))
  zz = lambda a: None if a is None else zigzag(a, 4)
  unzz = lambda a: None if a is None else unzigzag(a, 4)
  # One device on the natural order, its results put in the zig-zag order.
  reordered = lambda *a: jax.tree.map(zz, one(*map(unzz, a)))
  args = tuple(map(zz, (q, k, v, seg)))
  _close(_value_and_grads(many, *args), _value_and_grads(reordered, *args))


@pytest.mark.parametrize("strategy", _context.STRATEGIES)
def test_more_keys_than_queries(strategy):
  """T ≠ S (q 128 and k 256 long, over 4 shards): queries and keys compared by their
  positions in their own sequences, as on one device."""
  q, _, _, _ = _problem(5, t=128)
  _, k, v, _ = _problem(6, t=256)
  one = lambda q, k, v: memeff_jax.flash_attention(q, k, v, causal=True,
                                                   sliding_window=(40, 10), return_lse=True)
  mesh = _mesh((2, 4), ("data", "context"), AxisType.Auto)
  many = shard_map(
      lambda q, k, v: memeff_jax.flash_attention(
          q, k, v, causal=True, sliding_window=(40, 10), return_lse=True,
          context_axis="context", context_strategy=strategy),
      mesh=mesh, in_specs=(P("data", "context"),) * 3,
      out_specs=(P("data", "context"), P("data", "context")))
  with_seg = lambda f: lambda q, k, v, _: f(q, k, v)
  _close(_value_and_grads(with_seg(many), q, k, v, None),
         _value_and_grads(with_seg(one), q, k, v, None))


def test_ring_runs_pallas_kernels_under_check_vma():
  """The ring's backward calls flash_attention_backward per step: a Pallas kernel (Triton,
  interpreted) inside shard_map(check_vma=True) gives one device's gradients."""
  q, k, v, _ = _problem(4, b=4, t=64, hq=2)
  impl = PallasTriton(interpret=True)
  one = lambda q, k, v: memeff_jax.flash_attention(q, k, v, causal=True, implementation=impl)
  mesh = _mesh((4, 2), ("data", "context"), AxisType.Auto)
  many = shard_map(
      lambda q, k, v: memeff_jax.flash_attention(
          q, k, v, causal=True, implementation=impl, context_axis="context",
          context_strategy="ring"),
      mesh=mesh, in_specs=(P("data", "context"),) * 3, out_specs=P("data", "context"))
  grads = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), (0, 1, 2)))(q, k, v)
  _close(grads(many), grads(one))


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_pallas_kernels_under_check_vma_remat_and_scan(strategy):
  """Layers of interpreted Triton kernels under jax.checkpoint with a policy, in a scan,
  inside shard_map(check_vma=True): remat's partial evaluation re-traces the kernels' region
  with the checks on, and it still gives one device's gradients."""
  q, k, v, _ = _problem(5, b=4, t=64, hq=2)
  impl = PallasTriton(interpret=True)
  policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

  def layers(context):
    attend = lambda q, k, v: memeff_jax.flash_attention(q, k, v, causal=True, implementation=impl,
                                                        **context)
    return lambda q, k, v: jax.lax.scan(
        lambda x, _: (jax.checkpoint(attend, policy=policy)(x, k, v), None), q, None,
        length=2)[0]

  mesh = _mesh((4, 2), ("data", "context"), AxisType.Auto)
  many = shard_map(layers(dict(context_axis="context", context_strategy=strategy)),
                   mesh=mesh, in_specs=(P("data", "context"),) * 3,
                   out_specs=P("data", "context"), check_vma=True)
  grads = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), (0, 1, 2)))(q, k, v)
  _close(grads(many), grads(layers({})))


def test_zigzag_round_trips():

  x = jnp.arange(2 * 16).reshape(2, 16)
  assert zigzag(x, 4)[0].tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
  np.testing.assert_array_equal(unzigzag(zigzag(x, 4), 4), x)
  with pytest.raises(ValueError, match="must split into 8 equal chunks"):
    zigzag(jnp.ones((1, 12)), 4)


def test_a_whole_range_update_is_no_scatter():
  """_put over all rows is the value itself (jaxlib 0.11's GPU partitioner crashes on a
  whole-array .at update inside shard_map); a partial range is a scatter."""
  a, x = jnp.zeros((2, 8, 3)), jnp.ones((2, 8, 3))
  whole = str(jax.make_jaxpr(lambda a, x: (_context._put(a, 0, 8, x),
                                           _context._put(a, 0, 8, x, add=True)))(a, x))
  assert "scatter" not in whole and "dynamic_update_slice" not in whole
  part = jax.jit(lambda a, x: _context._put(a, 2, 6, x[:, :4], add=True))(a + 1, x)
  np.testing.assert_array_equal(part[0, :, 0], [1, 1, 2, 2, 2, 2, 1, 1])


def test_key_spans_are_what_each_shard_can_see():
  """Queries 768..1023 of 1024: causal reaches every key before their last, a left window of
  100 only from 668; a right window widens the span; local windows ≥ 0."""
  assert _context.key_span(0, 256, 1024, (None, 0)) == (0, 256, (None, 0))
  assert _context.key_span(768, 256, 1024, (None, 0)) == (0, 1024, (None, 768))
  assert _context.key_span(768, 256, 1024, (100, 0)) == (668, 1024, (0, 100))
  assert _context.key_span(256, 256, 1024, (1000, 3)) == (0, 515, (744, 259))
  assert _context.key_span(0, 256, 1024, (0, None)) == (0, 1024, (0, None))


def test_ring_plans_skip_what_no_mask_reaches():
  """Causal zig-zag: every step after the first runs one of two dense plans (the shard's
  two query chunks against the visitor's first, or its second query chunk against both),
  equal work; a left window of 100 over chunks of 64 reaches two chunks back, so the ring
  stops after step 2; a window pair is local to its slices."""
  steps = _context.ring_plans(64, 64, 4, (None, 0), "zigzag")
  assert len(steps) == 4
  for plans, which in steps[1:]:
    assert len(plans) == 2 and sorted(set(which)) == [0, 1]
    assert all(local == (None, None) for plan in plans for *_, local in plan)
    assert sorted(sum((qb - qa) * (kb - ka) for qa, qb, ka, kb, _ in p) for p in plans) == [
        2 * 32 * 32] * 2
  assert len(_context.ring_plans(64, 64, 8, (100, 0), "contiguous")) == 3
  # Queries 64..127 with a left window of 30 see keys 34..63 of 0..63, from queries 64..93.
  assert _context.pair_plan(64, 64, 0, 64, (30, 0)) == (0, 30, 34, 64, (0, None))
  assert _context.pair_plan(64, 64, 0, 64, (100, 0)) == (0, 64, 0, 64, (36, None))
  assert _context.pair_plan(0, 64, 64, 64, (None, 0)) is None


def test_ring_steps_merge_only_the_rows_they_reach():
  """A step's partial result covers the query rows its plans reach, and only those are merged
  with the steps before: under a left window of 40 the second step's first 40 rows. A plan
  of one call over all of them and every visiting key keeps the call's result as it is."""
  steps = _context.ring_plans(64, 64, 4, (40, 0), "contiguous")
  assert [_context._step_rows(plans) for plans, _ in steps] == [(0, 64), (0, 40)]
  assert all(_context._whole(plan, (0, 64), (0, 64)) for plan in steps[0][0])
  # The second step: shard 0 reaches nothing; the others one call of their first 40 rows
  # over the 40 keys passed round (rows 24..63 of the previous shard's).
  assert steps[1][1] == [0, 1, 1, 1] and steps[1][0][0] == ()
  assert _context._whole(steps[1][0][1], (0, 40), (24, 64))
  # Causal zig-zag: a shard's two chunks reach every row at every step.
  steps = _context.ring_plans(64, 64, 4, (None, 0), "zigzag")
  assert {_context._step_rows(plans) for plans, _ in steps} == {(0, 64)}


def _documents(seed, length):
  """q, k, v, documents of `length` tokens as segment ids, a data × context mesh (2 × 4) and
  the spec that shards the sequence over context."""
  q, k, v, _ = _problem(seed)
  seg = jnp.broadcast_to(jnp.arange(q.shape[1]) // length, q.shape[:2])
  return q, k, v, seg, _mesh((2, 4), ("data", "context"), AxisType.Auto), P("data", "context")


def _causal_one(q, k, v, seg):
  return memeff_jax.flash_attention(q, k, v, q_segment_ids=seg, causal=True, return_lse=True)


def test_ring_skips_steps_whose_segment_ids_cannot_meet():
  """Packed documents of 48 tokens over 4 shards of 64: after the first step some visitors
  hold only other documents, and those steps run no kernel and merge nothing (a conditional
  on the ids' ranges), while documents that cross a shard's edge keep theirs; values and
  gradients stay one device's. (test_zigzag_order_in_shard_map's ring with random
  documents runs the zig-zag order through the same conditional.)"""
  q, k, v, seg, mesh, spec = _documents(6, 48)
  many = shard_map(
      lambda q, k, v, seg: memeff_jax.flash_attention(
          q, k, v, q_segment_ids=seg, causal=True, return_lse=True, context_axis="context",
          context_strategy="ring"),
      mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec), check_vma=True)
  both = jax.jit(lambda *a: (many(*a), jax.grad(_loss(many), (0, 1, 2))(*a)))
  compiled = both.lower(q, k, v, seg).compile()
  _close(compiled(q, k, v, seg), _value_and_grads(_causal_one, q, k, v, seg))
  assert " conditional(" in compiled.as_text()


def test_ring_skips_chunk_pairs_whose_segment_ids_cannot_meet():
  """Zig-zag order with one document per chunk (4 shards of 64 rows, chunks of 32): no query
  meets a key of another chunk, so of the chunk pairs a shard's causal plans hold (three at
  the first step, two to four at the others) only its two diagonal ones run a kernel, in
  the forward and in the backward; values and gradients stay one device's."""
  calls = collections.Counter()
  count = lambda name: jax.debug.callback(lambda: calls.update([name]))

  def attend(q, k, v, q_seg, kv_seg, window):
    count("forward")
    return memeff_jax.flash_attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                                      sliding_window=window, return_lse=True)

  def attend_backward(q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, window):
    count("backward")
    return flash_attention_backward(q, k, v, out, lse, d_out, d_lse,
                                    q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                                    sliding_window=window)

  q, k, v, seg, mesh, spec = _documents(8, 32)
  many = shard_map(
      lambda q, k, v, seg: _context.attention(
          attend, attend_backward, q, k, v, seg, seg, axis="context", shards=4,
          window=(None, 0), order="zigzag", strategy="ring"),
      mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec))
  # One device on the natural order, its results put in the zig-zag order.
  reordered = lambda *a: jax.tree.map(lambda x: zigzag(x, 4),
                                      _causal_one(*(unzigzag(x, 4) for x in a)))
  args = tuple(zigzag(a, 4) for a in (q, k, v, seg))
  got = jax.block_until_ready(_value_and_grads(many, *args))
  # 2 pairs on each of 8 devices; the forward runs for the value and for the gradient
  assert calls == {"forward": 2 * 2 * 8, "backward": 2 * 8}, calls
  _close(got, _value_and_grads(reordered, *args))


def test_segment_ranges_meet():
  """A step is skipped only where no query's id can equal a key's in any batch row."""
  ids = lambda *rows: jnp.asarray(rows, jnp.int32)
  assert not _context._segments_meet(ids([0, 0, 1], [4, 4, 4]), ids([2, 3, 3], [5, 6, 6]))
  assert _context._segments_meet(ids([0, 0, 1], [4, 4, 5]), ids([2, 3, 3], [5, 6, 6]))
  assert _context._segments_meet(ids([3, 0]), ids([1, 2]))  # out of order: in range, kept


@pytest.mark.parametrize("strategy, window, rows, hkv, check_vma", [
    ("ring", (40, 0), {40}, 2, True), ("all_gather", (40, 0), {40}, 2, True),
    ("all_gather", (30, 20), {30, 20}, 1, False)])
def test_windows_pass_only_the_keys_they_reach(strategy, window, rows, hkv, check_vma):
  """Under a window that reaches at most the neighbouring shards (shards of 64 keys) only
  the rows in reach move: the ring passes each shard's last 40 keys (and their dK/dV) on,
  the all-gather strategy exchanges halos (the previous shard's last rows, the next one's
  first) instead of gathering; the compiled program's collective-permutes move only such
  rows, values and gradients stay one device's (MQA and check_vma off too)."""
  q, k, v, seg = _problem(3, hkv=hkv, segments=True)
  kw = dict(sliding_window=window, return_lse=True)
  one = lambda q, k, v, seg: memeff_jax.flash_attention(q, k, v, q_segment_ids=seg, **kw)
  mesh = _mesh((2, 4), ("data", "context"), AxisType.Auto)
  spec = P("data", "context")
  many = shard_map(lambda q, k, v, seg: memeff_jax.flash_attention(
      q, k, v, q_segment_ids=seg, context_axis="context", context_strategy=strategy, **kw),
                   mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec),
                   check_vma=check_vma)
  want, want_grads = _value_and_grads(one, q, k, v, seg)
  both = jax.jit(lambda *a: (many(*a), jax.grad(_loss(many), (0, 1, 2))(*a)))
  compiled = both.lower(q, k, v, seg).compile()
  got, grads = compiled(q, k, v, seg)
  _close(got, want)
  _close(grads, want_grads)
  text = compiled.as_text()
  moved = re.findall(r"\S+\[([0-9,]*)\]\S* collective-permute(?:-start)?\(", text)
  assert moved and {int(m.split(",")[1]) for m in moved} == rows, moved
  assert " all-gather" not in text and " reduce-scatter" not in text
  assert not re.search(rf"\[\d+,{q.shape[1]},", text), "a buffer of the whole sequence"


def test_halos_move_bf16_rows_and_windows_of_both_halos_keep_float32():
  """bf16 inputs: the halo exchange's keys, values and their dK/dV travel in bf16 (a key
  row's gradient is its shard's term plus at most one neighbour's: bf16's add rounds it
  once, as a float32 sum's final cast would); where both halos would cover a row (left +
  right > a shard's 64 keys) the dK/dV travel in float32. Values and gradients stay close
  to one device's bf16 call."""
  q, k, v, _ = _problem(5, hkv=2)
  q, k, v = (a.astype(jnp.bfloat16) for a in (q, k, v))
  mesh = _mesh((2, 4), ("data", "context"), AxisType.Auto)
  spec = P("data", "context")
  for window, dk_dtype in (((40, 0), "bf16"), ((40, 30), "f32")):
    kw = dict(sliding_window=window, return_lse=True)
    one = lambda q, k, v, seg, kw=kw: memeff_jax.flash_attention(q, k, v, **kw)
    many = shard_map(lambda q, k, v, kw=kw: memeff_jax.flash_attention(
        q, k, v, context_axis="context", **kw), mesh=mesh, in_specs=(spec,) * 3,
                     out_specs=(spec, spec))
    want, want_grads = _value_and_grads(one, q, k, v, None)
    both = jax.jit(lambda q, k, v, many=many: (many(q, k, v), jax.grad(
        _loss(lambda q, k, v, seg: many(q, k, v)), (0, 1, 2))(q, k, v, None)))
    lowered = both.lower(q, k, v)
    got, grads = lowered.compile()(q, k, v)
    for g, w in zip(jax.tree.leaves((got, grads)), jax.tree.leaves((want, want_grads))):
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                 rtol=3e-2, atol=3e-2)
    # The program as written (XLA's CPU backend then widens bf16 collectives to float32).
    moved = set(re.findall(r"collective_permute.*\(tensor<1x\d+x2x32x(\w+)>\)",
                           lowered.as_text()))
    assert moved == {"bf16", dk_dtype}, (window, moved)


def test_rows_in_reach():
  """What goes round: the ring's rows after its first step, the all-gather strategy's halos
  (None: gather every shard's keys)."""
  plans = lambda window, order="contiguous": _context.ring_plans(64, 64, 4, window, order)
  assert _context.passed_rows(plans((40, 0))) == (24, 64)
  assert _context.passed_rows(plans((None, 0), "zigzag")) == (0, 64)
  assert _context.passed_rows(plans((0, 0))) is None
  assert _context.halo_rows(64, 64, 4, (40, 0), "contiguous") == (40, 0)
  assert _context.halo_rows(64, 64, 4, (30, 20), "contiguous") == (30, 20)
  assert _context.halo_rows(64, 64, 4, (70, 20), "contiguous") is None  # past a neighbour
  assert _context.halo_rows(64, 64, 2, (None, 0), "contiguous") is None  # no fewer rows
  assert _context.halo_rows(64, 64, 4, (40, 0), "zigzag") is None


def test_context_axis_errors():
  q = jnp.ones((1, 128, 2, 16))
  with pytest.raises(ValueError, match="context_axis='context' is not an axis of an enclosing"):
    memeff_jax.flash_attention(q, q, q, context_axis="context")
  with pytest.raises(TypeError, match="context_axis must be a mesh axis name"):
    memeff_jax.flash_attention(q, q, q, context_axis=3)
  with pytest.raises(ValueError, match="context_order must be one of"):
    memeff_jax.flash_attention(q, q, q, context_order="ring")
  with pytest.raises(ValueError, match="context_order='zigzag' is for a sequence sharded"):
    memeff_jax.flash_attention(q, q, q, context_order="zigzag")
  with pytest.raises(ValueError, match="context_strategy must be one of"):
    memeff_jax.flash_attention(q, q, q, context_strategy="ulysses")
  with pytest.raises(ValueError, match="context_strategy='ring' is for a sequence sharded"):
    memeff_jax.flash_attention(q, q, q, context_strategy="ring")
  explicit = _mesh((8,), ("data",))
  with jax.set_mesh(explicit):
    x = jax.device_put(jnp.ones((8, 128, 2, 16)), NamedSharding(explicit, P("data")))
    with pytest.raises(ValueError, match="are for q, k, v sharded on the sequence"):
      memeff_jax.flash_attention(x, x, x, context_strategy="ring")
  mesh = _mesh((8,), ("context",), AxisType.Auto)
  mask = jnp.ones((128, 128 * 8), bool)
  with pytest.raises(ValueError, match="context_axis takes the structured masks"):
    shard_map(lambda q: memeff_jax.flash_attention(q, q, q, mask=mask, context_axis="context"),
              mesh=mesh, in_specs=P(None, "context"), out_specs=P(None, "context"))(
                  jnp.ones((1, 1024, 2, 16)))
  odd = jnp.ones((1, 8 * 65, 2, 16))  # 65 tokens per shard: no two equal chunks
  with pytest.raises(ValueError, match="must be even, got T=65, S=65 per shard"):
    shard_map(lambda q: memeff_jax.flash_attention(q, q, q, context_axis="context",
                                                   context_order="zigzag"),
              mesh=mesh, in_specs=P(None, "context"), out_specs=P(None, "context"))(odd)
  # On an Auto mesh the partitioner raises it while compiling, wrapped by XLA.
  with pytest.raises((ValueError, jax.errors.JaxRuntimeError),
                     match="must be even, got T=65, S=65 per shard"):
    x = jax.device_put(odd, NamedSharding(mesh, P(None, "context")))
    jax.jit(lambda q: memeff_jax.flash_attention(q, q, q, context_order="zigzag"))(x)
