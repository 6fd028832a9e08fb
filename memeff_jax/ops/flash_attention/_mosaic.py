"""Pieces shared by the Mosaic GPU attention kernels (pallas_mosaic_gpu, mosaic_gpu_backward)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None


def div(x, n):
  """Integer division of kernel indices (Python ints or traced int32)."""
  return lax.div(jnp.asarray(x, jnp.int32), jnp.asarray(n, jnp.int32))


def rem(x, n):
  return lax.rem(jnp.asarray(x, jnp.int32), jnp.asarray(n, jnp.int32))


def fill_ring(load, n, stages: int, free) -> None:
  """The memory warpgroup's loop: load(i, slot) for steps 0..n-1 into `stages` shared-memory
  slots, refilling a slot once every barrier array in `free` has been arrived on for it.
  `n` may be traced (causal CTAs need fewer steps); the first fills are then guarded."""
  for i in range(stages):
    if isinstance(n, int):
      if i < n:
        load(i, i)
    else:
      pl.when(i < n)(functools.partial(load, i, i))

  @pl.loop(stages, n)
  def _(i):
    slot = rem(i, stages)
    for barrier in free:
      plgpu.barrier_wait(barrier.at[slot])
    load(i, slot)
