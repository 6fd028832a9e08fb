"""A Llama-style decoder in Flax NNX: RMSNorm, RoPE, SwiGLU, GQA, optional tied embeddings,
segment-id packing, the layers stacked and run with nnx.scan under a remat policy.

`Llama(cfg, kernels="memeff")` uses memeff_jax.flash_attention and FusedLMHead.
`kernels="plain"` is what an informed JAX user writes without this library: nnx.Linear + optax
for the loss, and jax.nn.dot_product_attention with `is_causal=True`, on cuDNN on an NVIDIA
GPU (XLA elsewhere); packed documents add their segment mask as a boolean `mask`, the best
cuDNN takes. `kernels="plain_xla"` is the same with XLA's attention everywhere. All have
identical parameter trees, so a checkpoint of one loads into the others.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import tomllib

from flax import nnx
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import optax

from memeff_jax import remat
from memeff_jax.flax.nnx import FusedLMHead
from memeff_jax.models import sharding
from memeff_jax.ops.flash_attention import flash_attention
from memeff_jax.ops.flash_attention._context import DEFAULT
from memeff_jax.ops.flash_attention._context import ORDERS
from memeff_jax.ops.flash_attention._context import STRATEGIES

KERNELS = ("memeff", "plain", "plain_xla")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Model size and numerics. `remat_policy` names a memeff_jax.remat.POLICIES entry, a
  `jax.checkpoint_policies` entry, or "none" for no rematerialization."""

  vocab_size: int = 256
  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  d_ff: int = 352
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat_policy: str = "nothing"

  def __post_init__(self):
    if self.d_model % self.n_heads:
      raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads="
                       f"{self.n_kv_heads}")
    try:
      remat.resolve(self.remat_policy)
    except ValueError as err:
      raise ValueError(f"remat_policy={self.remat_policy!r}: {err}") from None

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @classmethod
  def from_toml(cls, path) -> tuple["LlamaConfig", dict]:
    """(model config, the file's [train] table) from a configs/models/*.toml file."""
    with pathlib.Path(path).open("rb") as f:
      data = tomllib.load(f)
    return cls(**data.get("model", {})), data.get("train", {})


def rope(x, positions, theta: float):
  """Rotary position embedding (Su et al. 2021) on x [B, T, H, D] at positions [B, T]."""
  d = x.shape[-1]
  freq = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)  # [D/2]
  angle = positions[..., None].astype(jnp.float32) * freq  # [B, T, D/2]
  cos, sin = jnp.cos(angle)[:, :, None], jnp.sin(angle)[:, :, None]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def _tensor_sharded(sequence_parallel: bool):
  """x -> x with its dimension 2 (heads, or the MLP's hidden units) over tensor, where the
  model runs sequence parallel (sharding.tensor_sharded); the identity elsewhere."""
  if not sequence_parallel:
    return lambda x: x
  return functools.partial(sharding.tensor_sharded, dim=2)


class Attention(nnx.Module):

  def __init__(self, cfg: LlamaConfig, kernels: str, context: tuple,
               sequence_parallel: bool = False, *, rngs: nnx.Rngs):
    self.cfg, self.kernels, self.context = cfg, kernels, context
    self.sequence_parallel = sequence_parallel
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=cfg.dtype,
                                  param_dtype=cfg.param_dtype, rngs=rngs)
    hd = cfg.head_dim
    self.q_proj = lin(cfg.d_model, cfg.n_heads * hd)
    self.k_proj = lin(cfg.d_model, cfg.n_kv_heads * hd)
    self.v_proj = lin(cfg.d_model, cfg.n_kv_heads * hd)
    self.o_proj = lin(cfg.n_heads * hd, cfg.d_model)

  def __call__(self, x, positions, segment_ids):
    cfg, (b, t, _) = self.cfg, x.shape
    heads = _tensor_sharded(self.sequence_parallel)
    q = heads(self.q_proj(x).reshape(b, t, cfg.n_heads, cfg.head_dim))
    k = heads(self.k_proj(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim))
    v = checkpoint_name(heads(self.v_proj(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)),
                        "value_proj")
    q = checkpoint_name(rope(q, positions, cfg.rope_theta), "query_proj")
    k = checkpoint_name(rope(k, positions, cfg.rope_theta), "key_proj")
    if self.kernels == "memeff":  # per sequence shard where the mesh has a context axis
      order, strategy = self.context
      out = sharding.context_attention(
          lambda q, k, v, ids, axis: flash_attention(
              q, k, v, causal=True, q_segment_ids=ids, context_axis=axis,
              **({} if axis is None else dict(context_order=order, context_strategy=strategy))),
          q, k, v, segment_ids)
    else:
      mask = None
      if segment_ids is not None:  # [B, 1, T, T]: the same document
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
      cudnn = self.kernels == "plain" and jax.default_backend() == "gpu"
      out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                         implementation="cudnn" if cudnn else "xla")
    out = checkpoint_name(out, "attention_out")
    return self.o_proj(out.reshape(b, t, cfg.n_heads * cfg.head_dim))


class MLP(nnx.Module):
  """SwiGLU (Shazeer 2020)."""

  def __init__(self, cfg: LlamaConfig, sequence_parallel: bool = False, *, rngs: nnx.Rngs):
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=cfg.dtype,
                                  param_dtype=cfg.param_dtype, rngs=rngs)
    self.sequence_parallel = sequence_parallel
    self.gate = lin(cfg.d_model, cfg.d_ff)
    self.up = lin(cfg.d_model, cfg.d_ff)
    self.down = lin(cfg.d_ff, cfg.d_model)

  def __call__(self, x):
    units = _tensor_sharded(self.sequence_parallel)
    gate = checkpoint_name(units(self.gate(x)), "mlp_gate")
    return self.down(jax.nn.silu(gate) * checkpoint_name(units(self.up(x)), "mlp_up"))


class Block(nnx.Module):

  def __init__(self, cfg: LlamaConfig, kernels: str, context: tuple,
               sequence_parallel: bool = False, *, rngs: nnx.Rngs):
    self.sequence_parallel = sequence_parallel
    norm = lambda: nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=cfg.dtype,
                               param_dtype=cfg.param_dtype, rngs=rngs)
    self.attn_norm = norm()
    self.attn = Attention(cfg, kernels, context, sequence_parallel, rngs=rngs)
    self.mlp_norm, self.mlp = norm(), MLP(cfg, sequence_parallel, rngs=rngs)

  def __call__(self, x, positions, segment_ids):
    x = x + self._branch(self.attn_norm(x), lambda h: self.attn(h, positions, segment_ids))
    return x + self._branch(self.mlp_norm(x), self.mlp)

  def _branch(self, h, fn):
    """fn(h). With sequence parallelism h comes sharded on the sequence over the tensor axis
    (as the residual stream is): it is gathered whole for fn, and fn's output, partial sums
    over the tensor shards of its last matmul, reduce-scattered back to that layout."""
    if not self.sequence_parallel:
      return fn(h)
    return sharding.scatter_sequence(fn(sharding.gather_sequence(h)))


class Llama(nnx.Module):
  """tokens [B, T] -> loss, through `loss()`; `logits()` for inference.

  On a mesh with a "context" axis (models.sharding) the memeff attention runs context
  parallel: `context_strategy` "all_gather" or "ring", `context_order` "contiguous" or
  "zigzag" (flash_attention's options of those names). With "zigzag" the batch's sequences
  must come in that order with their positions (sharding.context_batch puts them so).

  `sequence_parallel` (Megatron's, Korthikanti et al. 2022), on a mesh with a "tensor" axis
  and no "context" one: the residual stream is sharded on the sequence over tensor, so each
  tensor rank keeps, normalizes and adds 1/tensor of it; every block gathers its branches'
  inputs and reduce-scatters their outputs where it would all-reduce them. Less memory, but
  slower steps on GPUs (docs/design/multi_device.md).
  """

  def __init__(self, cfg: LlamaConfig, *, kernels: str = "memeff",
               context_order: str = "contiguous", context_strategy: str = "all_gather",
               sequence_parallel: bool = False, rngs: nnx.Rngs):
    if kernels not in KERNELS:
      raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    for name, value, allowed in (("context_order", context_order, ORDERS),
                                 ("context_strategy", context_strategy, STRATEGIES)):
      if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if kernels != "memeff" and (context_order, context_strategy) != DEFAULT:
      raise ValueError(f"context_order and context_strategy are for kernels='memeff', got "
                       f"kernels={kernels!r}")
    self.cfg, self.kernels, self.sequence_parallel = cfg, kernels, sequence_parallel
    context = (context_order, context_strategy)
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype,
                           param_dtype=cfg.param_dtype, rngs=rngs)

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
      return Block(cfg, kernels, context, sequence_parallel, rngs=rngs)

    self.blocks = make_blocks(rngs)
    self.final_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=cfg.dtype,
                                  param_dtype=cfg.param_dtype, rngs=rngs)
    tied = self.embed if cfg.tie_embeddings else None
    if kernels == "memeff":
      self.lm_head = FusedLMHead(cfg.d_model, cfg.vocab_size, dtype=cfg.dtype,
                                 param_dtype=cfg.param_dtype, tied_embedding=tied, rngs=rngs)
    elif tied is None:
      self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=cfg.dtype,
                                param_dtype=cfg.param_dtype, rngs=rngs)
    else:
      self.lm_head = None  # logits through embed.attend

  def hidden(self, tokens, segment_ids=None, positions=None):
    """Final-norm hidden states [B, T, D]."""
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    policy = remat.resolve(self.cfg.remat_policy)
    residual = functools.partial(sharding.activations, sequence_parallel=self.sequence_parallel)

    def layer(x, block):
      return residual(block(x, positions, segment_ids))

    if policy is not None:
      layer = nnx.remat(layer, policy=policy)
    # The table's rows looked up whole (D gathered, as FSDP gathers a layer's weights): from
    # rows sharded on D, XLA cannot reach the batch-sharded activations without replicating.
    table = sharding.gathered(self.embed.embedding[...].astype(self.cfg.dtype), 1)
    x = jnp.take(table, tokens, axis=0)
    if self.sequence_parallel:  # looked up whole, then split: not the table gathered
      x = sharding.whole_sequence(x)
    x = nnx.scan(layer, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(residual(x), self.blocks)
    return residual(self.final_norm(x))

  def logits(self, tokens, segment_ids=None):
    h = self.hidden(tokens, segment_ids)
    return self.lm_head.logits(h) if self.kernels == "memeff" else self._plain_logits(h)

  def _plain_logits(self, h):
    return self.embed.attend(h) if self.lm_head is None else self.lm_head(h)

  def loss(self, tokens, labels, segment_ids=None, positions=None):
    """Mean next-token cross-entropy over labels != -100 (positions: default 0..T-1)."""
    h = self.hidden(tokens, segment_ids, positions)
    if self.kernels == "memeff":
      flat = functools.partial(sharding.tokens, sequence_parallel=self.sequence_parallel)
      return self.lm_head(flat(h), flat(labels))
    logits = self._plain_logits(h)
    valid = labels != -100
    per = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), jnp.where(valid, labels, 0))
    return jnp.sum(jnp.where(valid, per, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
