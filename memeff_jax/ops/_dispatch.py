"""Implementation choice by fall-through, shared by every op's api.py.

An op keeps a registry {name: implementation object} and a default order. A call tries the
implementations in order; one that cannot serve the call raises Unsupported (a
NotImplementedError) with the reason and the next is tried; if none can, the error lists
every reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any


class Unsupported(NotImplementedError):
  """An implementation cannot serve this call (the message says why): the next one is tried.
  Only this is caught: a NotImplementedError that JAX raises while tracing an implementation
  is an error, not a reason to switch implementation."""


def resolve(implementation, registry: Mapping[str, Any], default: Sequence[str]) -> list[Any]:
  """Names, objects or a sequence of them (None: `default`) -> implementation objects."""
  if implementation is None:
    implementation = default
  if isinstance(implementation, str) or callable(implementation):
    implementation = (implementation,)
  elif not isinstance(implementation, (tuple, list)):
    raise TypeError(f"implementation must be None, a name ({', '.join(sorted(registry))}), an "
                    f"implementation object or a sequence of them, got {implementation!r}")
  resolved = []
  for impl in implementation:
    if isinstance(impl, str):
      if impl not in registry:
        raise ValueError(f"unknown implementation={impl!r}; expected one of "
                         f"{sorted(registry)} or an implementation object")
      impl = registry[impl]
    elif not callable(impl):
      raise TypeError(f"implementation entries must be names or implementation objects, "
                      f"got {impl!r}")
    resolved.append(impl)
  if not resolved:
    raise ValueError("implementation must not be an empty sequence")
  return resolved


def first_that_serves(implementations: Sequence[Any], call: Callable[[Any], Any]):
  """call(impl) for the first implementation that does not raise NotImplementedError."""
  reasons = []
  for impl in implementations:
    try:
      return call(impl)
    except Unsupported as err:
      reasons.append(f"{getattr(impl, 'name', impl)}: {err}")
  raise Unsupported("no implementation can serve this call:\n  " + "\n  ".join(reasons))
