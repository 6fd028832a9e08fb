"""A small Llama-style decoder built from memeff_jax's layers (demo, tests, benchmarks)."""

from memeff_jax.models.llama import Llama
from memeff_jax.models.llama import LlamaConfig
from memeff_jax.models.train import TrainState
from memeff_jax.models.train import abstract_train_step
from memeff_jax.models.train import make_train_step
from memeff_jax.models.train import policy_steps
