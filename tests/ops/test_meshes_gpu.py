"""Both ops on a mesh of real GPUs (2 or more of one host): the Hopper kernels run per shard
inside custom_partitioning (Auto axes), on Explicit axes and inside jax.shard_map, and give
what one GPU gives. `bash benchmarks/gpu.sh tests` runs this file with every GPU visible."""

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
from memeff_jax.ops.flash_attention import pallas_mosaic_gpu
from memeff_jax.ops.flash_attention import unzigzag
from memeff_jax.ops.flash_attention import zigzag
from tests.ops.test_meshes import _run

pytestmark = pytest.mark.gpu
BF16 = jnp.bfloat16
_MOSAIC = "mosaic_gpu"
_TRITON = "__gpu$xla.gpu.triton"


def _gpus() -> int:
  return jax.device_count() if jax.default_backend() == "gpu" else 0


@pytest.fixture(scope="module", params=[AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def mesh(request):
  """('data', 'model') = (n/2, 2) over the host's first n = 2 or 4 GPUs."""
  n = min(_gpus(), 4)
  if n < 2 or pallas_mosaic_gpu.hopper_available() is not None:
    pytest.skip("needs 2 or more Hopper GPUs")
  return jax.make_mesh((n // 2, 2), ("data", "model"), axis_types=(request.param,) * 2,
                       devices=jax.devices()[:n])


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def _assert_close(got, want, tol):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape and _rel(g, w) < tol, (g.shape, _rel(g, w))


def _one_gpu(f, loss, argnums, *args):
  """f's values and loss's gradients on the first GPU alone (the inputs unsharded)."""
  args = jax.device_put(args, jax.devices()[0])
  return jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=argnums)(*a)))(*args)


def _in_mesh(mesh):
  explicit = mesh.axis_types[0] == AxisType.Explicit
  return jax.set_mesh(mesh) if explicit else _Nothing()


class _Nothing:
  def __enter__(self):
    return None

  def __exit__(self, *exc):
    return False


@pytest.mark.parametrize("hkv, kw", [(2, dict(causal=True)),
                                     (8, dict(causal=True)),  # a fused backward's new_ref
                                     (2, dict(causal=True, segments=True, logit_softcap=30.0)),
                                     (1, dict(sliding_window=(256, 0)))])
def test_attention_batch_and_heads_sharded(mesh, hkv, kw):
  """The batch over 'data', the heads over 'model' (one key head, MQA: shared by the 'model'
  shards): the Mosaic kernels per shard, nothing gathered, one GPU's values and gradients."""
  kw = dict(kw)
  ks = jax.random.split(jax.random.key(hkv), 4)
  b, t, hq, d = 4, 1024, 8, 128
  q = jax.random.normal(ks[0], (b, t, hq, d), BF16)
  k, v = (jax.random.normal(key, (b, t, hkv, d), BF16) for key in ks[1:3])
  seg = (jnp.arange(t) // 300)[None].repeat(b, 0) if kw.pop("segments", False) else None
  f = lambda q, k, v, seg: memeff_jax.flash_attention(q, k, v, q_segment_ids=seg, **kw)
  ct = jax.random.normal(ks[3], q.shape, jnp.float32)
  loss = lambda q, k, v, seg: jnp.sum(f(q, k, v, seg).astype(jnp.float32) * ct)
  want, want_grads = _one_gpu(f, loss, (0, 1, 2), q, k, v, seg)
  kv_spec = P("data", None, "model") if hkv > 1 else P("data")
  with _in_mesh(mesh):
    put = lambda x, spec: None if x is None else jax.device_put(x, NamedSharding(mesh, spec))
    args = (put(q, P("data", None, "model")), put(k, kv_spec), put(v, kv_spec),
            put(seg, P("data")))
    got, grads, collectives, text = _run(f, loss, (0, 1, 2), *args)
  assert _MOSAIC in text
  _assert_close(got, want, 1e-2)
  _assert_close(grads, want_grads, 1e-2)
  assert got.sharding.is_equivalent_to(args[0].sharding, 4)
  assert collectives["all-gather"] == collectives["all-to-all"] == 0, collectives
  if hkv > 1:
    assert collectives["all-reduce"] <= 1, collectives  # the scalar loss only


@pytest.mark.parametrize("check_vma", [True, False])
def test_attention_in_shard_map(mesh, check_vma):
  ks = jax.random.split(jax.random.key(3), 3)
  q, k, v = (jax.random.normal(key, (4, 512, 8, 128), BF16) for key in ks)
  f = lambda q, k, v: memeff_jax.flash_attention(q, k, v, causal=True)
  spec = P("data", None, "model")
  sharded = shard_map(f, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=check_vma)
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v).astype(jnp.float32)))
  want, want_grads = _one_gpu(f, loss(f), (0, 1, 2), q, k, v)
  with _in_mesh(mesh):
    args = jax.device_put((q, k, v), NamedSharding(mesh, spec))
    got, grads, _, text = _run(sharded, loss(sharded), (0, 1, 2), *args)
  assert _MOSAIC in text
  _assert_close(got, want, 1e-2)
  _assert_close(grads, want_grads, 1e-2)


@pytest.mark.parametrize("w_axis, kw", [(None, dict()),
                                         ("model", dict(label_smoothing=0.1, z_loss=1e-4)),
                                         ("model", dict(reduction="sum", weight_layout="vd"))])
def test_loss_tokens_and_vocab_sharded(mesh, w_axis, kw):
  """Tokens over 'data'; W replicated, or its vocabulary over 'model' (vocab parallel): the
  Mosaic GPU loss per shard, one GPU's loss and gradients, W's gradient sharded as W."""
  n, d, v = 4096, 1024, 32000
  ks = jax.random.split(jax.random.key(7), 3)
  layout = kw.get("weight_layout", "dv")
  x = jax.random.normal(ks[0], (n, d), BF16)
  w = (jax.random.normal(ks[1], (d, v) if layout == "dv" else (v, d)) / 32).astype(BF16)
  y = jax.random.randint(ks[2], (n,), 0, v).at[:7].set(-100)
  f = lambda x, w: memeff_jax.linear_cross_entropy(x, w, y, **kw)
  loss = lambda x, w: f(x, w) * 2.0
  want, want_grads = _one_gpu(f, loss, (0, 1), x, w)
  w_spec = P() if w_axis is None else P(None, w_axis) if layout == "dv" else P(w_axis)
  with _in_mesh(mesh):
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    args = (put(x, P("data")), put(w, w_spec))
    got, grads, collectives, text = _run(f, loss, (0, 1), *args)
    assert grads[1].sharding.is_equivalent_to(args[1].sharding, 2)
  # Mosaic GEMMs; with label smoothing cuBLAS around the Triton softmax kernel
  assert _MOSAIC in text or _TRITON in text
  _assert_close(got, want, 2e-3)
  _assert_close(grads, want_grads, 2e-2)
  assert collectives["all-gather"] == collectives["all-to-all"] == 0, collectives


def test_loss_sequence_parallel(mesh):
  """The tokens over 'data' and 'model', W's vocabulary over 'model' too: the tokens are
  gathered over 'model' (never W) and dx reduce-scattered back, one GPU's loss and
  gradients."""
  from tests.ops.test_meshes import _gathered_shapes  # pylint: disable=import-outside-toplevel
  n, d, v = 4096, 1024, 32000
  ks = jax.random.split(jax.random.key(9), 3)
  x = jax.random.normal(ks[0], (n, d), BF16)
  w = (jax.random.normal(ks[1], (d, v)) / 32).astype(BF16)
  y = jax.random.randint(ks[2], (n,), 0, v)
  f = lambda x, w: memeff_jax.linear_cross_entropy(x, w, y)
  want, want_grads = _one_gpu(f, f, (0, 1), x, w)
  with _in_mesh(mesh):
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    args = (put(x, P(("data", "model"))), put(w, P(None, "model")))
    got, grads, _, text = _run(f, f, (0, 1), *args)
    assert grads[0].sharding.is_equivalent_to(args[0].sharding, 2)
  assert _MOSAIC in text
  assert f"bf16[{d},{v}]" not in _gathered_shapes(text)
  assert " reduce-scatter(" in text or " reduce-scatter-start(" in text
  _assert_close(got, want, 2e-3)
  _assert_close(grads, want_grads, 2e-2)


def test_loss_fsdp_in_token_groups(mesh):
  """W's D over 'data' (FSDP) and its vocabulary over 'model', with more tokens per shard
  than the loss adds up in bf16 (32 chunks of 128): token groups, each group's dW
  reduce-scattered; one GPU's loss and gradients."""
  n, d, v = 16384, 1024, 32000
  ks = jax.random.split(jax.random.key(10), 3)
  x = jax.random.normal(ks[0], (n, d), BF16)
  w = (jax.random.normal(ks[1], (d, v)) / 32).astype(BF16)
  y = jax.random.randint(ks[2], (n,), 0, v)
  f = lambda x, w: memeff_jax.linear_cross_entropy(x, w, y, chunk_size=128)
  want, want_grads = _one_gpu(f, f, (0, 1), x, w)
  with _in_mesh(mesh):
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    args = (put(x, P("data")), put(w, P("data", "model")))
    got, grads, _, text = _run(f, f, (0, 1), *args)
    assert grads[1].sharding.is_equivalent_to(args[1].sharding, 2)
  scatters = text.count(" reduce-scatter(") + text.count(" reduce-scatter-start(")
  assert scatters >= (2 if mesh.shape["data"] > 1 else 0)
  _assert_close(got, want, 2e-3)
  _assert_close(grads, want_grads, 2e-2)


@pytest.mark.parametrize("check_vma", [True, False])
def test_loss_vocab_parallel_in_shard_map(mesh, check_vma):
  """The exp_logits path merges E's row sums over 'model' inside its chunk loop."""
  n, d, v = 2048, 1024, 32000
  ks = jax.random.split(jax.random.key(8), 3)
  x = jax.random.normal(ks[0], (n, d), BF16)
  w = (jax.random.normal(ks[1], (d, v)) / 32).astype(BF16)
  y = jax.random.randint(ks[2], (n,), 0, v)
  local = lambda x, w, y, **vp: memeff_jax.linear_cross_entropy(x, w, y, reduction="sum", **vp)
  total = shard_map(lambda x, w, y: jax.lax.psum(local(x, w, y, vocab_axis="model"), "data"),
                    mesh=mesh, in_specs=(P("data"), P(None, "model"), P("data")),
                    out_specs=P(), check_vma=check_vma)
  want, want_grads = _one_gpu(local, local, (0, 1), x, w, y)
  with _in_mesh(mesh):
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    args = (put(x, P("data")), put(w, P(None, "model")), put(y, P("data")))
    got, grads, _, text = _run(total, total, (0, 1), *args)
  assert _MOSAIC in text
  _assert_close(got, want, 2e-3)
  _assert_close(grads, want_grads, 2e-2)


@pytest.mark.parametrize("strategy, order, kw", [
    ("all_gather", "contiguous", dict(causal=True)),
    ("all_gather", "zigzag", dict(causal=True)),
    ("all_gather", "zigzag", dict(causal=True, segments=True)),
    ("all_gather", "contiguous", dict(causal=True, sliding_window=(384, 0))),
    ("ring", "zigzag", dict(causal=True, segments=True)),
    ("ring", "contiguous", dict(causal=True, sliding_window=(384, 0)))])
def test_attention_sequence_sharded(strategy, order, kw):
  """Context parallelism over every GPU (2 or 4): the sequence over 'context' inside
  shard_map, each shard's queries through the Mosaic kernels against the keys their mask
  reaches (GQA 4:1), gathered, exchanged as halos (the window) or passed round the ring;
  one GPU's values and gradients."""
  n = min(_gpus(), 4)
  if n < 2 or pallas_mosaic_gpu.hopper_available() is not None:
    pytest.skip("needs 2 or more Hopper GPUs")
  kw = dict(kw)
  mesh = jax.make_mesh((n,), ("context",), devices=jax.devices()[:n])
  ks = jax.random.split(jax.random.key(11), 4)
  b, t, hq, hkv, d = 2, 512 * n, 8, 2, 128
  q = jax.random.normal(ks[0], (b, t, hq, d), BF16)
  k, v = (jax.random.normal(key, (b, t, hkv, d), BF16) for key in ks[1:3])
  seg = (jnp.arange(t) // 700)[None].repeat(b, 0) if kw.pop("segments", False) else None
  one = lambda q, k, v, seg: memeff_jax.flash_attention(q, k, v, q_segment_ids=seg, **kw)
  zz = (lambda a: a) if order == "contiguous" else (lambda a: None if a is None else zigzag(a, n))
  unzz = (lambda a: a) if order == "contiguous" else (lambda a: unzigzag(a, n))
  ct = jax.random.normal(ks[3], q.shape, jnp.float32)
  loss = lambda f, ct: lambda q, k, v, seg: jnp.sum(f(q, k, v, seg).astype(jnp.float32) * ct)
  want, want_grads = _one_gpu(one, loss(one, ct), (0, 1, 2), q, k, v, seg)
  spec = P(None, "context")
  many = shard_map(
      lambda q, k, v, seg: memeff_jax.flash_attention(
          q, k, v, q_segment_ids=seg, context_axis="context", context_order=order,
          context_strategy=strategy, **kw),
      mesh=mesh, in_specs=(spec, spec, spec, spec if seg is not None else None),
      out_specs=spec)
  args = jax.device_put(tuple(map(zz, (q, k, v, seg))), NamedSharding(mesh, spec))
  got, grads, collectives, text = _run(many, loss(many, zz(ct)), (0, 1, 2), *args)
  assert _MOSAIC in text
  _assert_close(unzz(got), want, 1e-2)
  _assert_close([unzz(g) for g in grads], want_grads, 1e-2)
  window = kw.get("sliding_window", (None, None))
  halo = _context.halo_rows(t // n, t // n, n, (window[0], 0), order)
  if strategy == "all_gather" and not halo:
    assert collectives["all-gather"] >= 1 and " reduce-scatter" in text, collectives
  else:  # the ring, or halos that a window keeps within the neighbours
    assert collectives["collective-permute"] >= 1 and not collectives["all-gather"], collectives
  assert collectives["all-to-all"] == 0, collectives


@pytest.mark.parametrize("strategy, order", [("all_gather", "contiguous"), ("ring", "zigzag")])
def test_attention_sequence_sharded_on_an_auto_mesh(strategy, order):
  """jit with the sequence sharded over an Auto axis of every GPU: the custom_partitioning
  runs context parallelism through the Mosaic kernels; one GPU's values and gradients."""
  n = min(_gpus(), 4)
  if n < 2 or pallas_mosaic_gpu.hopper_available() is not None:
    pytest.skip("needs 2 or more Hopper GPUs")
  mesh = jax.make_mesh((n,), ("context",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:n])
  ks = jax.random.split(jax.random.key(12), 4)
  b, t, hq, hkv, d = 2, 512 * n, 8, 2, 128
  q = jax.random.normal(ks[0], (b, t, hq, d), BF16)
  k, v = (jax.random.normal(key, (b, t, hkv, d), BF16) for key in ks[1:3])
  zz = (lambda a: a) if order == "contiguous" else (lambda a: zigzag(a, n))
  unzz = (lambda a: a) if order == "contiguous" else (lambda a: unzigzag(a, n))
  ct = zz(jax.random.normal(ks[3], q.shape, jnp.float32))
  f = lambda q, k, v, **c: memeff_jax.flash_attention(q, k, v, causal=True, **c)
  one = lambda q, k, v: zz(f(unzz(q), unzz(k), unzz(v)))
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * ct)
  args = tuple(map(zz, (q, k, v)))
  want, want_grads = _one_gpu(one, loss(one), (0, 1, 2), *args)
  many = lambda q, k, v: f(q, k, v, context_order=order, context_strategy=strategy)
  args = jax.device_put(args, NamedSharding(mesh, P(None, "context")))
  got, grads, collectives, text = _run(many, loss(many), (0, 1, 2), *args)
  assert _MOSAIC in text
  _assert_close(got, want, 1e-2)
  _assert_close(grads, want_grads, 1e-2)
  assert got.sharding.is_equivalent_to(args[0].sharding, 4)
  assert collectives["all-to-all"] == 0, collectives


def test_model_sequence_parallel_reduce_scatters():
  """The model's sequence parallelism on tensor=2 GPUs (bf16): one GPU's losses, and XLA's
  GPU pipeline turns each block branch's all-reduce and slice into a reduce-scatter, so at
  most the embedding lookup's all-reduce carries the whole residual stream."""
  import re  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  # pylint: disable-next=import-outside-toplevel
  from memeff_jax.models import Llama, LlamaConfig, make_train_step, run, sharding
  if _gpus() < 2 or pallas_mosaic_gpu.hopper_available() is not None:
    pytest.skip("needs 2 or more Hopper GPUs")
  cfg = LlamaConfig(vocab_size=256, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                    d_ff=512, tie_embeddings=True, dtype="bfloat16")
  train = dict(learning_rate=3e-3, data="source")
  kw = dict(kernels="memeff", steps=3, batch=2, seq_len=256, show_progress=False)
  mesh = sharding.make_mesh({"tensor": 2})
  many = run.train(cfg, train, mesh=mesh, sequence_parallel=True, **kw).losses
  np.testing.assert_allclose(many, run.train(cfg, train, **kw).losses, rtol=5e-3)
  state, step = make_train_step(Llama(cfg, sequence_parallel=True, rngs=nnx.Rngs(0)),
                                mesh=mesh)
  tokens = jax.ShapeDtypeStruct((2, 256), np.int32, sharding=sharding.batch_sharding(mesh))
  text = step.lower(state.state, {"tokens": tokens, "labels": tokens}).compile().as_text()
  whole, half = f"[2,256,{cfg.d_model}]", f"[2,128,{cfg.d_model}]"
  scattered = re.findall(rf"(?:bf16|f32){re.escape(half)}\S* reduce-scatter(?:-start)?\(", text)
  reduced = re.findall(rf"(?:bf16|f32){re.escape(whole)}\S* all-reduce(?:-start)?\(", text)
  assert len(scattered) >= 2 * cfg.n_layers and len(reduced) <= 1, (scattered, reduced)
