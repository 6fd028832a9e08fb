"""End-to-end train step, plain Flax layers vs memeff layers, in one run.

    python benchmarks/train_step.py --config 1b [--kernels plain,plain_xla,memeff] [--steps 10]
    python benchmarks/train_step.py --config 125m --curve 1000 --batch 4
    python benchmarks/train_step.py --config 1b --mesh data=2,fsdp=2 --batch 16

Kernel sets (memeff_jax.models.llama): memeff; plain (Flax, optax, cuDNN attention);
plain_xla (the same with XLA's attention). For each: tokens/s and peak device memory at the
config's batch, and the largest batch that fits. The search starts from a prediction: the
train step compiled (not run) at twice the batch gives the bytes per sequence, and the
device's `bytes_limit` then gives the batch where the compiled peak reaches the limit. Real
runs at that batch and the next one confirm it (and step on from there if the prediction was
off). Every run is a fresh process, so `peak_bytes_in_use` starts from zero and an
out-of-memory failure only means "does not fit". JAX may use 95% of the GPU
(XLA_PYTHON_CLIENT_MEM_FRACTION, unless set), preallocated as one pool.
With `--mesh` (as `memeff-jax train --mesh` takes it) the step trains on that mesh of the
host's devices; batches are global, searched in multiples of the data × fsdp shards, and the
peak is the first device's.
`--curve STEPS` instead trains each kernel set STEPS steps from the same parameters on the
same data and keeps every step's loss (an op="train_curve" row each), to compare the curves.
Rows go to benchmarks/results/train_step.jsonl (or --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def worker(args) -> None:
  """One measurement in this process; prints one JSON line."""
  import jax  # pylint: disable=import-outside-toplevel

  from memeff_jax.cli import _config_path  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import LlamaConfig  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import run  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import sharding  # pylint: disable=import-outside-toplevel

  cfg, train_cfg = LlamaConfig.from_toml(_config_path(args.config))
  if args.remat_policy:
    cfg = dataclasses.replace(cfg, remat_policy=args.remat_policy)
  seq = args.seq_len or train_cfg["seq_len"]
  probes = tuple(int(b) for b in args.probe.split(",") if b)
  def compiled(_, report):  # printed first: a run that then fails still reports its prediction
    print(json.dumps(dict(compiled=True, predicted_peak_bytes=report.peak_bytes,
                          temp_bytes=report.temp_bytes)), flush=True)

  mesh = sharding.make_mesh(sharding.parse_mesh(args.mesh)) if args.mesh else None

  def trained(r):  # printed before the probes compile: a run whose probes fail still ran
    stats = jax.devices()[0].memory_stats() or {}
    print(json.dumps(dict(kernels=args.kernels, batch=args.batch, seq_len=seq,
                          remat_policy=cfg.remat_policy,
                          tokens_per_s=r.tokens_per_s, temp_bytes=r.temp_bytes,
                          peak_bytes=r.peak_bytes, predicted_peak_bytes=r.predicted_peak_bytes,
                          bytes_limit=stats.get("bytes_limit"),
                          first_loss=r.losses[0], last_loss=r.losses[-1],
                          **({"losses": r.losses} if args.keep_losses else {}),
                          device=jax.devices()[0].device_kind, jax=jax.__version__)),
          flush=True)

  r = run.train(cfg, train_cfg, kernels=args.kernels, steps=args.steps, batch=args.batch,
                seq_len=seq, show_progress=False, probe_batches=probes, on_compiled=compiled,
                on_trained=trained, mesh=mesh, context_order=args.context_order,
                context_strategy=args.context_strategy,
                sequence_parallel=args.sequence_parallel)
  if probes:
    print(json.dumps(dict(probes=r.probes)), flush=True)


# What the allocator or XLA writes to stderr when a device runs out of memory.
OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Out of memory", "ran out of memory")


def _out_of_memory(line: str) -> bool:
  return any(m in line for m in OUT_OF_MEMORY)


def run_worker(cmd: list[str], env: dict | None = None, timeout: float | None = None,
               grace: float = 30.0) -> subprocess.CompletedProcess:
  """Runs a worker to its end, or stops it: `timeout` seconds after it started (stderr then
  ends with "timed out after ... s"), or `grace` seconds after it reported running out of
  memory. On a mesh the devices that did not fail wait in their next collective for the
  one that did, and the process would never exit by itself."""
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env)
  out, err, oom_at = [], [], []

  def read_stderr():
    for line in proc.stderr:
      err.append(line)
      if not oom_at and _out_of_memory(line):
        oom_at.append(time.monotonic())

  readers = [threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True),
             threading.Thread(target=read_stderr, daemon=True)]
  for r in readers:
    r.start()
  start, timed_out = time.monotonic(), False
  while proc.poll() is None:
    now = time.monotonic()
    timed_out = timeout is not None and now - start > timeout
    if timed_out or (oom_at and now - oom_at[0] > grace):
      proc.kill()
      break
    time.sleep(0.1)
  proc.wait()
  for r in readers:
    r.join()
  if timed_out:  # counted as not running: the search goes lower
    err.append(f"timed out after {timeout:.0f} s\n")
  return subprocess.CompletedProcess(cmd, proc.returncode, "".join(out), "".join(err))


def measure(config: str, kernels: str, batch: int, steps: int, seq_len: int | None,
            remat_policy: str | None = None, probe: tuple[int, ...] = (), runs_out=None,
            keep_losses: bool = False, mesh: str | None = None, timeout: float | None = None,
            context: tuple[str, str] = ("contiguous", "all_gather"), failures: list | None = None,
            sequence_parallel: bool = False):
  """One fresh-process run (run_worker); its JSON row, or None if it did not run (out of
  memory, or not done within `timeout` seconds). With `runs_out`, every run, fitting or
  not, is appended there as an op="train_step_run" row as soon as it ends; `failures` gets
  why a run did not.
  `context`: the attention's (order, strategy) on a mesh with a context axis;
  `sequence_parallel`: the model's, on a mesh with a tensor axis."""
  cmd = [sys.executable, __file__, "--worker", "--config", config, "--kernels", kernels,
         "--batch", str(batch), "--steps", str(steps)]
  if seq_len:
    cmd += ["--seq-len", str(seq_len)]
  if remat_policy:
    cmd += ["--remat-policy", remat_policy]
  if probe:
    cmd += ["--probe", ",".join(map(str, probe))]
  if keep_losses:
    cmd += ["--keep-losses"]
  if mesh:
    cmd += ["--mesh", mesh, "--context-order", context[0], "--context-strategy", context[1]]
  if sequence_parallel:
    cmd += ["--sequence-parallel"]
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  # One preallocated pool, as JAX's default has it. Grown on demand instead, the allocator
  # kept the compile's freed buffers in regions of their own and found no contiguous room
  # for the step's temporaries far below the limit (plain layers out of memory at a 50.5 GiB
  # compiled peak of the 75 GiB allowed on an H100, memeff ones at 57.4).
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
  proc = run_worker(cmd, env, timeout)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  record = dict(op="train_step_run", config=config, kernels=kernels, batch=batch,
                remat_policy=remat_policy, preallocated=True, **({"mesh": mesh} if mesh else {}),
                **({"sequence_parallel": True} if sequence_parallel else {}))
  prediction = [json.loads(l) for l in lines if l.startswith('{"compiled"')]
  probes = [json.loads(l)["probes"] for l in lines if l.startswith('{"probes"')]
  lines = [l for l in lines if not l.startswith(('{"compiled"', '{"probes"'))]
  if prediction:
    record["predicted_peak_bytes"] = prediction[-1]["predicted_peak_bytes"]
    record["temp_bytes"] = prediction[-1]["temp_bytes"]
  if not lines:  # it did not train (a run that trained and then failed to probe did)
    oom = [l for l in proc.stderr.splitlines() if _out_of_memory(l)]
    reason = "out of memory" if oom else \
        (proc.stderr.strip().splitlines()[-1:] or ["failed"])[0][:300]
    where = ("at compile" if not prediction else
             f"compiled peak {prediction[-1]['predicted_peak_bytes'] / 2**30:.2f} GiB")
    print(f"  {kernels:9s} batch {batch:4d}: does not run ({reason}, {where})", flush=True)
    if failures is not None:
      failures.append(reason)
    if runs_out:
      # the allocator's own words (which allocation, how large) where it ran out
      _append(runs_out, dict(record, fits=False, error=reason,
                             **({"oom_message": oom[0].strip()[:500]} if oom else {})))
    return None
  row = dict(json.loads(lines[-1]), probes=probes[-1] if probes else {})
  if runs_out:
    _append(runs_out, dict(record, **row, fits=True))
  print(f"  {kernels:9s} batch {batch:4d}: {row['tokens_per_s']:9.0f} tokens/s, peak "
        f"{(row['peak_bytes'] or 0) / 2**30:6.2f} GiB, temporaries "
        f"{(row['temp_bytes'] or 0) / 2**30:6.2f} GiB", flush=True)
  return row


def _append(path, row):
  from benchmarks import _harness  # pylint: disable=import-outside-toplevel
  _harness.append(path, [{**_harness.environment(), **row}])


def predict_largest(row: dict) -> int | None:
  """The batch where the compiled peak, linear in the batch, reaches bytes_limit."""
  (b2, p2), = row["probes"].items()
  b1, p1, limit = row["batch"], row["predicted_peak_bytes"], row["bytes_limit"]
  if not (p1 and p2 and limit) or int(b2) <= b1 or p2 <= p1:
    return None
  per_sequence = (p2 - p1) / (int(b2) - b1)
  return max(1, int((limit - (p1 - b1 * per_sequence)) // per_sequence))


def largest_batch(config, kernels, start, steps, seq_len, max_batch, start_fits=None,
                  runs_out=None, mesh: str | None = None, unit: int = 1,
                  timeout: float | None = None, sequence_parallel: bool = False):
  """Largest batch ≤ max_batch that runs, searched outward from `start` (a known-good batch
  or a prediction): steps of 1, 2, 4, ... `unit`s (the batch's shards on a mesh) until the
  answer flips, then bisection."""
  runs = lambda k: measure(config, kernels, k * unit, steps, seq_len, runs_out=runs_out,
                           mesh=mesh, timeout=timeout, sequence_parallel=sequence_parallel)
  start, max_batch = max(min(start, max_batch) // unit, 1), max_batch // unit
  if start_fits is None:
    start_fits = bool(runs(start))
  if start_fits:
    good, bad, step = start, None, 1
    while bad is None:
      if good + step > max_batch:
        return good * unit  # a lower bound: everything tried fits
      if runs(good + step):
        good, step = good + step, step * 2
      else:
        bad = good + step
  else:
    good, bad, step = 0, start, 1
    while good == 0 and bad - step >= 1:
      if runs(bad - step):
        good = bad - step
      else:
        bad, step = bad - step, step * 2
  while bad - good > 1:
    mid = (good + bad) // 2
    if runs(mid):
      good = mid
    else:
      bad = mid
  return good * unit


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="1b")
  p.add_argument("--kernels", default="plain,plain_xla,memeff")
  p.add_argument("--batch", type=int, default=None, help="default: the config's")
  p.add_argument("--seq-len", type=int, default=None)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--remat-policy", default=None, help="default: the config's")
  p.add_argument("--probe", default="", help=argparse.SUPPRESS)
  p.add_argument("--no-search", action="store_true", help="skip the largest-batch search")
  p.add_argument("--max-batch", type=int, default=256, help="where the search stops")
  p.add_argument("--search-from", type=int, default=None,
                 help="start the largest-batch search here instead of at the prediction")
  p.add_argument("--curve", type=int, default=None, metavar="STEPS",
                 help="train STEPS steps per kernel set and keep every loss (no timing search)")
  p.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                 help="train on this mesh of the host's devices, e.g. data=2,fsdp=2")
  p.add_argument("--sequence-parallel", action="store_true",
                 help="with a tensor axis in --mesh: the model's sequence parallelism")
  p.add_argument("--context-order", default="contiguous", help=argparse.SUPPRESS)
  p.add_argument("--context-strategy", default="all_gather", help=argparse.SUPPRESS)
  p.add_argument("--run-timeout", type=float, default=None, metavar="SECONDS",
                 help="a run not done by then counts as not running (the search goes lower)")
  p.add_argument("--keep-losses", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_step.jsonl"))
  args = p.parse_args(argv)
  if args.worker:
    worker(args)
    return
  from benchmarks import _harness  # pylint: disable=import-outside-toplevel
  from memeff_jax.cli import _config_path  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import LlamaConfig  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import sharding  # pylint: disable=import-outside-toplevel

  _, train_cfg = LlamaConfig.from_toml(_config_path(args.config))
  batch = args.batch or train_cfg["batch"]
  env = dict(_harness.environment(), preallocated=True)  # as measure's runs record it
  mesh = {}
  if args.mesh:  # global batches: whole multiples of the batch's shards
    mesh = sharding.parse_mesh(args.mesh)
    env = dict(env, mesh=args.mesh)  # as the runs record it
    if args.sequence_parallel:
      env["sequence_parallel"] = True
  unit = mesh.get("data", 1) * mesh.get("fsdp", 1)
  if batch % unit:
    raise SystemExit(f"--batch {batch} must be a multiple of the data × fsdp shards ({unit})")
  if args.curve:
    for kernels in args.kernels.split(","):
      row = measure(args.config, kernels, batch, args.curve, args.seq_len, keep_losses=True)
      if row:
        _harness.append(args.out, [{"op": "train_curve", "config": args.config, **env, **row}])
    return
  for kernels in args.kernels.split(","):
    row = measure(args.config, kernels, batch, args.steps, args.seq_len,
                  probe=() if args.no_search or args.search_from else (2 * batch,),
                  runs_out=args.out, mesh=args.mesh, timeout=args.run_timeout,
                  sequence_parallel=args.sequence_parallel) or {}
    row = {"op": "train_step", "config": args.config, "kernels": kernels, "batch": batch,
           **env, **row}
    if not args.no_search:
      predicted = predict_largest(row) if row.get("probes") else None
      print(f"  {kernels}: predicted largest batch: {predicted}", flush=True)
      row["predicted_largest_batch"] = predicted
      start = args.search_from or predicted or batch
      row["largest_batch"] = largest_batch(
          args.config, kernels, start, 2, args.seq_len, args.max_batch,
          start_fits="tokens_per_s" in row if start == batch else None, runs_out=args.out,
          mesh=args.mesh, unit=unit, timeout=args.run_timeout,
          sequence_parallel=args.sequence_parallel)
      print(f"  {kernels}: largest batch that fits: {row['largest_batch']}", flush=True)
    _harness.append(args.out, [row])


if __name__ == "__main__":
  main()
