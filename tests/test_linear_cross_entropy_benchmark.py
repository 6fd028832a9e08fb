"""benchmarks/linear_cross_entropy.py's loss-alone mode (a set's `backward = false`): every JAX
provider computes the same loss with and without its gradients, and a run's rows say which
pass they timed."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from benchmarks import linear_cross_entropy as bench
from benchmarks import make_results

PROVIDERS = ["jax_naive", "jax_scan_remat", "memeff", "memeff:chunked_xla"]


@pytest.mark.parametrize("options", [
    dict(),
    dict(reduction="none"),
    dict(softcap=5.0, smoothing=0.1),
])
def test_the_loss_alone_is_the_loss_of_the_step(options):
  x, w, y, kg = bench.make_inputs(256, 64, 1000, jnp.float32, seed=1)
  for provider in PROVIDERS:
    step, step_args = bench.jax_case(provider, x, w, y, kg, **options)
    alone, alone_args = bench.jax_case(provider, x, w, y, kg, **options, backward=False)
    loss, (dx, dw) = step(*step_args)
    out = alone(*alone_args)
    assert len(out) == 1, provider  # the loss, no gradients
    np.testing.assert_allclose(out[0], loss, rtol=1e-5, err_msg=provider)
    assert dx.shape == x.shape and dw.shape == w.shape


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_every_provider_weights_the_same_tokens(reduction):
  """A `token_weights` set: memeff's token_weights, its per-token losses weighted after
  (per_token=1) and the plain JAX losses weighted give one loss and one set of gradients."""
  x, w, y, kg = bench.make_inputs(256, 64, 1000, jnp.float32, seed=2)
  weights = bench.token_weights(256)
  results = {}
  for provider in PROVIDERS + ["memeff:default:per_token=1"]:
    fn, args = bench.jax_case(provider, x, w, y, kg, reduction=reduction, weights=weights)
    results[provider] = fn(*args)
  want = results.pop("jax_naive")
  unweighted = bench.jax_case("jax_naive", x, w, y, kg, reduction=reduction)[0](x, w)
  assert not np.allclose(unweighted[0], want[0], rtol=1e-2)  # the weights count
  for provider, got in results.items():
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6, err_msg=provider)


@pytest.mark.parametrize("options", [dict(), dict(softcap=5.0, reduction="none")])
def test_every_provider_takes_the_same_entropy_bonus(options):
  """An `entropy_bonus` set: memeff's token_loss of the log-prob and entropy, its Aux.entropy
  (aux=1, also with per_token=1) and the plain JAX entropies of the logits give one
  objective and one set of gradients."""
  x, w, y, kg = bench.make_inputs(256, 64, 1000, jnp.float32, seed=3)
  results = {provider: bench.jax_case(provider, x, w, y, kg, bonus=0.5, **options)
             for provider in PROVIDERS + ["memeff:default:per_token=1",
                                          "memeff:default:aux=1"]}
  results = {p: fn(*args) for p, (fn, args) in results.items()}
  want = results.pop("jax_naive")
  plain = bench.jax_case("jax_naive", x, w, y, kg, **options)[0](x, w)
  assert not np.allclose(plain[0], want[0], rtol=1e-3)  # the bonus counts
  for provider, got in results.items():
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6, err_msg=provider)


def test_every_provider_takes_the_same_ppo_objective():
  """A `ppo_sequence` set: memeff's token_loss, its per-token log-probs with the surrogate
  after them, and plain JAX's give one objective and one set of gradients, and the old
  log-probs clip some ratios and not others."""
  x, w, y, kg = bench.make_inputs(256, 64, 1000, jnp.float32, seed=4)
  ppo = (*bench.ppo_inputs(x, w, y, 64), 64)
  log_p = -optax.softmax_cross_entropy_with_integer_labels(x @ w, y)
  ratio = np.exp(np.asarray(log_p) - np.asarray(ppo[1]))
  assert 0.1 < np.mean((ratio < 0.8) | (ratio > 1.2)) < 0.9
  results = {provider: bench.jax_case(provider, x, w, y, kg, ppo=ppo)
             for provider in PROVIDERS + ["memeff:default:per_token=1"]}
  results = {p: fn(*args) for p, (fn, args) in results.items()}
  want = results.pop("jax_naive")
  for provider, got in results.items():
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6, err_msg=provider)


def test_the_floor_alone_is_the_logits_product():
  x, w, y, kg = bench.make_inputs(64, 32, 200, jnp.float32)
  fn, args = bench.jax_case("floor", x, w, y, kg, backward=False)
  (logits,) = fn(*args)
  assert logits.shape == (64, 256)  # the vocabulary padded to a multiple of 128
  np.testing.assert_allclose(logits[:, :200], x @ w, rtol=1e-5, atol=1e-5)


def test_a_forward_run_says_so(tmp_path):
  out = tmp_path / "rows.jsonl"
  rows = bench.run("small-forward", ["floor", "memeff"], str(out), reps=1)
  assert {r["provider"] for r in rows} == {"floor", "memeff"}
  for r in rows:
    assert r["backward"] is False
    assert r["tflops"] == pytest.approx(2.0 * r["n"] * r["d"] * r["v"] / r["ms"] / 1e9)
  assert len(out.read_text().splitlines()) == len(rows)
  (key, group), *_ = make_results.runs([json.loads(line) for line in
                                        out.read_text().splitlines()])
  assert "forward (no gradients)" in make_results.run_heading(key, group)


def test_heads_summary_takes_each_heads_latest_run_per_gpu():
  """One line per head and GPU from its latest `heads` run: memeff over that run's floor,
  named after the one-head set of its shape; plain XLA's column only where a run timed it."""
  from benchmarks import make_results  # pylint: disable=import-outside-toplevel
  head = dict(set="heads", n=16384, d=768, v=50257, dtype="bfloat16", rounds=3)
  rows = [dict(head, device="A", timestamp="t", provider="floor", ms=5.0),
          dict(head, device="A", timestamp="t", provider="memeff", ms=6.0, extra_bytes=2**29),
          dict(head, device="A", timestamp="u", provider="floor", ms=4.0),
          dict(head, device="A", timestamp="u", provider="memeff", ms=5.0, extra_bytes=2**28),
          dict(head, device="B", timestamp="t", provider="floor", ms=5.0),
          dict(head, device="B", timestamp="t", provider="memeff", ms=5.5, extra_bytes=2**28),
          dict(head, device="B", timestamp="t", provider="jax_naive", ms=20.0)]
  text = "\n".join(make_results.heads_section(rows))
  assert "**heads** on A, u" in text and "**heads** on B, t" in text
  assert "| gpt2 | 16,384 | 768 | 50,257 | 4.00 | 5.00 | 1.250 | 0.250 |\n" in text + "\n"
  assert "| gpt2 | 16,384 | 768 | 50,257 | 5.00 | 5.50 | 1.100 | 0.250 | 4.000 |" in text
  assert text.count("plain XLA") == 1
