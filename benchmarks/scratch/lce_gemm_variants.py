"""The all-Mosaic LCE loss at llama3-8b under variants of its GEMM tiles, timed in one process
in interleaved rounds (medians), so that ratios between variants carry no clock drift.

    VARIANTS='base;dx.max_concurrent_steps=4;logits.in_flight=0' LAYOUT=vd CHUNK=512 \
        ROUNDS=5 python benchmarks/scratch/lce_gemm_variants.py

A variant is "base" (the tiles of configs/tuning) or '+'-joined gemm.field=value changes to
them (gemm: logits, dx, dw; values parsed as Python literals), or impl.field=value for a
PallasGpu field (impl.dw_accumulation="tma_add"), or kernel.field=value for the softmax
kernel's KernelConfig. Session 11 timed a
`memory_warp` GemmConfig option this way (the memory warpgroup's work in one warp): no
change (96.50 against 96.54 ms), so the option was not kept. Each line also gives the
compiled temporaries (memory_analysis) of its loss.
"""

import ast
import dataclasses
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.getcwd())
from benchmarks import _harness  # noqa: E402
import memeff_jax  # noqa: E402
from memeff_jax import _tuning  # noqa: E402
from memeff_jax.ops import linear_cross_entropy as lce  # noqa: E402
from memeff_jax.ops.linear_cross_entropy import pallas_gpu  # noqa: E402


def parse(variant: str):
  """'dx.max_concurrent_steps=4+logits.in_flight=0' -> (change(name, config), PallasGpu
  field edits: 'impl.dw_accumulation="tma_add"')."""
  edits = {}
  for part in ([] if variant == "base" else variant.split("+")):
    key, value = part.split("=", 1)
    gemm, field = key.split(".")
    edits.setdefault(gemm, {})[field] = ast.literal_eval(value)
  impl = dict(edits.get("impl", {}))
  if "kernel" in edits:  # the softmax kernel's tile: kernel.block_v=16384+kernel.num_warps=16
    impl["kernel"] = pallas_gpu.KernelConfig(**{
        **_tuning.lookup("linear_cross_entropy", "pallas_gpu", fields=pallas_gpu.KernelConfig),
        **edits["kernel"]})
  return (lambda name, cfg: dataclasses.replace(cfg, **edits.get(name, {}))), impl


@dataclasses.dataclass(frozen=True)
class Variant(lce.PallasGpu):
  variant: str = "base"

  def gemm_configs(self, *args):
    change, _ = parse(self.variant)
    return tuple((name, change(name, cfg))
                 for name, cfg in super().gemm_configs(*args))


def main():
  n, d, v = 16384, 4096, 128256
  layout = os.environ.get("LAYOUT", "vd")
  chunk = int(os.environ.get("CHUNK", "512"))
  rounds = int(os.environ.get("ROUNDS", "5"))
  names = os.environ.get("VARIANTS", "base").split(";")
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (n, d), jnp.float32).astype(jnp.bfloat16)
  shape = (v, d) if layout == "vd" else (d, v)
  w = (jax.random.normal(k[1], shape, jnp.float32) / d**0.5).astype(jnp.bfloat16)
  y = jax.random.randint(k[2], (n,), 0, v)
  timers, losses, temps = {}, {}, {}
  for name in names:
    impl = Variant(variant=name, **{"mosaic_gemms": pallas_gpu.GEMMS, **parse(name)[1]})
    fn = jax.jit(jax.value_and_grad(lambda x, w, impl=impl: memeff_jax.linear_cross_entropy(
        x, w, y, weight_layout=layout, implementation=impl, chunk_size=chunk), argnums=(0, 1)))
    try:
      loss, (dx, dw) = fn(x, w)
    except Exception as err:  # pylint: disable=broad-except  (e.g. tiles past shared memory)
      print(f"{name}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
      continue
    losses[name] = (float(loss), float(jnp.abs(dx.astype(jnp.float32)).sum()),
                    float(jnp.abs(dw.astype(jnp.float32)).sum()))
    temps[name] = fn.lower(x, w).compile().memory_analysis().temp_size_in_bytes
    timers[name] = lambda fn=fn: _harness.time_jax(fn, x, w, reps=10)
  times = _harness.interleaved(timers, rounds)
  names = [name for name in names if name in timers]
  base = statistics.median(times[names[0]])
  for name in names:
    med = statistics.median(times[name])
    print(f"{name:8s} {med:8.2f} ms  ×{med / base:.4f} vs {names[0]}   rounds "
          + " ".join(f"{t:.2f}" for t in times[name]) + f"   temp {temps[name]:,} B"
          + f"   loss/|dx|/|dW| {losses[name]}")


if __name__ == "__main__":
  main()
