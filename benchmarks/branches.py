"""Peak memory of ten independent branches, by how they are written and scheduled.

    python benchmarks/branches.py [--branches 10] [--dtype float32]

Each branch is relu → [2048×1024] @ [1024×4096] → relu → @ [4096×1024]. Written one after
another, stage by stage, as a `lax.map` over stacked inputs, and forced into sequence with
`memeff_jax.memory.sequential`; forward and forward+backward. Temporaries come from the
compiled memory analysis (`memeff_jax.memory.analyze`). Each XLA flag setting runs in its own
process (flags are read once per process). Rows go to benchmarks/results/branches.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

M, D, H = 2048, 1024, 4096

FLAGS = {
    "cpu": ["", "--xla_cpu_enable_concurrency_optimized_scheduler=false"],
    "gpu": ["", "--xla_gpu_enable_latency_hiding_scheduler=true",
            "--xla_gpu_enable_latency_hiding_scheduler=false"],
}


def worker(k: int, dtype: str) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from memeff_jax import memory  # pylint: disable=import-outside-toplevel

  def branch(x, w1, w2):
    return jnp.maximum(jnp.maximum(x, 0) @ w1, 0) @ w2

  variants = {
      "one branch": lambda xs, w1s, w2s: [branch(xs[0], w1s[0], w2s[0])],
      "in sequence": lambda xs, w1s, w2s: [branch(*a) for a in zip(xs, w1s, w2s)],
      "stage by stage": _stage_by_stage,
      "lax.map": lambda xs, w1s, w2s: list(jax.lax.map(
          lambda a: branch(*a), (jnp.stack(xs), jnp.stack(w1s), jnp.stack(w2s)))),
      "memory.sequential": lambda xs, w1s, w2s: memory.sequential(
          branch, list(zip(xs, w1s, w2s))),
  }
  s = jax.ShapeDtypeStruct
  args = ([s((M, D), dtype)] * k, [s((D, H), dtype)] * k, [s((H, D), dtype)] * k)
  for name, fn in variants.items():
    grad = jax.grad(lambda *a, fn=fn: sum(jnp.sum(o.astype(jnp.float32)) for o in fn(*a)),
                    argnums=(0, 1, 2))
    row = dict(variant=name, forward=memory.analyze(fn, *args).temp_bytes,
               forward_backward=memory.analyze(grad, *args).temp_bytes)
    print(json.dumps(row), flush=True)


def _stage_by_stage(xs, w1s, w2s):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  h = [jnp.maximum(x, 0) for x in xs]
  h = [a @ w for a, w in zip(h, w1s)]
  h = [jnp.maximum(a, 0) for a in h]
  return [a @ w for a, w in zip(h, w2s)]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--branches", type=int, default=10)
  p.add_argument("--dtype", default="float32")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "branches.jsonl"))
  args = p.parse_args(argv)
  if args.worker:
    worker(args.branches, args.dtype)
    return
  from benchmarks import _harness  # pylint: disable=import-outside-toplevel
  env = _harness.environment()
  hidden = M * H * {"float32": 4, "bfloat16": 2}[args.dtype]
  print(f"{args.branches} branches on {env['device']}; one branch's hidden activations: "
        f"{hidden / 2**20:.0f} MiB")
  for flags in FLAGS.get(env["platform"], [""]):
    environ = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
    proc = subprocess.run([sys.executable, __file__, "--worker", "--branches",
                           str(args.branches), "--dtype", args.dtype],
                          env=environ, capture_output=True, text=True, check=False)
    rows = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode:
      print(proc.stderr[-2000:])
    print(f"XLA_FLAGS: {flags or '(default)'}")
    for row in rows:
      row.update(op="branches", branches=args.branches, dtype=args.dtype,
                 xla_flags=flags, **env)
      print(f"  {row['variant']:18s} forward {row['forward'] / 2**20:8.1f} MiB   "
            f"forward+backward {row['forward_backward'] / 2**20:8.1f} MiB")
    _harness.append(args.out, rows)


if __name__ == "__main__":
  main()
