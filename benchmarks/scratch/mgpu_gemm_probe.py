"""Probe (device only): jax's Hopper Mosaic GPU matmul example vs XLA/cuBLAS on the LCE GEMMs.

Shapes of one 512-token chunk at llama3-8b, "dv" layout: dW += x_cᵀ G ([4096,512]@[512,V]),
and the logits GEMM x_c @ W ([512,4096]@[4096,V]).
"""
import functools
import itertools
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from benchmarks import _harness  # noqa: E402

try:
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
except ImportError as err:
  print("no hopper_matmul_mgpu:", err)
  raise SystemExit

C, D, V = 512, 4096, 128256
k = jax.random.split(jax.random.key(0), 4)
xt = jax.random.normal(k[0], (D, C), jnp.bfloat16)
g = (jax.random.normal(k[1], (C, V), jnp.float32) * 1e-3).astype(jnp.bfloat16)
acc = (jax.random.normal(k[2], (D, V), jnp.float32) * 1e-2).astype(jnp.bfloat16)
x = jax.random.normal(k[3], (C, D), jnp.bfloat16)
w = (jax.random.normal(k[3], (D, V), jnp.float32) * 1e-2).astype(jnp.bfloat16)
flops = 2 * C * D * V


def report(name, fn, *args):
  try:
    ms = _harness.time_jax(jax.jit(fn), *args, inner=10)
    print(f"  {name:60s} {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
    return ms
  except Exception as e:  # pylint: disable=broad-except
    print(f"  {name:60s} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)


print("dW accumulate, [4096,512]@[512,V] + C")
report("xla c + a@b", lambda a, b, c: c + jnp.dot(a, b, preferred_element_type=jnp.float32).astype(c.dtype), xt, g, acc)
report("xla a@b", lambda a, b: jnp.dot(a, b), xt, g)
ref = (acc.astype(jnp.float32) + jnp.dot(xt, g, preferred_element_type=jnp.float32)).astype(jnp.bfloat16)
for tm, tn, steps, minor, width, wgd in itertools.product(
    (128,), (128, 64), (4, 3), (hm.MatmulDimension.M, hm.MatmulDimension.N), (1, 8),
    (hm.MatmulDimension.N, hm.MatmulDimension.M)):
  cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=steps,
                        grid_minor_dim=minor, grid_tile_width=width, wg_dimension=wgd)
  name = f"mgpu c tm={tm} tn={tn} st={steps} minor={minor} w={width} wg={wgd}"
  ms = report(name, functools.partial(hm.matmul, config=cfg), xt, g, acc)
  if ms and (tm, tn, steps, width) == (128, 128, 4, 1):
    out = jax.jit(functools.partial(hm.matmul, config=cfg))(xt, g, acc)
    print("    max err", float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)))))
print("logits [512,4096]@[4096,V]")
report("xla x@w", lambda a, b: jnp.dot(a, b), x, w)
for tm, tn, minor, wgd in itertools.product((128, 64), (128, 64), (hm.MatmulDimension.M, hm.MatmulDimension.N),
                                            (hm.MatmulDimension.N, hm.MatmulDimension.M)):
  cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=4,
                        grid_minor_dim=minor, grid_tile_width=1, wg_dimension=wgd)
  report(f"mgpu tm={tm} tn={tn} minor={minor} wg={wgd}", functools.partial(hm.matmul, c=None, config=cfg), x, w)
