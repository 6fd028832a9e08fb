"""No [T, S] buffer in chunked_xla (compiled memory analysis), and clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memeff_jax.ops.flash_attention import PallasTriton
from memeff_jax.ops.flash_attention import flash_attention
from memeff_jax.ops.flash_attention import pallas_triton


def _temp_bytes(fn, *args):
  analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
  if analysis is None:
    pytest.skip("this backend gives no memory analysis")
  return analysis.temp_size_in_bytes


def test_chunked_xla_forward_backward_holds_no_t_by_s_buffer():
  b, t, h, d = 1, 4096, 4, 64
  q = jax.ShapeDtypeStruct((b, t, h, d), jnp.float32)
  one_score_matrix = t * t * 4  # a single head's [T, S] in float32: 64 MiB

  def step(impl):
    def f(q, k, v):
      return jnp.sum(flash_attention(q, k, v, causal=True, implementation=impl))
    return jax.grad(f, argnums=(0, 1, 2))

  ours = _temp_bytes(step("chunked_xla"), q, q, q)
  assert ours < one_score_matrix, f"{ours / 2**20:.1f} MiB of temporaries"
  # The measurement can fail: the reference holds all heads' scores.
  assert _temp_bytes(step("reference"), q, q, q) >= h * one_score_matrix


Q = jnp.ones((2, 16, 4, 32))
K = jnp.ones((2, 24, 2, 32))


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((jnp.ones((16, 4, 32)), K, K), {}, ValueError, r"q must be \[B, T, heads, D\]"),
    ((Q, jnp.ones((2, 24, 3, 32)), jnp.ones((2, 24, 3, 32))), {}, ValueError,
     r"Hq=4 must be a multiple of key/value heads Hkv=3"),
    ((Q, K, jnp.ones((2, 24, 2, 16))), {}, ValueError, r"k.shape=.* and v.shape=.* must be equal"),
    ((Q, jnp.ones((2, 24, 2, 16)), jnp.ones((2, 24, 2, 16))), {}, ValueError,
     r"k.shape=\(2, 24, 2, 16\) must be \[B=2, S, Hkv, D=32\]"),
    ((Q.astype(jnp.int32), K, K), {}, TypeError, r"q must be float32, bfloat16 or float16"),
    ((Q, K.astype(jnp.bfloat16), K), {}, TypeError, r"q, k, v must share a dtype"),
    ((Q, K, K), dict(q_segment_ids=jnp.zeros((2, 15), jnp.int32)), ValueError,
     r"q_segment_ids.shape=\(2, 15\) must be \(B, T\)=\(2, 16\)"),
    ((Q, K, K), dict(q_segment_ids=jnp.zeros((2, 16), jnp.int32)), ValueError,
     r"kv_segment_ids defaults to q_segment_ids, which needs T == S"),
    ((Q, K, K), dict(q_segment_ids=jnp.zeros((2, 16)), kv_segment_ids=jnp.zeros((2, 24))),
     TypeError, r"q_segment_ids must be integers"),
    ((Q, K, K), dict(kv_segment_ids=jnp.zeros((2, 24), jnp.int32)), ValueError,
     r"kv_segment_ids needs q_segment_ids"),
    ((Q, K, K), dict(sliding_window=(-1, 2)), ValueError, r"sliding_window must be ≥ 0"),
    ((Q, K, K), dict(sliding_window=True), TypeError, r"sliding_window must be a Python int"),
    ((Q, K, K), dict(sliding_window=2.5), TypeError, r"sliding_window must be a Python int"),
    ((Q, K, K), dict(sliding_window=(1, 2, 3)), ValueError, r"sliding_window must be an int or"),
    ((Q, K, K), dict(causal="no"), TypeError, r"causal must be a Python bool, got 'no'"),
    ((Q, K, K), dict(deterministic=1), TypeError, r"deterministic must be a Python bool"),
    ((Q, K, K), dict(return_lse="yes"), TypeError, r"return_lse must be a Python bool"),
    ((Q, K, K), dict(logit_softcap=-1.0), ValueError, r"logit_softcap must be None or > 0"),
    ((Q, K, K), dict(logit_softcap=float("nan")), ValueError, r"logit_softcap must be None or"),
    ((Q, K, K), dict(scale=float("inf")), ValueError, r"scale must be finite"),
    ((Q, K, K), dict(scale="1"), TypeError, r"scale must be a Python real"),
    ((Q, K, K), dict(implementation="cudnn"), ValueError, r"unknown implementation='cudnn'"),
    ((Q, K, K), dict(implementation=123), TypeError, r"implementation must be None, a name"),
    ((Q, jnp.ones((2, 24, 0, 32)), jnp.ones((2, 24, 0, 32))), {}, ValueError,
     r"Hq=4 must be a multiple of key/value heads Hkv=0"),
    ((Q, K, K), dict(query_seq_lengths=jnp.array([3.0, 4.0])), TypeError,
     r"query_seq_lengths must be integers, got query_seq_lengths.dtype=float32"),
    ((Q, K, K), dict(key_value_seq_lengths=jnp.array([3, 4, 5])), ValueError,
     r"key_value_seq_lengths.shape=\(3,\) must be \(B,\)=\(2,\)"),
    ((Q, K, K), dict(query_seq_lengths=jnp.array([3, 4]),
                     q_segment_ids=jnp.zeros((2, 16), jnp.int32)), ValueError,
     r"kv_segment_ids defaults to q_segment_ids, which needs T == S"),
    ((Q, K, K), dict(key_value_seq_lengths=jnp.array([3, 4]), context_axis="x"), ValueError,
     r"count positions of the whole sequence in order, which a shard under context_axis"),
    ((Q, K, K), dict(query_seq_lengths=jnp.array([3, 4]), context_order="zigzag"), ValueError,
     r"context_order='zigzag' reorders: pass segment ids"),
])
def test_bad_input(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    flash_attention(*args, **kwargs)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU message")
def test_explicit_kernel_on_cpu_says_why():
  with pytest.raises(NotImplementedError, match=r"pallas_triton needs an NVIDIA GPU"):
    flash_attention(Q, K, K, implementation="pallas_triton")


def test_traced_option_is_refused_by_name():
  with pytest.raises(TypeError, match=r"logit_softcap must be a Python real, not a traced"):
    jax.jit(lambda cap: flash_attention(Q, K, K, logit_softcap=cap))(30.0)


def test_infinite_softcap_is_no_cap():
  q, k = jax.random.normal(jax.random.key(0), (2, 2, 16, 4, 32))
  np.testing.assert_array_equal(flash_attention(q, k, k, logit_softcap=float("inf")),
                                flash_attention(q, k, k))


def _problem(key, b, t, s, hq, hkv, d):
  kq, kk, kv = jax.random.split(key, 3)
  return (jax.random.normal(kq, (b, t, hq, d)), jax.random.normal(kk, (b, s, hkv, d)),
          jax.random.normal(kv, (b, s, hkv, d)))


def _value_and_grads(impl, q, k, v, jit=True, **kw):
  def f(q, k, v):
    out, lse = flash_attention(q, k, v, return_lse=True, implementation=impl, **kw)
    return jnp.sum(out * jnp.cos(out)), (out, lse)
  step = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)
  (_, (out, lse)), grads = (jax.jit(step) if jit else step)(q, k, v)
  return out, lse, grads


@pytest.mark.parametrize("d, causal", [(1, False), (8, True), (16, False), (300, True)])
def test_any_head_dim(d, causal):
  """Every D ≥ 1 works, as in jax.nn.dot_product_attention: the default falls through to an
  implementation that serves it."""
  q, k, v = _problem(jax.random.key(d), 2, 33, 40, 4, 2, d)
  got = _value_and_grads(None, q, k, v, causal=causal)
  want = _value_and_grads("reference", q, k, v, causal=causal)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(got[0], jax.nn.dot_product_attention(q, k, v, is_causal=causal),
                             rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("shape", [(0, 8, 8, 4, 2, 16), (2, 0, 8, 4, 2, 16), (2, 8, 0, 4, 2, 16),
                                   (2, 8, 8, 0, 0, 16), (2, 8, 8, 4, 2, 0)])
def test_zero_size_inputs(shape):
  """Empty batch, queries, keys, heads or head dim: the reference's answer (a query that
  sees no key: output 0, lse -inf; D = 0: lse over the visible keys), zero gradients."""
  q, k, v = _problem(jax.random.key(1), *shape)
  for causal in (False, True):
    got = _value_and_grads(None, q, k, v, causal=causal)
    assert got[0].shape == q.shape and got[1].shape == q.shape[:3]
    if shape[2] == 0:
      assert np.all(np.isneginf(got[1])) and not np.any(got[0])
    if shape[-1] == 0 and shape[1]:
      np.testing.assert_allclose(got[1][0, :, 0], np.log(np.arange(1, 9)) if causal
                                 else np.full(8, np.log(8.0)), rtol=1e-6)
    for g, x in zip(got[2], (q, k, v)):
      assert g.shape == x.shape and not np.any(g)


def test_int64_segment_ids_stay_distinct():
  """Ids 0 and 2**32 are two documents, not one (narrowed to int32 they would alias)."""
  q, k, v = _problem(jax.random.key(2), 1, 16, 16, 2, 2, 8)
  with jax.enable_x64(True):
    ids = jnp.where(jnp.arange(16) < 8, 0, 2**32)[None].astype(jnp.int64)
    small = jnp.where(jnp.arange(16) < 8, 0, 1)[None].astype(jnp.int32)
    np.testing.assert_array_equal(flash_attention(q, k, v, q_segment_ids=ids),
                                  flash_attention(q, k, v, q_segment_ids=small))


def test_second_order_gradients_say_so():
  q, k, v = _problem(jax.random.key(3), 1, 16, 16, 2, 2, 8)
  grad = lambda impl: jax.grad(lambda q: jnp.sum(flash_attention(q, k, v, implementation=impl)))
  with pytest.raises(NotImplementedError, match=r"higher-order gradients are not supported by "
                     r"chunked_xla; use implementation='reference'"):
    jax.grad(lambda q: jnp.sum(grad("chunked_xla")(q)))(q)
  jax.grad(lambda q: jnp.sum(grad("reference")(q)))(q)  # the reference serves them


def test_jax_errors_while_tracing_are_not_a_reason_to_fall_through():
  """Only Unsupported moves the dispatcher on; a NotImplementedError from JAX propagates."""
  from memeff_jax.ops import _dispatch  # pylint: disable=import-outside-toplevel

  def broken(*args, **kwargs):
    raise NotImplementedError("raised by JAX while tracing")

  with pytest.raises(NotImplementedError, match="raised by JAX while tracing"):
    _dispatch.first_that_serves([broken, "never tried"], lambda impl: impl())
  with pytest.raises(_dispatch.Unsupported, match="a: no\n  b: no"):
    _dispatch.first_that_serves(["a", "b"], lambda impl: (_ for _ in ()).throw(
        _dispatch.Unsupported("no")))


def test_interpret_mode_kernels_run_under_x64():
  q, k, v = _problem(jax.random.key(4), 1, 32, 32, 2, 1, 16)
  with jax.enable_x64(True):  # under jit too: the interpreter runs at lowering, with x64 on
    got = _value_and_grads(PallasTriton(interpret=True), q, k, v, jit=True, causal=True)
  want = _value_and_grads("reference", q, k, v, causal=True)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_without_pallas_triton_calls_fall_through(monkeypatch):
  """A JAX without Pallas Triton (deprecated there): pallas_triton is Unsupported, naming
  the missing module, and a call that names it first runs on the next implementation."""
  monkeypatch.setattr(pallas_triton, "plgpu", None)
  q, k, v = _problem(jax.random.key(5), 1, 32, 32, 2, 1, 16)
  with pytest.raises(NotImplementedError, match=r"pallas\.triton is not importable"):
    flash_attention(q, k, v, implementation=PallasTriton(interpret=True))
  got = _value_and_grads((PallasTriton(interpret=True), "chunked_xla"), q, k, v, causal=True)
  want = _value_and_grads("chunked_xla", q, k, v, causal=True)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(g, w)
