"""The `memeff-jax` command.

  memeff-jax demo    the fused loss beside the naive one: values, gradients, memory, time
  memeff-jax bench   run a benchmark script from a source checkout (benchmarks/<op>.py)
"""

from __future__ import annotations

import argparse
import pathlib
import runpy
import sys
import time


def _demo(args) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  import memeff_jax  # pylint: disable=import-outside-toplevel

  n, d, v = args.tokens, args.hidden, args.vocab
  dtype = jnp.dtype(args.dtype)
  device = jax.devices()[0]
  print(f"memeff-jax demo on {device.platform} ({device.device_kind}): LM-head loss of "
        f"{n:,} tokens, hidden {d}, vocab {v:,}, {dtype.name}")
  logits_gib = n * v * 4 / 2**30
  print(f"The float32 logits alone would take {logits_gib:.2f} GiB.\n")
  kx, kw, ky = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (n, d), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (d, v), jnp.float32) / np.sqrt(d)).astype(dtype)
  y = jax.random.randint(ky, (n,), 0, v)

  def naive(x, w):
    return optax.softmax_cross_entropy_with_integer_labels((x @ w).astype(jnp.float32), y).mean()

  def fused(x, w):
    return memeff_jax.linear_cross_entropy(x, w, y)

  rows = []
  ref_grads = None
  for name, fn in (("naive: x @ W + optax", naive), ("memeff_jax.linear_cross_entropy", fused)):
    step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
    compiled = step.lower(x, w).compile()
    analysis = compiled.memory_analysis()
    temp = None if analysis is None else analysis.temp_size_in_bytes
    loss, grads = jax.block_until_ready(compiled(x, w))
    t0 = time.perf_counter()
    for _ in range(args.reps):
      loss, grads = compiled(x, w)
    jax.block_until_ready(grads)
    ms = (time.perf_counter() - t0) * 1e3 / args.reps
    if ref_grads is None:
      ref_grads, err = grads, 0.0
    else:
      err = max(float(jnp.linalg.norm((g - r).astype(jnp.float32)) /
                      jnp.linalg.norm(r.astype(jnp.float32)))
                for g, r in zip(grads, ref_grads))
    rows.append((name, float(loss), err, temp, ms))

  print(f"{'':34s} {'loss':>10s} {'grad rel. err':>14s} {'temporaries':>12s} {'time':>10s}")
  for name, loss, err, temp, ms in rows:
    mem = "n/a" if temp is None else f"{temp / 2**20:9.1f} MiB"
    print(f"{name:34s} {loss:10.6f} {err:14.2e} {mem:>12s} {ms:7.1f} ms")
  naive_temp, ours_temp = rows[0][3], rows[1][3]
  if naive_temp and ours_temp:
    print(f"\nSame loss and gradients with {naive_temp / ours_temp:.0f}x less temporary memory "
          "(XLA's compiled memory analysis of jit(value_and_grad)).")
  ok = abs(rows[0][1] - rows[1][1]) <= 1e-3 * abs(rows[0][1]) and rows[1][2] < 2e-2
  if not ok:
    print("MISMATCH between the naive and the fused loss", file=sys.stderr)
  return 0 if ok else 1


def _bench(args) -> int:
  script = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / f"{args.op}.py"
  if not script.exists():
    print(f"no benchmark script {script}; `memeff-jax bench` runs from a source checkout",
          file=sys.stderr)
    return 2
  sys.argv = [str(script)] + args.rest
  runpy.run_path(str(script), run_name="__main__")
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="memeff-jax", description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  demo = sub.add_parser("demo", help="fused vs naive LM-head loss: values, gradients, memory")
  demo.add_argument("--tokens", type=int, default=8192)
  demo.add_argument("--hidden", type=int, default=256)
  demo.add_argument("--vocab", type=int, default=50257)
  demo.add_argument("--dtype", default="float32")
  demo.add_argument("--reps", type=int, default=3)
  demo.set_defaults(func=_demo)
  bench = sub.add_parser("bench", help="run benchmarks/<op>.py (source checkout)")
  bench.add_argument("op", choices=["linear_cross_entropy", "flash_attention"])
  bench.add_argument("rest", nargs=argparse.REMAINDER)
  bench.set_defaults(func=_bench)
  args = parser.parse_args(argv)
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
