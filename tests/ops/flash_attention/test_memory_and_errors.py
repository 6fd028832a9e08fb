"""No [T, S] buffer in chunked_xla (compiled memory analysis), and clear errors."""

import jax
import jax.numpy as jnp
import pytest

from memeff_jax.ops.flash_attention import flash_attention


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
    ((jnp.ones((2, 16, 4, 512)),) * 3, {}, ValueError, r"head dim D=512 is not supported"),
    ((jnp.ones((2, 16, 4, 16)),) * 3, {}, ValueError, r"head dim D=16 is not supported"),
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
    ((Q, K, K), dict(sliding_window=(-1, 2)), ValueError, r"sliding_window must be an int ≥ 0"),
    ((Q, K, K), dict(logit_softcap=-1.0), ValueError, r"logit_softcap must be None or > 0"),
    ((Q, K, K), dict(implementation="cudnn"), ValueError, r"unknown implementation='cudnn'"),
])
def test_bad_input(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    flash_attention(*args, **kwargs)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU message")
def test_explicit_kernel_on_cpu_says_why():
  with pytest.raises(NotImplementedError, match=r"pallas_triton needs an NVIDIA GPU"):
    flash_attention(Q, K, K, implementation="pallas_triton")
