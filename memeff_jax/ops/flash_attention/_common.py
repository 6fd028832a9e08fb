"""Pieces shared by the flash_attention implementations."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from memeff_jax.ops.flash_attention.masks import MaskSpec


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """Static options of one call (hashable: custom_vjp nondiff argument)."""

  mask: MaskSpec
  scale: float
  logit_softcap: float | None = None


class Residuals(NamedTuple):
  q: jax.Array
  k: jax.Array
  v: jax.Array
  q_segment_ids: jax.Array | None
  kv_segment_ids: jax.Array | None
  out: jax.Array
  lse: jax.Array  # float32 [B, Hq, T]; -inf for a query that sees no key


def cap(s, softcap):
  return s if softcap is None else softcap * jnp.tanh(s / softcap)


def cap_grad(s_capped, softcap):
  """d capped / d raw, from the capped value."""
  return 1.0 if softcap is None else 1.0 - jnp.square(s_capped / softcap)


def finite_or_zero(x):
  return jnp.where(jnp.isfinite(x), x, 0.0)


def lse_from(m, l):
  """log-sum-exp from a running max and sum; -inf where nothing was visible (l = 0)."""
  return jnp.where(l > 0, finite_or_zero(m) + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
