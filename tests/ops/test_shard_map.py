"""Both ops inside a user's jax.shard_map, with either check_vma setting: per-shard values and
gradients equal the single-device ones (eight CPU devices, see conftest). A weight or key
the shards share gets the sum of every shard's gradient contribution."""

import jax
from jax import shard_map
import jax.numpy as jnp
from jax.sharding import AxisType
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


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("hkv, kw", [(4, dict(causal=True)), (1, dict(sliding_window=(7, 3))),
                                     (4, dict(causal=True, segments=True))])
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
  _close(jax.jit(sharded)(q, k, v, seg), f(q, k, v, seg))
  _close(jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(q, k, v),
         jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v))


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
  _close(jax.jit(total)(x, w, y), local(x, w, y), 1e-4)
  _close(jax.jit(jax.grad(total, argnums=(0, 1)))(x, w, y),
         jax.grad(local, argnums=(0, 1))(x, w, y), 1e-4)
