"""A/B of module-level switches of linear_cross_entropy's pallas_gpu or of ops.mosaic_gemm
("mg.NAME"; an experiment's patch adds them) inside the loss at llama3-8b "dv" bf16, in the
default and/or the all-Mosaic exp_logits setting, beside the floor, in interleaved rounds
in one process: every combination of the named switches, each traced and compiled with the
switches as set, with its loss, gradients' sums and temporaries printed.

    python benchmarks/scratch/lce_flag_ab.py --flags _SCALE_IN_EPILOGUE,_LSE_BY_SUM [--rounds 5]
    git apply benchmarks/scratch/patches/defer_store_wait.diff
    python benchmarks/scratch/lce_flag_ab.py --flags mg.DEFER_STORE_WAIT --settings default,all-Mosaic

Session 24, H200 (as gemm_flag_ab.py): mg.DEFER_STORE_WAIT (the ring kernels' wait for the
last tile's store to leave the epilogue buffer, moved from before the main loop to the
epilogue) made no difference (all-Mosaic 81.11 / 80.98 ms, default 81.15 / 81.40).
Session 25: see benchmarks/NOTES.md.
"""
import argparse
import itertools
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
  parser.add_argument("--flags", required=True,
                      help="comma-separated pallas_gpu switches, or mosaic_gemm's as mg.NAME")
  parser.add_argument("--settings", default="default", help="default and/or all-Mosaic")
  args = parser.parse_args()
  settings = {"default": None,
              "all-Mosaic": pallas_gpu.PallasGpu(mosaic_gemms=pallas_gpu.GEMMS,
                                                 dw_accumulation="tma_add")}
  settings = {k: v for k, v in settings.items() if k in args.settings.split(",")}
  flags = args.flags.split(",")  # pallas_gpu's, or mosaic_gemm's as "mg.NAME"
  owner = lambda f: (mg, f[3:]) if f.startswith("mg.") else (pallas_gpu, f)
  missing = [f for f in flags if not hasattr(*owner(f))]
  if missing:
    sys.exit(f"no switch {missing}: apply the experiment's patch first")
  k = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(k[0], (N, D), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(k[1], (D, V), jnp.float32) * D ** -0.5).astype(jnp.bfloat16)
  y = jax.random.randint(k[2], (N,), 0, V)
  g = (jax.random.normal(k[3], (N, V), jnp.float32) * 1e-3).astype(jnp.bfloat16)
  floor = jax.jit(lambda x, w, g: (x @ w, g @ w.T, x.T @ g))
  timers = {"floor": lambda: _harness.time_jax(floor, x, w, g, reps=10)}
  for (setting, impl), values in itertools.product(
      settings.items(), itertools.product((False, True), repeat=len(flags))):
    for flag, on in zip(flags, values):
      setattr(*owner(flag), on)
    name = " ".join([setting] + [f"{f}={int(v)}" for f, v in zip(flags, values)])
    fn = jax.jit(jax.value_and_grad(
        lambda x, w, impl=impl: memeff_jax.linear_cross_entropy(x, w, y, implementation=impl),
        argnums=(0, 1)))
    compiled = fn.lower(x, w).compile()  # traced and compiled now, with the switches as set
    loss, (dx, dw) = compiled(x, w)
    print(f"{name}: loss {float(loss):.6f} |dx| {float(jnp.abs(dx).astype(jnp.float32).sum()):.6e} "
          f"|dW| {float(jnp.abs(dw).astype(jnp.float32).sum()):.6e} temp "
          f"{compiled.memory_analysis().temp_size_in_bytes / 2**30:.4f} GiB", flush=True)
    timers[name] = lambda c=compiled: _harness.time_jax(c, x, w, reps=10)
  times = _harness.interleaved(timers, args.rounds)
  base = statistics.median(times["floor"])
  for name, ts in times.items():
    med = statistics.median(ts)
    print(f"{name:40} {med:8.2f} ms  x floor {med / base:.4f}  "
          + " ".join(f"{t:.2f}" for t in ts), flush=True)


if __name__ == "__main__":
  main()
