"""benchmarks/scaling.py runs on fake CPU devices (a dry run of the multi-GPU benchmark)."""

import json

import jax
import pytest

from benchmarks import scaling


def test_scaling_dry_run(tmp_path):
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  out = tmp_path / "scaling.jsonl"
  scaling.main(["--small", "--devices", "1,2", "--cases", "loss,vocab,context",
                "--match", "^(loss|vocab|context-(causal-zigzag|packed-bounded)-ring)",
                "--rounds", "1",
                "--out", str(out)])
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  got = {(r["case"], r["provider"], r["devices"]) for r in rows}  # device_index rows too
  losses = {("loss", p, n) for p in ("memeff", "jax_naive", "memeff:local_dw",
                                      "jax_naive:local_dw") for n in (1, 2)}
  assert got == losses | {("loss", "dw_allreduce", 2), ("vocab", "memeff", 1),
                          ("vocab", "memeff", 2)} | {
                     (f"context-{variant}-256", "memeff", n)
                     for variant in ("causal-zigzag-ring", "packed-bounded-ring")
                     for n in (1, 2)}
  base = [r for r in rows if "device_index" not in r]
  assert all(r["efficiency"] == 1.0 for r in base if r["devices"] == 1)
  assert all(r["ms"] > 0 for r in rows)
  # the loss's one-device case also ran alone on device 1 (no efficiency: no baseline there)
  alone = {(r["case"], r["provider"]) for r in rows if r.get("device_index") == 1}
  assert alone == {("loss", p) for p in ("memeff", "jax_naive", "memeff:local_dw",
                                         "jax_naive:local_dw")}
  assert all(r["devices"] == 1 and r["efficiency"] is None for r in rows if "device_index" in r)


def test_visible_pairs():
  assert scaling.visible_pairs(4, "causal", 2) == 10
  assert scaling.visible_pairs(6, "packed", 3) == 12  # two documents of 3: 6 pairs each
  assert scaling.visible_pairs(6, "packed+window", 3) == 12  # a window that cuts nothing
  assert scaling.visible_pairs(5, "window", 1) == 9  # 1 + 2 + 2 + 2 + 2



def test_context_train_dry_run(tmp_path):
  """The train step on one sequence over a context axis: one device's losses on 2 devices,
  by both strategies (the ring runs at the longest length); efficiency against one
  device's."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  out = tmp_path / "scaling.jsonl"
  scaling.main(["--small", "--devices", "2,1", "--cases", "context-train", "--lengths", "512",
                "--steps", "2", "--out", str(out)])
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [(r["case"], r["provider"], r["devices"]) for r in rows] == [
      ("context-train-tiny-512", "memeff", 1), ("context-train-tiny-512", "memeff", 2),
      ("context-train-tiny-512", "memeff:ring", 2)]
  for r in rows:
    one = next(o for o in rows if o["case"] == r["case"] and o["devices"] == 1)
    assert r["last_loss"] == pytest.approx(one["last_loss"], rel=1e-4)
    assert r["efficiency"] == pytest.approx(r["tokens_per_s_per_device"]
                                            / one["tokens_per_s_per_device"])

  # A run not done within --run-timeout (here: before it could start) is recorded as such.
  scaling.main(["--small", "--devices", "2", "--cases", "context-train", "--lengths", "256",
                "--steps", "2", "--run-timeout", "0.01", "--out", str(out)])
  late = [json.loads(line) for line in out.read_text().splitlines()][len(rows):]
  assert [(r["devices"], r["error"], "ms" in r) for r in late] == [
      (2, "timed out after 0 s", False), (2, "timed out after 0 s", False)]


def test_results_keep_the_latest_run_of_each_host(monkeypatch):
  """RESULTS.md's scaling tables: one per host (GPU kind × the most GPUs a run used), each
  case from its latest run there, so a later run on fewer GPUs keeps the wider one's rows;
  a run that did not fit says so."""
  from benchmarks import make_results  # pylint: disable=import-outside-toplevel

  def row(n, ms, stamp, **kw):
    return dict(op="scaling", case="attention", provider="memeff", devices=n, ms=ms,
                efficiency=ms and 7.0 / ms, platform="gpu", device="NVIDIA H200", jax="0.11.2",
                timestamp=stamp, **kw)
  rows = [row(1, 7.0, "2026-01-01T00:00"), row(4, 7.7, "2026-01-01T00:00"),
          row(1, 7.0, "2026-01-02T00:00"), row(2, 7.1, "2026-01-02T00:00"),
          dict(row(1, None, "2026-01-03T00:00", error="out of memory"),
               case="context-train-1b-640k", efficiency=None)]
  monkeypatch.setattr(make_results, "load", lambda op: rows if op == "scaling" else [])
  monkeypatch.setattr(make_results, "scaling_plot", lambda path: False)
  text = "\n".join(make_results.scaling_section())
  four, two, one = (text.index(f"**{n} × NVIDIA H200**") for n in (4, 2, 1))
  assert four < two < one
  assert "| attention | memeff | 7.00 (1.000) | 7.70 (0.909) | 2026-01-01 |" in text[four:two]
  assert "| attention | memeff | 7.00 (1.000) | 7.10 (0.986) | 2026-01-02 |" in text[two:one]
  assert "| context-train-1b-640k | memeff | out of memory | 2026-01-03 |" in text[one:]


def test_train_dry_run_with_sequence_parallelism(tmp_path):
  """The train case's sequence-parallel layout alone (--match; tensor=2 of 2 devices), both
  layer sets."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  out = tmp_path / "scaling.jsonl"
  scaling.main(["--small", "--devices", "2", "--cases", "train", "--match", "tensor-sp",
                "--out", str(out)])
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert {(r["case"], r["provider"], r["devices"]) for r in rows} == {
      ("train-tiny-fsdp×tensor-sp", k, 2) for k in ("memeff", "plain")}
  assert all(r["mesh"] == {"fsdp": 1, "tensor": 2} and r["ms"] > 0 for r in rows)
