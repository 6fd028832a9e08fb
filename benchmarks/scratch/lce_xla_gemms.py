"""Diagnostic (device only): the pallas_gpu loss with XLA's own (Triton) GEMMs instead of cuBLAS.

    python benchmarks/scratch/lce_xla_gemms.py '[["vd", 512, {"xla_gpu_...": value}], ...]'

cuBLAS custom calls hold a 32 MiB workspace each (XLA's kHopperWorkspace, no flag), the one
temporary that keeps the bridged loss above Liger-Kernel's memory. Compiler options given
per compilation (`.compile(compiler_options=...)`) can send the dots to XLA's Triton GEMM
emitter instead, which has no workspace. For each (weight layout, chunk, options) this prints
the fwd+bwd time, the temp bytes and the largest temporaries, and the three-matmul floor
under the same options, at the llama3-8b shape.
"""
import glob
import json
import os
import sys
import tempfile
import time

dump = tempfile.mkdtemp()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_dump_to={dump} --xla_dump_hlo_module_re=.*(loss|floor).*")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks import _harness  # noqa: E402
import memeff_jax  # noqa: E402

N, D, V = 16384, 4096, 128256


def temps(before, pattern):
  files = sorted(set(glob.glob(os.path.join(dump, f"*{pattern}*buffer-assignment.txt"))) - before)
  if not files:
    return []
  out = [(size, shape, name) for name, (size, shape, kind) in _harness.buffer_values(files[-1]).items()
         if kind in ("temp", "other") and size >= 2**20]
  return sorted(out, reverse=True)[:6]


def run(name, fn, args, options, pattern):
  before = set(glob.glob(os.path.join(dump, "*")))
  t0 = time.perf_counter()
  try:
    c = jax.jit(fn).lower(*args).compile(compiler_options=options or None)
  except Exception as err:  # pylint: disable=broad-except
    print(f"{name} {options}: {type(err).__name__} {str(err)[:300]}", flush=True)
    return
  compile_s = time.perf_counter() - t0
  m = c.memory_analysis()
  ms = _harness.time_jax(c, *args, reps=10)
  print(f"{name} {json.dumps(options)}: {ms:.2f} ms, temp {m.temp_size_in_bytes / 2**30:.4f} GiB"
        f" (compile {compile_s:.0f} s)", flush=True)
  for size, shp, buf in temps(before, pattern):
    print(f"    {size / 2**20:8.1f} MiB {shp:30s} {buf}")


def main():
  k = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(k[0], (N, D), jnp.bfloat16)
  y = jax.random.randint(k[2], (N,), 0, V)
  variants = json.loads(sys.argv[1])
  floors_done = set()
  for layout, chunk, options in variants:
    shape = (V, D) if layout == "vd" else (D, V)
    w = (jax.random.normal(k[1], shape, jnp.float32) / D**0.5).astype(jnp.bfloat16)
    key = (layout, json.dumps(options, sort_keys=True))
    if key not in floors_done:
      floors_done.add(key)
      g = (jax.random.normal(k[3], (N, V), jnp.float32) * 1e-3).astype(jnp.bfloat16)
      wt = (lambda w: w.T) if layout == "vd" else (lambda w: w)
      def floor(x, w, g):
        return x @ wt(w), g @ wt(w).T, x.T @ g
      floor.__name__ = "floor"
      run(f"floor {layout}", floor, (x, w, g), options, "floor")
      del g

    def loss(x, w):
      return memeff_jax.linear_cross_entropy(x, w, y, weight_layout=layout, chunk_size=chunk)

    run(f"loss {layout} chunk {chunk}", jax.value_and_grad(loss, argnums=(0, 1)), (x, w),
        options, "loss")


if __name__ == "__main__":
  main()
