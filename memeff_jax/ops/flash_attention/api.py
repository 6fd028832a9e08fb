"""flash_attention(): argument checks and the choice of implementation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from memeff_jax.kernels import hopper
from memeff_jax.ops import _auto
from memeff_jax.ops import _checks
from memeff_jax.ops import _dispatch
from memeff_jax.ops import _explicit
from memeff_jax.ops.flash_attention import _common
from memeff_jax.ops.flash_attention import _context
from memeff_jax.ops.flash_attention._common import AttentionOptions
from memeff_jax.ops.flash_attention.chunked_xla import ChunkedXla
from memeff_jax.ops.flash_attention.masks import MaskSpec
from memeff_jax.ops.flash_attention.pallas_mosaic_gpu import PallasMosaicGpu
from memeff_jax.ops.flash_attention.pallas_triton import PallasTriton
from memeff_jax.ops.flash_attention.reference import Reference

IMPLEMENTATIONS = {
    "reference": Reference(),
    "chunked_xla": ChunkedXla(),
    "pallas_triton": PallasTriton(),
    "pallas_mosaic_gpu": PallasMosaicGpu(),
}
# The default order's Mosaic kernels: calls they would run padded at more work than
# pallas_triton's kernels lose go to pallas_triton.
_MOSAIC_WHERE_FASTER = PallasMosaicGpu(pad="where_faster")
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check_segments(name, ids, batch, length, which):
  ids = jnp.asarray(ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"{name} must be integers, got {name}.dtype={ids.dtype}")
  if ids.shape != (batch, length):
    raise ValueError(f"{name}.shape={ids.shape} must be (B, {which})=({batch}, {length})")
  return ids


def _checked_segments(q_ids, kv_ids, b: int, t: int, s: int):
  """The segment ids, checked; kv_ids defaults to q_ids (which needs T == S). (None, None)
  where none are given."""
  if q_ids is None:
    if kv_ids is not None:
      raise ValueError("kv_segment_ids needs q_segment_ids")
    return None, None
  q_ids = _check_segments("q_segment_ids", q_ids, b, t, "T")
  if kv_ids is None:
    if s != t:
      raise ValueError(f"kv_segment_ids defaults to q_segment_ids, which needs T == S; got "
                       f"T={t}, S={s}: pass kv_segment_ids")
    kv_ids = q_ids
  return q_ids, _check_segments("kv_segment_ids", kv_ids, b, s, "S")


def _int32_segments(q_ids, kv_ids):
  """Segment ids as the kernels take them, int32, equal exactly where the given ids are.

  Ids of 32 bits or fewer convert one to one. Wider ids (int64 under jax_enable_x64) would
  alias in int32 (0 and 2³² would merge two documents): each row's ids are replaced by their
  rank among the row's distinct ids, which keeps equality and order."""
  if jnp.iinfo(q_ids.dtype).bits <= 32 and jnp.iinfo(kv_ids.dtype).bits <= 32:
    return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
  common = jnp.promote_types(q_ids.dtype, kv_ids.dtype)
  if not jnp.issubdtype(common, jnp.integer):
    raise TypeError(f"q_segment_ids ({q_ids.dtype}) and kv_segment_ids ({kv_ids.dtype}) have "
                    "no common integer type; pass both as int32 or int64")
  return _common.rank_segments(q_ids.astype(common), kv_ids.astype(common))


def _length_segments(q, k, q_ids, kv_ids, query_seq_lengths, key_value_seq_lengths):
  """Segment ids that also hide each row's queries from query_seq_lengths[b] on and its keys
  from key_value_seq_lengths[b] on (either may be None: all valid): such a query sees no key,
  such a key no query. The given ids (or one document per row) are ranked to ids below
  T + S, and hidden queries and keys take the ids T + S and T + S + 1, which no query or key
  shares with them; padding at the rows' ends keeps ids that never decrease, whose blocks
  the Mosaic kernels skip exactly (_mosaic.segment_block_ranges). Without lengths, the
  given ids as they are."""
  if query_seq_lengths is None and key_value_seq_lengths is None:
    return q_ids, kv_ids
  if jnp.ndim(q) != 4 or jnp.ndim(k) != 4:
    raise ValueError(f"q and k must be [B, T, heads, D] and [B, S, heads, D], got "
                     f"q.shape={jnp.shape(q)}, k.shape={jnp.shape(k)}")
  (b, t), s = jnp.shape(q)[:2], jnp.shape(k)[1]

  def valid(name, lengths, length):
    if lengths is None:
      return None
    lengths = jnp.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
      raise TypeError(f"{name} must be integers, got {name}.dtype={lengths.dtype}")
    if lengths.shape != (b,):
      raise ValueError(f"{name}.shape={lengths.shape} must be (B,)=({b},)")
    return jnp.arange(length)[None, :] < lengths[:, None]

  q_valid = valid("query_seq_lengths", query_seq_lengths, t)
  kv_valid = valid("key_value_seq_lengths", key_value_seq_lengths, s)
  q_ids, kv_ids = _checked_segments(q_ids, kv_ids, b, t, s)
  if q_ids is None:
    q_ids, kv_ids = jnp.zeros((b, t), jnp.int32), jnp.zeros((b, s), jnp.int32)
  else:
    q_ids, kv_ids = _common.rank_segments(*_int32_segments(_whole_rows(q_ids),
                                                           _whole_rows(kv_ids)))
  if q_valid is not None:
    q_ids = jnp.where(q_valid, q_ids, t + s)
  if kv_valid is not None:
    kv_ids = jnp.where(kv_valid, kv_ids, t + s + 1)
  return q_ids, kv_ids


def _whole_rows(ids):
  """[B, L] ids with each row whole on a shard: on an Explicit mesh that shards the sequence
  its axes are gathered (a few bytes a token), as rank_segments' sorts along the rows need."""
  mesh, dims = _explicit.layout(ids)
  if mesh is None or not dims[1]:
    return ids
  return jax.sharding.reshard(ids, _explicit.spec([dims[0], ()]))


def _window(sliding_window):
  """sliding_window as a (left, right) pair of ints ≥ 0 or None (unbounded), or None."""
  if sliding_window is None:
    return None
  pair = isinstance(sliding_window, (tuple, list))
  sides = tuple(sliding_window) if pair else (sliding_window,) * 2
  if len(sides) != 2:
    raise ValueError(f"sliding_window must be an int or a (left, right) pair, got "
                     f"{sliding_window!r}")
  sides = tuple(None if w is None else _checks.static_int("sliding_window", w) for w in sides)
  if any(w is not None and w < 0 for w in sides):
    raise ValueError(f"sliding_window must be ≥ 0 on each side (None: unbounded), got "
                     f"{sliding_window!r}")
  return None if sides == (None, None) else sides


def _check_mask(mask, b: int, hq: int, t: int, s: int):
  """A dense boolean mask as [B|1, Hq|1, T, S] (jax.nn.dot_product_attention's layout)."""
  mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_:
    raise TypeError(f"mask must be boolean (True: the query sees the key), got "
                    f"mask.dtype={mask.dtype}")
  if mask.ndim > 4 or any(m not in (1, n) for m, n in zip(mask.shape[::-1], (s, t, hq, b))):
    raise ValueError(f"mask.shape={mask.shape} must broadcast to [B, Hq, T, S]=[{b}, {hq}, "
                     f"{t}, {s}]")
  mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
  return jnp.broadcast_to(mask, mask.shape[:2] + (t, s))


def _masked(q, k, v, q_seg, kv_seg, mask, opts):
  """The call with a dense mask, for implementations that take one (`masked`)."""
  def call(impl):
    if not hasattr(impl, "masked"):
      raise _dispatch.Unsupported(f"{getattr(impl, 'name', impl)} takes no dense mask (the "
                                  "GPU kernels serve causal, sliding-window and segment masks)")
    return impl.masked(q, k, v, q_seg, kv_seg, mask, opts=opts)
  return call


def _per_shard(mesh, q, k, v, q_segment_ids, kv_segment_ids, mask, return_lse, context_order,
               context_strategy, **options):
  """flash_attention on an Explicit mesh: the single-device call per shard under shard_map,
  for inputs sharded on the batch and the heads (q's and k/v's heads alike, or k/v's single
  head shared), and on the sequence (q's and k/v's alike: context parallelism)."""
  qd, kd, vd = (_explicit.dims_of(a, 4) for a in (q, k, v))
  where = f"q: {_explicit.spec(qd)}, k: {_explicit.spec(kd)}, v: {_explicit.spec(vd)}"
  if any(d[3] for d in (qd, kd, vd)):
    raise ValueError(f"on an Explicit mesh the head dim must not be sharded, got {where}")
  if kd != vd or kd[0] != qd[0] or kd[1] != qd[1] or (
      kd[2] != qd[2] and not (not kd[2] and k.shape[2] == 1)):
    raise ValueError("on an Explicit mesh k and v must be sharded alike, on the batch and "
                     "sequence axes of q and on the heads as q is (or, with one key head, not "
                     f"on the heads), got {where}")
  batch, seq, heads = qd[0], qd[1], qd[2]
  if seq and mask is not None:
    raise ValueError(f"a dense mask is not taken with the sequence sharded (got {where}); "
                     "the structured masks are")
  rows = lambda ids: None if ids is None else jax.sharding.reshard(
      ids, _explicit.spec([batch, seq]))
  q_segment_ids, kv_segment_ids = rows(q_segment_ids), rows(kv_segment_ids)
  if mask is not None:
    b, t, hq, _ = q.shape
    mask = _check_mask(mask, b, hq, t, k.shape[1])
    mask = jax.sharding.reshard(mask, _explicit.spec(
        [batch if mask.shape[0] > 1 else (), heads if mask.shape[1] > 1 else (), (), ()]))
  out_spec = _explicit.spec([batch, seq, heads, ()])
  lse_spec = _explicit.spec([batch, seq, heads])
  if seq:
    options.update(context_axis=seq if len(seq) > 1 else seq[0], context_order=context_order,
                   context_strategy=context_strategy)
  elif (context_order, context_strategy) != _context.DEFAULT:
    raise ValueError(f"context_order={context_order!r}, context_strategy={context_strategy!r} "
                     f"are for q, k, v sharded on the sequence, got {where}")

  def local(q, k, v, q_seg, kv_seg, mask):
    return flash_attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, mask=mask,
                           return_lse=True, **options)

  args = (q, k, v, q_segment_ids, kv_segment_ids, mask)
  out, lse = jax.shard_map(local, mesh=mesh, in_specs=tuple(map(_explicit.spec_of, args)),
                           out_specs=(out_spec, lse_spec))(*args)
  return (out, lse) if return_lse else out


def _context_parallel(q, k, v, q_segment_ids, kv_segment_ids, mask, return_lse, context_axis,
                      context_order, context_strategy, *, causal, sliding_window, **options):
  """flash_attention inside shard_map with the sequence sharded over `context_axis`."""
  axis, shards = _checks.manual_axis("context_axis", context_axis,
                                     "q, k and v must be sharded over it on the sequence")
  if mask is not None:
    raise ValueError("context_axis takes the structured masks (causal, sliding_window, "
                     "segment ids), not a dense mask")
  opts, _, _ = _prepare(q, k, v, causal=causal, scale=options["scale"],
                        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                        sliding_window=sliding_window, logit_softcap=options["logit_softcap"],
                        deterministic=options["deterministic"])
  _context.check_lengths(context_order, q.shape[1], k.shape[1])
  if kv_segment_ids is None:
    kv_segment_ids = q_segment_ids

  def attend(q, k, v, q_seg, kv_seg, window):
    return flash_attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                           sliding_window=window, return_lse=True, **options)

  def attend_backward(q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, window):
    return flash_attention_backward(q, k, v, out, lse, d_out, d_lse, q_segment_ids=q_seg,
                                    kv_segment_ids=kv_seg, sliding_window=window, **options)

  out, lse = _context.attention(attend, attend_backward, q, k, v, q_segment_ids,
                                kv_segment_ids, axis=axis, shards=shards,
                                window=(opts.mask.left, opts.mask.right), order=context_order,
                                strategy=context_strategy)
  return (out, lse) if _checks.static_bool("return_lse", return_lse) else out


def _default() -> tuple:
  if hopper.on_nvidia_gpu():
    return (_MOSAIC_WHERE_FASTER, "pallas_triton", "chunked_xla")
  return ("chunked_xla",)


def _prepare(q, k, v, *, causal, scale, q_segment_ids, kv_segment_ids, sliding_window,
             logit_softcap, deterministic, context=_context.DEFAULT):
  """Checks every argument; returns (AttentionOptions, q_segment_ids, kv_segment_ids)."""
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  for name, a in (("q", q), ("k", k), ("v", v)):
    if a.ndim != 4:
      raise ValueError(f"{name} must be [B, {'T' if name == 'q' else 'S'}, heads, D], got "
                       f"{name}.shape={a.shape}")
    if a.dtype not in _DTYPES:
      raise TypeError(f"{name} must be float32, bfloat16 or float16, got "
                      f"{name}.dtype={a.dtype}")
  if not q.dtype == k.dtype == v.dtype:
    raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  b, t, hq, d = q.shape
  if k.shape != v.shape:
    raise ValueError(f"k.shape={k.shape} and v.shape={v.shape} must be equal")
  if k.shape[0] != b or k.shape[3] != d:
    raise ValueError(f"k.shape={k.shape} must be [B={b}, S, Hkv, D={d}] for q.shape={q.shape}")
  s, hkv = k.shape[1], k.shape[2]
  if hkv == 0 and hq != 0 or hkv and hq % hkv:
    raise ValueError(f"query heads Hq={hq} must be a multiple of key/value heads Hkv={hkv} "
                     f"(q.shape={q.shape}, k.shape={k.shape})")
  q_segment_ids, kv_segment_ids = _checked_segments(q_segment_ids, kv_segment_ids, b, t, s)
  if q_segment_ids is not None:
    q_segment_ids, kv_segment_ids = _int32_segments(q_segment_ids, kv_segment_ids)
  sliding_window = _window(sliding_window)
  logit_softcap = _checks.logit_softcap(logit_softcap)
  deterministic = _checks.static_bool("deterministic", deterministic)
  causal = _checks.static_bool("causal", causal)
  if scale is None:
    scale = 1.0 / math.sqrt(d) if d else 1.0
  elif not math.isfinite(scale := _checks.static_real("scale", scale)):
    raise ValueError(f"scale must be finite, got {scale!r}")

  opts = AttentionOptions(
      mask=MaskSpec.make(causal, sliding_window, q_segment_ids is not None),
      scale=float(scale), logit_softcap=logit_softcap, deterministic=deterministic,
      context=context)
  return opts, q_segment_ids, kv_segment_ids


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sliding_window: int | tuple[int, int] | None = None,
    logit_softcap: float | None = None,
    mask: jax.Array | None = None,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    return_lse: bool = False,
    deterministic: bool = True,
    implementation=None,
    context_axis=None,
    context_order: str = "contiguous",
    context_strategy: str = "all_gather",
):
  """Scaled dot-product attention without the [T, S] score matrix.

    s = scale · q kᵀ,  ŝ = c·tanh(s / c) (c = logit_softcap),  out = softmax(ŝ) v

  over the keys each query sees. Same layout and mask meanings as
  `jax.nn.dot_product_attention`: `causal` lets query i see keys 0..i (top-left aligned);
  `sliding_window=(left, right)` keys i-left..i+right (an int w means (w, w)); with segment
  ids a query sees a key only where their ids are equal. All combine. A query that sees no
  key gets output 0 (and lse -inf) with zero gradients.

  Args:
    q: [B, T, Hq, D]; k, v: [B, S, Hkv, D] with Hq % Hkv == 0 (GQA, MQA: k/v are not
      repeated in memory). T ≠ S allowed; any D (the GPU kernels serve D 16–256, other head
      dims run chunked_xla); float32, bfloat16 or float16.
    causal, sliding_window, q_segment_ids ([B, T] ints), kv_segment_ids ([B, S] ints;
      defaults to q_segment_ids, which then needs T == S): the mask. sliding_window is an
      int w (keys i-w..i+w) or a (left, right) pair of ints ≥ 0, a side None for unbounded.
    scale: default 1/sqrt(D).
    logit_softcap: optional c > 0 (Gemma 2).
    mask: optional dense boolean mask, broadcastable to [B, Hq, T, S] (True: the query sees
      the key), combined with the masks above, as jax.nn.dot_product_attention's `mask`.
      Only `chunked_xla` (query blocks of 128 rows against all keys, recomputed in the
      backward: [B, Hq, 128, S] scores at a time) and `reference` take one; prefer the
      structured masks, which the GPU kernels serve.
    query_seq_lengths, key_value_seq_lengths: optional [B] ints, as jax.nn.dot_product_
      attention's: row b's queries from query_seq_lengths[b] on, and its keys from
      key_value_seq_lengths[b] on, are padding: such a query sees no key (output 0), such
      a key no query. They become segment ids (combined with any given), which the GPU
      kernels serve.
    return_lse: also return the float32 log-sum-exp, [B, T, Hq] (differentiable).
    deterministic: the backward gives bitwise-identical gradients on every run (the
      default). pallas_mosaic_gpu's one-pass backward adds dq into a float32 buffer by TMA
      reductions, in a fixed order where the tuning table names an ordered kernel for the
      call (D = 64, 96, 128, 224, 256, and 192 causal without GQA; causal GQA at D 64 to
      128 adds each query head's dk and dv into the bf16 outputs in the group's order, and
      up to 16 key blocks per query block dq into the output itself, one rounding per
      add); elsewhere its kernel computes dk and dv alone and a Mosaic dq kernel dq (no
      float32 dq buffer). deterministic=False lets the reductions land in whatever order
      the CTAs arrive at D = 48 and 80, which have no ordered kernel, and elsewhere runs
      what deterministic calls run, which measured as fast or faster (a tuning table may
      name arrival order for a call). Every other implementation is deterministic either
      way.
    implementation: None (fastest available: on NVIDIA GPUs "pallas_mosaic_gpu" where it
      serves the call (Hopper, bf16/f16, D 33–256; lengths the kernels do not take
      padded, in place or on copies, and D other than multiples of 16 up to 128 and of 32
      above on zero-padded copies, where that beats pallas_triton), then "pallas_triton",
      then "chunked_xla"), a name, an implementation object or a sequence tried in order.

  Returns:
    out [B, T, Hq, D] in q's dtype; with return_lse, (out, lse).

  Memory: reference holds [B, Hq, T, S] float32 scores; chunked_xla [B, Hq, block_q,
  block_k]; pallas_triton and pallas_mosaic_gpu only the kernels' tiles.

    context_axis: inside jax.shard_map, the mesh axis (or tuple of axes) that shards the
      sequence: q, k, v and segment ids hold this shard's contiguous chunk of it, in shard
      order, and attention runs over the whole sequence (context parallelism: every shard
      gathers the keys and values, and its queries attend to the span their mask reaches).
    context_order: how the sequence lies on the shards: "contiguous" (shard i holds the i-th
      of n equal chunks) or "zigzag" (cut into 2n chunks, shard i holds chunks i and
      2n − 1 − i, so a causal mask gives every shard the same work; `zigzag` in this
      module puts tokens, positions, labels and segment ids in that order).
    context_strategy: how the keys reach the queries: "all_gather" (every shard gathers
      all keys and values, then runs its queries against the span their mask reaches; the
      backward reduce-scatters dK/dV in float32; a window that reaches only the
      neighbouring shards' keys, in the contiguous order, has only those rows exchanged)
      or "ring" (keys and values pass from shard
      to shard, each step's attention overlapping the next transfer and merged through the
      log-sum-exp; the backward passes them round again with float32 dK/dV accumulators:
      a shard holds at most two shards' keys, and a window stops the ring after the last
      step it reaches and has it pass only the keys it reaches). Packed documents of at
      most m tokens: sliding_window=(m, 0) leaves their mask as it is and, in the
      contiguous order, lets either strategy move only a halo of m keys.

  Meshes: with q, k, v sharded on the batch and heads (an Auto or Explicit mesh under jit,
  or inside jax.shard_map) each shard runs its part; on an Auto or Explicit mesh also on
  the sequence (q's and k/v's alike, T == S on Auto meshes: context parallelism with
  `context_order` and `context_strategy`); the head dim must not be sharded (see
  docs/design/multi_device.md).

  Raises:
    ValueError / TypeError: bad shapes, dtypes or options; the message names the argument.
    NotImplementedError: when an explicitly chosen implementation cannot serve the call.

  >>> import jax, jax.numpy as jnp
  >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 128, 4, 64))
  >>> flash_attention(q, k, v, causal=True).shape
  (1, 128, 4, 64)
  """
  options = dict(causal=causal, scale=scale, sliding_window=sliding_window,
                 logit_softcap=logit_softcap, deterministic=deterministic,
                 implementation=implementation)
  if context_order not in _context.ORDERS:
    raise ValueError(f"context_order must be one of {_context.ORDERS}, got {context_order!r}")
  if context_strategy not in _context.STRATEGIES:
    raise ValueError(f"context_strategy must be one of {_context.STRATEGIES}, got "
                     f"{context_strategy!r}")
  if ((query_seq_lengths is not None or key_value_seq_lengths is not None)
      and (context_axis is not None or context_order != "contiguous")):
    raise ValueError("query_seq_lengths and key_value_seq_lengths count positions of the "
                     "whole sequence in order, which a shard under context_axis does not "
                     "see and context_order='zigzag' reorders: pass segment ids that mark "
                     "the padding instead")
  q_segment_ids, kv_segment_ids = _length_segments(q, k, q_segment_ids, kv_segment_ids,
                                                   query_seq_lengths, key_value_seq_lengths)
  if context_axis is not None:
    return _context_parallel(q, k, v, q_segment_ids, kv_segment_ids, mask, return_lse,
                             context_axis, context_order, context_strategy, **options)
  mesh = _explicit.common_mesh(q, k, v, q_segment_ids, kv_segment_ids)
  if mesh is not None:
    return _per_shard(mesh, q, k, v, q_segment_ids, kv_segment_ids, mask, return_lse,
                      context_order, context_strategy, **options)
  context = (context_order, context_strategy)
  if context != _context.DEFAULT and not _auto.available(q, k, v):
    name, value = (("context_order", context_order) if context_order != "contiguous" else
                   ("context_strategy", context_strategy))
    raise ValueError(f"{name}={value!r} is for a sequence sharded over a mesh axis "
                     "(context_axis= inside shard_map, or an Explicit or Auto mesh)")
  opts, q_segment_ids, kv_segment_ids = _prepare(
      q, k, v, causal=causal, scale=scale, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids, sliding_window=sliding_window,
      logit_softcap=logit_softcap, deterministic=deterministic, context=context)
  return_lse = _checks.static_bool("return_lse", return_lse)
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  implementations = _dispatch.resolve(implementation, IMPLEMENTATIONS, _default())
  (b, t, hq, d), s = q.shape, k.shape[1]
  if b * t * hq == 0 or s == 0:  # no output, or no key to see: output 0, lse -inf
    out = jnp.zeros(q.shape, q.dtype)
    lse = jnp.full((b, hq, t), -jnp.inf, jnp.float32)
  else:
    if d == 0:  # every score is 0, as with one zero feature (its output column is dropped)
      q, k, v = (jnp.pad(a, ((0, 0),) * 3 + ((0, 1),)) for a in (q, k, v))
    if mask is None:
      call = lambda impl: impl(q, k, v, q_segment_ids, kv_segment_ids, opts=opts)
    else:
      call = _masked(q, k, v, q_segment_ids, kv_segment_ids, _check_mask(mask, b, hq, t, s),
                     opts)
    out, lse = _dispatch.first_that_serves(implementations, call)
    if d == 0:
      out = out[..., :0]
  if return_lse:
    return out, jnp.moveaxis(lse, 1, 2)
  return out


def flash_attention_backward(q, k, v, out, lse, d_out, d_lse=None, *, causal=False, scale=None,
                             q_segment_ids=None, kv_segment_ids=None, sliding_window=None,
                             logit_softcap=None, query_seq_lengths=None,
                             key_value_seq_lengths=None, deterministic=True,
                             implementation=None):
  """(dq, dk, dv) of flash_attention from its saved output and log-sum-exp.

  For callers that keep their own residuals (the PyTorch bridge): out [B, T, Hq, D] and
  lse [B, T, Hq] as flash_attention(..., return_lse=True) returned them, d_out like out,
  d_lse like lse or None. Options must equal the forward call's. No forward pass is run
  (the reference implementation excepted: it recomputes).
  """
  q_segment_ids, kv_segment_ids = _length_segments(q, k, q_segment_ids, kv_segment_ids,
                                                   query_seq_lengths, key_value_seq_lengths)
  opts, q_segment_ids, kv_segment_ids = _prepare(
      q, k, v, causal=causal, scale=scale, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids, sliding_window=sliding_window,
      logit_softcap=logit_softcap, deterministic=deterministic)
  lse = jnp.moveaxis(jnp.asarray(lse, jnp.float32), 2, 1)  # public [B, T, H] -> [B, H, T]
  d_lse = jnp.zeros_like(lse) if d_lse is None else jnp.moveaxis(
      jnp.asarray(d_lse, jnp.float32), 2, 1)
  return _dispatch.first_that_serves(
      _dispatch.resolve(implementation, IMPLEMENTATIONS, _default()),
      lambda impl: impl.backward(q, k, v, q_segment_ids, kv_segment_ids, out, lse, d_out,
                                 d_lse, opts=opts))
