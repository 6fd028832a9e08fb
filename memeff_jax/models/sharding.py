"""Sharding rules of memeff_jax.models.Llama for a mesh of "data", "fsdp" and "tensor" axes
(any of them may be missing or of size 1), as MaxText lays out a decoder:

- the batch is sharded over data × fsdp (data parallelism, FSDP's activations);
- every weight's model dimension D over fsdp (FSDP: gathered by XLA where a layer uses it);
- the heads, the MLP's hidden units and the vocabulary over tensor (tensor parallelism: the
  attention runs per head shard, the loss per vocabulary shard, see
  docs/design/multi_device.md).

The optimizer's moments take their parameter's sharding. A dimension that the mesh axis
does not divide stays replicated. The mesh's axes are Auto: XLA propagates the shardings
through the model, and the ops' custom partitionings keep their Pallas kernels per shard.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")

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


def activations(x):
  """x [B, ...] (the residual stream, the final hidden states) with its batch over the
  data × fsdp axes of the mesh in context and its other dimensions whole; x itself outside
  a mesh. Without it XLA's propagation carries the weights' fsdp-sharded D into the
  activations and partitions each matmul over its contraction, all-reducing [B, T, F]
  activations of the whole batch in every layer where FSDP gathers weights instead."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  axes = tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)
  if not axes or x.shape[0] % _size(mesh, axes):
    return x
  return jax.lax.with_sharding_constraint(x, P(axes, *(None,) * (x.ndim - 1)))


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


def batch_sharding(mesh) -> NamedSharding:
  """Tokens, labels and segment ids [B, T]: the batch over data × fsdp."""
  axes = tuple(a for a in ("data", "fsdp") if a in mesh.shape and mesh.shape[a] > 1)
  return NamedSharding(mesh, P(axes or None))
