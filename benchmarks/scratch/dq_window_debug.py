"""Where the dq kernel's gradient goes wrong: dq's relative error per 64-row query block (a
compute warpgroup's rows) against the float32 reference, for dq configs, masks and shapes.

  python3 benchmarks/scratch/dq_window_debug.py           # the cases below
  python3 benchmarks/scratch/dq_window_debug.py d128 x=1,256,384,1,1,128/100,30/64,2,1
Works against whichever memeff_jax is first on PYTHONPATH (main, or a branch's tree), and
passes v_stages only where MosaicDqConfig has it.
"""
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from memeff_jax.ops.flash_attention import flash_attention
from memeff_jax.ops.flash_attention import MosaicDqConfig
from memeff_jax.ops.flash_attention import PallasMosaicGpu

HAS_V = "v_stages" in {f.name for f in dataclasses.fields(MosaicDqConfig)}


def problem(b, t, s, hq, hkv, d, seed):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, hq, d), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, s, hkv, d), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, s, hkv, d), jnp.float32).astype(jnp.bfloat16)
  return q, k, v, jax.random.normal(ks[3], (b, t, hq, d), jnp.float32)


def dq_of(impl, q, k, v, ct, opts):
  def f(q):
    return jnp.sum(flash_attention(q, k, v, implementation=impl, **opts).astype(jnp.float32) * ct)
  return np.asarray(jax.jit(jax.grad(f))(q), np.float64)


def case(name, config, opts, shape, seed=7):
  b, t, s, hq, hkv, d = shape
  q, k, v, ct = problem(*shape, seed)
  up = lambda x: x.astype(jnp.float32)
  want = dq_of("reference", up(q), up(k), up(v), ct, opts)
  try:
    got = dq_of(PallasMosaicGpu(dq_config=config), q, k, v, ct, opts)
  except Exception as e:  # pylint: disable=broad-except
    print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return
  total = np.linalg.norm(got - want) / np.linalg.norm(want)
  if os.environ.get("DUMP"):  # the problem and both gradients, for offline analysis
    np.savez(os.path.join(os.environ["DUMP"], f"{name}.npz"), got=got, want=want,
             q=np.asarray(up(q)), k=np.asarray(up(k)), v=np.asarray(up(v)), ct=np.asarray(ct))
  print(f"{name}: {config} {opts} shape={shape}: dq rel err {total:.2e}", flush=True)
  if total < 3e-2:
    return
  for bi in range(b):
    for h in range(hq):
      errs = []
      for r in range(0, t, 64):
        g, w = got[bi, r:r + 64, h], want[bi, r:r + 64, h]
        errs.append(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
      print(f"   b{bi} h{h} per 64-row block: " + " ".join(f"{e:.0e}" for e in errs))


def main():
  kv = lambda **kw: MosaicDqConfig(**{k: x for k, x in kw.items() if HAS_V or k != "v_stages"})
  wide = dict(sliding_window=(100, 30))
  cases = [
      ("main-default-d128", MosaicDqConfig(), wide, (2, 256, 384, 8, 2, 128)),
      ("kv64-d128", MosaicDqConfig(block_kv=64), wide, (2, 256, 384, 8, 2, 128)),
      ("s1-d128", MosaicDqConfig(stages=1), wide, (2, 256, 384, 8, 2, 128)),
      ("d256-k1v1", MosaicDqConfig(block_kv=64, stages=1), wide, (1, 256, 384, 4, 2, 256)),
  ]
  if HAS_V:
    cases += [
        ("d256-k2v1", kv(block_kv=64, stages=2, v_stages=1), wide, (1, 256, 384, 4, 2, 256)),
        ("d256-k2v1-T384S384", kv(block_kv=64, stages=2, v_stages=1), wide,
         (1, 384, 384, 2, 1, 256)),
        ("d256-k2v1-left", kv(block_kv=64, stages=2, v_stages=1),
         dict(sliding_window=(100, 0)), (1, 256, 384, 4, 2, 256)),
        ("d256-k2v1-right", kv(block_kv=64, stages=2, v_stages=1),
         dict(sliding_window=(0, 100)), (1, 256, 384, 4, 2, 256)),
        ("d128-k2v1", kv(stages=2, v_stages=1), wide, (2, 256, 384, 8, 2, 128)),
        ("d128-kv64-k2v1", kv(block_kv=64, stages=2, v_stages=1), wide,
         (2, 256, 384, 8, 2, 128)),
        ("d128-kv64-k3v1", kv(block_kv=64, stages=3, v_stages=1), wide,
         (2, 256, 384, 8, 2, 128)),
        ("d128-kv64-k1v2", kv(block_kv=64, stages=1, v_stages=2), wide,
         (2, 256, 384, 8, 2, 128)),
        ("d128-kv64-k2v2", kv(block_kv=64, stages=2, v_stages=2), wide,
         (2, 256, 384, 8, 2, 128)),
    ]
  only = [a for a in sys.argv[1:] if "=" not in a]
  for a in sys.argv[1:]:  # name=b,t,s,hq,hkv,d/left,right/block_kv,stages,v_stages
    if "=" in a:
      name, spec = a.split("=")
      shape, window, cfg = (tuple(map(int, part.split(","))) for part in spec.split("/"))
      cases.append((name, kv(block_kv=cfg[0], stages=cfg[1], v_stages=cfg[2]),
                    dict(sliding_window=window), shape))
      only.append(name)
  for name, config, opts, shape in cases:
    if not only or any(o in name for o in only):
      case(name, config, opts, shape)


if __name__ == "__main__":
  main()
