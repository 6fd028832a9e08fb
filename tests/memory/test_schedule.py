"""memeff_jax.memory.after / sequential: ten independent branches at one branch's memory."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memeff_jax.memory import after
from memeff_jax.memory import analyze
from memeff_jax.memory import sequential

S = jax.ShapeDtypeStruct
K, M, D, H = 10, 512, 256, 1024  # each branch's hidden activations: 2 MiB


def branch(x, w1, w2):
  return jnp.maximum(jnp.maximum(x, 0) @ w1, 0) @ w2


def written_in_sequence(xs, w1s, w2s):
  return [branch(x, a, b) for x, a, b in zip(xs, w1s, w2s)]


def written_stage_by_stage(xs, w1s, w2s):
  h = [jnp.maximum(x, 0) for x in xs]
  h = [a @ w for a, w in zip(h, w1s)]
  h = [jnp.maximum(a, 0) for a in h]
  return [a @ w for a, w in zip(h, w2s)]


def forced(xs, w1s, w2s):
  return sequential(branch, list(zip(xs, w1s, w2s)))


def _shapes(k=K):
  return ([S((M, D), jnp.float32)] * k, [S((D, H), jnp.float32)] * k,
          [S((H, D), jnp.float32)] * k)


def _inputs(k=3, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3 * k)
  xs = [jax.random.normal(keys[i], (16, 8)) for i in range(k)]
  w1s = [jax.random.normal(keys[k + i], (8, 12)) for i in range(k)]
  w2s = [jax.random.normal(keys[2 * k + i], (12, 8)) for i in range(k)]
  return xs, w1s, w2s


def test_forced_order_holds_one_branch_at_a_time():
  minimum = analyze(written_in_sequence, *_shapes(1)).temp_bytes  # one branch alone
  forced_bytes = analyze(forced, *_shapes()).temp_bytes
  assert forced_bytes <= 1.1 * minimum, (forced_bytes, minimum)
  # Without it, XLA's order may hold every branch at once (the CPU scheduler does); the
  # forced order is never worse than either way of writing the branches.
  for written in (written_in_sequence, written_stage_by_stage):
    assert forced_bytes <= analyze(written, *_shapes()).temp_bytes


def test_values_and_gradients_unchanged():
  args = _inputs()
  chex.assert_trees_all_close(forced(*args), written_in_sequence(*args), atol=0, rtol=0)
  total = lambda f: lambda *a: sum(jnp.sum(jnp.sin(o)) for o in f(*a))
  want = jax.grad(total(written_in_sequence), argnums=(0, 1, 2))(*args)
  got = jax.grad(total(forced), argnums=(0, 1, 2))(*args)
  chex.assert_trees_all_close(got, want, atol=0, rtol=0)


def test_after_keeps_special_values_and_pytrees():
  x = {"a": jnp.array([np.nan, -0.0, np.inf, 1.5]), "b": jnp.ones((2,), jnp.bfloat16)}
  for dep in (jnp.array([np.nan]), jnp.array([np.inf, 2.0]), jnp.arange(3)):
    out = after(x, dep)
    np.testing.assert_array_equal(out["a"], x["a"])
    assert np.signbit(out["a"][1]) and out["b"].dtype == jnp.bfloat16
  # integer deps get float0 cotangents
  g = jax.grad(lambda v, i: after(v, i).sum(), allow_int=True, argnums=(0, 1))(
      jnp.ones(3), jnp.arange(2))
  np.testing.assert_array_equal(g[0], np.ones(3))


def test_after_rejects_integer_values():
  with pytest.raises(TypeError, match="floating-point"):
    after(jnp.arange(3), jnp.ones(2))
