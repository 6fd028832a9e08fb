"""remat.matmul_flops: matmul FLOPs on the jaxpr, loops and recomputation included."""

import jax
import jax.numpy as jnp
import pytest

from memeff_jax import flash_attention
from memeff_jax import remat
from memeff_jax.ops.flash_attention import PallasTriton

S = jax.ShapeDtypeStruct
B, M, D, L = 8, 32, 48, 5


def _layers(policy):
  def loss(x, w):
    def layer(h, w_i):
      return jnp.tanh(h @ w_i), None
    h, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), x, w)
    return h.sum()
  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def test_counts_every_scanned_layer_and_the_recomputation():
  one = 2 * M * D * D  # one layer's forward matmul
  args = (S((M, D), jnp.float32), S((L, D, D), jnp.float32))
  cp = jax.checkpoint_policies
  # forward, dx and dW per layer; keeping nothing recomputes the forward once more.
  assert remat.matmul_flops(_layers(cp.everything_saveable), *args) == 3 * L * one
  assert remat.matmul_flops(_layers(cp.nothing_saveable), *args) == 4 * L * one


def test_counts_pallas_kernels_by_their_cost_estimate():
  b, t, h, d = 1, 64, 2, 32
  q = S((b, t, h, d), jnp.float32)
  impl = PallasTriton(interpret=True)
  fwd = lambda q, k, v: flash_attention(q, k, v, implementation=impl)
  per_matmul = 2 * b * h * t * t * d
  assert remat.matmul_flops(fwd, q, q, q) == 2 * per_matmul
  grad = jax.grad(lambda q, k, v: fwd(q, k, v).sum(), argnums=(0, 1, 2))
  # Δ = rowsum(dO ∘ O) outside the kernels is a product and a sum, no matmul.
  assert remat.matmul_flops(grad, q, q, q) == (2 + 3 + 4) * per_matmul
  causal = lambda q, k, v: flash_attention(q, k, v, causal=True, implementation=impl)
  assert remat.matmul_flops(causal, q, q, q) == 2 * per_matmul * (t + 1) / (2 * t)


@pytest.mark.parametrize("unit", [1, 3])
def test_plain_matmuls(unit):
  assert remat.matmul_flops(lambda a, b: a @ b, S((unit, 8), jnp.float32),
                            S((8, 16), jnp.float32)) == 2 * unit * 8 * 16


def test_saved_attention_outputs_are_not_counted_as_recomputed():
  # The backward's remat body still holds the forward kernel when the policy saved its
  # outputs (JAX's DCE keeps a pallas_call); XLA drops it, and the count must too.
  b, t, h, d = 1, 64, 2, 32
  q = S((b, t, h, d), jnp.float32)
  w = S((d, d), jnp.float32)
  impl = PallasTriton(interpret=True)

  def grad(policy):
    def layer(q, w):
      return flash_attention(q @ w, q, q, causal=True, implementation=impl)
    return jax.value_and_grad(lambda q, w: jax.checkpoint(layer, policy=policy)(q, w).sum())

  fwd_kernel = remat.matmul_flops(
      lambda q, k, v: flash_attention(q, k, v, causal=True, implementation=impl), q, q, q)
  nothing = remat.matmul_flops(grad(remat.POLICIES["nothing"]), q, w)
  attention = remat.matmul_flops(grad(remat.POLICIES["attention"]), q, w)
  assert nothing - attention == fwd_kernel
