"""See where a jitted function's bytes go: `analyze(fn, *args) -> MemoryReport`."""

from memeff_jax.memory.analyze import Buffer
from memeff_jax.memory.analyze import MemoryReport
from memeff_jax.memory.analyze import analyze
from memeff_jax.memory.analyze import report_of
