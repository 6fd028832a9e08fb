"""remat.fit: the cheapest policy under a budget, on the model's real train step."""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import pytest

from memeff_jax import remat
from memeff_jax.models import Llama
from memeff_jax.models import LlamaConfig
from memeff_jax.models import make_train_step

CFG = LlamaConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=512)
CANDIDATES = ("nothing", "attention", "attention_projections", "dots_no_batch", "everything")


@pytest.fixture(scope="module")
def step_args():
  state, _ = make_train_step(Llama(CFG, rngs=nnx.Rngs(0)))
  tokens = jax.ShapeDtypeStruct((2, 512), jnp.int32)
  return state.state, dict(tokens=tokens, labels=tokens)


def _make_step(name):
  return make_train_step(Llama(dataclasses.replace(CFG, remat_policy=name),
                               rngs=nnx.Rngs(0)))[1]


@pytest.fixture(scope="module")
def fitted(step_args):
  """remat.fit under a budget every policy fits: (its pick, the candidates). Each policy is
  compiled once for the module; the tests below choose among the candidates."""
  return remat.fit(_make_step, *step_args, budget_bytes=2**40, policies=CANDIDATES,
                   verbose=False)


def test_fit_trades_recomputation_for_memory(fitted):
  best, candidates = fitted
  by_name = {c.name: c for c in candidates}
  assert [c.name for c in candidates] == list(CANDIDATES)
  assert all(c.fits for c in candidates)
  assert by_name[best].flops == min(c.flops for c in candidates)
  # Keeping nothing holds the least and recomputes the most; keeping everything the reverse.
  assert by_name["nothing"].peak_bytes < by_name["everything"].peak_bytes
  assert by_name["nothing"].flops > by_name["everything"].flops
  # Saving the attention output spares recomputing attention in the backward pass: the
  # FLOP count sees it, inside the scanned layers and the attention's own loops.
  assert by_name["attention"].flops < by_name["nothing"].flops
  assert by_name["everything"].flops <= by_name["attention_projections"].flops

  budgets = sorted({by_name["nothing"].peak_bytes, by_name["everything"].peak_bytes})
  picked = [remat.choose(candidates, b) for b in budgets]
  flops = [by_name[p].flops for p in picked]
  assert flops == sorted(flops, reverse=True)  # more budget, never more recomputation
  for b, p in zip(budgets, picked):
    assert by_name[p].peak_bytes <= b
  assert by_name[picked[-1]].flops == min(c.flops for c in candidates)


def test_fit_says_when_nothing_fits(fitted):
  with pytest.raises(ValueError, match="no remat policy fits budget_bytes=1,024"):
    remat.choose(fitted[1], 1024)


def test_unknown_policy():
  with pytest.raises(ValueError, match="unknown remat policy 'keep_some'"):
    remat.resolve("keep_some")


def test_fit_says_what_make_step_must_be():
  """A plain step where a factory of steps is expected."""
  with pytest.raises(TypeError, match=r"make_step must take a policy name and return the step"):
    remat.fit(lambda x: jnp.sum(x ** 2), jnp.ones(3), budget_bytes=2**30)
