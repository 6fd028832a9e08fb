"""End-to-end train step, plain Flax layers vs memeff layers, in one run.

    python benchmarks/train_step.py --config 1b [--kernels plain,memeff] [--steps 10]

For each kernel set: tokens/s and peak device memory at the config's batch, and the largest
batch that fits (doubling, then bisecting). Every measurement runs in a fresh process, so
`peak_bytes_in_use` starts from zero and an out-of-memory failure only means "does not fit".
Rows go to benchmarks/results/train_step.jsonl (or --out).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def worker(args) -> None:
  """One measurement in this process; prints one JSON line."""
  import jax  # pylint: disable=import-outside-toplevel

  from memeff_jax.cli import _config_path  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import LlamaConfig  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import run  # pylint: disable=import-outside-toplevel

  cfg, train_cfg = LlamaConfig.from_toml(_config_path(args.config))
  seq = args.seq_len or train_cfg["seq_len"]
  r = run.train(cfg, train_cfg, kernels=args.kernels, steps=args.steps, batch=args.batch,
                seq_len=seq, show_progress=False)
  print(json.dumps(dict(kernels=args.kernels, batch=args.batch, seq_len=seq,
                        tokens_per_s=r.tokens_per_s, temp_bytes=r.temp_bytes,
                        peak_bytes=r.peak_bytes, first_loss=r.losses[0],
                        last_loss=r.losses[-1], device=jax.devices()[0].device_kind,
                        jax=jax.__version__)))


def measure(config: str, kernels: str, batch: int, steps: int, seq_len: int | None):
  cmd = [sys.executable, __file__, "--worker", "--config", config, "--kernels", kernels,
         "--batch", str(batch), "--steps", str(steps)]
  if seq_len:
    cmd += ["--seq-len", str(seq_len)]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if proc.returncode or not lines:
    reason = "out of memory" if "RESOURCE_EXHAUSTED" in proc.stderr or "Out of memory" in \
        proc.stderr else proc.stderr.strip().splitlines()[-1:] or ["failed"]
    print(f"  {kernels:6s} batch {batch:4d}: does not run ({reason})", flush=True)
    return None
  row = json.loads(lines[-1])
  print(f"  {kernels:6s} batch {batch:4d}: {row['tokens_per_s']:9.0f} tokens/s, peak "
        f"{(row['peak_bytes'] or 0) / 2**30:6.2f} GiB, temporaries "
        f"{(row['temp_bytes'] or 0) / 2**30:6.2f} GiB", flush=True)
  return row


def largest_batch(config, kernels, start, steps, seq_len, max_batch):
  """Largest batch ≤ max_batch that runs: double from `start` until one fails, then bisect."""
  good, bad = 0, None
  batch = start
  while bad is None:
    if batch > max_batch:
      return good  # a lower bound: everything tried fits
    if measure(config, kernels, batch, steps, seq_len):
      good, batch = batch, batch * 2
    else:
      bad = batch
  while bad - good > 1:
    mid = (good + bad) // 2
    if measure(config, kernels, mid, steps, seq_len):
      good = mid
    else:
      bad = mid
  return good


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="1b")
  p.add_argument("--kernels", default="plain,memeff")
  p.add_argument("--batch", type=int, default=None, help="default: the config's")
  p.add_argument("--seq-len", type=int, default=None)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--no-search", action="store_true", help="skip the largest-batch search")
  p.add_argument("--max-batch", type=int, default=256, help="where the search stops")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_step.jsonl"))
  args = p.parse_args(argv)
  if args.worker:
    worker(args)
    return
  from benchmarks import _harness  # pylint: disable=import-outside-toplevel
  from memeff_jax.cli import _config_path  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import LlamaConfig  # pylint: disable=import-outside-toplevel

  _, train_cfg = LlamaConfig.from_toml(_config_path(args.config))
  batch = args.batch or train_cfg["batch"]
  env = _harness.environment()
  for kernels in args.kernels.split(","):
    row = measure(args.config, kernels, batch, args.steps, args.seq_len) or {}
    row = {"op": "train_step", "config": args.config, "kernels": kernels, "batch": batch,
           **env, **row}
    if not args.no_search:
      row["largest_batch"] = largest_batch(args.config, kernels, batch, 3, args.seq_len,
                                           args.max_batch)
      print(f"  {kernels}: largest batch that fits: {row['largest_batch']}")
    _harness.append(args.out, [row])


if __name__ == "__main__":
  main()
