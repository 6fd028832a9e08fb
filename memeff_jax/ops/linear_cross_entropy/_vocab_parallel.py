"""Linear cross-entropy with the vocabulary sharded over a mesh axis (Megatron's vocab-parallel
loss), run per shard inside `jax.shard_map`.

Each shard holds W's columns [o, o + V_s) (and the bias's) and every token. It runs the fused
loss on its slice, which gives each token's log-sum-exp over the slice, lse_s, as a
differentiable output; the shards' slices then merge through [N]-sized collectives only:

  lse   = m + log Σ_s exp(lse_s − m)          m = max_s lse_s (pmax; a constant for autodiff)
  z_y   = Σ_s [y ∈ slice s] ẑ(x · W[:, y] + b_y)   (psum; ẑ the softcap)
  Σ_v ẑ = Σ_s V_s · (lse_s − loss_s)         label smoothing's term: the slice's loss with
                                             ε = 1 is lse_s − mean_v ẑ
  loss  = lse − (1 − ε) z_y − (ε / V) Σ_v ẑ + λ lse²   (_common.finish, as on one device)

Autodiff through these gives each slice exactly its part of the single-device gradient:
∂lse/∂lse_s = exp(lse_s − lse), so the slice's logits get exp(ẑ − lse), the global softmax;
dW and the bias stay local, and dx (a sum over the slices) is summed over the axis by
shard_map's transpose of the replicated x. Nothing of size [N, V] or [D, V] crosses devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from memeff_jax.ops.linear_cross_entropy._common import Stats


def shared_sum(x, axis):
  """psum for a per-shard context without shard_map's bookkeeping (custom_partitioning's): the
  sum is used alike by every shard downstream, so its cotangent is the same on each and
  passes through unchanged (JAX's psum transposes to another psum there)."""
  @jax.custom_vjp
  def total(x):
    return jax.lax.psum(x, axis)

  total.defvjp(lambda x: (jax.lax.psum(x, axis), None), lambda _, ct: (ct,))
  return total(x)


def stats(x, weight, bias, labels, valid, *, axis, weight_layout: str, smoothing: bool,
          logit_softcap, loss_fn, psum=jax.lax.psum) -> Stats:
  """Every token's Stats over the whole vocabulary, for `weight`/`bias` this shard's slice of
  it along `axis` (_common.finish makes the loss of them). labels: [N] int32 global class
  ids; valid: [N] bool. loss_fn(x, weight, labels, bias, label_smoothing) -> (per-token loss,
  lse): the single-device fused loss (no z-loss, reduction "none") on the slice."""
  v_local = weight.shape[1] if weight_layout == "dv" else weight.shape[0]
  offset = jax.lax.axis_index(axis) * v_local
  # The slice's lse (and with smoothing, its mean logit): every token, any label in range.
  slice_loss, lse_s = loss_fn(x, weight, jnp.zeros_like(labels), bias, 1.0 if smoothing else 0.0)
  m = jax.lax.pmax(jax.lax.stop_gradient(lse_s), axis)
  lse = m + jnp.log(psum(jnp.exp(lse_s - m), axis))

  # The label's logit, from the shard that holds its column.
  local = labels - offset
  mine = valid & (local >= 0) & (local < v_local)
  idx = jnp.clip(local, 0, v_local - 1)
  cols = jnp.take(weight, idx, axis=1).T if weight_layout == "dv" else jnp.take(weight, idx, 0)
  z = jnp.sum(x.astype(jnp.float32) * cols.astype(jnp.float32), axis=-1)
  if bias is not None:
    z = z + jnp.take(bias, idx).astype(jnp.float32)
  if logit_softcap is not None:
    z = logit_softcap * jnp.tanh(z / logit_softcap)
  label_logit = psum(jnp.where(mine, z, 0.0), axis)

  logit_sum = jnp.zeros_like(lse)
  if smoothing:  # the slice's loss with ε = 1 is lse_s − Σ_v ẑ / V_s
    logit_sum = psum(v_local * (lse_s - slice_loss), axis)
  return Stats(lse, label_logit, logit_sum)
