"""`memeff_jax.remat.fit` on a model's train step, checked against a real run.

    python benchmarks/remat_fit.py --config 1b [--batch 4] [--budgets-gib 30,40,60]

Compiles the memeff train step once per remat policy (nothing runs) to get each one's peak
and FLOPs, picks a policy for each of three budgets (by default: just above the smallest,
a middle and the largest candidate peak that the device can hold), then trains two steps
with each chosen policy in a fresh process and compares `peak_bytes_in_use` with the peak
`memeff_jax.memory.analyze` predicted. Rows go to benchmarks/results/remat_fit.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import _harness  # pylint: disable=wrong-import-position
from benchmarks import train_step  # pylint: disable=wrong-import-position


def compile_candidates(config: str, batch: int, seq_len: int | None, policies=None):
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from memeff_jax import remat  # pylint: disable=import-outside-toplevel
  from memeff_jax.cli import _config_path  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import Llama, LlamaConfig, policy_steps  # pylint: disable=import-outside-toplevel

  cfg, train_cfg = LlamaConfig.from_toml(_config_path(config))
  seq_len = seq_len or train_cfg["seq_len"]
  tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  make_step, state = policy_steps(
      lambda policy: Llama(dataclasses.replace(cfg, remat_policy=policy), kernels="memeff",
                           rngs=nnx.Rngs(0)),
      learning_rate=train_cfg.get("learning_rate", 3e-3))
  return remat.candidates(make_step, state, dict(tokens=tokens, labels=tokens),
                          policies=policies), seq_len


def default_budgets(cands, limit: int | None) -> list[int]:
  """Three budgets for which fit picks three different policies where it can: one just
  above each candidate's peak gives every choice fit can make; keep the first, a middle and
  the last distinct one."""
  from memeff_jax import remat  # pylint: disable=import-outside-toplevel

  fitting = sorted(c.peak_bytes for c in cands if c.fits and (not limit or c.peak_bytes <= limit))
  choices = {}  # policy -> smallest budget that picks it
  for peak in fitting:
    budget = int(peak * 1.02)
    choices.setdefault(remat.choose(cands, budget), budget)
  budgets = sorted(choices.values())
  if len(budgets) <= 3:
    return budgets
  return [budgets[0], budgets[len(budgets) // 2], budgets[-1]]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="1b")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--seq-len", type=int, default=None)
  p.add_argument("--budgets-gib", default="", help="comma-separated; default: from candidates")
  p.add_argument("--policies", default="", help="comma-separated; default: remat.POLICIES")
  p.add_argument("--out", default=str(_harness.RESULTS / "remat_fit.jsonl"))
  args = p.parse_args(argv)

  import jax  # pylint: disable=import-outside-toplevel

  from memeff_jax import remat  # pylint: disable=import-outside-toplevel

  env = _harness.environment()
  cands, seq_len = compile_candidates(args.config, args.batch, args.seq_len,
                                      [n for n in args.policies.split(",") if n] or None)
  limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  if args.budgets_gib:
    budgets = [int(float(b) * 2**30) for b in args.budgets_gib.split(",")]
  else:
    budgets = default_budgets(cands, limit)
  candidate_rows = [dataclasses.asdict(c) for c in cands]
  print(f"{args.config}, memeff layers, batch {args.batch} × {seq_len} on {env['device']}:")
  print(remat.table(cands, max(budgets or [0])))
  measured = {}
  rows = []
  for budget in budgets:
    row = dict(op="remat_fit", config=args.config, batch=args.batch, seq_len=seq_len,
               budget_bytes=budget, candidates=candidate_rows, **env)
    try:
      chosen = remat.choose(cands, budget)
    except ValueError as err:
      row["error"] = str(err).splitlines()[0]
      print(f"budget {budget / 2**30:.2f} GiB: {row['error']}")
      rows.append(row)
      continue
    predicted = next(c.peak_bytes for c in cands if c.name == chosen)
    if chosen not in measured:
      run = train_step.measure(args.config, "memeff", args.batch, 2, seq_len,
                               remat_policy=chosen)
      measured[chosen] = (run or {}).get("peak_bytes")
    peak = measured[chosen]
    row.update(chosen=chosen, predicted_peak_bytes=predicted, measured_peak_bytes=peak,
               measured_over_predicted=peak / predicted if peak and predicted else None)
    print(f"budget {budget / 2**30:7.2f} GiB → {chosen:22s} predicted "
          f"{predicted / 2**30:7.2f} GiB, measured "
          f"{'n/a' if not peak else f'{peak / 2**30:7.2f} GiB ({peak / predicted:.3f}×)'}",
          flush=True)
    rows.append(row)
  _harness.append(args.out, rows)


if __name__ == "__main__":
  main()
