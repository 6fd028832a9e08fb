"""benchmarks/train_step.py's largest-batch search, with a fake run in place of the GPU's."""

import json
import subprocess

import pytest

from benchmarks import train_step


@pytest.mark.parametrize("start, unit, limit, want", [
    (10, 1, 37, 37),    # one GPU: any batch
    (24, 4, 37, 36),    # a data × fsdp = 4 mesh: multiples of 4 only
    (200, 4, 37, 36),   # a prediction far too high: down, then bisection
    (8, 4, 1000, 36)])  # all fit; 68 is past --max-batch: 36, a lower bound
def test_largest_batch_in_multiples_of_the_shards(monkeypatch, start, unit, limit, want):
  tried = []

  def fake(config, kernels, batch, steps, seq_len, **kw):
    tried.append(batch)
    return {"tokens_per_s": 1.0} if batch <= limit else None

  monkeypatch.setattr(train_step, "measure", fake)
  got = train_step.largest_batch("1b", "memeff", start, 2, None, max_batch=64,
                                 mesh="data=2,fsdp=2" if unit > 1 else None, unit=unit)
  assert got == want
  assert all(b % unit == 0 for b in tried)


def test_a_run_past_its_timeout_does_not_run(tmp_path):
  """measure() gives up on a run after --run-timeout seconds and records why."""
  out = tmp_path / "runs.jsonl"
  assert train_step.measure("tiny", "memeff", 2, 1, None, runs_out=out, timeout=0.01) is None
  assert "timed out after" in out.read_text()


def test_a_worker_that_ran_out_of_memory_is_stopped():
  """On a mesh a device out of memory leaves the others waiting in a collective: the worker
  is stopped `grace` seconds after the allocator's message, not at its timeout."""
  import sys  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel
  hang = ("import sys, time; print('{\"compiled\": true}', flush=True); "
          "print('Allocator (GPU_0_bfc) ran out of memory trying to allocate 65.86GiB', "
          "file=sys.stderr, flush=True); time.sleep(60)")
  start = time.monotonic()
  proc = train_step.run_worker([sys.executable, "-c", hang], timeout=50, grace=0.5)
  assert time.monotonic() - start < 20
  assert proc.returncode != 0 and '{"compiled": true}' in proc.stdout
  assert "ran out of memory" in proc.stderr and "timed out" not in proc.stderr


def test_a_run_that_trained_counts_though_its_probe_did_not_finish(tmp_path, monkeypatch):
  """The worker prints its trained row before compiling the probes: a run cut off while
  probing still trained (and is recorded so), without a prediction."""
  trained = {"kernels": "memeff", "batch": 2, "tokens_per_s": 5.0, "peak_bytes": 7,
             "temp_bytes": 3}
  stdout = "\n".join([json.dumps({"compiled": True, "predicted_peak_bytes": 6,
                                  "temp_bytes": 3}), json.dumps(trained)])

  def run(cmd, env, timeout):
    return subprocess.CompletedProcess(cmd, -9, stdout, f"timed out after {timeout} s\n")

  monkeypatch.setattr(train_step, "run_worker", run)
  out = tmp_path / "runs.jsonl"
  row = train_step.measure("tiny", "memeff", 2, 1, None, probe=(4,), runs_out=out, timeout=9)
  assert row["tokens_per_s"] == 5.0 and row["probes"] == {}
  recorded = json.loads(out.read_text())
  assert recorded["fits"] and recorded["predicted_peak_bytes"] == 6


def test_a_run_preallocates_its_pool(tmp_path, monkeypatch):
  """Every worker runs on one preallocated pool, whatever the caller's environment says (an
  allocator grown on demand found no contiguous room well below the limit), and its row
  says so."""
  seen = []

  def run(cmd, env, timeout):
    seen.append(env)
    return subprocess.CompletedProcess(cmd, 1, "", "failed\n")

  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  monkeypatch.setattr(train_step, "run_worker", run)
  out = tmp_path / "runs.jsonl"
  assert train_step.measure("tiny", "memeff", 2, 1, None, runs_out=out) is None
  assert seen[0]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
  assert json.loads(out.read_text())["preallocated"] is True


def test_results_replace_a_kernel_sets_grown_runs_with_its_preallocated_ones(monkeypatch):
  """RESULTS.md's train-step table: where a kernel set has runs on a preallocated pool, its
  runs on an allocator grown on demand (out of memory below the limit) leave the table; a
  set with none keeps them, under a note that its largest batch is a lower bound."""
  from benchmarks import make_results  # pylint: disable=import-outside-toplevel
  base = dict(op="train_step_run", config="1b", device="GPU", platform="gpu", jax="0",
              seq_len=8, peak_bytes=1, predicted_peak_bytes=1, temp_bytes=1)
  run = lambda kernels, batch, fits, **kw: dict(base, kernels=kernels, batch=batch, fits=fits,
                                                tokens_per_s=1.0, **kw)
  rows = [run("memeff", 50, True), run("memeff", 51, False, error="out of memory"),
          run("plain", 8, True), run("plain", 9, False, error="out of memory"),
          run("memeff", 51, True, preallocated=True), run("memeff", 82, True, preallocated=True),
          run("memeff", 83, False, error="out of memory", preallocated=True)]
  monkeypatch.setattr(make_results, "load", lambda op: rows)
  text = "\n".join(make_results.train_step_section()[0])
  assert "| memeff | 50 |" not in text and "| memeff | 82 | yes |" in text
  assert "| memeff | 51 | yes |" in text and "| plain | 9 | no: out of memory |" in text
  summary = text.split("largest batch that runs")[1]
  assert "| memeff | 82 |" in summary and "| plain (cuDNN attention) | 8 |" in summary
  assert "Note: the runs of plain grew JAX's allocator" in text


def test_results_name_a_failure_other_than_out_of_memory(monkeypatch):
  """The summary's largest batch is exact only where the next batch ran out of memory; a run
  that timed out says so, since a longer wait might have found a larger batch."""
  from benchmarks import make_results  # pylint: disable=import-outside-toplevel
  base = dict(op="train_step_run", config="1b", device="GPU", platform="gpu", jax="0",
              seq_len=8, peak_bytes=1, predicted_peak_bytes=1, temp_bytes=1, tokens_per_s=1.0,
              preallocated=True)
  rows = [dict(base, kernels="memeff", batch=161, fits=True),
          dict(base, kernels="memeff", batch=162, fits=False, error="timed out after 150 s"),
          dict(base, kernels="plain", batch=34, fits=True),
          dict(base, kernels="plain", batch=35, fits=False, error="out of memory")]
  monkeypatch.setattr(make_results, "load", lambda op: rows)
  summary = "\n".join(make_results.train_step_section()[0]).split("largest batch that runs")[1]
  assert "| memeff | 161 (162 fails: timed out after 150 s) |" in summary
  assert "| plain (cuDNN attention) | 34 |" in summary
