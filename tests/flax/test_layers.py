"""The Flax layers equal the plain layers they replace, with the same parameters."""

import functools

import chex
from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from memeff_jax.flax import linen as mlinen
from memeff_jax.flax import nnx as mnnx

jax.config.update("jax_default_matmul_precision", "highest")
B, T, D, V = 2, 9, 16, 203


def _data():
  x = jax.random.normal(jax.random.key(0), (B, T, D))
  y = jax.random.randint(jax.random.key(1), (B, T), 0, V).at[0, :2].set(-100)
  return x, y


def _optax_loss(logits, y):
  valid = y != -100
  per = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, y, 0))
  return jnp.sum(jnp.where(valid, per, 0.0)) / jnp.sum(valid)


@pytest.mark.parametrize("use_bias", [False, True])
def test_linen_head_equals_dense_plus_optax(use_bias):
  x, y = _data()
  dense, head = nn.Dense(V, use_bias=use_bias), mlinen.FusedLMHead(V, use_bias=use_bias)
  params = dense.init(jax.random.key(2), x)
  head_params = head.init(jax.random.key(2), x, y)
  chex.assert_trees_all_equal(params, head_params)  # same structure, same initial values

  plain = lambda p, x: _optax_loss(dense.apply(p, x), y)
  fused = lambda p, x: head.apply(p, x, y)
  (l1, g1), (l2, g2) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, x)
                        for f in (plain, fused))
  np.testing.assert_allclose(l1, l2, rtol=1e-6)
  chex.assert_trees_all_close(g1, g2, rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(head.apply(params, x, method="logits"), dense.apply(params, x),
                              rtol=1e-6)


def test_linen_tied_head_uses_the_embedding_table():
  x, y = _data()
  table = jax.random.normal(jax.random.key(3), (V, D))
  head = mlinen.FusedLMHead(V, tied=True)
  params = head.init(jax.random.key(0), x, y, embedding=table)
  assert params == {} or not jax.tree.leaves(params)
  loss, g = jax.value_and_grad(lambda t: head.apply(params, x, y, embedding=t))(table)
  want, g_want = jax.value_and_grad(lambda t: _optax_loss(x @ t.T, y))(table)
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  np.testing.assert_allclose(g, g_want, rtol=1e-5, atol=1e-7)
  with pytest.raises(ValueError, match="needs embedding="):
    head.apply(params, x, y)


@pytest.mark.parametrize("use_bias", [False, True])
def test_nnx_head_equals_linear_plus_optax(use_bias):
  x, y = _data()
  linear = nnx.Linear(D, V, use_bias=use_bias, rngs=nnx.Rngs(0))
  head = mnnx.FusedLMHead(D, V, use_bias=use_bias, rngs=nnx.Rngs(0))
  s1, s2 = nnx.state(linear, nnx.Param), nnx.state(head, nnx.Param)
  chex.assert_trees_all_equal(s1, s2)

  loss_plain = lambda m: _optax_loss(m(x), y)
  loss_fused = lambda m: m(x, y)
  (l1, g1), (l2, g2) = (nnx.value_and_grad(f)(m) for f, m in
                        ((loss_plain, linear), (loss_fused, head)))
  np.testing.assert_allclose(l1, l2, rtol=1e-6)
  chex.assert_trees_all_close(nnx.state(g1), nnx.state(g2), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(head.logits(x), linear(x), rtol=1e-6)
  np.testing.assert_allclose(head(x), linear(x), rtol=1e-6)  # no labels: logits, as linen
  with pytest.raises(ValueError, match=r"loss options \['z_loss'\] need labels"):
    head(x, z_loss=1e-4)
  # Switch back: the head's state loads into a plain Linear.
  nnx.update(linear, nnx.state(head, nnx.Param))


def test_use_bias_true_holds_a_default_linears_parameters():
  """The README's promise: FusedLMHead(D, V, use_bias=True) loads nnx.Linear(D, V)."""
  linear = nnx.Linear(D, V, rngs=nnx.Rngs(0))
  head = mnnx.FusedLMHead(D, V, use_bias=True, rngs=nnx.Rngs(0))
  chex.assert_trees_all_equal(nnx.state(linear, nnx.Param), nnx.state(head, nnx.Param))
  assert mnnx.FusedLMHead(D, V, rngs=nnx.Rngs(0)).bias is None


def test_nnx_tied_head_shares_the_embed():
  x, y = _data()
  embed = nnx.Embed(V, D, rngs=nnx.Rngs(0))
  head = mnnx.FusedLMHead(D, V, tied_embedding=embed, rngs=nnx.Rngs(1))
  assert head.tied_embedding is embed and head.kernel is None
  loss = head(x, y)
  np.testing.assert_allclose(loss, _optax_loss(embed.attend(x), y), rtol=1e-6)
  with pytest.raises(ValueError, match=r"tied_embedding table \(203, 16\) must be"):
    mnnx.FusedLMHead(8, V, tied_embedding=embed, rngs=nnx.Rngs(1))


def _mha_inputs():
  return jax.random.normal(jax.random.key(5), (2, 12, 64))


def test_linen_attention_fn_equals_default():
  x = _mha_inputs()
  plain = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=64)
  ours = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=64,
                                         attention_fn=mlinen.flash_attention_fn)
  params = plain.init(jax.random.key(0), x)
  apply = lambda m: jax.jit(lambda p, mask: m.apply(p, x, mask=mask))  # one program each
  np.testing.assert_allclose(apply(ours)(params, None), apply(plain)(params, None), rtol=1e-5,
                             atol=1e-6)
  causal = nn.make_causal_mask(jnp.ones((2, 12)))
  np.testing.assert_allclose(apply(ours)(params, causal), apply(plain)(params, causal),
                             rtol=1e-5, atol=1e-6)
  g1 = jax.jit(jax.grad(lambda p: jnp.sum(plain.apply(p, x, mask=causal) ** 2)))(params)
  g2 = jax.jit(jax.grad(lambda p: jnp.sum(ours.apply(p, x, mask=causal) ** 2)))(params)
  # The key bias gradient is exactly 0 in exact arithmetic (it shifts a whole score row):
  # both sides hold rounding noise there, hence the absolute tolerance.
  chex.assert_trees_all_close(g1, g2, rtol=1e-4, atol=2e-5)


def test_nnx_attention_fn_equals_default():
  x = _mha_inputs()
  kw = dict(num_heads=2, in_features=64, decode=False)
  plain = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  ours = nnx.MultiHeadAttention(**kw, attention_fn=mnnx.flash_attention_fn, rngs=nnx.Rngs(1))
  nnx.update(ours, nnx.state(plain, nnx.Param))  # same parameters
  for causal in (False, True):
    np.testing.assert_allclose(ours(x, is_causal=causal), plain(x, is_causal=causal),
                               rtol=1e-5, atol=1e-6)


def test_attention_fn_refuses_what_it_cannot_do():
  x = _mha_inputs()
  q = x.reshape(2, 12, 2, 32)
  with pytest.raises(NotImplementedError, match="does not implement attention dropout"):
    mlinen.flash_attention_fn(q, q, q, dropout_rate=0.1, deterministic=False)
  with pytest.raises(NotImplementedError, match="additive attention bias"):
    mlinen.flash_attention_fn(q, q, q, bias=jnp.zeros((2, 2, 12, 12)))
  # What a partial binds is honoured: a window of 2 equals the reference with that window.
  fn = functools.partial(mlinen.flash_attention_fn, causal=True, sliding_window=2)
  from memeff_jax.ops.flash_attention import flash_attention  # pylint: disable=import-outside-toplevel
  np.testing.assert_allclose(fn(q, q, q), flash_attention(q, q, q, causal=True, sliding_window=2,
                                                          implementation="reference"),
                             rtol=1e-5, atol=1e-6)
  # flax's `deterministic` is dropout's; the kernel's own reaches flash_attention by its name.
  with pytest.raises(TypeError, match="deterministic must be a Python bool"):
    mlinen.flash_attention_fn(q, q, q, deterministic=True, deterministic_backward="no")


def test_attention_fn_takes_any_mask():
  """A dense mask, concrete or traced, as jax.nn.dot_product_attention takes it: the general
  mask path; the usual causal code under jit (nnx.make_causal_mask) among them."""
  x = _mha_inputs()
  q = x.reshape(2, 12, 2, 32)
  odd = jax.random.bernoulli(jax.random.key(7), 0.6, (2, 1, 12, 12)) | jnp.eye(12, dtype=bool)
  want = jax.nn.dot_product_attention(q, q, q, mask=odd)
  np.testing.assert_allclose(mlinen.flash_attention_fn(q, q, q, mask=odd), want,
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(jax.jit(lambda m: mlinen.flash_attention_fn(q, q, q, mask=m))(odd),
                             want, rtol=1e-5, atol=1e-6)
  kw = dict(num_heads=2, in_features=64, decode=False)
  plain = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  ours = nnx.MultiHeadAttention(**kw, attention_fn=mnnx.flash_attention_fn, rngs=nnx.Rngs(1))
  nnx.update(ours, nnx.state(plain, nnx.Param))
  causal = nnx.make_causal_mask(jnp.ones((2, 12)))
  step = nnx.jit(lambda m, x, mask: m(x, mask=mask))
  np.testing.assert_allclose(step(ours, x, causal), step(plain, x, causal), rtol=1e-5, atol=1e-6)
  grads = [nnx.grad(lambda m: jnp.sum(step(m, x, causal) ** 2))(m) for m in (ours, plain)]
  chex.assert_trees_all_close(nnx.state(grads[0]), nnx.state(grads[1]), rtol=1e-4, atol=1e-5)
  module = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=mlinen.flash_attention_fn)
  params = module.init(jax.random.key(0), x)
  mask = nn.make_causal_mask(jnp.ones((2, 12)))
  got = jax.jit(lambda p, x, m: module.apply(p, x, mask=m))(params, x, mask)
  default = nn.MultiHeadDotProductAttention(num_heads=2).apply(params, x, mask=mask)
  np.testing.assert_allclose(got, default, rtol=1e-5, atol=1e-6)
