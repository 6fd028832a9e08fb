"""linear_cross_entropy(): argument checks and the choice of implementation."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from memeff_jax.kernels import hopper
from memeff_jax.ops import _auto
from memeff_jax.ops import _checks
from memeff_jax.ops import _dispatch
from memeff_jax.ops import _explicit
from memeff_jax.ops import _vma
from memeff_jax.ops.linear_cross_entropy import _common
from memeff_jax.ops.linear_cross_entropy import _partition
from memeff_jax.ops.linear_cross_entropy import _vocab_parallel
from memeff_jax.ops.linear_cross_entropy._common import LossOptions
from memeff_jax.ops.linear_cross_entropy.chunked_xla import ChunkedXla
from memeff_jax.ops.linear_cross_entropy.pallas_mosaic_gpu import PallasMosaicGpu
from memeff_jax.ops.linear_cross_entropy.reference import Reference

IMPLEMENTATIONS = {
    "reference": Reference(),
    "chunked_xla": ChunkedXla(),
    "pallas_mosaic_gpu": PallasMosaicGpu(),
}
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


class Aux(NamedTuple):
  """Auxiliary outputs of linear_cross_entropy(..., return_aux=True)."""

  lse: jax.Array  # float32, labels.shape: log-sum-exp of each token's (capped) logits
  z_loss: jax.Array  # the z-loss term λ·lse², weighted and reduced like the loss (in it)
  # float32, labels.shape: each token's entropy −Σ_v p log p of softmax(ẑ), with `entropy`
  entropy: jax.Array | None = None


class Int64Labels(NamedTuple):
  """64-bit class ids as int32 words, for JAX without x64 (which cannot hold int64 arrays).

  `words` is [..., 2], int32 or uint32: each id's (low, high) halves, little-endian. That is
  what a contiguous torch int64 tensor `t` gives as `t.view(torch.int32).view(*t.shape, 2)`,
  zero-copy, so torch's labels reach the loss without an int32 copy (the torch bridge passes
  them this way). Which tokens are `ignore_index` is decided on all 64 bits; an id outside
  the int32 range is outside [0, V) and gives NaN like any other out-of-range label.
  """

  words: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(jnp.shape(self.words)[:-1])


def _int64_words(labels: Int64Labels, ignore_index: int):
  """([N, 2] int32 words, [N] valid) of Int64Labels, after checking them."""
  words = jnp.asarray(labels.words)
  if words.ndim < 1 or words.shape[-1] != 2 or words.dtype not in (jnp.int32, jnp.uint32):
    raise TypeError(f"Int64Labels.words must be [..., 2] int32 or uint32 (the low and high "
                    f"words of each id), got shape {words.shape} and dtype {words.dtype}")
  if not -2**63 <= ignore_index < 2**63:
    raise ValueError(f"ignore_index={ignore_index} is outside the int64 range")
  words = jax.lax.bitcast_convert_type(words, jnp.int32).reshape(-1, 2)
  low = (ignore_index & 0xFFFFFFFF) - (2**32 if ignore_index & 0x80000000 else 0)
  ignored = (words[:, 0] == low) & (words[:, 1] == ignore_index >> 32)
  return words, ~ignored


def _int32_labels(labels: jax.Array, ignore_index: int):
  """([N] int32 class ids, [N] valid) of integer labels of any width. Which tokens are
  `ignore_index` is decided in the labels' own dtype, and a label outside the int32 range
  becomes INT32_MIN (outside [0, V): NaN for that token), never another class."""
  flat = labels.reshape(-1)
  info, i32 = jnp.iinfo(flat.dtype), jnp.iinfo(jnp.int32)
  if info.min <= ignore_index <= info.max:
    valid = flat != jnp.asarray(ignore_index, flat.dtype)
  else:  # no label can equal it
    valid = jnp.ones(flat.shape, jnp.bool_)
  if info.min < i32.min or info.max > i32.max:
    inside = (flat >= max(info.min, i32.min)) & (flat <= min(info.max, i32.max))
    return jnp.where(inside, flat.astype(jnp.int32), i32.min), valid
  return flat.astype(jnp.int32), valid


def _chunk_size(chunk_size):
  """chunk_size as a positive int or a (tokens, vocab entries) pair of them."""
  if chunk_size is None:
    return None
  pair = isinstance(chunk_size, (tuple, list))
  sizes = tuple(chunk_size) if pair else (chunk_size,)
  if not 1 <= len(sizes) <= 2:
    raise ValueError(f"chunk_size must be a positive int or a (tokens, vocab) pair, got "
                     f"{chunk_size!r}")
  sizes = tuple(_checks.static_int("chunk_size", size) for size in sizes)
  if min(sizes) <= 0:
    raise ValueError(f"chunk_size must be positive, got {chunk_size!r}")
  return sizes if pair else sizes[0]


def _per_shard(mesh, x, weight, labels, bias, where, token_weights, loss_args, *, token_loss,
               ignore_index, reduction, return_aux, weight_layout, **options):
  """linear_cross_entropy on an Explicit mesh. x's token dims may be sharded (data
  parallelism); W's vocabulary too (vocab parallelism: each shard runs the loss on its
  slice, see _vocab_parallel, the bias sharded with it), and W's D (FSDP: W gathered
  inside the call, dW reduce-scattered by the gather's transpose). Token axes that also
  shard the vocabulary (sequence parallelism) have the tokens gathered over them inside the
  call, so dx is reduce-scattered by the gather's transpose. Each shard computes its
  tokens' loss; a sum (and a mean's count of counted tokens) is summed over the token
  shards, so every reduction keeps its single-device meaning. Under FSDP a shard with more
  tokens than the implementation adds up in W's 16-bit dtype (_rounded_tokens) takes them
  in groups, each with its own gather of W, so each group's 16-bit dW is reduce-scattered
  by its gather's transpose and the shards are added up in float32 (as _partition's
  _token_groups does on Auto meshes): no device holds a whole float32 dW."""
  if weight_layout not in _common.WEIGHT_LAYOUTS:
    raise ValueError(f"weight_layout must be 'dv' ([D, V]) or 'vd' ([V, D]), got "
                     f"{weight_layout!r}")
  xd = _explicit.dims_of(x, x.ndim)
  token_dims = xd[:-1]
  axes = tuple(a for dim in token_dims for a in dim)
  wd = _explicit.dims_of(weight, 2) if weight.ndim == 2 else [()] * weight.ndim
  d_dim = 0 if weight_layout == "dv" else 1
  d_axes, v_axes = (wd[d_dim], wd[1 - d_dim]) if weight.ndim == 2 else ((), ())
  if xd[-1] or weight.ndim != 2:
    raise ValueError(
        "on an Explicit mesh linear_cross_entropy takes x sharded on its token dims, not D, "
        f"and a 2-D weight; got x: {_explicit.spec(xd)}, weight ({weight_layout!r}): "
        f"{_explicit.spec(wd)}")
  # Sequence parallel: per token dim, the vocabulary's axes that also shard it.
  shared = [tuple(a for a in dim if a in v_axes) for dim in token_dims]
  if bias is not None:
    if any(a not in v_axes for dim in _explicit.dims_of(bias, bias.ndim) for a in dim):
      raise ValueError(f"bias must be sharded like the weight's vocabulary ({v_axes or 'not'}),"
                       f" got {_explicit.spec(_explicit.dims_of(bias, bias.ndim))}")
    bias = jax.sharding.reshard(bias, _explicit.spec([v_axes]))
  tokens = _explicit.spec(token_dims)
  labels = jax.sharding.reshard(labels, tokens)
  where = None if where is None else jax.sharding.reshard(where, tokens)
  if token_weights is not None:
    token_weights = jax.sharding.reshard(_checked_weights(token_weights, labels.shape), tokens)
  # The token_loss's arguments as one [..., k] array, sharded like the labels.
  stacked = None
  if loss_args:
    stacked = jax.sharding.reshard(jnp.stack(loss_args, axis=-1),
                                   _explicit.spec([*token_dims, ()]))
  local_reduction = "none" if reduction == "none" else "sum"

  def gathered(t):  # the tokens of every shard of the shared axes
    for dim, names in enumerate(shared):
      if names and t is not None:
        t = jax.lax.all_gather(t, names, axis=dim, tiled=True)
    return t

  def own(t):  # this shard's tokens of a gathered per-token output
    for dim, names in enumerate(shared):
      if names:
        size = t.shape[dim] // _auto.size(mesh, names)
        t = jax.lax.dynamic_slice_in_dim(t, jax.lax.axis_index(names) * size, size, axis=dim)
    return t

  def unstacked(stacked):
    return {"token_loss": token_loss, "token_loss_args": () if stacked is None else
            tuple(stacked[..., i] for i in range(stacked.shape[-1]))}

  def grouped_loss(x, weight, labels, bias, where, weights, stacked):
    """The shard's loss and aux outputs (local_reduction) of its tokens, under FSDP in
    groups: W gathered whole per group, its transpose reduce-scattering that group's dW."""
    lead, d = x.shape[:-1], x.shape[-1]
    n = math.prod(lead)
    limit = _rounded_tokens(_implementations(options["implementation"])[0],
                            jnp.result_type(x.dtype, weight.dtype),
                            _chunk_size(options["chunk_size"])) if d_axes else None
    group = _partition.token_group(limit, x.reshape(n, d), weight, (d_axes, d_dim))
    if not group:  # one piece; with FSDP, one gather (and reduce-scatter)
      if d_axes:
        weight = jax.lax.all_gather(weight, d_axes, axis=d_dim, tiled=True)
      out = linear_cross_entropy(x, weight, labels, bias=bias, where=where,
                                 token_weights=weights, **unstacked(stacked),
                                 ignore_index=ignore_index, reduction=local_reduction,
                                 return_aux=return_aux, weight_layout=weight_layout,
                                 vocab_axis=v_axes or None, **options)
      return out if return_aux else (out, None)
    # The groups' gathers read a float32 copy: the shards of dW add up in float32.
    w32, flat = weight.astype(jnp.float32), lambda t: None if t is None else t.reshape(n)
    x, labels, where, weights = x.reshape(n, d), flat(labels), flat(where), flat(weights)
    stacked = None if stacked is None else stacked.reshape(n, -1)
    outs = []
    for rows in _partition.token_slices(n, group):
      w = jax.lax.all_gather(w32.astype(weight.dtype), d_axes, axis=d_dim, tiled=True)
      outs.append(linear_cross_entropy(
          x[rows], w, labels[rows], bias=bias, where=_partition.token_rows(where, rows),
          token_weights=_partition.token_rows(weights, rows),
          **unstacked(_partition.token_rows(stacked, rows)), ignore_index=ignore_index,
          reduction=local_reduction, return_aux=True, weight_layout=weight_layout,
          vocab_axis=v_axes or None, **options))
    join = (lambda ts: jnp.concatenate(ts).reshape(lead)) if local_reduction == "none" else sum
    aux = Aux(lse=jnp.concatenate([o[1].lse for o in outs]).reshape(lead),
              z_loss=join([o[1].z_loss for o in outs]),
              entropy=None if outs[0][1].entropy is None else
              jnp.concatenate([o[1].entropy for o in outs]).reshape(lead))
    return join([o[0] for o in outs]), aux if return_aux else None

  def local(x, weight, labels, bias, where, weights, stacked):
    loss, aux = grouped_loss(gathered(x), weight, gathered(labels), bias, gathered(where),
                             gathered(weights), gathered(stacked))
    if reduction == "none":
      return own(loss), aux and Aux(*(None if a is None else own(a) for a in aux))
    # Its tokens were gathered over the shared axes: the sums are over the other ones.
    summed = tuple(a for a in axes if not any(a in names for names in shared))
    sums = jnp.stack([loss] + ([aux.z_loss] if return_aux else []))
    sums = jax.lax.psum(sums, summed) if summed else sums
    if reduction == "mean":  # counted over the shard's own tokens, summed over all token axes
      valid = _int32_labels(labels, ignore_index)[1]
      valid = valid if where is None else valid & where.reshape(-1)
      sums = sums / jnp.maximum(jax.lax.psum(jnp.sum(valid, dtype=jnp.float32), axes), 1.0)
    return sums[0], aux and Aux(lse=own(aux.lse), z_loss=sums[1],
                                entropy=None if aux.entropy is None else own(aux.entropy))

  reduced = tokens if reduction == "none" else P()  # a sum over the shards is replicated
  args = (x, weight, labels, bias, where, token_weights, stacked)
  loss, aux = jax.shard_map(
      local, mesh=mesh, in_specs=tuple(map(_explicit.spec_of, args)),
      out_specs=(reduced, Aux(lse=tokens, z_loss=reduced,
                              entropy=tokens if options.get("entropy") else None)
                 if return_aux else None))(*args)
  return (loss, aux) if return_aux else loss


def _auto_partitions(vocab_axis, labels, x2, weight, d, implementations) -> bool:
  """Whether the call goes through _partition (per shard on Auto meshes): a loss by a
  custom_vjp implementation (the reference is plain JAX, which XLA partitions itself),
  where _auto.available says custom_partitioning may be used."""
  return (vocab_axis is None
          and not isinstance(labels, Int64Labels) and x2.shape[0] > 0 and d > 0
          and not isinstance(implementations[0], Reference) and _auto.available(x2, weight))


def _implementations(implementation):
  """The implementations to try, in order, for the `implementation` argument."""
  default = ("pallas_mosaic_gpu", "chunked_xla") if hopper.on_nvidia_gpu() else ("chunked_xla",)
  return _dispatch.resolve(implementation, IMPLEMENTATIONS, default)


def _rounded_tokens(impl, dtype, chunk_size):
  """v_local -> the most tokens whose dW `impl` adds up in a 16-bit dtype, or None (see
  _partition.reduced_loss); None where the implementation sets no such limit."""
  limit = getattr(impl, "rounded_tokens", None)
  if limit is None:
    return None

  def tokens(v_local):
    try:
      return limit(v_local, jnp.dtype(dtype).itemsize, chunk_size)
    except _dispatch.Unsupported:
      return None
  return tokens


def _compute(x2, weight, bias, labels2, valid, weights, opts: LossOptions, implementations,
             chunk_size, vocab_axis, in_shard_map: bool = True):
  """(loss, lse, z-loss term, entropy) of [N, D] tokens (with their weights, or None) by the
  first implementation that serves them; with vocab_axis, `weight` (and `bias`) are this
  shard's slice of opts.vocab_size (see _vocab_parallel), inside jax.shard_map or (not
  in_shard_map) custom_partitioning."""
  vocab = {}
  if vocab_axis is not None:
    shares = in_shard_map and not _vma.checking()
    vocab = {"vocab": _vocab_parallel.VocabShards(vocab_axis, cotangent_shares=shares)}
  return _dispatch.first_that_serves(implementations, lambda impl: impl(
      x2, weight, bias, labels2, valid, weights, opts=opts, chunk_size=chunk_size, **vocab))


def _checked_entropy(entropy, return_aux: bool, token_loss) -> bool:
  """`entropy` as a bool, after checking that something takes it: the auxiliary outputs
  that hold it, or a token_loss."""
  entropy = _checks.static_bool("entropy", entropy)
  if entropy and not return_aux and token_loss is None:
    raise ValueError("entropy=True returns the entropy in Aux (pass return_aux=True too) or "
                     "hands it to a token_loss")
  return entropy


def _checked_weights(token_weights, shape):
  """token_weights as an array, after checking them against the labels' shape."""
  token_weights = jnp.asarray(token_weights)
  if not jnp.issubdtype(token_weights.dtype, jnp.floating):
    raise TypeError(f"token_weights must be floating point, got token_weights.dtype="
                    f"{token_weights.dtype}")
  if token_weights.shape != shape:
    raise ValueError(f"token_weights.shape={token_weights.shape} must equal labels.shape="
                     f"{shape}")
  return token_weights


def _checked_token_loss(token_loss, token_loss_args, shape, label_smoothing, z_loss, entropy):
  """(token_loss, its arguments as a tuple of arrays) after checking them: a callable of
  scalars (the log-probability, the entropy where `entropy`, then one float per argument)
  returning a real scalar, each argument a float array of the labels' shape."""
  if not isinstance(token_loss_args, (tuple, list)):
    raise TypeError(f"token_loss_args must be a tuple of arrays, got "
                    f"{type(token_loss_args).__name__}")
  args = tuple(jnp.asarray(a) for a in token_loss_args)
  if token_loss is None:
    if args:
      raise ValueError(f"token_loss_args ({len(args)} arrays) given without a token_loss")
    return None, ()
  if not callable(token_loss):
    raise TypeError(f"token_loss must be a callable f(log_prob, *token_loss_args) -> loss, "
                    f"got {token_loss!r}")
  if label_smoothing or z_loss:
    raise ValueError(f"token_loss replaces the cross-entropy, so it takes no label_smoothing "
                     f"or z_loss; got label_smoothing={label_smoothing!r}, z_loss={z_loss!r}")
  for i, a in enumerate(args):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise TypeError(f"token_loss_args[{i}] must be floating point, got dtype {a.dtype}")
    if a.shape != shape:
      raise ValueError(f"token_loss_args[{i}].shape={a.shape} must equal labels.shape={shape}")
  scalar = jax.ShapeDtypeStruct((), jnp.float32)
  try:
    out = jax.eval_shape(token_loss, scalar, *(scalar,) * (entropy + len(args)))
  except Exception as err:
    takes = "the log-probability" + (", the entropy (entropy=True)" if entropy else "")
    raise TypeError(f"token_loss must take {takes} and {len(args)} more float32 scalars "
                    f"(token_loss_args), one token at a time; calling it so raised "
                    f"{type(err).__name__}: {err}") from err
  if not (hasattr(out, "shape") and out.shape == () and jnp.issubdtype(out.dtype, jnp.floating)):
    raise TypeError(f"token_loss must return one real scalar per token, got {out}")
  return token_loss, args


def _token_inputs(weights, args, n: int):
  """The implementations' per-token float32 operand: the token weights [N] (or None), or
  with a token_loss's arguments [N, 1 + k], the weights (1 where none) first."""
  if weights is not None:
    weights = weights.reshape(n).astype(jnp.float32)
  if not args:
    return weights
  ones = jnp.ones((n,), jnp.float32) if weights is None else weights
  return jnp.stack([ones] + [a.reshape(n).astype(jnp.float32) for a in args], axis=1)


def _check_float(name, a):
  if a.dtype not in _FLOAT_DTYPES:
    raise TypeError(f"{name} must be float32, bfloat16 or float16, got {name}.dtype={a.dtype}")


def linear_cross_entropy(
    x: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    weight_layout: str = "dv",
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcap: float | None = None,
    where: jax.Array | None = None,
    token_weights: jax.Array | None = None,
    token_loss=None,
    token_loss_args: tuple = (),
    return_aux: bool = False,
    entropy: bool = False,
    implementation=None,
    chunk_size: int | tuple[int, int] | None = None,
    vocab_axis: str | tuple[str, ...] | None = None,
):
  """Cross-entropy of `x @ weight` against integer labels, without holding the logits.

  Equals `optax.softmax_cross_entropy_with_integer_labels(x @ weight + bias, labels)`,
  with torch's meanings of `ignore_index` and `label_smoothing`:

    ẑ = c·tanh((x·W + b) / c)            (c = logit_softcap; no cap when None)
    loss_n = logsumexp(ẑ_n) - Σ_v q_nv ẑ_nv + z_loss · logsumexp(ẑ_n)²,
    q_nv = (1 - ε)[v = y_n] + ε / V,     ε = label_smoothing

  Tokens whose label is `ignore_index`, or where `where` is False, contribute 0 and are
  left out of the mean; with every token left out the loss is 0 and so are the gradients.
  `token_weights` ω multiply each token's loss_n: "sum" is Σ ω_n loss_n, "mean" that over the
  number of counted tokens (not Σ ω), "none" ω_n loss_n.
  A label outside [0, V) that is not `ignore_index` gives NaN for that token, as optax does.

  Args:
    x: [..., D] activations.
    weight: [D, V] (`weight_layout="dv"`, as `flax.linen.Dense`) or [V, D] (`"vd"`, a tied
      embedding table or a `torch.nn.Linear` weight).
    labels: [...] integer labels, the leading shape of x; or `Int64Labels` (64-bit ids as
      int32 words, e.g. torch's int64 labels without a copy).
    bias: optional [V].
    weight_layout: "dv" or "vd".
    ignore_index: label value that marks a token to skip.
    reduction: "mean" (over counted tokens), "sum" or "none" (per token, labels.shape).
    label_smoothing: ε in [0, 1].
    z_loss: λ ≥ 0, weight of the log-sum-exp² regulariser (PaLM).
    logit_softcap: optional c > 0 (Gemma 2).
    where: optional boolean [...] mask, like labels; False tokens are skipped.
    token_weights: optional float [...] weights, like labels, any sign (a policy gradient's
      advantages, per-sequence normalisers), differentiable. A weighted mean or sum costs
      what the unweighted one does: the three matmuls, gradients made in the forward pass;
      `reduction="none"` then a weighted sum by the caller needs a fourth (the logits
      again in the backward pass, for the per-token cotangents).
    token_loss: optional f(log_prob, *args) -> loss of one token, replacing the
      cross-entropy −log_prob (which is f(ℓ) = −ℓ): ℓ = log softmax(ẑ)[y], each args entry
      that token's entry of the `token_loss_args`, all float32 scalars (f is vmapped over
      the tokens). A policy-gradient objective (PPO's or GRPO's clipped ratio against old
      log-probs, a KL penalty to a reference's) as one call: its gradients are made in the
      forward pass as the cross-entropy's are (∂f/∂ℓ is known once ℓ is), so a mean or sum
      costs the three matmuls, where `reduction="none"` and f applied by the caller cost a
      fourth. Weights, masks and reductions apply to f's values. Differentiable in all its
      inputs; not with label_smoothing or z_loss. With `entropy=True` f takes each token's
      entropy after its log-probability, f(log_prob, entropy, *args) (an entropy bonus,
      −β·entropy, in the same three matmuls; return_aux is then optional). Pass a function
      defined once (a new closure per call retraces a jitted caller).
    token_loss_args: a tuple of float arrays shaped like labels (advantages, old
      log-probs), f's arguments after the log-probability.
    return_aux: also return `Aux(lse, z_loss, entropy)`; all are differentiable. The z-loss
      term is weighted like the loss, the log-sum-exp and entropy not.
    entropy: with return_aux, also each token's entropy H = −Σ_v p log p of softmax(ẑ)
      (Aux.entropy, float32 labels.shape; None without it): an RL step's entropy, logged
      or, differentiated, a bonus; with a token_loss, also its second argument. Its
      statistic Σ_v p ẑ costs an elementwise product in the softmax pass; pallas_mosaic_gpu
      then takes that pass rather than exp_logits. Aux.entropy differentiated beside a mean
      or sum loss costs one more pass over the chunks (the forward made the loss's
      gradients without it); with reduction="none" it shares that reduction's one backward
      pass; as a token_loss's argument it costs no pass of its own.
    implementation: None (fastest available: "pallas_mosaic_gpu" on NVIDIA GPUs, then
      "chunked_xla"), a name ("reference", "chunked_xla", "pallas_mosaic_gpu"), an implementation
      object (`PallasMosaicGpu(...)`, `ChunkedXla(...)`) or a sequence of those tried in order.
    chunk_size: tokens per chunk, or (tokens, vocab entries) for chunked_xla. None derives
      it from the implementation's `memory_budget_bytes` (256 MiB for chunked_xla's float32
      logits and G, 240 MiB for pallas_mosaic_gpu's one buffer in the compute dtype).
    vocab_axis: inside `jax.shard_map`, the mesh axis (or axes) that `weight` and `bias` are
      sharded over on V: each shard holds one contiguous slice of the vocabulary, in axis
      order, and every token; labels stay global class ids. The shards' slices merge
      through [N]-sized collectives (Megatron's vocab-parallel loss) and every option keeps
      its single-device meaning; dW and the bias's gradient stay local. On an Explicit mesh
      a weight sharded on V does this by itself. For tokens sharded over the same axis
      (sequence parallelism), gather them first: `jax.lax.all_gather` transposes to the
      reduce-scatter of dx.

  Returns:
    The loss (a scalar, or labels.shape for "none"), float32; with return_aux,
    (loss, Aux).

  Meshes: tokens sharded and W's vocabulary sharded (Auto or Explicit meshes under jit, or
  vocab_axis inside jax.shard_map) run per shard; where an axis shards both (sequence
  parallelism) the tokens are gathered over it in the call and dx reduce-scattered; W's D
  sharded too (FSDP) is gathered in the call. See docs/design/multi_device.md.

  Memory: reference holds N·V float32 logits; chunked_xla about its budget plus a float32
  dW accumulator (D·V·4 bytes); pallas_mosaic_gpu about its budget, accumulating dW in the
  weight's dtype.

  Raises:
    ValueError / TypeError: for bad shapes, dtypes or options (the message names them).
    NotImplementedError: when an explicitly chosen implementation cannot serve the call.

  >>> import jax, jax.numpy as jnp
  >>> x = jax.random.normal(jax.random.key(0), (8, 16))
  >>> w = jax.random.normal(jax.random.key(1), (16, 100))
  >>> labels = jnp.arange(8)
  >>> loss = linear_cross_entropy(x, w, labels)
  >>> loss.shape, loss.dtype
  ((), dtype('float32'))
  """
  x, weight = jnp.asarray(x), jnp.asarray(weight)
  ignore_index = _checks.static_int("ignore_index", ignore_index)
  mesh = _explicit.common_mesh(x, weight, bias, where, token_weights,
                               None if isinstance(labels, Int64Labels) else labels)
  if mesh is not None:
    if isinstance(labels, Int64Labels):
      raise ValueError("Int64Labels on an Explicit mesh are not supported; pass int32 labels")
    if vocab_axis is not None:
      raise ValueError(f"vocab_axis={vocab_axis!r} is for inside jax.shard_map; on an Explicit "
                       "mesh the weight's sharding says which axes hold the vocabulary")
    if reduction not in _common.REDUCTIONS:
      raise ValueError(f"reduction must be one of {_common.REDUCTIONS}, got {reduction!r}")
    labels = jnp.asarray(labels)
    token_loss, loss_args = _checked_token_loss(token_loss, token_loss_args, labels.shape,
                                                label_smoothing, z_loss,
                                                _checks.static_bool("entropy", entropy))
    return _per_shard(mesh, x, weight, labels, bias, where, token_weights, loss_args,
                      token_loss=token_loss, ignore_index=ignore_index, reduction=reduction,
                      return_aux=_checks.static_bool("return_aux", return_aux),
                      entropy=_checked_entropy(entropy, return_aux, token_loss),
                      weight_layout=weight_layout, label_smoothing=label_smoothing,
                      z_loss=z_loss, logit_softcap=logit_softcap,
                      implementation=implementation, chunk_size=chunk_size)
  if isinstance(labels, Int64Labels):  # read as words chunk by chunk: no int32 copy
    words, valid = _int64_words(labels, ignore_index)
  else:
    labels = jnp.asarray(labels)
  if weight_layout not in _common.WEIGHT_LAYOUTS:
    raise ValueError(f"weight_layout must be 'dv' ([D, V]) or 'vd' ([V, D]), got "
                     f"{weight_layout!r}")
  if reduction not in _common.REDUCTIONS:
    raise ValueError(f"reduction must be one of {_common.REDUCTIONS}, got {reduction!r}")
  if x.ndim < 1:
    raise ValueError(f"x must be [..., D], got x.shape={x.shape}")
  if weight.ndim != 2:
    raise ValueError(f"weight must be 2-D ({'[D, V]' if weight_layout == 'dv' else '[V, D]'}"
                     f" for weight_layout={weight_layout!r}), got weight.shape={weight.shape}")
  _check_float("x", x)
  _check_float("weight", weight)
  d, vocab = weight.shape if weight_layout == "dv" else weight.shape[::-1]
  if x.shape[-1] != d:
    raise ValueError(f"x.shape={x.shape} has D={x.shape[-1]} but weight.shape="
                     f"{weight.shape} with weight_layout={weight_layout!r} has D={d}")
  if not isinstance(labels, Int64Labels) and not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"labels must be integers (class ids), got labels.dtype={labels.dtype}")
  if labels.shape != x.shape[:-1]:
    raise ValueError(f"labels.shape={labels.shape} must equal x.shape[:-1]="
                     f"{x.shape[:-1]} (x.shape={x.shape})")
  if bias is not None:
    bias = jnp.asarray(bias)
    _check_float("bias", bias)
    if bias.shape != (vocab,):
      raise ValueError(f"bias.shape={bias.shape} must be (V,)=({vocab},)")
  if where is not None:
    where = jnp.asarray(where)
    if where.dtype != jnp.bool_:
      raise TypeError(f"where must be a boolean mask, got where.dtype={where.dtype}")
    if where.shape != labels.shape:
      raise ValueError(f"where.shape={where.shape} must equal labels.shape={labels.shape}")
  if token_weights is not None:
    token_weights = _checked_weights(token_weights, labels.shape)
  if not 0.0 <= _checks.static_real("label_smoothing", label_smoothing) <= 1.0:
    raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
  if not 0.0 <= _checks.static_real("z_loss", z_loss) < float("inf"):
    raise ValueError(f"z_loss must be finite and ≥ 0, got {z_loss!r}")
  token_loss, loss_args = _checked_token_loss(token_loss, token_loss_args, labels.shape,
                                              label_smoothing, z_loss,
                                              _checks.static_bool("entropy", entropy))
  weights = _token_inputs(token_weights, loss_args, math.prod(labels.shape))
  logit_softcap = _checks.logit_softcap(logit_softcap)
  chunk_size = _chunk_size(chunk_size)
  return_aux = _checks.static_bool("return_aux", return_aux)
  entropy = _checked_entropy(entropy, return_aux, token_loss)
  if vocab == 0:
    raise ValueError(f"the vocabulary is empty (weight.shape={weight.shape})")
  vocab_axis, shards = _checks.manual_axis("vocab_axis", vocab_axis,
                                           "the weight's vocabulary must be sharded over it")
  if vocab_axis is not None and isinstance(labels, Int64Labels):
    raise ValueError("vocab_axis takes int32 labels, not Int64Labels")

  opts = LossOptions(vocab_size=int(vocab) * shards, weight_layout=weight_layout,
                     reduction=reduction,
                     label_smoothing=_checks.static_real("label_smoothing", label_smoothing),
                     z_loss=_checks.static_real("z_loss", z_loss), logit_softcap=logit_softcap,
                     aux_outputs=return_aux, entropy=entropy, token_loss=token_loss)
  lead = labels.shape
  dtype = jnp.result_type(x.dtype, weight.dtype)
  x2 = x.reshape(math.prod(lead), d).astype(dtype)  # (-1 cannot be inferred at D = 0)
  weight = weight.astype(dtype)
  if d == 0:  # logits of zeros, as from one zero feature (its gradients are sliced away)
    x2 = jnp.pad(x2, ((0, 0), (0, 1)))
    weight = jnp.pad(weight, ((0, 1), (0, 0)) if weight_layout == "dv" else ((0, 0), (0, 1)))
  if isinstance(labels, Int64Labels):
    labels2 = words
  else:
    labels2, valid = _int32_labels(labels, ignore_index)
  if where is not None:
    valid = valid & where.reshape(-1)

  implementations = _implementations(implementation)
  if x2.shape[0] == 0:  # no tokens: no chunks; the reference's (empty) computation
    implementations = [IMPLEMENTATIONS["reference"]]
  if _auto_partitions(vocab_axis, labels, x2, weight, d, implementations):
    def shard_loss(x, w, b, labels, valid, weights, axis, reduction):  # W: a vocabulary slice
      return _compute(x, w, b, labels, valid, weights,
                      dataclasses.replace(opts, reduction=reduction), implementations,
                      chunk_size, axis, in_shard_map=False)

    shared = dict(weight_layout=weight_layout, loss_fn=shard_loss,
                  name=getattr(implementations[0], "name", type(implementations[0]).__name__),
                  rounded_tokens=_rounded_tokens(implementations[0], dtype, chunk_size))
    if reduction != "none" and not return_aux:
      return _partition.reduced_loss(x2, weight, bias, labels2, valid, weights,
                                     reduction=reduction, **shared)
    # Per-token outputs per shard; a reduced loss with its aux outputs reduced from them.
    loss, *aux = _partition.per_token_loss(x2, weight, bias, labels2, valid, weights,
                                           outputs=1 + 2 * return_aux + entropy, **shared)
    if reduction == "none":
      return (loss.reshape(lead), Aux(*(a.reshape(lead) for a in aux))) if return_aux \
          else loss.reshape(lead)
    r = _common.valid_scale(valid, reduction)
    return _common.reduced_sum(loss, valid, r), Aux(
        lse=aux[0].reshape(lead), z_loss=jnp.sum(aux[1] * r),
        entropy=aux[2].reshape(lead) if entropy else None)
  loss, lse, zterm, ent = _compute(x2, weight, bias, labels2, valid, weights, opts,
                                   implementations, chunk_size, vocab_axis)
  if reduction == "none":
    loss = loss.reshape(lead)
  if return_aux:  # (without it, chunked implementations may return None for lse and zterm)
    return loss, Aux(lse=lse.reshape(lead), z_loss=zterm.reshape(lead) if reduction == "none"
                     else zterm, entropy=None if ent is None else ent.reshape(lead))
  return loss
