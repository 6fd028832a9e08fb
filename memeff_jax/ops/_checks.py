"""Checks of the options both ops share. Options are static Python values (they pick kernels
and shapes), so a traced value, a bool where a number is meant, or a truthy string where a
bool is meant is refused with the argument's name, never taken as something else."""

from __future__ import annotations

import functools
import math
import numbers

import jax
import numpy as np

try:
  from jax.core import Tracer
except ImportError:  # pragma: no cover  (a jax that dropped the public alias)
  from jax._src.core import Tracer


def _scalar(name: str, value, kind: str):
  """value as a Python scalar of `kind` ("bool", "int" or "real"), or TypeError."""
  if isinstance(value, Tracer):
    raise TypeError(f"{name} must be a Python {kind}, not a traced value: it is a static "
                    "option (pass a Python value, or mark the argument static in jax.jit)")
  if isinstance(value, (np.ndarray, jax.Array)) and np.ndim(value) == 0:
    value = np.asarray(value).item()  # a concrete 0-d array, as jnp.float32(0.1) gives
  is_bool = isinstance(value, (bool, np.bool_))
  if kind == "bool" and is_bool:
    return bool(value)
  if kind == "int" and not is_bool and isinstance(value, numbers.Integral):
    return int(value)
  if kind == "real" and not is_bool and isinstance(value, numbers.Real):
    return float(value)
  raise TypeError(f"{name} must be a Python {kind}, got {value!r} ({type(value).__name__})")


def static_bool(name: str, value) -> bool:
  return _scalar(name, value, "bool")


def static_int(name: str, value) -> int:
  return _scalar(name, value, "int")


def static_real(name: str, value) -> float:
  return _scalar(name, value, "real")


def manual_axis(name: str, axis, role: str):
  """(axis, shards along it) for an argument naming the mesh axis (or a tuple of axes) of an
  enclosing jax.shard_map that something is sharded over (`role` says what); None passes as
  (None, 1). A clear error for anything else, outside such a shard_map too."""
  if axis is None:
    return None, 1
  if isinstance(axis, (list, tuple)) and len(axis) == 1:
    axis = axis[0]
  elif isinstance(axis, list):
    axis = tuple(axis)
  names = axis if isinstance(axis, tuple) else (axis,)
  if not names or not all(isinstance(a, str) for a in names):
    raise TypeError(f"{name} must be a mesh axis name or a tuple of them, got {axis!r}")
  size = 1
  try:
    for a in names:
      size *= jax.lax.axis_size(a)
  except NameError as err:
    raise ValueError(f"{name}={axis!r} is not an axis of an enclosing jax.shard_map ({role}): "
                     f"{err}") from None
  return axis, size


def logit_softcap(value) -> float | None:
  """None, or the cap c > 0 as a float; c = inf is no cap (c·tanh(s/c) → s), so None."""
  if value is None:
    return None
  cap = static_real("logit_softcap", value)
  if math.isnan(cap) or cap <= 0:
    raise ValueError(f"logit_softcap must be None or > 0, got {value!r}")
  return None if math.isinf(cap) else cap


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _guard(message: str, *arrays):
  return arrays


@_guard.defjvp
def _guard_jvp(message, primals, tangents):
  del primals, tangents
  raise NotImplementedError(message)


def first_order_only(name: str, *arrays):
  """`arrays` unchanged. An implementation whose custom_vjp runs kernels that JAX cannot
  differentiate passes its forward's inputs and its backward's through this: a second-order
  gradient (which differentiates those) then stops here with a clear error, rather than deep
  inside a kernel or a loop."""
  return _guard(f"higher-order gradients are not supported by {name}; use "
                "implementation='reference'", *arrays)
