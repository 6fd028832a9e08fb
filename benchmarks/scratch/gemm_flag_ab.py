"""A/B of a module-level switch of ops.mosaic_gemm (an experiment's patch adds it) inside
the whole loss at llama3-8b "dv" bf16, default and all-Mosaic exp_logits settings, beside
the floor, in interleaved rounds in one process (each variant traced with the switch set
as named).

    git apply benchmarks/scratch/patches/defer_store_wait.diff
    python benchmarks/scratch/gemm_flag_ab.py --flag DEFER_STORE_WAIT [--rounds 5]

Session 24, H200: DEFER_STORE_WAIT (the ring kernels' wait for the last tile's store to
leave the epilogue buffer, moved from before the main loop to the epilogue) made no
difference (all-Mosaic 81.11 / 80.98 ms, default 81.15 / 81.40).
"""
import argparse
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from benchmarks import _harness  # noqa: E402
import memeff_jax  # noqa: E402
from memeff_jax.ops import mosaic_gemm as mg  # noqa: E402
from memeff_jax.ops.linear_cross_entropy import pallas_gpu  # noqa: E402

N, D, V = 16384, 4096, 128256


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--flag", required=True, help="the ops.mosaic_gemm switch to toggle")
  parser.add_argument("--only", default="default,all-Mosaic", help="settings to time")
  args = parser.parse_args()
  if not hasattr(mg, args.flag):
    sys.exit(f"ops.mosaic_gemm has no {args.flag}: apply the experiment's patch first")
  k = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(k[0], (N, D), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(k[1], (D, V), jnp.float32) * D ** -0.5).astype(jnp.bfloat16)
  y = jax.random.randint(k[2], (N,), 0, V)
  g = (jax.random.normal(k[3], (N, V), jnp.float32) * 1e-3).astype(jnp.bfloat16)
  floor = jax.jit(lambda x, w, g: (x @ w, g @ w.T, x.T @ g))
  timers = {"floor": lambda: _harness.time_jax(floor, x, w, g, reps=10)}
  settings = {"default": None,
              "all-Mosaic": pallas_gpu.PallasGpu(mosaic_gemms=pallas_gpu.GEMMS,
                                                 dw_accumulation="tma_add")}
  settings = {k: v for k, v in settings.items() if k in args.only.split(",")}
  for on in (False, True):
    setattr(mg, args.flag, on)
    for name, impl in settings.items():
      fn = jax.jit(jax.value_and_grad(lambda x, w, impl=impl: memeff_jax.linear_cross_entropy(
          x, w, y, implementation=impl), argnums=(0, 1)))
      loss, (dx, dw) = fn(x, w)  # traced and compiled now, with the flag as set
      print(f"{name} {args.flag}={on}: loss {float(loss):.6f} |dx| {float(jnp.abs(dx).astype(jnp.float32).sum()):.6e} "
            f"|dW| {float(jnp.abs(dw).astype(jnp.float32).sum()):.6e}", flush=True)
      timers[f"{name} {int(on)}"] = lambda fn=fn: _harness.time_jax(fn, x, w, reps=10)
  times = _harness.interleaved(timers, args.rounds)
  base = statistics.median(times["floor"])
  for name, ts in times.items():
    med = statistics.median(ts)
    print(f"{name:22} {med:8.2f} ms  x floor {med / base:.3f}  " + " ".join(f"{t:.2f}" for t in ts),
          flush=True)


if __name__ == "__main__":
  main()
