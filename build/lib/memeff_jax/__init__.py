"""memeff_jax: memory-efficient training primitives for JAX on GPUs."""

from memeff_jax.ops.flash_attention import flash_attention
from memeff_jax.ops.linear_cross_entropy import Aux
from memeff_jax.ops.linear_cross_entropy import linear_cross_entropy

__version__ = "0.1.0"
