"""Sharding rules of memeff_jax.models.Llama for a mesh of "data", "fsdp", "tensor" and
"context" axes (any of them may be missing or of size 1), as MaxText lays out a decoder:

- the batch is sharded over data × fsdp (data parallelism, FSDP's activations);
- the sequence over context (context parallelism: flash_attention's `context_axis`, the keys
  and values gathered or passed round the ring);
- every weight's model dimension D over fsdp (FSDP: gathered by XLA where a layer uses it);
- the heads, the MLP's hidden units and the vocabulary over tensor (tensor parallelism: the
  attention runs per head shard, the loss per vocabulary shard, see
  docs/design/multi_device.md); with sequence parallelism the residual stream's sequence
  over tensor too, gathered and reduce-scattered around each block's branches.

The optimizer's moments take their parameter's sharding. A dimension that the mesh axis
does not divide stays replicated. The mesh's axes are Auto: XLA propagates the shardings
through the model, and the ops' custom partitionings keep their Pallas kernels per shard.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from memeff_jax.ops.flash_attention import zigzag

AXES = ("data", "fsdp", "tensor", "context")

# The last two names of a parameter's path -> the mesh axes of its dimensions (a stacked
# block's parameters have the layer axis in front, unsharded).
_RULES = {
    ("embed", "embedding"): ("tensor", "fsdp"),  # [V, D]
    ("lm_head", "kernel"): ("fsdp", "tensor"),  # [D, V]
    ("q_proj", "kernel"): ("fsdp", "tensor"),  # [D, H·hd]
    ("k_proj", "kernel"): ("fsdp", "tensor"),
    ("v_proj", "kernel"): ("fsdp", "tensor"),
    ("o_proj", "kernel"): ("tensor", "fsdp"),  # [H·hd, D]
    ("gate", "kernel"): ("fsdp", "tensor"),  # [D, F]
    ("up", "kernel"): ("fsdp", "tensor"),
    ("down", "kernel"): ("tensor", "fsdp"),  # [F, D]
}


def make_mesh(sizes: dict[str, int]) -> jax.sharding.Mesh:
  """An Auto mesh of the named axes (from "data", "fsdp", "tensor") over the first
  prod(sizes) devices."""
  unknown = set(sizes) - set(AXES)
  if unknown:
    raise ValueError(f"mesh axes must be among {AXES}, got {sorted(unknown)}")
  n = 1
  for size in sizes.values():
    if size < 1:
      raise ValueError(f"mesh axis sizes must be ≥ 1, got {sizes}")
    n *= size
  if n > jax.device_count():
    raise ValueError(f"the mesh {sizes} needs {n} devices, this process sees "
                     f"{jax.device_count()}")
  names = tuple(sizes)
  return jax.make_mesh(tuple(sizes.values()), names, axis_types=(AxisType.Auto,) * len(names),
                       devices=jax.devices()[:n])


def parse_mesh(text: str) -> dict[str, int]:
  """"data=2,fsdp=2,tensor=2" -> {"data": 2, "fsdp": 2, "tensor": 2}."""
  sizes = {}
  for part in filter(None, text.split(",")):
    name, _, size = part.partition("=")
    if not size.isdigit():
      raise ValueError(f"--mesh takes name=size pairs like data=2,tensor=2, got {text!r}")
    sizes[name.strip()] = int(size)
  return sizes


def _spec(mesh, axes, shape) -> P:
  """The PartitionSpec of a parameter of `shape` whose trailing dims want `axes`."""
  lead = (None,) * (len(shape) - len(axes))
  dims = []
  for axis, size in zip(axes, shape[len(lead):]):
    ok = axis in mesh.shape and mesh.shape[axis] > 1 and size % mesh.shape[axis] == 0
    dims.append(axis if ok else None)
  return P(*lead, *dims)


def state_shardings(state, mesh):
  """NamedShardings for a train state (parameters and optimizer moments) by _RULES."""
  def sharding(path, leaf):
    names = tuple(k.key for k in path if isinstance(getattr(k, "key", None), str))
    axes = _RULES.get(names[-2:], ())
    shape = getattr(leaf, "shape", ())
    return NamedSharding(mesh, _spec(mesh, axes, shape) if axes and len(shape) >= 2 else P())
  return jax.tree_util.tree_map_with_path(sharding, state)


def activations(x, sequence_parallel: bool = False):
  """x [B, T, ...] (the residual stream, the final hidden states) with its batch over the
  data × fsdp axes of the mesh in context, its sequence over context (with
  `sequence_parallel`, over tensor) and its other dimensions whole; x itself outside a mesh.
  Without it XLA's propagation carries the weights' fsdp-sharded D into the activations and
  partitions each matmul over its contraction, all-reducing [B, T, F] activations of the
  whole batch in every layer where FSDP gathers weights instead."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  batch, seq = _token_axes(mesh, x.shape, sequence_parallel)
  if not batch and not seq:
    return x
  return jax.lax.with_sharding_constraint(x, P(batch or None, seq, *(None,) * (x.ndim - 2)))


def whole_sequence(x):
  """x [B, T, ...] with its batch laid out as `activations` lays it out and its sequence and
  other dimensions whole (replicated over tensor): a sequence-parallel branch's input,
  gathered before its first matmuls; x itself outside a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  batch, _ = _token_axes(mesh, x.shape)
  return jax.lax.with_sharding_constraint(x, P(batch or None, *(None,) * (x.ndim - 1)))


@jax.custom_vjp
def gather_sequence(x):
  """Sequence parallelism's gather: x [B, T, ...], sharded on the sequence over tensor,
  whole on every tensor rank (whole_sequence); its cotangent, partial sums over the
  tensor ranks, reduce-scattered back to the sequence shards."""
  return whole_sequence(x)


def _gather_fwd(x):
  return whole_sequence(x), None


def _gather_bwd(_, ct):
  return (activations(ct, sequence_parallel=True),)


gather_sequence.defvjp(_gather_fwd, _gather_bwd)


@jax.custom_vjp
def scatter_sequence(x):
  """Sequence parallelism's reduce-scatter: x [B, T, ...], partial sums over the tensor ranks
  (a row-parallel matmul's output), summed onto the sequence shards; its cotangent gathered
  whole, so that the matmul's backward runs on whole sequences, as its forward did."""
  return activations(x, sequence_parallel=True)


def _scatter_fwd(x):
  return activations(x, sequence_parallel=True), None


def _scatter_bwd(_, ct):
  return (whole_sequence(ct),)


scatter_sequence.defvjp(_scatter_fwd, _scatter_bwd)


def tensor_sharded(x, dim: int):
  """x [B, T, ...] (a projection's heads, the MLP's hidden units) with dimension `dim` over
  tensor, its batch and sequence laid out as `activations` lays them out and its other
  dimensions whole; x itself outside a mesh or where tensor does not divide the dimension.
  Under sequence parallelism XLA's propagation otherwise carries the residual stream's
  sequence sharding into the matmuls and gathers their weights."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.shape.get("tensor", 1) == 1 or x.shape[dim] % mesh.shape["tensor"]:
    return x
  batch, seq = _token_axes(mesh, x.shape)
  spec = [batch or None, seq] + [None] * (x.ndim - 2)
  spec[dim] = "tensor"
  return jax.lax.with_sharding_constraint(x, P(*spec))


def _token_axes(mesh, shape, sequence_parallel: bool = False) -> tuple:
  """(the batch's axes, the sequence's axis or None) for an array of `shape` [B, T, ...] on
  `mesh`, where they divide those dimensions: the sequence over context, or with
  `sequence_parallel` over tensor."""
  batch = _batch_axes(mesh)
  if batch and shape[0] % _size(mesh, batch):
    batch = ()
  seq = "context" if mesh.shape.get("context", 1) > 1 else None
  if sequence_parallel and mesh.shape.get("tensor", 1) > 1:
    if seq:
      raise ValueError("sequence_parallel shards the sequence over the tensor axis, which "
                       f"cannot combine with a context axis (mesh {dict(mesh.shape)})")
    seq = "tensor"
  if seq and shape[1] % mesh.shape[seq]:
    seq = None
  return batch, seq


def _batch_axes(mesh) -> tuple:
  """The axes the batch is sharded over: data × fsdp, those of size > 1."""
  return tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)


def tokens(x, sequence_parallel: bool = False):
  """x [B, T, ...] flattened to [B·T, ...], its tokens sharded over the batch's and the
  sequence's axes together on the mesh in context (XLA, left alone, gathers a sequence
  sharded over context before the flattened loss)."""
  flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return flat
  batch, seq = _token_axes(mesh, x.shape, sequence_parallel)
  axes = batch + ((seq,) if seq else ())
  if not axes:
    return flat
  return jax.lax.with_sharding_constraint(flat, P(axes, *(None,) * (flat.ndim - 1)))


def context_attention(attend, q, k, v, segment_ids):
  """attend(q, k, v, segment_ids, context_axis) per shard under jax.shard_map where the mesh
  in context has a "context" axis (the sequence sharded over it, the batch over data ×
  fsdp, the heads over tensor where it divides both head counts); attend(..., None) itself
  elsewhere."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.shape.get("context", 1) == 1:
    return attend(q, k, v, segment_ids, None)
  batch, seq = _token_axes(mesh, q.shape)
  if seq is None:
    raise ValueError(f"the sequence ({q.shape[1]}) must split evenly over the context axis "
                     f"({mesh.shape['context']})")
  tensor = mesh.shape.get("tensor", 1)
  heads = "tensor" if tensor > 1 and q.shape[2] % tensor == 0 == k.shape[2] % tensor else None
  spec = P(batch or None, seq, heads, None)  # q, k, v and the output alike
  ids = None if segment_ids is None else P(batch or None, seq)
  # check_vma=False: the one call inside is the attention's explicit forward and backward (one
  # custom_vjp), which needs no type checks.
  return jax.shard_map(lambda q, k, v, ids: attend(q, k, v, ids, seq), mesh=mesh,
                       in_specs=(spec, spec, spec, ids), out_specs=spec,
                       check_vma=False)(q, k, v, segment_ids)


def gathered(w, dim: int):
  """w with dimension `dim` whole (gathered where fsdp shards it) and its other dimensions
  left to XLA, on the mesh in context; w itself outside a mesh."""
  if jax.sharding.get_abstract_mesh().empty:
    return w
  spec = [P.UNCONSTRAINED] * w.ndim
  spec[dim] = None
  return jax.lax.with_sharding_constraint(w, P(*spec))


def in_mesh(fn, mesh):
  """fn traced with `mesh` in context (for `activations`)."""
  def call(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)
  return call


def _size(mesh, axes) -> int:
  n = 1
  for a in axes:
    n *= mesh.shape[a]
  return n


def context_batch(batch: dict, mesh, order: str) -> dict:
  """batch (tokens, labels, segment ids [B, T]) as a model with `context_order=order` takes
  it on `mesh`: with "zigzag" and a context axis, every array's sequence in the zig-zag
  order over that axis (flash_attention's `zigzag`) and the tokens' positions beside them
  (the loss, a mean over tokens, is the same in any order); otherwise batch itself."""
  shards = 1 if mesh is None else mesh.shape.get("context", 1)
  if order != "zigzag" or shards == 1:
    return batch
  tokens = batch["tokens"]
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  return {name: np.asarray(zigzag(np.asarray(x), shards))
          for name, x in dict(batch, positions=positions).items()}


def batch_sharding(mesh) -> NamedSharding:
  """Tokens, labels and segment ids [B, T]: the batch over data × fsdp, the sequence over
  context."""
  axes = _batch_axes(mesh)
  if mesh.shape.get("context", 1) > 1:
    return NamedSharding(mesh, P(axes or None, "context"))
  return NamedSharding(mesh, P(axes or None))
