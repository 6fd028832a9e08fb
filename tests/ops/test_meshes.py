"""Both ops on meshes (eight CPU devices, see conftest), against the single-device result:
inside a user's jax.shard_map with either check_vma setting (a weight or key the shards share
gets the sum of every shard's gradient contribution), under jit on Auto meshes (attention's
custom_partitioning) and on Explicit meshes with the batch, heads or tokens sharded, the
vocabulary (vocab parallel) or W's D (FSDP): the outputs keep their shardings, and the
compiled programs' collectives are only the expected ones."""

import contextlib
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


@pytest.fixture(scope="module")
def mesh():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _close(got, want, tol=2e-5):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


def _weighted_sum(out):
  """A scalar of a loss's output whose gradient puts a fixed weight, different per element,
  on each. sum(sin(out)) made the gradients turn on out's last bit where out is large: a
  shard's summed loss of 158.65 has cosine 0.001, so one ulp between two summation orders
  (the vocabulary shards' and one device's) moved its gradients by 1.4%."""
  weights = 1.5 + jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape)
  return jnp.sum(out * weights)


@pytest.mark.parametrize("check_vma, hkv, kw", [
    (True, 4, dict(causal=True)), (True, 1, dict(sliding_window=(7, 3))),
    (False, 1, dict(sliding_window=(7, 3))), (False, 4, dict(causal=True, segments=True))])
def test_attention_batch_and_heads_sharded(mesh, check_vma, hkv, kw):
  """Batch over 'data', heads over 'model'; with one key head (MQA) the keys are shared by
  the 'model' shards, whose dk and dv contributions are summed."""
  kw = dict(kw)
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (8, 40, 4, 16))
  k, v = (jax.random.normal(key, (8, 40, hkv, 16)) for key in ks[1:])
  seg = (jnp.arange(40) // 13)[None].repeat(8, 0) if kw.pop("segments", False) else None
  f = lambda q, k, v, seg: memeff_jax.flash_attention(q, k, v, q_segment_ids=seg, **kw)
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, seg) * jnp.cos(f(q, k, v, seg)))
  kv_spec = P("data", None, "model") if hkv > 1 else P("data")
  sharded = shard_map(f, mesh=mesh, in_specs=(P("data", None, "model"), kv_spec, kv_spec,
                                              None if seg is None else P("data")),
                      out_specs=P("data", None, "model"), check_vma=check_vma)
  values, grads, _, _ = _run(lambda q, k, v: sharded(q, k, v, seg), loss(sharded), (0, 1, 2),
                             q, k, v)
  _close(values, f(q, k, v, seg))
  _close(grads, jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("kw", [dict(reduction="sum"), dict(reduction="none"),
                                dict(reduction="sum", chunk_size=(4, 32)),
                                dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3)])
def test_loss_tokens_sharded_weight_replicated(mesh, check_vma, kw):
  """Tokens over both axes, W replicated: each shard's loss, and dW summed over shards."""
  x = jax.random.normal(jax.random.key(1), (64, 16))
  w = jax.random.normal(jax.random.key(2), (16, 100))
  y = jax.random.randint(jax.random.key(3), (64,), 0, 100)
  tokens = P(("data", "model"))
  local = lambda x, w, y: jnp.sum(memeff_jax.linear_cross_entropy(x, w, y, **kw))
  total = shard_map(lambda x, w, y: jax.lax.psum(local(x, w, y), ("data", "model")),
                    mesh=mesh, in_specs=(tokens, P(), tokens), out_specs=P(),
                    check_vma=check_vma)
  values, grads, _, _ = _run(total, total, (0, 1), x, w, y)
  _close(values, local(x, w, y), 1e-4)
  _close(grads, jax.grad(local, argnums=(0, 1))(x, w, y), 1e-4)


@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_attention_on_an_auto_mesh(mesh, hkv):
  """jit with the batch over 'data' and the heads over 'model' (Auto axes): per shard through
  custom_partitioning, no input gathered; with one key head (MQA) only the sum of its dk, dv."""
  ks = jax.random.split(jax.random.key(8), 3)
  q = jax.random.normal(ks[0], (8, 64, 4, 16))
  k, v = (jax.random.normal(key, (8, 64, hkv, 16)) for key in ks[1:])
  seg = (jnp.arange(64) // 20)[None].repeat(8, 0)
  f = lambda q, k, v, seg: memeff_jax.flash_attention(q, k, v, causal=True, q_segment_ids=seg,
                                                      logit_softcap=20.0)
  loss = lambda q, k, v, seg: jnp.sum(jnp.sin(f(q, k, v, seg)))
  want, want_grads = f(q, k, v, seg), jax.grad(loss, argnums=(0, 1, 2))(q, k, v, seg)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  kv_spec = P("data", None, "model") if hkv > 1 else P("data")
  args = (put(q, P("data", None, "model")), put(k, kv_spec), put(v, kv_spec), put(seg, P("data")))
  got, grads, collectives, _ = _run(f, loss, (0, 1, 2), *args)
  _close(got, want)
  _close(grads, want_grads, 1e-4)
  assert got.sharding.spec == P("data", None, "model")
  pad = lambda spec: (tuple(spec) + (None,) * 4)[:4]
  assert [pad(g.sharding.spec) for g in grads] == [pad(a.sharding.spec) for a in args[:3]]
  assert collectives["all-gather"] == collectives["all-to-all"] == 0, collectives
  assert collectives["all-reduce"] == (0 if hkv > 1 else 1), collectives


def test_partitioned_functions_may_make_constants(mesh):
  """Tracing a kernel may make constants for the call's shapes (a persistent kernel's
  schedule table), which custom_partitioning refuses, and mutable arrays that the kernel
  writes into (a fused backward's statistics), which its per-shard module may not hold:
  _auto.partitioned passes the constants as replicated operands and discharges the
  arrays, on one device and on a mesh."""
  from jax.experimental.custom_partitioning import ArrayMapping  # pylint: disable=import-outside-toplevel
  from jax.experimental.custom_partitioning import SdyShardingRule  # pylint: disable=import-outside-toplevel
  from memeff_jax.ops import _auto  # pylint: disable=import-outside-toplevel

  def fn(x):
    acc = jax.new_ref(jnp.zeros_like(x))
    acc[...] += x * jnp.asarray(np.arange(1, x.shape[1] + 1, dtype=np.float32))
    return acc[...]

  f = _auto.partitioned(
      fn, lambda mesh, args, result: (mesh, fn, args[0].sharding, (args[0].sharding,)),
      lambda mesh, values, results: SdyShardingRule((ArrayMapping("i", "j"),),
                                                    (ArrayMapping("i", "j"),)))
  x = jax.random.normal(jax.random.key(0), (8, 3))
  want = np.asarray(x) * np.arange(1, 4)
  np.testing.assert_allclose(jax.jit(f)(x), want, rtol=1e-6)
  sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
  compiled = jax.jit(f).lower(sharded).compile()
  np.testing.assert_allclose(compiled(sharded), want, rtol=1e-6)
  assert " all-gather" not in compiled.as_text()


def test_attention_under_vmap_folds_the_axis_into_the_batch(mesh, monkeypatch):
  """custom_partitioning has no batching rule: vmap goes through custom_vmap (q on the mesh,
  replicated: the call is partitioned)."""
  from memeff_jax.ops import _auto  # pylint: disable=import-outside-toplevel
  calls, partitioned = [], _auto.partitioned
  monkeypatch.setattr(_auto, "partitioned", lambda *a: calls.append(1) or partitioned(*a))
  q = jax.device_put(jax.random.normal(jax.random.key(9), (3, 1, 32, 2, 8)),
                     NamedSharding(mesh, P()))
  f = lambda q: memeff_jax.flash_attention(q, q, q, causal=True)
  flat = lambda q: f(q.reshape(-1, *q.shape[2:])).reshape(q.shape)  # rows are independent
  _close(jax.vmap(f)(q), flat(q))
  _close(jax.grad(lambda q: jnp.sum(jax.vmap(f)(q) ** 2))(q),
         jax.grad(lambda q: jnp.sum(flat(q) ** 2))(q), 1e-4)
  assert calls


def test_single_device_values_skip_the_partitioning(monkeypatch):
  """Arrays on one device (single-device code on a host of several) take the single-device
  path: no custom_partitioning, no per-shard recomputation."""
  from memeff_jax.ops import _auto  # pylint: disable=import-outside-toplevel
  calls, partitioned = [], _auto.partitioned
  monkeypatch.setattr(_auto, "partitioned", lambda *a: calls.append(1) or partitioned(*a))
  q = jax.random.normal(jax.random.key(10), (2, 16, 2, 8))
  jax.jit(jax.grad(lambda q: jnp.sum(memeff_jax.flash_attention(q, q, q) ** 2)))(q)
  x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
  jax.jit(jax.grad(lambda x: jnp.sum(memeff_jax.linear_cross_entropy(
      x, w, jnp.zeros(8, jnp.int32), reduction="none"))))(x)
  assert not calls


@pytest.fixture(scope="module")
def explicit_mesh():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def _run(f, loss, argnums, *args):
  """(f(*args), the gradients of loss, how many of each collective the compiled program
  runs, its text): one compiled program for all of them."""
  both = jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=argnums)(*a)))
  compiled = both.lower(*args).compile()
  text = compiled.as_text()
  counts = {op: text.count(f" {op}(") + text.count(f" {op}-start(") for op in (
      "all-gather", "all-reduce", "all-to-all", "collective-permute")}
  return (*compiled(*args), counts, text)


@pytest.mark.parametrize("hkv, kv_spec", [(2, P("data", None, "model")), (1, P("data"))])
def test_attention_on_an_explicit_mesh(explicit_mesh, hkv, kv_spec):
  ks = jax.random.split(jax.random.key(4), 3)
  q = jax.random.normal(ks[0], (8, 40, 4, 16))
  k, v = (jax.random.normal(key, (8, 40, hkv, 16)) for key in ks[1:])
  seg = (jnp.arange(40) // 13)[None].repeat(8, 0)
  f = lambda q, k, v: memeff_jax.flash_attention(q, k, v, causal=True, q_segment_ids=seg,
                                                 return_lse=True)
  loss = lambda q, k, v: jnp.sum(f(q, k, v)[0] ** 2)
  want, want_grads = f(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  with jax.set_mesh(explicit_mesh):
    put = lambda x, spec: jax.device_put(x, NamedSharding(explicit_mesh, spec))
    args = (put(q, P("data", None, "model")), put(k, kv_spec), put(v, kv_spec))
    got, grads, collectives, _ = _run(f, loss, (0, 1, 2), *args)
    assert got[0].sharding.spec == P("data", None, "model", None)
    assert all(g.sharding.is_equivalent_to(a.sharding, 4) for g, a in zip(grads, args))
  _close(got, want)
  _close(grads, want_grads, 1e-4)
  # Per shard, no communication; with one key head shared by the 'model' shards, only the
  # sums of its dk and dv contributions.
  assert collectives["all-gather"] == collectives["all-to-all"] == 0
  assert (collectives["all-reduce"] == 0 if hkv > 1
          else 1 <= collectives["all-reduce"] <= 2), collectives


@pytest.mark.parametrize("axes", ["auto", "explicit", "explicit_sequence"])
def test_attention_sequence_lengths_on_a_mesh(request, axes):
  """query_seq_lengths and key_value_seq_lengths, sharded with the batch over 'data' (the
  heads over 'model', or on an Explicit mesh the sequence: context parallelism), beside
  packed documents: one device's output and gradients, no input gathered but the keys
  that context parallelism gathers."""
  mesh = request.getfixturevalue("mesh" if axes == "auto" else "explicit_mesh")
  ks = jax.random.split(jax.random.key(14), 3)
  q, k, v = (jax.random.normal(key, (8, 40, 4, 16)) for key in ks)
  seg = (jnp.arange(40) // 13)[None].repeat(8, 0)
  q_len, kv_len = jnp.array([40, 31, 0, 12, 40, 5, 39, 20]), jnp.array([40, 35, 9, 12, 1, 40,
                                                                         39, 30])
  f = lambda q, k, v, seg, q_len, kv_len: memeff_jax.flash_attention(
      q, k, v, causal=True, q_segment_ids=seg, query_seq_lengths=q_len,
      key_value_seq_lengths=kv_len)
  loss = lambda *a: jnp.sum(jnp.sin(f(*a)))
  args = (q, k, v, seg, q_len, kv_len)
  want, want_grads = f(*args), jax.grad(loss, argnums=(0, 1, 2))(*args)
  sequence = axes == "explicit_sequence"
  specs = (P("data", "model") if sequence else P("data", None, "model"),) * 3
  specs += (P("data", "model") if sequence else P("data"),) + (P("data"),) * 2
  with jax.set_mesh(mesh):
    sharded = [jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in zip(args, specs)]
    got, grads, collectives, _ = _run(f, loss, (0, 1, 2), *sharded)
  _close(got, want)
  _close(grads, want_grads, 1e-4)
  assert collectives["all-to-all"] == 0, collectives
  assert sequence or collectives["all-gather"] == 0, collectives


def test_attention_refuses_what_it_cannot_shard(explicit_mesh):
  """The head dim sharded; the sequence of q sharded but not that of k and v (context
  parallelism shards all three alike)."""
  q = jnp.ones((2, 16, 2, 8))
  with jax.set_mesh(explicit_mesh):
    put = lambda spec: jax.device_put(q, NamedSharding(explicit_mesh, spec))
    with pytest.raises(ValueError, match=r"the head dim must not be sharded, got q: "
                       r"P\(None, None, None, 'data'\)"):
      memeff_jax.flash_attention(*(put(P(None, None, None, "data")),) * 3)
    with pytest.raises(ValueError, match=r"k and v must be sharded alike, on the batch and "
                       r"sequence axes of q"):
      memeff_jax.flash_attention(put(P(None, "data")), put(P()), put(P()))


@pytest.mark.parametrize("kw", [dict(), dict(reduction="sum"), dict(reduction="none"),
                                dict(label_smoothing=0.1, z_loss=1e-3, return_aux=True)])
def test_loss_on_an_explicit_mesh(explicit_mesh, kw):
  """Tokens sharded over both axes, W replicated: the mean over the global count of counted
  tokens, dW summed over the shards (its all-reduce) and nothing gathered."""
  x = jax.random.normal(jax.random.key(1), (8, 16, 32))
  w = jax.random.normal(jax.random.key(2), (32, 100))
  y = jax.random.randint(jax.random.key(3), (8, 16), 0, 100).at[:, :3].set(-100)
  f = lambda x, w: memeff_jax.linear_cross_entropy(x, w, y, **kw)
  loss = lambda x, w: jnp.mean(jax.tree.leaves(f(x, w))[0])
  want, want_grads = f(x, w), jax.grad(loss, argnums=(0, 1))(x, w)
  with jax.set_mesh(explicit_mesh):
    xs = jax.device_put(x, NamedSharding(explicit_mesh, P("data", "model")))
    got, grads, collectives, _ = _run(f, loss, (0, 1), xs, w)
    assert grads[0].sharding.spec == P("data", "model", None)
  _close(got, want, 1e-5)
  _close(grads, want_grads, 1e-5)
  assert collectives["all-gather"] == 0 and collectives["all-reduce"] >= 1


_VOCAB_OPTIONS = [dict(), dict(reduction="sum", bias=True),
                  dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=5.0, return_aux=True),
                  dict(reduction="none", weight_layout="vd", where=True),
                  dict(chunk_size=(8, 16), label_smoothing=0.2, bias=True)]


def _vocab_problem(seed, n_lead=(8, 16), d=32, v=96, layout="dv"):
  ks = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(ks[0], (*n_lead, d))
  w = jax.random.normal(ks[1], (d, v) if layout == "dv" else (v, d)) / 4
  y = jax.random.randint(ks[2], n_lead, 0, v).at[..., :3].set(-100)
  b = jax.random.normal(ks[3], (v,))
  where = jax.random.bernoulli(ks[4], 0.8, n_lead)
  return x, w, y, b, where


def _vocab_call(kw, y, b, where):
  """(kw without the switches, loss(x, w, b)) for kw's options: `bias` and `where` switch
  on the problem's bias and mask."""
  kw = dict(kw)
  use_bias, mask = kw.pop("bias", False), where if kw.pop("where", False) else None
  return kw, lambda x, w, b_, y_=y, m=mask, **extra: memeff_jax.linear_cross_entropy(
      x, w, y_, bias=b_ if use_bias else None, where=m, **kw, **extra)


def _weighted(seed, kw):
  """(x, w, b, call, loss, one device's values and gradients) of the problem of `seed` with
  kw's options (see _vocab_call): loss weights every token's output differently (a reduced
  one by 3)."""
  x, w, y, b, where = _vocab_problem(seed, layout=kw.get("weight_layout", "dv"))
  kw, call = _vocab_call(kw, y, b, where)
  weights = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
  loss = lambda x, w, b: (lambda o: jnp.sum(o * (weights if o.ndim else 3.0)))(
      jax.tree.leaves(call(x, w, b))[0])
  return x, w, b, call, loss, call(x, w, b), jax.grad(loss, argnums=(0, 1, 2))(x, w, b)


@pytest.mark.parametrize("check_vma, kw", [(True, kw) for kw in _VOCAB_OPTIONS]
                         + [(False, _VOCAB_OPTIONS[2]), (False, _VOCAB_OPTIONS[3])])
def test_loss_vocab_parallel_in_shard_map(mesh, check_vma, kw):
  """W (and the bias) sharded on V over 'model', tokens over 'data', vocab_axis='model':
  each 'data' shard's loss as one device computes it for those tokens, every option, and
  the gradients (dx summed over the vocabulary shards, dW and the bias's kept local)."""
  layout = kw.get("weight_layout", "dv")
  x, w, y, b, where = _vocab_problem(5, layout=layout)
  kw, call = _vocab_call(kw, y, b, where)
  first = lambda out: jax.tree.leaves(out)[0]
  none = kw.get("reduction") == "none"
  per_shard = lambda out: first(out) if none else first(out)[None]
  w_spec = P(None, "model") if layout == "dv" else P("model")
  mask = where if call.__defaults__[1] is not None else None

  sharded = shard_map(
      lambda x, w, b, y_, m: per_shard(call(x, w, b, y_, m, vocab_axis="model")), mesh=mesh,
      in_specs=(P("data"), w_spec, P("model"), P("data"), None if mask is None else P("data")),
      out_specs=P("data"), check_vma=check_vma)
  got = lambda x, w, b: sharded(x, w, b, y, mask)

  def want(x, w, b):  # one device, each 'data' shard's two rows of tokens on their own
    return jnp.concatenate([per_shard(call(x[r:r + 2], w, b, y[r:r + 2],
                                           None if mask is None else mask[r:r + 2]))
                            for r in range(0, 8, 2)])

  obj = lambda f: lambda x, w, b: _weighted_sum(f(x, w, b))
  values, grads, _, _ = _run(got, obj(got), (0, 1, 2), x, w, b)
  _close(values, want(x, w, b), 1e-5)
  _close(grads, jax.grad(obj(want), argnums=(0, 1, 2))(x, w, b), 1e-5)


_VOCAB_IMPLEMENTATIONS = {
    "reference": "reference",
    "pallas_softmax": memeff_jax.ops.linear_cross_entropy.PallasMosaicGpu(interpret=True,
                                                                         exp_logits=False),
    "pallas_exp_logits": memeff_jax.ops.linear_cross_entropy.PallasMosaicGpu(interpret=True,
                                                                            exp_logits=True),
}


@pytest.mark.parametrize("impl, scale, kw, check_vma", [
    ("reference", 1.0, dict(label_smoothing=0.1, z_loss=1e-3, bias=True), False),
    ("pallas_softmax", 1.0, dict(label_smoothing=0.1, logit_softcap=5.0), True),
    ("pallas_softmax", 1.0, dict(), False),
    ("pallas_exp_logits", 1.0, dict(z_loss=1e-3), False),
    ("pallas_exp_logits", 40.0, dict(), True),  # lse > 60 on most rows: the softmax fallback
    ("pallas_exp_logits", 1.0, dict(reduction="none", return_aux=True), True),
    ("pallas_exp_logits", 40.0, dict(reduction="none"), False),  # the statistics' fallback
    # Smoothing's share after the chunks (smoothing_apart): the slices' Σ ẑ and dx added up.
    ("pallas_exp_logits", 1.0, dict(label_smoothing=0.1, z_loss=1e-3), True),
    ("pallas_exp_logits", 1.0, dict(label_smoothing=0.1, reduction="none"), False)])
def test_loss_vocab_parallel_implementations(mesh, check_vma, impl, scale, kw):
  """Vocab parallel in shard_map by the reference (JAX's autodiff through the merge) and
  the GPU loss's kernels in interpret mode: the softmax pass on merged statistics, and
  exp_logits merging E's row sums (its fallback too), against one device."""
  x, w, y, b, _ = _vocab_problem(9)
  x = x * scale
  _, ref = _vocab_call(dict(kw, implementation="reference"), y, b, None)
  kw, call = _vocab_call(dict(kw, implementation=_VOCAB_IMPLEMENTATIONS[impl]), y, b, None)
  none = kw.get("reduction") == "none"
  per_shard = lambda out: jax.tree.leaves(out)[0] if none else jax.tree.leaves(out)[0][None]
  sharded = shard_map(
      lambda x, w, b, y_: per_shard(call(x, w, b, y_, vocab_axis="model")), mesh=mesh,
      in_specs=(P("data"), P(None, "model"), P("model"), P("data")), out_specs=P("data"),
      check_vma=check_vma)
  got = lambda x, w, b: sharded(x, w, b, y)

  def want(x, w, b):  # the reference on one device, each 'data' shard's tokens on their own
    return jnp.concatenate([per_shard(ref(x[r:r + 2], w, b, y[r:r + 2]))
                            for r in range(0, 8, 2)])

  obj = lambda f: lambda x, w, b: _weighted_sum(f(x, w, b))
  values, grads, _, _ = _run(got, obj(got), (0, 1, 2), x, w, b)
  # Scaled logits reach hundreds: float32's rounding of them and of lse, merged across the
  # shards in another order, moves G's small entries by ~1e-4 where gradients reach 100.
  tol = 1e-4 * max(1.0, scale / 4)
  _close(values, want(x, w, b), tol)
  _close(grads, jax.grad(obj(want), argnums=(0, 1, 2))(x, w, b), tol)


@pytest.mark.parametrize("check_vma", [True, False])
def test_loss_vocab_parallel_runs_three_matmuls(mesh, check_vma):
  """A vocabulary shard's loss and gradients cost the single-device loss's three matmuls on
  its slice: the statistics are merged inside the chunk loop, never a second logits pass
  for a global log-sum-exp; dx is summed over 'model' once."""
  x, w, y, _, _ = _vocab_problem(11)
  loss = lambda x, w, y: jax.lax.psum(memeff_jax.linear_cross_entropy(
      x, w, y, reduction="sum", vocab_axis="model", chunk_size=8), "data")
  step = shard_map(jax.grad(loss, argnums=(0, 1)), mesh=mesh,
                   in_specs=(P("data"), P(None, "model"), P("data")),
                   out_specs=(P("data"), P(None, "model")), check_vma=check_vma)
  text = jax.jit(step).lower(x, w, y).compile().as_text()
  assert text.count(" dot(") == 3, text.count(" dot(")


@pytest.mark.parametrize("w_axis, kw", [(None, dict(reduction="sum")), ("model", _VOCAB_OPTIONS[1]),
                                         ("model", _VOCAB_OPTIONS[2]),
                                         ("model", dict(weight_layout="vd", where=True)),
                                         ("model", _VOCAB_OPTIONS[4])])
def test_loss_on_an_auto_mesh(mesh, w_axis, kw):
  """jit with the tokens over 'data' and W replicated or its vocabulary over 'model' (Auto
  axes): per shard through custom_partitioning; nothing gathered, dW kept as W is."""
  layout = kw.get("weight_layout", "dv")
  x, w, y, b, where = _vocab_problem(10, layout=layout)
  kw, call = _vocab_call(kw, y, b, where)
  loss = lambda x, w, b: jax.tree.leaves(call(x, w, b))[0] * 3.0
  want, want_grads = call(x, w, b), jax.grad(loss, argnums=(0, 1, 2))(x, w, b)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  w_spec = P() if w_axis is None else P(None, w_axis) if layout == "dv" else P(w_axis)
  args = (put(x, P("data")), put(w, w_spec), put(b, P(w_axis)))
  got, grads, collectives, _ = _run(call, loss, (0, 1, 2), *args)
  _close(got, want, 1e-5)
  _close(grads, want_grads, 1e-5)
  assert grads[1].sharding.is_equivalent_to(args[1].sharding, 2)
  assert collectives["all-gather"] == collectives["all-to-all"] == 0, collectives
  assert collectives["all-reduce"] >= 1, collectives  # dW's sum over the token shards


@pytest.mark.parametrize("w_axis, kw", [(None, dict(reduction="none", where=True)),
                                         ("model", dict(reduction="none", bias=True,
                                                        label_smoothing=0.1, z_loss=1e-3)),
                                         ("model", dict(reduction="none", weight_layout="vd")),
                                         (None, dict(return_aux=True, z_loss=1e-3)),
                                         ("model", dict(return_aux=True, reduction="none",
                                                        z_loss=1e-3, bias=True)),
                                         ("model", dict(return_aux=True, reduction="sum",
                                                        where=True, weight_layout="vd"))])
def test_per_token_outputs_on_an_auto_mesh(mesh, monkeypatch, w_axis, kw):
  """reduction="none" or return_aux under jit with the tokens over 'data' (and W's
  vocabulary over 'model'): per shard through custom_partitioning (on a GPU XLA cannot
  partition the kernels), the per-token losses, log-sum-exps and z-loss terms sharded as the
  tokens (a reduced loss and z-loss reduced from them), the gradients of a weighted sum of
  every output one device's, and nothing gathered."""
  from memeff_jax.ops.linear_cross_entropy import _partition  # pylint: disable=import-outside-toplevel
  calls, per_token_loss = [], _partition.per_token_loss
  monkeypatch.setattr(_partition, "per_token_loss",
                      lambda *a, **k: calls.append(1) or per_token_loss(*a, **k))
  layout = kw.get("weight_layout", "dv")
  x, w, y, b, where = _vocab_problem(12, layout=layout)
  aux = kw.get("return_aux", False)
  kw, call = _vocab_call(kw, y, b, where)
  weights = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)

  def loss(x, w, b):
    value, extra = call(x, w, b) if aux else (call(x, w, b), None)
    return jnp.sum(value * weights) + (0.0 if extra is None else jnp.sum(
        extra.lse * weights ** 2) + 5 * jnp.sum(extra.z_loss))

  want, want_grads = call(x, w, b), jax.grad(loss, argnums=(0, 1, 2))(x, w, b)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  w_spec = P() if w_axis is None else P(None, w_axis) if layout == "dv" else P(w_axis)
  args = (put(x, P("data")), put(w, w_spec), put(b, P(w_axis)))
  got, grads, collectives, _ = _run(call, loss, (0, 1, 2), *args)
  assert calls
  _close(got, want, 1e-5)
  _close(grads, want_grads, 1e-5)
  per_token = got[1].lse if aux else got
  assert per_token.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), per_token.ndim)
  assert grads[1].sharding.is_equivalent_to(args[1].sharding, 2)
  assert collectives["all-gather"] == collectives["all-to-all"] == 0, collectives


@pytest.mark.parametrize("kw", [dict(label_smoothing=0.1), dict(bias=True, weight_layout="vd"),
                                dict(reduction="none", bias=True)])
def test_loss_fsdp_weight_on_an_auto_mesh(mesh, kw):
  """Tokens over 'data', W's D over 'data' too (FSDP) and its vocabulary over 'model', Auto
  axes: W gathered for the call, dW reduce-scattered back into W's sharding."""
  layout = kw.get("weight_layout", "dv")
  x, w, b, call, loss, want, want_grads = _weighted(13, kw)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  w_spec = P("data", "model") if layout == "dv" else P("model", "data")
  args = (put(x, P("data")), put(w, w_spec), put(b, P("model")))
  got, grads, _, text = _run(call, loss, (0, 1, 2), *args)
  _close(got, want, 1e-5)
  _close(grads, want_grads, 1e-5)
  assert grads[1].sharding.is_equivalent_to(args[1].sharding, 2)
  assert " reduce-scatter(" in text or " reduce-scatter-start(" in text, \
      "dW should leave by a reduce-scatter"


# Every pair of (groups, reduction, mesh kind); the groups with a token_loss on each kind.
@pytest.mark.parametrize("groups, reduction, kind, token_loss", [
    (True, "mean", "auto", False), (True, "none", "explicit", False),
    (False, "mean", "explicit", False), (False, "none", "auto", False),
    (True, "mean", "explicit", True), (True, "none", "auto", True)])
def test_loss_fsdp_groups_keep_no_float32_dw(request, monkeypatch, groups, reduction, kind,
                                             token_loss):
  """FSDP (W's D over 'data', its vocabulary over 'model') with more tokens per shard than
  the GPU loss adds up in bf16 (max_rounded_chunks chunks, here 32 chunks of one token):
  the tokens go in groups, each group's bf16 dW reduce-scattered as it comes, so no chunk
  loop adds up a float32 dW of the shard's whole [D, V_s] (without the groups, one does:
  its own groups of chunks, _chunked._grouped); one device's loss and gradients either
  way, on Auto and Explicit meshes, also with a token_loss (its arguments split into the
  groups with the tokens)."""
  mesh = request.getfixturevalue("mesh" if kind == "auto" else "explicit_mesh")
  from memeff_jax.ops.linear_cross_entropy import PallasMosaicGpu  # pylint: disable=import-outside-toplevel
  from memeff_jax.ops.linear_cross_entropy import api  # pylint: disable=import-outside-toplevel
  from memeff_jax.ops.linear_cross_entropy import pallas_mosaic_gpu  # pylint: disable=import-outside-toplevel
  accumulated, dw_dtype = [], pallas_mosaic_gpu.ChunkBackend.dw_dtype
  def spy(self, w):  # asked wherever a chunk loop makes dW: (its columns, dW's dtype)
    accumulated.append((w.shape[1], jnp.dtype(dw_dtype(self, w)).name))
    return dw_dtype(self, w)
  monkeypatch.setattr(pallas_mosaic_gpu.ChunkBackend, "dw_dtype", spy)
  from memeff_jax.ops.linear_cross_entropy import _chunked  # pylint: disable=import-outside-toplevel
  summed, grouped = [], _chunked._grouped
  def spy_groups(carry, *args):  # a chunk loop's float32 sum of its groups' dW: its columns
    out = grouped(carry, *args)
    summed.append(out[2].shape[1])
    return out
  monkeypatch.setattr(_chunked, "_grouped", spy_groups)
  if not groups:
    monkeypatch.setattr(api, "_rounded_tokens", lambda *a: None)
  impl = PallasMosaicGpu(interpret=True)
  x, w, y, _, _ = _vocab_problem(16, n_lead=(16, 16))
  x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  weights = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
  if token_loss:
    ppo = dict(token_loss=_clipped_ratio, token_loss_args=(
        weights + 0.5, -4.6 + 0.5 * jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(
            y.shape)))
  f = lambda x, w, **kw: jnp.sum(weights * memeff_jax.linear_cross_entropy(
      x, w, y, chunk_size=1, reduction=reduction, **kw, **(ppo if token_loss else {})))
  want, want_grads = jax.value_and_grad(lambda x, w: f(x, w, implementation="reference"),
                                        argnums=(0, 1))(x, w)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  args = (put(x, P("data")), put(w, P("data", "model")))
  step = jax.jit(jax.value_and_grad(lambda x, w: f(x, w, implementation=impl), argnums=(0, 1)))
  with jax.set_mesh(mesh) if kind == "explicit" else contextlib.nullcontext():
    compiled = step.lower(*args).compile()
    got, grads = compiled(*args)
  _close(got, want, 2e-2)
  for g, wg in zip(grads, want_grads):  # bf16 dW: up to 32 roundings per group
    g, wg = np.asarray(g, np.float64), np.asarray(wg, np.float64)
    assert np.linalg.norm(g - wg) < 1e-2 * np.linalg.norm(wg)
  assert grads[1].sharding.is_equivalent_to(args[1].sharding, 2)
  # a shard's slice of the vocabulary (the call traced whole, for custom_partitioning's
  # shapes, does not run)
  assert {dtype for cols, dtype in accumulated if cols < w.shape[1]} == {"bfloat16"}
  assert any(cols < w.shape[1] for cols in summed) != groups, summed
  text = compiled.as_text()
  scatters = text.count(" reduce-scatter(") + text.count(" reduce-scatter-start(")
  assert scatters >= (2 if groups else 1)


def test_vocab_axis_needs_an_enclosing_shard_map():
  with pytest.raises(ValueError, match=r"vocab_axis='model' is not an axis of an enclosing"):
    memeff_jax.linear_cross_entropy(jnp.ones((4, 8)), jnp.ones((8, 16)),
                                    jnp.zeros(4, jnp.int32), vocab_axis="model")
  with pytest.raises(TypeError, match="vocab_axis must be a mesh axis name"):
    memeff_jax.linear_cross_entropy(jnp.ones((4, 8)), jnp.ones((8, 16)),
                                    jnp.zeros(4, jnp.int32), vocab_axis=3)


@pytest.mark.parametrize("kind, kw", [
    ("shard_map", dict(label_smoothing=0.1, z_loss=1e-3, where=True)),
    ("shard_map_unchecked", dict(reduction="none", return_aux=True, z_loss=1e-3)),
    ("shard_map", dict(z_loss=1e-3, implementation=_VOCAB_IMPLEMENTATIONS["pallas_exp_logits"])),
    ("shard_map_unchecked", dict(implementation=_VOCAB_IMPLEMENTATIONS["pallas_softmax"])),
    ("auto", dict(bias=True, z_loss=1e-3, where=True)),
    ("auto", dict(return_aux=True, reduction="sum", z_loss=1e-3)),
    ("explicit", dict(label_smoothing=0.1, where=True)),
    ("explicit", dict(reduction="none", weight_layout="vd"))])
def test_token_weights_on_meshes(mesh, explicit_mesh, kind, kw):
  """token_weights sharded like the tokens, W's vocabulary over 'model': inside shard_map
  with vocab_axis (either check_vma setting), under jit on Auto and Explicit meshes; the
  values and the gradients of x, W, the bias and the weights one device's."""
  layout = kw.get("weight_layout", "dv")
  x, w, y, b, where = _vocab_problem(13, layout=layout)
  omega = jax.random.normal(jax.random.key(14), y.shape)
  kw, call = _vocab_call(kw, y, b, where)
  mask = call.__defaults__[1]
  obj = lambda f: lambda x, w, b, om: sum(map(_weighted_sum, jax.tree.leaves(f(x, w, b, om))))
  w_spec = P(None, "model") if layout == "dv" else P("model")
  if kind.startswith("shard_map"):
    none = kw.get("reduction") == "none"
    per_shard = lambda out: out if none else jax.tree.map(lambda t: t[None], out)
    sharded = shard_map(
        lambda x, w, b, y_, m, om: per_shard(call(x, w, b, y_, m, vocab_axis="model",
                                                  token_weights=om)),
        mesh=mesh, in_specs=(P("data"), w_spec, P("model"), P("data"),
                             None if mask is None else P("data"), P("data")),
        out_specs=P("data"), check_vma=kind == "shard_map")
    got = lambda x, w, b, om: sharded(x, w, b, y, mask, om)

    def want(x, w, b, om):  # one device, each 'data' shard's two rows of tokens on their own
      rows = lambda t, r: None if t is None else t[r:r + 2]
      outs = [per_shard(call(x[r:r + 2], w, b, y[r:r + 2], rows(mask, r),
                             token_weights=om[r:r + 2])) for r in range(0, 8, 2)]
      return jax.tree.map(lambda *ts: jnp.concatenate(ts), *outs)
    args, context = (x, w, b, omega), contextlib.nullcontext()
  else:
    want = got = lambda x, w, b, om: call(x, w, b, token_weights=om)
    on = mesh if kind == "auto" else explicit_mesh
    put = lambda a, spec: jax.device_put(a, NamedSharding(on, spec))
    args = (put(x, P("data")), put(w, w_spec), put(b, P("model")), put(omega, P("data")))
    context = jax.set_mesh(explicit_mesh) if kind == "explicit" else contextlib.nullcontext()
  with context:
    values, grads, collectives, _ = _run(got, obj(got), (0, 1, 2, 3), *args)
  _close(values, want(x, w, b, omega), 1e-5)
  _close(grads, jax.grad(obj(want), argnums=(0, 1, 2, 3))(x, w, b, omega), 1e-5)
  if not kind.startswith("shard_map"):
    assert grads[3].sharding.is_equivalent_to(args[3].sharding, 2)
    assert collectives["all-gather"] == collectives["all-to-all"] == 0, collectives


def _clipped_ratio(log_p, advantages, old_log_p):
  """A token_loss: PPO's clipped surrogate."""
  ratio = jnp.exp(log_p - old_log_p)
  return -jnp.minimum(ratio * advantages, jnp.clip(ratio, 0.8, 1.2) * advantages)


@pytest.mark.parametrize("kind, kw", [
    ("shard_map", dict(logit_softcap=5.0, where=True)),
    ("shard_map_unchecked", dict(reduction="none",
                                 implementation=_VOCAB_IMPLEMENTATIONS["pallas_exp_logits"])),
    ("shard_map", dict(implementation=_VOCAB_IMPLEMENTATIONS["pallas_softmax"], bias=True)),
    ("auto", dict(reduction="sum", bias=True)),
    ("auto", dict(reduction="none", weight_layout="vd", return_aux=True)),
    ("explicit", dict(where=True)),
    ("explicit", dict(reduction="none", weight_layout="vd")),
    ("shard_map", dict(entropy=True, reduction="sum")),
    ("auto", dict(entropy=True, where=True)),
    ("explicit", dict(entropy=True, reduction="none"))])
def test_token_loss_on_meshes(mesh, explicit_mesh, kind, kw):
  """A token_loss with its arguments and token weights sharded like the tokens, W's
  vocabulary over 'model': inside shard_map with vocab_axis, under jit on Auto and Explicit
  meshes; the values and the gradients of x, W, the bias, the weights and f's arguments one
  device's. With entropy=True f takes the entropy too (merged over the slices)."""
  layout = kw.get("weight_layout", "dv")
  x, w, y, b, where = _vocab_problem(17, layout=layout)
  ks = jax.random.split(jax.random.key(18), 3)
  omega, adv = jax.random.uniform(ks[0], y.shape), jax.random.normal(ks[1], y.shape)
  old = -4.6 + 0.5 * jax.random.normal(ks[2], y.shape)  # log(1/96) nearby: some clipped
  f = _clipped_ratio
  if kw.get("entropy"):
    f = lambda lp, h, a, o: _clipped_ratio(lp, a, o) - 0.1 * h + 0.02 * h * h
  kw, call = _vocab_call(dict(kw, token_loss=f), y, b, where)
  mask = call.__defaults__[1]
  loss = lambda f: lambda x, w, b, om, a, o: sum(map(_weighted_sum,
                                                    jax.tree.leaves(f(x, w, b, om, a, o))))
  w_spec = P(None, "model") if layout == "dv" else P("model")
  if kind.startswith("shard_map"):
    none = kw.get("reduction") == "none"
    per_shard = lambda out: out if none else jax.tree.map(lambda t: t[None], out)
    sharded = shard_map(
        lambda x, w, b, y_, m, om, a, o: per_shard(call(
            x, w, b, y_, m, vocab_axis="model", token_weights=om, token_loss_args=(a, o))),
        mesh=mesh, in_specs=(P("data"), w_spec, P("model"), P("data"),
                             None if mask is None else P("data"), P("data"), P("data"),
                             P("data")),
        out_specs=P("data"), check_vma=kind == "shard_map")
    got = lambda x, w, b, om, a, o: sharded(x, w, b, y, mask, om, a, o)

    def want(x, w, b, om, a, o):  # one device, each 'data' shard's two rows on their own
      rows = lambda t, r: None if t is None else t[r:r + 2]
      outs = [per_shard(call(x[r:r + 2], w, b, y[r:r + 2], rows(mask, r),
                             token_weights=om[r:r + 2], token_loss_args=(a[r:r + 2],
                                                                         o[r:r + 2])))
              for r in range(0, 8, 2)]
      return jax.tree.map(lambda *ts: jnp.concatenate(ts), *outs)
    args, context = (x, w, b, omega, adv, old), contextlib.nullcontext()
  else:
    want = got = lambda x, w, b, om, a, o: call(x, w, b, token_weights=om,
                                                token_loss_args=(a, o))
    on = mesh if kind == "auto" else explicit_mesh
    put = lambda a, spec: jax.device_put(a, NamedSharding(on, spec))
    args = (put(x, P("data")), put(w, w_spec), put(b, P("model")), put(omega, P("data")),
            put(adv, P("data")), put(old, P("data")))
    context = jax.set_mesh(explicit_mesh) if kind == "explicit" else contextlib.nullcontext()
  argnums = (0, 1, 2, 3, 4, 5)
  with context:
    values, grads, collectives, _ = _run(got, loss(got), argnums, *args)
  _close(values, want(x, w, b, omega, adv, old), 1e-5)
  _close(grads, jax.grad(loss(want), argnums=argnums)(x, w, b, omega, adv, old), 1e-5)
  assert all(np.any(np.asarray(g) != 0) for g in grads[3:])
  if not kind.startswith("shard_map"):
    for i in (3, 4, 5):
      assert grads[i].sharding.is_equivalent_to(args[i].sharding, 2)
    assert collectives["all-gather"] == collectives["all-to-all"] == 0, collectives


@pytest.mark.parametrize("kind, kw", [
    ("shard_map", dict(logit_softcap=5.0, bias=True)),
    ("shard_map_unchecked", dict(reduction="none", label_smoothing=0.1)),
    ("shard_map", dict(implementation=_VOCAB_IMPLEMENTATIONS["pallas_softmax"])),
    ("shard_map_unchecked", dict(reduction="none",
                                 implementation=_VOCAB_IMPLEMENTATIONS["pallas_exp_logits"])),
    ("auto", dict(z_loss=1e-3, where=True)),
    ("auto", dict(reduction="none", weight_layout="vd")),
    ("explicit", dict(reduction="sum", bias=True)),
    ("explicit", dict(reduction="none", where=True))])
def test_entropy_on_meshes(mesh, explicit_mesh, kind, kw):
  """Aux.entropy with W's vocabulary over 'model' and the tokens over 'data' (its statistic
  merged over the slices): inside shard_map with vocab_axis (either check_vma setting),
  under jit on Auto and Explicit meshes; the values, and the gradients of x, W and the bias
  of every output differentiated, the entropy among them, one device's."""
  layout = kw.get("weight_layout", "dv")
  x, w, y, b, where = _vocab_problem(15, layout=layout)
  kw, call = _vocab_call(dict(kw, return_aux=True, entropy=True), y, b, where)
  mask = call.__defaults__[1]
  obj = lambda f: lambda x, w, b: sum(map(_weighted_sum, jax.tree.leaves(f(x, w, b))))
  w_spec = P(None, "model") if layout == "dv" else P("model")
  if kind.startswith("shard_map"):
    per_shard = lambda out: jax.tree.map(lambda t: t if t.ndim else t[None], out)
    sharded = shard_map(
        lambda x, w, b, y_, m: per_shard(call(x, w, b, y_, m, vocab_axis="model")),
        mesh=mesh, in_specs=(P("data"), w_spec, P("model"), P("data"),
                             None if mask is None else P("data")),
        out_specs=(P("data"), P("data")), check_vma=kind == "shard_map")
    got = lambda x, w, b: sharded(x, w, b, y, mask)

    def want(x, w, b):  # one device, each 'data' shard's two rows of tokens on their own
      rows = lambda t, r: None if t is None else t[r:r + 2]
      outs = [per_shard(call(x[r:r + 2], w, b, y[r:r + 2], rows(mask, r)))
              for r in range(0, 8, 2)]
      return jax.tree.map(lambda *ts: jnp.concatenate(ts), *outs)
    args, context = (x, w, b), contextlib.nullcontext()
  else:
    want = got = call
    on = mesh if kind == "auto" else explicit_mesh
    put = lambda a, spec: jax.device_put(a, NamedSharding(on, spec))
    args = (put(x, P("data")), put(w, w_spec), put(b, P("model")))
    context = jax.set_mesh(explicit_mesh) if kind == "explicit" else contextlib.nullcontext()
  with context:
    values, grads, collectives, _ = _run(got, obj(got), (0, 1, 2), *args)
  assert values[1].entropy.shape == y.shape
  _close(values, want(x, w, b), 1e-5)
  _close(grads, jax.grad(obj(want), argnums=(0, 1, 2))(x, w, b), 1e-5)
  if not kind.startswith("shard_map"):
    assert collectives["all-gather"] == collectives["all-to-all"] == 0, collectives


# bias, sum, smoothing, z-loss, softcap, aux outputs, "none", the "vd" layout and a mask
@pytest.mark.parametrize("kw", _VOCAB_OPTIONS[1:4])
def test_loss_vocab_parallel_on_an_explicit_mesh(explicit_mesh, kw):
  """Tokens over 'data', W's vocabulary (and the bias) over 'model': the loss and gradients
  of one device; W and its gradient never gathered, only [N]-sized statistics and dx summed
  over 'model', dW over 'data'."""
  layout = kw.get("weight_layout", "dv")
  x, w, y, b, where = _vocab_problem(6, layout=layout)
  kw, call = _vocab_call(kw, y, b, where)
  loss = lambda x, w, b: _weighted_sum(jax.tree.leaves(call(x, w, b))[0])
  want, want_grads = call(x, w, b), jax.grad(loss, argnums=(0, 1, 2))(x, w, b)
  w_spec = P(None, "model") if layout == "dv" else P("model", None)
  with jax.set_mesh(explicit_mesh):
    put = lambda a, spec: jax.device_put(a, NamedSharding(explicit_mesh, spec))
    args = (put(x, P("data")), put(w, w_spec), put(b, P("model")))
    got, grads, collectives, _ = _run(call, loss, (0, 1, 2), *args)
    assert grads[1].sharding.is_equivalent_to(args[1].sharding, 2)
  _close(got, want, 1e-5)
  _close(grads, want_grads, 1e-5)
  assert collectives["all-gather"] == collectives["all-to-all"] == 0, collectives
  assert collectives["all-reduce"] >= 2, collectives


@pytest.mark.parametrize("layout", ["dv", "vd"])
def test_loss_fsdp_weight_on_an_explicit_mesh(explicit_mesh, layout):
  """Tokens over 'data', W's D over 'data' too (FSDP) and its vocabulary over 'model': W is
  gathered over 'data' in the call and dW reduce-scattered back, never held whole."""
  x, w, y, b, _ = _vocab_problem(7, layout=layout)
  f = lambda x, w: memeff_jax.linear_cross_entropy(x, w, y, weight_layout=layout,
                                                   label_smoothing=0.1)
  loss = lambda x, w: f(x, w) * 3.0
  want, want_grads = f(x, w), jax.grad(loss, argnums=(0, 1))(x, w)
  w_spec = P("data", "model") if layout == "dv" else P("model", "data")
  with jax.set_mesh(explicit_mesh):
    put = lambda a, spec: jax.device_put(a, NamedSharding(explicit_mesh, spec))
    args = (put(x, P("data")), put(w, w_spec))
    got, grads, _, text = _run(f, loss, (0, 1), *args)
    assert grads[1].sharding.is_equivalent_to(args[1].sharding, 2)
  _close(got, want, 1e-5)
  _close(grads, want_grads, 1e-5)
  assert " all-gather(" in text or " all-gather-start(" in text
  assert " reduce-scatter(" in text, "dW should leave by a reduce-scatter"


def test_loss_refuses_x_sharded_on_d(explicit_mesh):
  with jax.set_mesh(explicit_mesh):
    x = jax.device_put(jnp.ones((8, 32)), NamedSharding(explicit_mesh, P(None, "data")))
    with pytest.raises(ValueError, match=r"x sharded on its token dims, not D"):
      memeff_jax.linear_cross_entropy(x, jnp.ones((32, 96)), jnp.zeros(8, jnp.int32))
    x = jax.device_put(jnp.ones((8, 32)), NamedSharding(explicit_mesh, P("data")))
    with pytest.raises(ValueError, match="vocab_axis='model' is for inside jax.shard_map"):
      memeff_jax.linear_cross_entropy(x, jnp.ones((32, 96)), jnp.zeros(8, jnp.int32),
                                      vocab_axis="model")


def _gathered_shapes(text: str) -> list[str]:
  """The result types of a compiled program's all-gathers, e.g. "f32[32,96]"."""
  return re.findall(r"= (\w+\[[\d,]*\])\S* all-gather(?:-start)?\(", text)


@pytest.mark.parametrize("x_spec, kw", [
    (P(("data", "model")), dict()),
    (P(("data", "model")), dict(reduction="none", bias=True)),
    (P(("data", "model")), dict(return_aux=True, z_loss=1e-3, label_smoothing=0.1,
                                weight_layout="vd")),
    (P(("model", "data")), dict(reduction="sum"))])  # 'model' not minor: W replicated
def test_loss_sequence_parallel_on_an_auto_mesh(mesh, x_spec, kw):
  """The tokens sharded over 'data' and 'model', W's vocabulary over 'model' too (Megatron's
  sequence parallelism): the call gathers the tokens over 'model', never W, and dx leaves it
  reduce-scattered over 'model'. Where 'model' is not the tokens' minor axis, gathering
  would reorder them: W is replicated instead."""
  layout = kw.get("weight_layout", "dv")
  x, w, b, call, loss, want, want_grads = _weighted(14, kw)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  w_spec = P(None, "model") if layout == "dv" else P("model")
  args = (put(x, x_spec), put(w, w_spec), put(b, P("model")))
  got, grads, _, text = _run(call, loss, (0, 1, 2), *args)
  _close(got, want, 1e-5)
  _close(grads, want_grads, 1e-5)
  assert grads[0].sharding.is_equivalent_to(args[0].sharding, 3)
  assert grads[1].sharding.is_equivalent_to(args[1].sharding, 2)
  if x_spec == P(("data", "model")):
    assert "f32[%d,%d]" % w.shape not in _gathered_shapes(text), _gathered_shapes(text)
    assert " reduce-scatter(" in text or " reduce-scatter-start(" in text


@pytest.mark.parametrize("x_spec, kw", [(P("data", "model"), dict()),
                                        (P("data", "model"), dict(reduction="none", bias=True)),
                                        (P(("model", "data")), dict(
                                            return_aux=True, reduction="sum", where=True,
                                            label_smoothing=0.1))])
def test_loss_sequence_parallel_on_an_explicit_mesh(explicit_mesh, x_spec, kw):
  """Sequence parallelism on an Explicit mesh: the tokens (here the sequence, or the batch
  over 'model' then 'data') gathered over 'model' inside the call, W never gathered, dx
  reduce-scattered by the gather's transpose; per-token outputs keep the tokens' sharding."""
  x, w, b, call, loss, want, want_grads = _weighted(15, kw)
  with jax.set_mesh(explicit_mesh):
    put = lambda a, spec: jax.device_put(a, NamedSharding(explicit_mesh, spec))
    args = (put(x, x_spec), put(w, P(None, "model")), put(b, P("model")))
    got, grads, _, text = _run(call, loss, (0, 1, 2), *args)
    assert grads[0].sharding.is_equivalent_to(args[0].sharding, 3)
    assert grads[1].sharding.is_equivalent_to(args[1].sharding, 2)
  _close(got, want, 1e-5)
  _close(grads, want_grads, 1e-5)
  assert "f32[%d,%d]" % w.shape not in _gathered_shapes(text), _gathered_shapes(text)
  assert " reduce-scatter(" in text or " reduce-scatter-start(" in text


# Each kernel case on both kinds of mesh and with check_vma on and off; each kind of mesh
# with check_vma on and off.
@pytest.mark.parametrize("impl, causal, hkv, kind, check_vma", [
    (*case, kind, (i + j) % 2 == 0)
    for i, case in enumerate([("pallas_mosaic_gpu", False, 2), ("pallas_mosaic_gpu", True, 2),
                              ("pallas_mosaic_gpu", True, 8), ("pallas_triton", True, 2)])
    for j, kind in enumerate(["auto", "explicit"])])
def test_attention_kernels_lower_for_cuda_in_shard_map(request, monkeypatch, check_vma, impl,
                                                       causal, hkv, kind):
  """The GPU kernels (fwd+bwd) traced inside jax.shard_map and lowered for CUDA on this host:
  with check_vma, Pallas wants its outputs' types and refuses a kernel body that mixes
  per-shard values with constants (_vma.unchecked); custom_partitioning stays out of the
  way there (_auto.available). Causal MHA's fused backward writes into mutable arrays, whose
  discharge at lowering re-traces the program with the checks on. On an Explicit mesh the
  ordered backward's rank table, computed while tracing, must carry none of the mesh's
  manual axes (hopper.host_constants)."""
  mesh = request.getfixturevalue("mesh" if kind == "auto" else "explicit_mesh")
  from memeff_jax.kernels import hopper  # pylint: disable=import-outside-toplevel
  from memeff_jax.ops.flash_attention import pallas_mosaic_gpu  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(pallas_mosaic_gpu, "hopper_available", lambda: None)
  monkeypatch.setattr(hopper, "on_nvidia_gpu", lambda: True)
  loss = lambda q, k, v: jnp.sum(memeff_jax.flash_attention(
      q, k, v, causal=causal, implementation=impl).astype(jnp.float32))
  spec = P("data", None, "model")
  step = shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh, in_specs=(spec,) * 3,
                   out_specs=(spec,) * 3, check_vma=check_vma)
  sharded = NamedSharding(mesh, spec) if kind == "explicit" else None
  q = jax.ShapeDtypeStruct((8, 256, 8, 128), jnp.bfloat16, sharding=sharded)
  k = jax.ShapeDtypeStruct((8, 256, hkv, 128), jnp.bfloat16, sharding=sharded)
  with jax.set_mesh(mesh) if kind == "explicit" else contextlib.nullcontext():
    text = jax.jit(step).trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
  assert ("mosaic_gpu" if impl == "pallas_mosaic_gpu" else "triton") in text


@pytest.mark.parametrize("hkv, kw", [(2, dict(causal=True)), (1, dict(sliding_window=(64, 0)))])
def test_attention_kernels_lower_for_cuda_on_an_explicit_mesh(explicit_mesh, monkeypatch, hkv,
                                                              kw):
  """The batch over 'data', the heads over 'model' of an Explicit mesh under jax.jit: the
  call runs per shard in a shard_map (ops/_explicit.py), the Mosaic kernels (fwd+bwd) in it,
  lowered for CUDA on this host."""
  from memeff_jax.kernels import hopper  # pylint: disable=import-outside-toplevel
  from memeff_jax.ops.flash_attention import pallas_mosaic_gpu  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(pallas_mosaic_gpu, "hopper_available", lambda: None)
  monkeypatch.setattr(hopper, "on_nvidia_gpu", lambda: True)
  f = lambda q, k, v: memeff_jax.flash_attention(q, k, v, **kw)
  loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32))
  shard = lambda spec: NamedSharding(explicit_mesh, spec)
  kv_spec = P("data", None, "model") if hkv > 1 else P("data")
  q = jax.ShapeDtypeStruct((8, 256, 8, 128), jnp.bfloat16, sharding=shard(P("data", None,
                                                                              "model")))
  k = jax.ShapeDtypeStruct((8, 256, hkv, 128), jnp.bfloat16, sharding=shard(kv_spec))
  with jax.set_mesh(explicit_mesh):
    both = jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=(0, 1, 2))(*a)))
    text = both.trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("check_vma", [True, False])
def test_loss_kernels_lower_for_cuda_in_shard_map(mesh, monkeypatch, check_vma):
  """The GPU loss's softmax kernels in the chunk loop (the GEMMs on cuBLAS) with the tokens
  over 'data' and the vocabulary over 'model', lowered for CUDA on this host: the slice's
  statistics, their merge and G, two passes. (exp_logits' conditional fallback GEMM, which
  writes into a mutable array, does not trace on CPU jaxlib 0.10; tests/ops/test_meshes_gpu.py
  runs it.)"""
  from memeff_jax.kernels import hopper  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(hopper, "unavailable", lambda: None)
  monkeypatch.setattr(hopper, "on_nvidia_gpu", lambda: True)
  impl = memeff_jax.ops.linear_cross_entropy.PallasMosaicGpu(dw_accumulation="weight",
                                                             exp_logits=False)
  loss = lambda x, w, y: jax.lax.psum(memeff_jax.linear_cross_entropy(
      x, w, y, reduction="sum", vocab_axis="model", implementation=impl), "data")
  step = shard_map(jax.value_and_grad(loss, argnums=(0, 1)), mesh=mesh,
                   in_specs=(P("data"), P(None, "model"), P("data")),
                   out_specs=(P(), (P("data"), P(None, "model"))), check_vma=check_vma)
  x = jax.ShapeDtypeStruct((8192, 1024), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((1024, 65536), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((8192,), jnp.int32)
  text = jax.jit(step).trace(x, w, y).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("linear_cross_entropy_lse") and text.count("linear_cross_entropy_softmax_grad")
