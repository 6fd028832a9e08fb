"""memeff_jax.memory.analyze: totals and the largest buffers of a compiled program."""

import jax
import jax.numpy as jnp
import optax
import pytest

import memeff_jax
from memeff_jax.memory import analyze

S = jax.ShapeDtypeStruct
N, D, V = 4096, 64, 32000
LOGITS = N * V * 4


def _lm_head_shapes():
  return S((N, D), jnp.float32), S((D, V), jnp.float32), S((N,), jnp.int32)


def test_finds_the_logits_of_a_naive_lm_head_loss():
  step = jax.value_and_grad(
      lambda x, w, y: optax.softmax_cross_entropy_with_integer_labels(x @ w, y).mean(),
      argnums=(0, 1))
  report = analyze(step, *_lm_head_shapes())
  top = report.largest(1)[0]
  assert top.shape == (N, V) and top.nbytes == LOGITS
  assert report.temp_bytes >= LOGITS and report.peak_bytes >= report.temp_bytes
  with pytest.raises(AssertionError, match="larger than"):
    report.assert_no_buffer_larger_than(LOGITS // 2)
  text = str(report)
  assert "temporaries" in text and "f32[4096, 32000]" in text


def test_reports_no_logits_buffer_for_linear_cross_entropy():
  step = jax.value_and_grad(
      lambda x, w, y: memeff_jax.linear_cross_entropy(x, w, y, chunk_size=256),
      argnums=(0, 1))
  report = analyze(step, *_lm_head_shapes())
  report.assert_no_buffer_larger_than(LOGITS // 8)
  report.assert_peak_below(LOGITS // 4)


def test_gradient_of_batched_matmul_builds_no_broadcast_buffer():
  """d/dW of [b, m, n] @ [n, k] must contract b and m at once, never holding [b, n, k]."""
  b, m, n, k = 64, 32, 256, 512

  def loss(a, w):
    return jnp.sum(jnp.tanh(a @ w))

  report = analyze(jax.grad(loss, argnums=1), S((b, m, n), jnp.float32), S((n, k), jnp.float32))
  broadcast = b * n * k * 4
  report.assert_no_buffer_larger_than(broadcast // 2)
  assert not any(buf.shape == (b, n, k) for buf in report.buffers)


def test_works_on_jitted_functions_and_concrete_arrays():
  f = jax.jit(lambda x: jnp.sin(x) @ x.T)
  report = analyze(f, jnp.ones((128, 32)))
  assert report.largest(1)[0].shape == (128, 128)
  assert report.argument_bytes == 128 * 32 * 4
