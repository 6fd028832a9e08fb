"""Diagnostic (device only): the pallas_gpu loss's temporaries and time per XLA GEMM option.

    python benchmarks/scratch/lce_temps.py

For each (weight layout, chunk, compiler options) prints temp bytes, the largest temporary
buffers from XLA's buffer assignment, and the fwd+bwd time at the llama3-8b shape.
"""
import glob
import os
import sys
import tempfile

dump = tempfile.mkdtemp()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_dump_to={dump} --xla_dump_hlo_module_re=.*loss.*")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks import _harness  # noqa: E402
import memeff_jax  # noqa: E402

N, D, V = 16384, 4096, 128256


def temps(before):
  files = sorted(set(glob.glob(os.path.join(dump, "*loss*buffer-assignment.txt"))) - before)
  if not files:
    return []
  out = [(size, shape, name) for name, (size, shape, kind) in _harness.buffer_values(files[-1]).items()
         if kind in ("temp", "other") and size >= 2**20]
  return sorted(out, reverse=True)[:8]


def main():
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (N, D), jnp.bfloat16)
  y = jax.random.randint(k[2], (N,), 0, V)
  fsk = {"xla_gpu_experimental_force_split_k": 1}
  dsf = {"xla_gpu_enable_dynamic_slice_fusion": True}
  tri = {"xla_gpu_cublas_fallback": False}
  lt = {"xla_gpu_enable_cublaslt": True}
  variants = [("vd", 512, {**lt, **fsk}), ("vd", 576, {**lt, **fsk}), ("vd", 512, {**fsk, **dsf}),
              ("vd", 512, {**lt, **fsk, **dsf})]
  if len(sys.argv) > 1:
    variants = variants[:int(sys.argv[1])]
  for layout, chunk, options in variants:
    shape = (V, D) if layout == "vd" else (D, V)
    w = (jax.random.normal(k[1], shape, jnp.float32) / D**0.5).astype(jnp.bfloat16)

    def loss(x, w):
      return memeff_jax.linear_cross_entropy(x, w, y, weight_layout=layout, chunk_size=chunk)

    before = set(glob.glob(os.path.join(dump, "*")))
    try:
      c = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).compile(
          compiler_options=options or None)
    except Exception as err:  # pylint: disable=broad-except
      print(f"{layout} {chunk} {options}: {type(err).__name__} {str(err)[:200]}", flush=True)
      continue
    m = c.memory_analysis()
    ms = _harness.time_jax(c, x, w, reps=10)
    print(f"{layout} chunk {chunk} {options}: {ms:.2f} ms, temp {m.temp_size_in_bytes / 2**30:.4f} GiB",
          flush=True)
    for size, shp, name in temps(before):
      print(f"    {size / 2**20:8.1f} MiB {shp:30s} {name}")


if __name__ == "__main__":
  main()
