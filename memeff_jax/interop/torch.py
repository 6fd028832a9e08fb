"""PyTorch bridge: memeff_jax's ops on torch tensors, zero-copy through DLPack.

    from memeff_jax.interop import torch as mt
    loss = mt.linear_cross_entropy(hidden, lm_head.weight, labels)   # torch conventions
    out = mt.flash_attention(q, k, v, causal=True, layout="bhtd")
    loss.backward()

Conventions are torch's: the weight is [V, D] as in nn.Linear, labels are integer class ids
(int64 as F.cross_entropy takes them), ignore_index=-100, and the option names of
F.cross_entropy where they overlap.

Both ops are `torch.library.custom_op`s with `register_fake` and `register_autograd`, so
`torch.compile(fullgraph=True)` traces a model that calls them without graph breaks.
Residuals are torch tensors (zero-copy views of the JAX buffers) saved with
`ctx.save_for_backward`, so they are freed right after backward and pass through
`torch.autograd.graph.saved_tensors_hooks` (e.g. CPU offload). None is kept on ctx attributes.

Memory: importing this module sets XLA_PYTHON_CLIENT_PREALLOCATE=false when it is unset and
JAX has not started a backend yet, so JAX allocates on demand instead of taking 75% of the
GPU that torch needs. If JAX has already started, a warning says so; set the variable
before importing JAX.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple
import warnings

import jax
from jax._src import xla_bridge as _xla_bridge
from jax._src import lib as _jax_lib

if "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ:
  if _xla_bridge.backends_are_initialized():
    warnings.warn("memeff_jax.interop.torch: JAX has already started with its default "
                  "preallocation (75% of GPU memory); set XLA_PYTHON_CLIENT_PREALLOCATE=false "
                  "before importing JAX so that torch keeps its memory")
  else:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from memeff_jax.ops import _dispatch  # noqa: E402
from memeff_jax.ops import flash_attention as _fa  # noqa: E402
from memeff_jax.ops.linear_cross_entropy import linear_cross_entropy as _lce  # noqa: E402
from memeff_jax.ops.linear_cross_entropy import IMPLEMENTATIONS as _LCE_NAMES  # noqa: E402
from memeff_jax.ops.linear_cross_entropy import Int64Labels  # noqa: E402

__all__ = ["to_jax", "to_torch", "linear_cross_entropy", "flash_attention",
           "LinearCrossEntropyLoss", "wrap"]

_WIDE = tuple(d for d in (torch.int64, torch.float64, torch.complex128,
                          getattr(torch, "uint64", None)) if d is not None)


# ----------------------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------------------


def _exportable(t: torch.Tensor) -> torch.Tensor:
  """t checked and made ready for a DLPack export: detached, contiguous (a copy if not)."""
  if not isinstance(t, torch.Tensor):
    raise TypeError(f"to_jax expects a torch.Tensor, got {type(t).__name__}")
  if t.dtype in _WIDE and not jax.config.jax_enable_x64:
    narrow = "torch.float32" if t.dtype.is_floating_point else "torch.int32"
    raise TypeError(f"to_jax got a {t.dtype} tensor; with jax_enable_x64 off JAX would "
                    f"narrow it, so convert explicitly, e.g. t.to({narrow})")
  t = t.detach()
  return t if t.is_contiguous() else t.contiguous()


def to_jax(t: torch.Tensor) -> jax.Array:
  """A torch tensor as a jax.Array on the same device, sharing its memory.

  Zero-copy for contiguous tensors (bf16 included). A non-contiguous tensor is copied once
  (`t.contiguous()`), since DLPack in JAX takes dense row-major buffers only. On CUDA, DLPack
  makes JAX's stream wait for torch's current stream, so pending torch writes are seen.
  64-bit tensors (int64, float64) raise unless `jax_enable_x64` is on: JAX would otherwise
  narrow them silently; convert explicitly (`t.to(torch.int32)`, `t.to(torch.float32)`). A
  tensor that requires grad is detached (autograd goes through the ops below, not through
  this function).
  """
  t = _exportable(t)
  return _import(t, _ready_stream(t), synced=False)


def to_torch(a: jax.Array) -> torch.Tensor:
  """A jax.Array as a torch tensor on the same device, sharing its memory (zero-copy).

  The torch tensor keeps the JAX buffer alive; deleting it releases the buffer. On CUDA,
  DLPack makes torch's current stream wait for the JAX computation that produced `a`.
  """
  return torch.from_dlpack(a)


_DL_CPU, _DL_CUDA = 1, 2  # DLPack device types


@functools.lru_cache(maxsize=None)
def _jax_device(dl_type: int, dl_id: int):
  """The JAX device of a DLPack (device type, id): CPU or CUDA."""
  backend = _xla_bridge.get_backend("cpu" if dl_type == _DL_CPU else "cuda")
  return backend.device_from_local_hardware_id(dl_id)


def _ready_stream(t: torch.Tensor):
  """JAX's stream for the ready events of buffers imported on t's CUDA device (None on CPU)."""
  if not t.is_cuda:
    return None
  return _jax_device(_DL_CUDA, t.device.index or 0).get_stream_for_external_ready_events()


# jaxlib's DLPack import as jax.dlpack.from_dlpack calls it (jaxlib extension 467 and later),
# without that function's Python around it (a backend and device lookup per call, and
# jnp.asarray to canonicalize the dtype, a no-op here: _exportable lets no 64-bit dtype
# through without x64), which runs for every tensor of every call (docs/design/torch_bridge.md).
_fast_import = (getattr(_jax_lib._jax, "dlpack_managed_tensor_to_buffer", None)
                if _jax_lib.jaxlib_extension_version >= 467 else None)


def _import(t: torch.Tensor, stream, synced: bool) -> jax.Array:
  """An exportable tensor as a jax.Array. On CUDA, `stream` is `_ready_stream(t)`; the export
  makes it wait for torch's current stream unless `synced` (an earlier input of the same
  call did). Tensors on other DLPack devices (pinned host memory) take the public path."""
  global _fast_import
  dl_type, dl_id = (int(i) for i in t.__dlpack_device__())
  if _fast_import is not None and dl_type in (_DL_CPU, _DL_CUDA):
    capsule = t.__dlpack__(stream=-1 if synced else stream) if t.is_cuda else t.__dlpack__()
    try:
      return _fast_import(capsule, _jax_device(dl_type, dl_id), stream, None, dl_type)
    except TypeError:  # a jaxlib whose signature moved on: the public path from now on
      _fast_import = None
  return jax.dlpack.from_dlpack(_Ordered(t) if synced else t)


class _Ordered:
  """A CUDA tensor exported without torch's stream handshake (DLPack stream -1), for the
  inputs of one call after the first: importing the first made JAX's stream wait for
  torch's, and the call's computation waits for every input's import, so the later ones
  are ordered after the same torch work. Saves one event, wait and stream object each."""

  __slots__ = ("tensor",)

  def __init__(self, tensor: torch.Tensor):
    self.tensor = tensor

  def __dlpack_device__(self):
    return self.tensor.__dlpack_device__()

  def __dlpack__(self, *, stream=None, **kwargs):
    del stream
    return self.tensor.__dlpack__(stream=-1, **kwargs)


def _to_jax_call(*tensors):
  """to_jax of one call's inputs (None stays None), with one stream handshake on CUDA: the
  first tensor's import synchronizes JAX with torch's current stream, the rest are ordered
  after it (DLPack stream -1, `_Ordered`)."""
  out, stream = [], None
  for t in tensors:
    if t is None:
      out.append(None)
      continue
    t = _exportable(t)
    synced = stream is not None and t.is_cuda
    if t.is_cuda and stream is None:
      stream = _ready_stream(t)
    out.append(_import(t, stream if t.is_cuda else None, synced))
  return out


def _label_words(labels: torch.Tensor) -> torch.Tensor:
  """int64 labels as their int32 words [..., 2] (a view; non-contiguous labels are made
  contiguous first, one copy); other integer dtypes as they are."""
  if labels.dtype != torch.int64:
    return labels
  labels = labels.contiguous()
  return labels.reshape(-1).view(torch.int32).view(*labels.shape, 2)


def _labels_from(labels: torch.Tensor, imported: jax.Array):
  """The JAX loss's labels from the import of `_label_words(labels)`: int64 ids as
  `Int64Labels` (JAX without x64 holds no int64), others as they are."""
  return Int64Labels(imported) if labels.dtype == torch.int64 else imported


def _lce_arrays(x, weight, bias, labels, *more):
  """The loss's JAX inputs (x, W, bias, labels, *more) for one call, by `_to_jax_call`."""
  jx, jw, jb, jy, *rest = _to_jax_call(x, weight, bias, _label_words(labels), *more)
  return (jx, jw, jb, _labels_from(labels, jy), *rest)


def _empty(like: torch.Tensor) -> torch.Tensor:
  return like.new_empty(0)


def _on(t: torch.Tensor):
  """Runs JAX on the tensor's device: a CPU tensor in a process whose JAX default is the
  GPU is computed on JAX's CPU backend (with the CPU implementations)."""
  platform = "gpu" if t.is_cuda else "cpu"
  devices = [d for d in jax.devices(platform)
             if platform == "cpu" or d.id == (t.device.index or 0)]
  return jax.default_device(devices[0])


# ----------------------------------------------------------------------------------------
# linear_cross_entropy
# ----------------------------------------------------------------------------------------


# Implementation objects (and sequences) and token_loss functions passed to the bridge, under
# the string keys that the custom ops carry (a torch.library schema has no slot for a Python
# object).
_OBJECTS: dict[str, object] = {}
_TOKEN_LOSSES: set[str] = set()  # the keys of token_loss functions
_MANY_TOKEN_LOSSES = 16  # distinct token_loss functions seen when the bridge warns


def _registered(obj) -> str:
  """The "@<n>" key of an object, registered on first sight (found again by ==, which is
  identity for functions)."""
  for key, known in _OBJECTS.items():
    if known == obj:
      return key
  key = f"@{len(_OBJECTS)}"
  _OBJECTS[key] = obj
  return key


def _implementation_key(implementation) -> str:
  """"" for the default, a name as it is, an object or sequence as a registered key."""
  if implementation is None:
    return ""
  _dispatch.resolve(implementation, _LCE_NAMES, ())  # refuses unknown names up front
  if isinstance(implementation, str):
    return implementation
  if not isinstance(implementation, tuple) and not callable(implementation):
    implementation = tuple(implementation)
  return _registered(implementation)


def _token_loss_key(token_loss) -> str:
  """"" for the cross-entropy, a token_loss function as a registered key. Each function
  object compiles the loss anew, so one made inside a training loop warns."""
  if token_loss is None:
    return ""
  key = _registered(token_loss)
  if key not in _TOKEN_LOSSES and len(_TOKEN_LOSSES) + 1 == _MANY_TOKEN_LOSSES:
    warnings.warn(f"memeff linear_cross_entropy: {_MANY_TOKEN_LOSSES} distinct token_loss "
                  "functions so far; each one compiles the loss anew. Define the token_loss "
                  "once (not a new lambda or partial per step) and pass what changes as "
                  "token_loss_args.")
  _TOKEN_LOSSES.add(key)
  return key


class _Static(NamedTuple):
  """The static options of a loss call, in the custom ops' terms: the key of its jitted
  JAX functions."""
  reduction: str
  ignore_index: int
  label_smoothing: float
  z_loss: float
  logit_softcap: float | None
  chunk_size: int | None
  implementation: str  # "" (the default), a name, or a key of _OBJECTS
  token_loss: str  # "" (the cross-entropy) or a key of _OBJECTS
  token_entropy: bool  # the token_loss takes each token's entropy
  entropy: bool  # each token's entropy is an output
  has_bias: bool
  weights_grad: bool  # the token weights get a gradient
  args_grad: bool  # the token_loss's arguments get a gradient

  @classmethod
  def of(cls, bias, ignore_index, reduction, label_smoothing, z_loss, logit_softcap,
         chunk_size, implementation, token_loss, token_entropy, weights_grad, args_grad,
         entropy) -> "_Static":
    return cls(reduction, int(ignore_index), float(label_smoothing), float(z_loss),
               None if logit_softcap is None else float(logit_softcap),
               None if chunk_size is None else int(chunk_size), implementation, token_loss,
               bool(token_entropy), bool(entropy), bias is not None, bool(weights_grad),
               bool(args_grad))


def _without_entropy(token_loss, log_prob, entropy, *args):
  del entropy
  return token_loss(log_prob, *args)


@functools.lru_cache(maxsize=None)
def _lce_fns(static: _Static):
  """Jitted JAX functions of (x, W, bias, labels, token_weights, loss_args) for one set of
  options: value, value+unit grads, and vjp. loss_args is the token_loss's arguments
  stacked on a last axis [..., k] (or None). The value is the loss, or with `entropy` the
  pair (loss, each token's entropy), whose entropy the unit grads leave out (an aux output)
  and the vjp takes a cotangent for. The grads are those of x, W, then the bias, the token
  weights and loss_args where `_Static` asks for them (otherwise these are constants, and
  the loss keeps no per-token statistics for their gradients)."""
  token_loss = _OBJECTS[static.token_loss] if static.token_loss else None
  if token_loss is not None and static.entropy and not static.token_entropy:
    # JAX's token_loss takes the entropy whenever it is computed; this one returns it only.
    token_loss = functools.partial(_without_entropy, token_loss)
  opts = dict(weight_layout="vd", reduction=static.reduction,
              ignore_index=static.ignore_index, label_smoothing=static.label_smoothing,
              z_loss=static.z_loss, logit_softcap=static.logit_softcap,
              chunk_size=static.chunk_size, token_loss=token_loss,
              entropy=static.entropy or static.token_entropy, return_aux=static.entropy,
              implementation=_OBJECTS.get(static.implementation, static.implementation or None))

  def loss(x, w, b, y, tw, loss_args):
    args = () if loss_args is None else tuple(loss_args[..., i]
                                              for i in range(loss_args.shape[-1]))
    out = _lce(x, w, y, bias=b, token_weights=tw, token_loss_args=args, **opts)
    return (out[0], out[1].entropy) if static.entropy else out

  argnums = ((0, 1) + ((2,) if static.has_bias else ()) + ((4,) if static.weights_grad else ())
             + ((5,) if static.args_grad else ()))
  value = jax.jit(loss)
  # For mean/sum the library computes the gradients inside the forward (three matmuls); the
  # gradient of a unit cotangent is what the torch backward scales.
  # With the entropy, (loss, entropy) is value_and_grad's (value, aux).
  value_and_grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=static.entropy))

  def vjp(x, w, b, y, tw, loss_args, g):
    args = (x, w, b, y, tw, loss_args)

    def of_differentiated(*diff):
      chosen = dict(zip(argnums, diff))
      return loss(*(chosen.get(i, a) for i, a in enumerate(args)))

    return jax.vjp(of_differentiated, *(args[i] for i in argnums))[1](g)

  return value, value_and_grads, jax.jit(vjp)


def _lce_grads(grads, x, static: _Static):
  """(dx, dW, db, d token_weights, d loss_args) as torch tensors from the JAX grads in
  `_lce_fns`'s order, an empty tensor for each one not computed."""
  grads = [to_torch(g) for g in grads]
  db = grads.pop(2) if static.has_bias else _empty(x)
  dtw = grads.pop(2) if static.weights_grad else _empty(x)
  dargs = grads.pop(2) if static.args_grad else _empty(x)
  return grads[0], grads[1], db, dtw, dargs


_GRADS = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@torch.library.custom_op("memeff::linear_cross_entropy", mutates_args=())
def _lce_op(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
            bias: torch.Tensor | None, token_weights: torch.Tensor | None,
            loss_args: torch.Tensor | None, ignore_index: int, reduction: str,
            label_smoothing: float, z_loss: float, logit_softcap: float | None,
            chunk_size: int | None, implementation: str, token_loss: str,
            token_entropy: bool, with_grads: bool, weights_grad: bool, args_grad: bool,
            entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                    torch.Tensor, torch.Tensor, torch.Tensor]:
  """(loss, entropy, dx, dW, db, d token_weights, d loss_args): the entropy with `entropy`,
  the gradients of a unit loss cotangent when with_grads (mean/sum), d token_weights and
  d loss_args only where asked for; an empty tensor for each one not computed."""
  static = _Static.of(bias, ignore_index, reduction, label_smoothing, z_loss, logit_softcap,
                      chunk_size, implementation, token_loss, token_entropy, weights_grad,
                      args_grad, entropy)
  value, value_and_grads, _ = _lce_fns(static)
  args = _lce_arrays(x, weight, bias, labels, token_weights, loss_args)
  with _on(x):
    if not with_grads:
      out, grads = value(*args), None
    else:
      out, grads = value_and_grads(*args)
  loss, ent = (to_torch(out[0]), to_torch(out[1])) if entropy else (to_torch(out), _empty(x))
  if grads is None:
    return (loss, ent) + tuple(_empty(x) for _ in range(5))
  return (loss, ent) + _lce_grads(grads, x, static)


def _fake_grads(x, weight, bias, token_weights, loss_args, weights_grad, args_grad):
  db = torch.empty_like(bias) if bias is not None else x.new_empty(0)
  dtw = torch.empty_like(token_weights) if weights_grad else x.new_empty(0)
  dargs = torch.empty_like(loss_args) if args_grad else x.new_empty(0)
  return torch.empty_like(x), torch.empty_like(weight), db, dtw, dargs


@_lce_op.register_fake
def _(x, weight, labels, bias, token_weights, loss_args, ignore_index, reduction,
      label_smoothing, z_loss, logit_softcap, chunk_size, implementation, token_loss,
      token_entropy, with_grads, weights_grad, args_grad, entropy):
  loss = x.new_empty(labels.shape if reduction == "none" else (), dtype=torch.float32)
  ent = x.new_empty(labels.shape, dtype=torch.float32) if entropy else x.new_empty(0)
  if not with_grads:
    return (loss, ent) + tuple(x.new_empty(0) for _ in range(5))
  return (loss, ent) + _fake_grads(x, weight, bias, token_weights, loss_args, weights_grad,
                                   args_grad)


@torch.library.custom_op("memeff::linear_cross_entropy_backward", mutates_args=())
def _lce_bwd_op(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                bias: torch.Tensor | None, token_weights: torch.Tensor | None,
                loss_args: torch.Tensor | None, grad: torch.Tensor,
                grad_entropy: torch.Tensor | None, ignore_index: int, label_smoothing: float,
                z_loss: float, logit_softcap: float | None, chunk_size: int | None,
                implementation: str, token_loss: str, token_entropy: bool,
                weights_grad: bool, args_grad: bool) -> _GRADS:
  """(dx, dW, db, d token_weights, d loss_args) for each token's loss cotangent (of
  reduction "none") and the entropy's (or None): recomputes the chunks."""
  static = _Static.of(bias, ignore_index, "none", label_smoothing, z_loss, logit_softcap,
                      chunk_size, implementation, token_loss, token_entropy, weights_grad,
                      args_grad, entropy=grad_entropy is not None)
  *args, g, g_entropy = _lce_arrays(x, weight, bias, labels, token_weights, loss_args, grad,
                                    grad_entropy)
  with _on(x):
    grads = _lce_fns(static)[2](*args, (g, g_entropy) if static.entropy else g)
  return _lce_grads(grads, x, static)


@_lce_bwd_op.register_fake
def _(x, weight, labels, bias, token_weights, loss_args, grad, grad_entropy, ignore_index,
      label_smoothing, z_loss, logit_softcap, chunk_size, implementation, token_loss,
      token_entropy, weights_grad, args_grad):
  return _fake_grads(x, weight, bias, token_weights, loss_args, weights_grad, args_grad)


def _lce_setup(ctx, inputs, output):
  (x, weight, labels, bias, token_weights, loss_args, ignore_index, reduction,
   label_smoothing, z_loss, softcap, chunk_size, implementation, token_loss, token_entropy,
   _, weights_grad, args_grad, entropy) = inputs
  ctx.static = _Static.of(bias, ignore_index, reduction, label_smoothing, z_loss, softcap,
                          chunk_size, implementation, token_loss, token_entropy, weights_grad,
                          args_grad, entropy)
  ctx.scaled = False
  # Only the loss and entropy are differentiated; without this autograd would fill [N, D]
  # and [V, D] zero gradients for the other outputs before every backward.
  ctx.set_materialize_grads(False)
  # The inputs, to recompute from (saving them copies nothing): for "none", and for an
  # entropy, whose cotangent the forward's unit gradients leave out.
  inputs = (x, weight, labels, bias, token_weights, loss_args)
  if reduction == "none":
    ctx.save_for_backward(*inputs)
  else:  # the unit gradients the forward computed
    ctx.save_for_backward(*output[2:], *(inputs if entropy else ()))


def _tracing(t: torch.Tensor) -> bool:
  """True while torch.compile traces, when values cannot be read. AOTAutograd traces the
  backward with fake/functional tensor subclasses, and on some torch releases (2.11) outside
  torch.compiler.is_compiling(); eager gradients are plain tensors."""
  return torch.compiler.is_compiling() or type(t) is not torch.Tensor  # pylint: disable=unidiomatic-typecheck


@functools.lru_cache(maxsize=None)
def _scale_kernel():
  """A Triton kernel (torch's CUDA builds ship Triton) that multiplies a flat tensor by the
  scalar at g_ptr in place, unless that scalar is 1: then each program reads it and returns.
  None where Triton is not importable."""
  try:
    import triton  # pylint: disable=import-outside-toplevel
    import triton.language as tl  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None

  @triton.jit
  def scale_unless_one(ptr, n, g_ptr, BLOCK: tl.constexpr):
    g = tl.load(g_ptr).to(tl.float32)
    if g != 1.0:
      for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < n
        v = tl.load(ptr + offsets, mask=mask)
        tl.store(ptr + offsets, (v.to(tl.float32) * g).to(v.dtype), mask=mask)

  return scale_unless_one


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
  return torch.cuda.get_device_properties(index).multi_processor_count


def _scale_unless_one(tensors, g: torch.Tensor):
  """t *= g for each tensor (the unit gradients, ours alone), skipped when g is 1, as it is
  from loss.backward(). On CUDA the test is made on the GPU by `_scale_kernel`, so the
  backward does not wait for the forward to finish: a host sync there leaves the GPU idle
  while the host runs the rest of the backward (docs/design/torch_bridge.md). Without
  Triton, on CPU, or for a g that is not one element: reading g (one sync), as Liger-Kernel
  does, is still cheaper than a pass over dW."""
  kernel = _scale_kernel() if g.is_cuda else None
  if g.numel() != 1:
    for t in tensors:
      t.mul_(g)
  elif kernel is None or any(not t.is_contiguous() or t.numel() >= 2**31 for t in tensors):
    if g.item() != 1.0:
      for t in tensors:
        t.mul_(g)
  else:
    block, programs = 4096, 4 * _multiprocessors(g.device.index or 0)
    for t in tensors:
      if t.numel():
        kernel[(min(programs, -(-t.numel() // block)),)](t, t.numel(), g, BLOCK=block)


def _lce_backward(ctx, g_loss, g_entropy, *unused):
  del unused
  static = ctx.static
  if g_loss is None and g_entropy is None:  # nothing flowed into the outputs
    return (None,) * 19
  if static.reduction == "none" or g_entropy is not None:  # recompute, for the cotangents
    x, weight, labels, bias, token_weights, loss_args = ctx.saved_tensors[-6:]
    if g_loss is None:
      g_loss = torch.zeros(labels.shape if static.reduction == "none" else (),
                           device=x.device)
    if static.reduction != "none":  # as each token's cotangent: no unit grads to recompute
      g_loss = g_loss.float().expand(labels.shape)
      if static.reduction == "mean":
        g_loss = g_loss / (labels != static.ignore_index).sum().clamp(min=1)
    grads = _lce_bwd_op(x, weight, labels, bias, token_weights, loss_args,
                        g_loss.contiguous().float(),
                        None if g_entropy is None else g_entropy.contiguous().float(),
                        static.ignore_index, static.label_smoothing, static.z_loss,
                        static.logit_softcap, static.chunk_size, static.implementation,
                        static.token_loss, static.token_entropy, static.weights_grad,
                        static.args_grad)
  elif _tracing(g_loss):
    grads = [(t * g_loss).to(t.dtype) for t in ctx.saved_tensors[:5]]
  else:  # eager: scale the unit gradients in place (they are ours alone), no second dW
    if ctx.scaled:
      raise RuntimeError("memeff linear_cross_entropy: a second backward through the same "
                         "loss (retain_graph=True) is not supported; its gradients were "
                         "scaled in place by the first. Call the loss again instead.")
    ctx.scaled = True
    grads = ctx.saved_tensors[:5]
    _scale_unless_one(grads, g_loss)
  dx, dw, db, dtw, dargs = grads
  return ((dx, dw, None, db if static.has_bias else None,
           dtw if static.weights_grad else None, dargs if static.args_grad else None)
          + (None,) * 13)


_lce_op.register_autograd(_lce_backward, setup_context=_lce_setup)


def _check_lce_inputs(x, weight, labels, bias, token_weights):
  """The loss's inputs in torch's terms: x [..., D], weight [V, D] as nn.Linear's, integer
  labels and float token weights [...], all on x's device."""
  if labels.dtype.is_floating_point or labels.dtype == torch.bool:
    raise TypeError(f"labels must be integer class ids, got labels.dtype={labels.dtype}; "
                    "convert explicitly, e.g. labels.to(torch.int64)")
  if x.dim() < 1 or weight.dim() != 2:
    raise ValueError(f"x must be [..., D] and weight [V, D] (torch.nn.Linear's weight), "
                     f"got x.shape={tuple(x.shape)}, weight.shape={tuple(weight.shape)}")
  d = x.shape[-1]
  if weight.shape[1] != d:
    hint = (" It looks transposed: pass the [V, D] weight of the nn.Linear, not its .T."
            if weight.shape[0] == d else "")
    raise ValueError(f"weight.shape={tuple(weight.shape)} must be [V, D={d}] (torch.nn.Linear's "
                     f"weight) for x.shape={tuple(x.shape)}.{hint}")
  if tuple(labels.shape) != tuple(x.shape[:-1]):
    raise ValueError(f"labels.shape={tuple(labels.shape)} must be x.shape[:-1]="
                     f"{tuple(x.shape[:-1])}")
  if bias is not None and tuple(bias.shape) != (weight.shape[0],):
    raise ValueError(f"bias.shape={tuple(bias.shape)} must be [V]=({weight.shape[0]},)")
  if token_weights is not None:
    _check_per_token("token_weights", token_weights, x, labels)
  for name, t in (("weight", weight), ("labels", labels), ("bias", bias)):
    if t is not None and t.device != x.device:
      raise ValueError(f"{name} is on {t.device}, x on {x.device}: pass them on one device")


def _check_per_token(name: str, t, x: torch.Tensor, labels: torch.Tensor):
  """A float tensor of one value per token, shaped like the labels and on x's device."""
  if not isinstance(t, torch.Tensor):
    raise TypeError(f"{name} must be a torch.Tensor shaped like labels, got "
                    f"{type(t).__name__}")
  if not t.dtype.is_floating_point:
    raise TypeError(f"{name} must be floating point, got {name}.dtype={t.dtype}")
  if tuple(t.shape) != tuple(labels.shape):
    raise ValueError(f"{name}.shape={tuple(t.shape)} must equal "
                     f"labels.shape={tuple(labels.shape)}")
  if t.device != x.device:
    raise ValueError(f"{name} is on {t.device}, x on {x.device}: pass them on one device")


def _check_token_loss(token_loss):
  if not callable(token_loss):
    raise TypeError(f"token_loss must be a callable f(log_prob, *token_loss_args) -> loss "
                    f"written with jax.numpy, got {token_loss!r}")


def _loss_args(token_loss, token_loss_args, entropy: bool, x: torch.Tensor,
               labels: torch.Tensor):
  """The token_loss's arguments as one float32 tensor [..., k] (None for none; a stack
  autograd sees through, so each argument gets its gradient), after checking them."""
  if not isinstance(entropy, bool):
    raise TypeError(f"entropy must be a bool, got {entropy!r}")
  if not isinstance(token_loss_args, (tuple, list)):
    raise TypeError(f"token_loss_args must be a tuple of tensors, got "
                    f"{type(token_loss_args).__name__}")
  if token_loss is None:
    if token_loss_args:
      raise ValueError(f"token_loss_args ({len(token_loss_args)} tensors) given without a "
                       "token_loss")
    if entropy:
      raise ValueError("entropy=True hands each token's entropy to a token_loss; to get it "
                       "back, pass return_entropy=True")
    return None
  _check_token_loss(token_loss)
  for i, a in enumerate(token_loss_args):
    _check_per_token(f"token_loss_args[{i}]", a, x, labels)
  if not token_loss_args:
    return None
  return torch.stack([a.float() for a in token_loss_args], dim=-1)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         bias: torch.Tensor | None = None,
                         token_weights: torch.Tensor | None = None, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         z_loss: float = 0.0, logit_softcap: float | None = None,
                         chunk_size: int | None = None, implementation=None,
                         token_loss=None, token_loss_args: tuple = (), entropy: bool = False,
                         return_entropy: bool = False):
  """`F.cross_entropy(F.linear(x, weight, bias), labels, ...)` without the logits.

  Args:
    x: [..., D]; weight: [V, D] (nn.Linear / tied embedding); labels: [...] integer ids
      (int64, as F.cross_entropy takes them, is read in place as int32 words: no copy; ids
      are compared with ignore_index on all 64 bits, and one past the int32 range is out
      of range, NaN as for any id outside [0, V));
    bias: optional [V];
    token_weights: optional float [...] weights ω, like labels, of any sign, that multiply
      each token's loss: "sum" is Σ ω·loss, "mean" that over the number of tokens not
      ignored, "none" ω·loss. With requires_grad, they get ω.grad (the cotangent times
      each token's unweighted loss). A weighted mean or sum keeps the gradients in the
      forward pass, unlike "none" followed by a weighted sum, which makes the logits again
      in the backward (e.g. policy-gradient advantages);
    ignore_index, reduction ("mean" | "sum" | "none"), label_smoothing: as
      F.cross_entropy; z_loss, logit_softcap, chunk_size: as memeff_jax.linear_cross_entropy
      (chunk_size: tokens per chunk, default from the implementation's memory budget).
    implementation: as memeff_jax.linear_cross_entropy: None (the fastest available), a
      name ("reference", "chunked_xla", "pallas_mosaic_gpu"), an implementation object such as
      `memeff_jax.ops.linear_cross_entropy.PallasMosaicGpu(mosaic_gemms=("logits", "dx", "dw"),
      dw_accumulation="tma_add", fused_lse=True)` (the lowest-memory setting on Hopper, see
      the README), or a sequence of them.
    token_loss: optional f(log_prob, *args) -> each token's loss in place of the
      cross-entropy −log_prob, as memeff_jax.linear_cross_entropy's: a policy-gradient
      objective (PPO's clipped ratio, a KL term) whose gradients the forward pass makes, so
      a mean or sum keeps the three matmuls. f is traced by JAX, one token at a time on
      float32 scalars: write it with jax.numpy (jnp.exp, jnp.minimum, jnp.clip), and define
      it once (each new function object compiles the loss anew). Not with label_smoothing
      or z_loss;
    token_loss_args: float tensors shaped like labels (old log-probabilities, advantages),
      f's arguments after the log-probability. Those with requires_grad get gradients;
    entropy: with a token_loss, f also takes each token's entropy after its
      log-probability, f(log_prob, entropy, *args): an entropy bonus in the same matmuls.
    return_entropy: also return each token's entropy −Σ p log p of softmax(logits)
      (float32, labels.shape), differentiable (an RL step's entropy, logged or as a bonus):
      as memeff_jax.linear_cross_entropy's `entropy` with return_aux. Differentiated, it
      makes the backward recompute the chunks, as "none" does; a bonus taken by a
      token_loss (`entropy=True`) does not.

  Returns:
    float32 loss (scalar, or labels.shape for "none"); with return_entropy, (loss, entropy).

  >>> import jax.numpy as jnp
  >>> def ppo(log_p, old_log_p, advantage):  # PPO's clipped surrogate, ε = 0.2
  ...   ratio = jnp.exp(log_p - old_log_p)
  ...   return -jnp.minimum(ratio * advantage, jnp.clip(ratio, 0.8, 1.2) * advantage)
  >>> x, w, y = torch.randn(8, 16), torch.randn(100, 16), torch.randint(0, 100, (8,))
  >>> old_log_p, advantage = -4.6 * torch.ones(8), torch.randn(8)
  >>> loss = linear_cross_entropy(x, w, y, token_loss=ppo,
  ...                             token_loss_args=(old_log_p, advantage))
  """
  if not isinstance(return_entropy, bool):
    raise TypeError(f"return_entropy must be a bool, got {return_entropy!r}")
  _check_lce_inputs(x, weight, labels, bias, token_weights)
  loss_args = _loss_args(token_loss, token_loss_args, entropy, x, labels)
  grad_enabled = torch.is_grad_enabled()
  weights_grad = grad_enabled and token_weights is not None and token_weights.requires_grad
  args_grad = grad_enabled and loss_args is not None and loss_args.requires_grad
  needs_grad = weights_grad or args_grad or grad_enabled and any(
      t is not None and t.requires_grad for t in (x, weight, bias))
  if labels.dtype not in (torch.int64, torch.int32):
    labels = labels.to(torch.int32)
  loss, ent, *_ = _lce_op(
      x, weight, labels, bias, token_weights, loss_args, int(ignore_index), reduction,
      float(label_smoothing), float(z_loss),
      None if logit_softcap is None else float(logit_softcap),
      None if chunk_size is None else int(chunk_size), _implementation_key(implementation),
      _token_loss_key(token_loss), entropy, needs_grad and reduction != "none", weights_grad,
      args_grad, return_entropy)
  return (loss, ent) if return_entropy else loss


class LinearCrossEntropyLoss(torch.nn.Module):
  """The LM-head loss as a module, over an existing [V, D] weight (nn.Linear or tied
  embedding), which it holds by reference, not as a copy or a new parameter. Options are
  linear_cross_entropy's; the token weights and a token_loss's arguments go to forward.

  >>> head = torch.nn.Linear(64, 1000, bias=False)
  >>> loss_fn = LinearCrossEntropyLoss(head.weight)
  >>> loss = loss_fn(torch.randn(8, 64), torch.randint(0, 1000, (8,)))
  """

  def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
               z_loss: float = 0.0, logit_softcap: float | None = None,
               chunk_size: int | None = None, implementation=None, token_loss=None,
               entropy: bool = False, return_entropy: bool = False):
    super().__init__()
    if weight.ndim != 2:
      raise ValueError(f"weight must be [V, D], got weight.shape={tuple(weight.shape)}")
    if token_loss is not None:
      _check_token_loss(token_loss)
    self._weight, self._bias = [weight], [bias]  # references: not registered twice
    self.options = dict(ignore_index=ignore_index, reduction=reduction,
                        label_smoothing=label_smoothing, z_loss=z_loss,
                        logit_softcap=logit_softcap, chunk_size=chunk_size,
                        implementation=implementation, token_loss=token_loss,
                        entropy=entropy, return_entropy=return_entropy)

  def forward(self, x: torch.Tensor, labels: torch.Tensor,
              token_weights: torch.Tensor | None = None, token_loss_args: tuple = ()):
    return linear_cross_entropy(x, self._weight[0], labels, bias=self._bias[0],
                                token_weights=token_weights, token_loss_args=token_loss_args,
                                **self.options)


# ----------------------------------------------------------------------------------------
# flash_attention
# ----------------------------------------------------------------------------------------


def _window(left: int, right: int):
  """The op's (left, right) ints, -1 for unbounded, as flash_attention's sliding_window."""
  return None if left < 0 and right < 0 else (None if left < 0 else left,
                                               None if right < 0 else right)


@torch.library.custom_op("memeff::flash_attention", mutates_args=())
def _fa_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           q_segment_ids: torch.Tensor | None, kv_segment_ids: torch.Tensor | None,
           causal: bool, scale: float | None, window_left: int, window_right: int,
           logit_softcap: float | None, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
  """(out [B, T, Hq, D], lse [B, T, Hq] float32), BTHD layout."""
  args = _to_jax_call(q, k, v, q_segment_ids, kv_segment_ids)
  with _on(q):
    out, lse = _fa_fwd(*args, causal=causal, scale=scale,
                       sliding_window=_window(window_left, window_right),
                       logit_softcap=logit_softcap, deterministic=deterministic)
  return to_torch(out), to_torch(lse)


@_fa_op.register_fake
def _(q, k, v, q_segment_ids, kv_segment_ids, causal, scale, window_left, window_right,
      logit_softcap, deterministic):
  return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("memeff::flash_attention_backward", mutates_args=())
def _fa_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor, d_out: torch.Tensor, d_lse: torch.Tensor | None,
               q_segment_ids: torch.Tensor | None, kv_segment_ids: torch.Tensor | None,
               causal: bool, scale: float | None, window_left: int, window_right: int,
               logit_softcap: float | None,
               deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
  args = _to_jax_call(q, k, v, out, lse, d_out, d_lse, q_segment_ids, kv_segment_ids)
  with _on(q):
    grads = _fa_bwd(*args, causal=causal, scale=scale,
                    sliding_window=_window(window_left, window_right),
                    logit_softcap=logit_softcap, deterministic=deterministic)
  return tuple(to_torch(g) for g in grads)


@_fa_bwd_op.register_fake
def _(q, k, v, out, lse, d_out, d_lse, *rest):
  del rest
  return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_FA_STATIC = ("causal", "scale", "sliding_window", "logit_softcap", "deterministic")


@functools.partial(jax.jit, static_argnames=_FA_STATIC)
def _fa_fwd(q, k, v, q_seg, kv_seg, *, causal, scale, sliding_window, logit_softcap,
            deterministic):
  return _fa.flash_attention(q, k, v, causal=causal, scale=scale, q_segment_ids=q_seg,
                             kv_segment_ids=kv_seg, sliding_window=sliding_window,
                             logit_softcap=logit_softcap, deterministic=deterministic,
                             return_lse=True)


@functools.partial(jax.jit, static_argnames=_FA_STATIC)
def _fa_bwd(q, k, v, out, lse, d_out, d_lse, q_seg, kv_seg, *, causal, scale, sliding_window,
            logit_softcap, deterministic):
  return _fa.flash_attention_backward(
      q, k, v, out, lse, d_out, d_lse, causal=causal, scale=scale, q_segment_ids=q_seg,
      kv_segment_ids=kv_seg, sliding_window=sliding_window, logit_softcap=logit_softcap,
      deterministic=deterministic)


def _fa_setup(ctx, inputs, output):
  q, k, v, q_seg, kv_seg, *options = inputs
  ctx.options = tuple(options)
  out, lse = output
  ctx.save_for_backward(q, k, v, out, lse, q_seg, kv_seg)
  ctx.set_materialize_grads(False)  # an unused lse gets no zero-filled gradient


def _fa_backward(ctx, d_out, d_lse):
  q, k, v, out, lse, q_seg, kv_seg = ctx.saved_tensors
  d_out = torch.zeros_like(out) if d_out is None else d_out
  # An lse that was not used gets no zero-filled gradient in torch: JAX's backward takes None.
  d_lse = None if d_lse is None else d_lse.contiguous()
  dq, dk, dv = _fa_bwd_op(q, k, v, out, lse, d_out.contiguous(), d_lse, q_seg, kv_seg,
                          *ctx.options)
  return dq, dk, dv, None, None, None, None, None, None, None, None


_fa_op.register_autograd(_fa_backward, setup_context=_fa_setup)


def _check_attention_shapes(q, k, v, layout: str):
  """q, k, v as the caller laid them out: errors name those shapes, not the transposes."""
  names = "[B, T, Hq, D]" if layout == "bthd" else "[B, Hq, T, D]"
  kv_names = "[B, S, Hkv, D]" if layout == "bthd" else "[B, Hkv, S, D]"
  shapes = f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
  if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
    raise ValueError(f"with layout={layout!r}, q must be {names} and k, v {kv_names}; got "
                     f"{shapes}")
  h = 2 if layout == "bthd" else 1
  if (k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]
      or (k.shape[h] == 0 and q.shape[h] != 0) or (k.shape[h] and q.shape[h] % k.shape[h])):
    raise ValueError(f"with layout={layout!r}, q must be {names} and k, v {kv_names} with the "
                     f"same B and D and Hq a multiple of Hkv; got {shapes}")


def _window_sides(sliding_window) -> tuple[int, int]:
  """(left, right) for the op: ints ≥ 0, or -1 for an unbounded side (FlashAttention's
  window_size meaning: (-1, 0) sees every earlier key and none later); None: (-1, -1)."""
  if sliding_window is None:
    return -1, -1
  pair = isinstance(sliding_window, (tuple, list))
  sides = tuple(sliding_window) if pair else (sliding_window,) * 2
  if len(sides) != 2 or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1
                                for w in sides):
    raise ValueError(f"sliding_window must be an int or a (left, right) pair of ints ≥ 0, "
                     f"-1 for an unbounded side (FlashAttention's window_size), got "
                     f"{sliding_window!r}")
  return sides


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    causal: bool = False, scale: float | None = None,
                    q_segment_ids: torch.Tensor | None = None,
                    kv_segment_ids: torch.Tensor | None = None,
                    sliding_window: int | tuple[int, int] | None = None,
                    logit_softcap: float | None = None, return_lse: bool = False,
                    deterministic: bool = True, layout: str = "bthd"):
  """memeff_jax.flash_attention on torch tensors, with autograd.

  layout "bthd": q [B, T, Hq, D], k/v [B, S, Hkv, D] (no copies). "bhtd":
  q [B, Hq, T, D] as F.scaled_dot_product_attention takes it; the tensors are transposed
  into BTHD, which costs one copy each, and the output is returned as a BHTD view. GQA
  (Hq a multiple of Hkv) needs no repeated k/v. Masks mean what they mean in
  memeff_jax.flash_attention (causal is top-left aligned, as SDPA's is_causal), and so does
  `deterministic` (bitwise-reproducible gradients, the default; False allows the faster
  Hopper backward). `sliding_window=(left, right)` takes FlashAttention's -1 for a side
  without bound.
  """
  if layout not in ("bthd", "bhtd"):
    raise ValueError(f"layout must be 'bthd' or 'bhtd', got {layout!r}")
  _check_attention_shapes(q, k, v, layout)
  if layout == "bhtd":
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
  left, right = _window_sides(sliding_window)
  if (q_segment_ids is None) and (kv_segment_ids is not None):
    raise ValueError("kv_segment_ids needs q_segment_ids")
  if q_segment_ids is not None:
    q_segment_ids = q_segment_ids.to(torch.int32)
    kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids.to(torch.int32)
  out, lse = _fa_op(q.contiguous(), k.contiguous(), v.contiguous(), q_segment_ids,
                    kv_segment_ids, bool(causal), None if scale is None else float(scale),
                    int(left), int(right),
                    None if logit_softcap is None else float(logit_softcap),
                    bool(deterministic))
  if layout == "bhtd":
    out, lse = out.transpose(1, 2), lse.transpose(1, 2)
  return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------
# wrap: any JAX function
# ----------------------------------------------------------------------------------------


def wrap(jax_fn, *, jit: bool = True):
  """A torch autograd function (eager) from a JAX function of arrays.

  `wrap(f)(*tensors)` converts the tensors zero-copy, runs `jax.vjp(f, ...)` and returns the
  outputs as torch tensors (a pytree of them as f returns). The VJP's residuals become torch
  tensors saved with `ctx.save_for_backward`: freed after backward, visible to
  saved_tensors_hooks. Non-array residual leaves (rare) are kept on ctx. Every argument is
  a tensor and is differentiated if it requires grad. For torch.compile use the custom ops
  above: this path runs eagerly.

  f is compiled with `jax.jit` (once per input shapes and dtypes), so the forward and the
  backward each run as one XLA computation rather than op by op (a dispatch and a launch
  per op). Pass `jit=False` for a function whose Python control flow depends on array
  values, which only eager `jax.vjp` can trace.
  """
  if jit:
    jax_fn = jax.jit(jax_fn)

  class _Fn(torch.autograd.Function):

    @staticmethod
    def forward(ctx, out_tree_box, *tensors):
      with _on(tensors[0]):
        outs, vjp_fn = jax.vjp(jax_fn, *_to_jax_call(*tensors))
      leaves, ctx.vjp_tree = jax.tree.flatten(vjp_fn)
      ctx.is_array = [isinstance(leaf, jax.Array) for leaf in leaves]
      ctx.others = [leaf for leaf, a in zip(leaves, ctx.is_array) if not a]
      ctx.save_for_backward(*(to_torch(leaf) for leaf, a in zip(leaves, ctx.is_array) if a))
      del leaves, vjp_fn  # the saved tensors now own the residual buffers
      flat, ctx.out_tree = jax.tree.flatten(outs)
      ctx.out_avals = [(o.shape, o.dtype) for o in flat]
      out_tree_box.append(ctx.out_tree)
      return tuple(to_torch(o) for o in flat)

    @staticmethod
    def backward(ctx, *cts):
      saved = ctx.saved_tensors
      where = next(t for t in (*saved, *cts) if t is not None)
      imported = _to_jax_call(*saved, *cts)  # one stream handshake for all of them
      saved, imported_cts = iter(imported[:len(saved)]), imported[len(saved):]
      others = iter(ctx.others)
      leaves = [next(saved) if a else next(others) for a in ctx.is_array]
      vjp_fn = jax.tree.unflatten(ctx.vjp_tree, leaves)
      with _on(where):
        cts = [jnp.zeros(shape, dtype) if ct is None else ct
               for ct, (shape, dtype) in zip(imported_cts, ctx.out_avals)]
        grads = vjp_fn(jax.tree.unflatten(ctx.out_tree, cts))
      return (None,) + tuple(to_torch(g) for g in grads)

  @functools.wraps(jax_fn)
  def run(*tensors):
    box = []
    flat = _Fn.apply(box, *tensors)
    return jax.tree.unflatten(box[0], list(flat))

  return run
