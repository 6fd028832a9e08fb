"""The decoder: memeff and plain layers hold the same parameters and train the same."""

import dataclasses

import chex
from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest

from memeff_jax.models import Llama
from memeff_jax.models import LlamaConfig
from memeff_jax.models import make_train_step
from memeff_jax.models import data

CFG = LlamaConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192)


def _batch(b=2, t=96):
  """Source bytes with two documents packed per row (the second starts at t // 3)."""
  batch = next(data.packed_batches(b, t))
  seg = np.where(np.arange(t) < t // 3, 1, 2)[None].repeat(b, 0)
  labels = batch["labels"].copy()
  labels[:, t // 3 - 1] = -100  # no target across the document boundary
  return dict(tokens=jnp.asarray(batch["tokens"]), labels=jnp.asarray(labels),
              segment_ids=jnp.asarray(seg, jnp.int32))


@pytest.mark.parametrize("tie", [False, True])
def test_same_parameter_tree_and_loss(tie):
  cfg = dataclasses.replace(CFG, tie_embeddings=tie)
  plain = Llama(cfg, kernels="plain", rngs=nnx.Rngs(0))
  ours = Llama(cfg, kernels="memeff", rngs=nnx.Rngs(0))
  chex.assert_trees_all_equal(nnx.state(plain, nnx.Param), nnx.state(ours, nnx.Param))
  batch = _batch()
  grad = nnx.jit(nnx.value_and_grad(lambda m: m.loss(**batch)))  # one program per model
  (l1, g1), (l2, g2) = (grad(m) for m in (plain, ours))
  np.testing.assert_allclose(l1, l2, rtol=1e-5)
  chex.assert_trees_all_close(nnx.state(g1), nnx.state(g2), rtol=2e-3, atol=2e-6)


@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_losses_agree_after_training_steps(dtype, rtol):
  cfg = dataclasses.replace(CFG, dtype=dtype)
  stream = data.packed_batches(2, 96, seed=1)
  batches = [{k: jnp.asarray(v) for k, v in next(stream).items()} for _ in range(4)]
  losses = {}
  for kernels in ("plain", "memeff"):
    state, step = make_train_step(Llama(cfg, kernels=kernels, rngs=nnx.Rngs(0)))
    state, out = state.state, []
    for b in batches:
      state, loss = step(state, b)
      out.append(float(loss))
    losses[kernels] = out
  np.testing.assert_allclose(losses["memeff"], losses["plain"], rtol=rtol)
  assert losses["memeff"][-1] < losses["memeff"][0]  # it learns


def test_logits_match_between_kernel_sets():
  plain = Llama(CFG, kernels="plain", rngs=nnx.Rngs(0))
  ours = Llama(CFG, kernels="memeff", rngs=nnx.Rngs(0))
  b = _batch()
  np.testing.assert_allclose(ours.logits(b["tokens"], b["segment_ids"]),
                             plain.logits(b["tokens"], b["segment_ids"]), rtol=1e-4, atol=1e-5)


def test_bad_config():
  with pytest.raises(ValueError, match="n_heads=4 must be a multiple of n_kv_heads=3"):
    LlamaConfig(n_heads=4, n_kv_heads=3)
  with pytest.raises(ValueError, match="remat_policy=.keep_all.: unknown remat policy"):
    LlamaConfig(remat_policy="keep_all")
  with pytest.raises(ValueError, match="kernels must be one of"):
    Llama(CFG, kernels="fast", rngs=nnx.Rngs(0))


def test_model_configs_parse():
  import pathlib  # pylint: disable=import-outside-toplevel
  for path in sorted((pathlib.Path(__file__).resolve().parents[2] / "configs" / "models").glob(
      "*.toml")):
    cfg, train = LlamaConfig.from_toml(path)
    assert train["seq_len"] > 0 and cfg.vocab_size > 0, path
