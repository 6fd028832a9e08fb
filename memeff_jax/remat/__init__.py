"""Recomputation under a memory budget: named checkpoint policies and `fit`."""

from memeff_jax.remat.policies import Candidate
from memeff_jax.remat.policies import POLICIES
from memeff_jax.remat.policies import candidates
from memeff_jax.remat.policies import choose
from memeff_jax.remat.policies import fit
from memeff_jax.remat.policies import resolve
from memeff_jax.remat.policies import table
from memeff_jax.remat.flops import matmul_flops
