"""See where a jitted function's bytes go (`analyze`), and force a low-memory order on
independent work (`after`, `sequential`)."""

from memeff_jax.memory.analyze import Buffer
from memeff_jax.memory.analyze import MemoryReport
from memeff_jax.memory.analyze import analyze
from memeff_jax.memory.analyze import report_of
from memeff_jax.memory.schedule import after
from memeff_jax.memory.schedule import sequential
