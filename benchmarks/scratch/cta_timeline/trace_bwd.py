"""Per-CTA start/end and per-step global-timer stamps of the Mosaic backward kernel.

The kernel writes them when MEMEFF_TRACE is set (see _stamp and _stamp_step in
mosaic_gpu_backward.py at this commit). On a Hopper GPU:
  PYTHONPATH=. OUT=/tmp/out python benchmarks/scratch/cta_timeline/trace_bwd.py
  python benchmarks/scratch/cta_timeline/an7.py /tmp/out   # phases of a step per variant
an4.py: per-CTA spans and a fit of duration to walk length; an6.py: the ordered send warp's
waits; an8.py: how far apart the adds into one dQ tile come.
"""
import dataclasses, json, os, time
import numpy as np
OUT = os.environ.get("OUT", "/tmp/out")
import jax, jax.numpy as jnp
from memeff_jax.ops import flash_attention as fa
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb

RESULT = {}
def timed(g, args, n=20):
  jax.block_until_ready(g(*args))
  ts = []
  for _ in range(n):
    t0 = time.perf_counter(); jax.block_until_ready(g(*args)); ts.append(time.perf_counter() - t0)
  return np.median(ts) * 1e3

def run(tag, shape, det, cfg=None, last_first=False):
  b, t, h, d = shape
  key = jax.random.PRNGKey(0)
  q, k, v, do = (jax.random.normal(kk, (b, t, h, d), jnp.bfloat16) for kk in jax.random.split(key, 4))
  out, lse = jax.jit(lambda q, k, v: fa.flash_attention(q, k, v, causal=True, return_lse=True))(q, k, v)
  impl = None if cfg is None else fa.PallasMosaicGpu(config=None, backward_config=cfg)
  if last_first: os.environ["MEMEFF_ARRIVAL_LAST_FIRST"] = "1"
  else: os.environ.pop("MEMEFF_ARRIVAL_LAST_FIRST", None)
  mk = lambda: jax.jit(lambda *a: fa.flash_attention_backward(*a, causal=True, deterministic=det, implementation=impl))
  args = (q, k, v, out, lse, do)
  os.environ.pop("MEMEFF_TRACE", None); jax.clear_caches()
  plain = timed(mk(), args)
  traced = 0.0
  if not os.environ.get("MEMEFF_TRACE_OFF"):
    os.environ["MEMEFF_TRACE"] = "1"; jax.clear_caches()
    mb._TRACES.clear()
    traced = timed(mk(), args)
    jax.effects_barrier()
    buf = mb._TRACES[-1]
    np.savez_compressed(os.path.join(OUT, tag + ".npz"), cta=buf[0], steps=buf[1])
  n_kv = t // 64
  if d == 128: n_kv = t // 128
  RESULT[tag] = (dict(plain_ms=plain, traced_ms=traced, b=b, h=h, n_kv=n_kv, calls=len(mb._TRACES)), None)
  print(f"{tag} {shape} {'det' if det else 'arrival'} {'last_first' if last_first else ''}: plain {plain:.3f} ms, traced {traced:.3f} ms ({len(mb._TRACES)} traces)", flush=True)

os.environ.pop("MEMEFF_Z_CARRY", None)
for cf in ("", "1"):
  os.environ["MEMEFF_COUNTER_FIRST"] = cf
  run(f"h16_ord_cf{cf}", (4, 4096, 16, 256), True)
  run(f"h4_ord_cf{cf}", (1, 4096, 4, 256), True)
os.environ["MEMEFF_TRACE_OFF"] = "1"
for cf in ("", "1", "", "1"):
  os.environ["MEMEFF_COUNTER_FIRST"] = cf
  for shp in ((4, 4096, 32, 128), (4, 4096, 64, 64), (4, 4096, 16, 256)):
    run(f"plain_{shp[2]}_{shp[3]}_cf{cf}", shp, True)
json.dump({k: v[0] for k, v in RESULT.items()}, open(os.path.join(OUT, "traces.json"), "w"))
