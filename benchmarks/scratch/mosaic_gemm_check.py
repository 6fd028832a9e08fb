"""Device check: memeff_jax.ops.mosaic_gemm against XLA, correctness then the LCE GEMMs' time.

    python benchmarks/scratch/mosaic_gemm_check.py [--quick]
"""
import functools
import itertools
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from benchmarks import _harness  # noqa: E402
from memeff_jax.ops import mosaic_gemm as mg  # noqa: E402

key = iter(jax.random.split(jax.random.key(0), 64))
rnd = lambda shape, s=1.0: (jax.random.normal(next(key), shape, jnp.float32) * s).astype(jnp.bfloat16)


def into(c, a, b, **kw):
  r = jax.new_ref(c)
  mg.gemm_into(r, a, b, **kw)
  return r[...]


print("correctness (max |err| vs float32 reference, bf16 output)", flush=True)
M, N, K = 512, 1024, 512
for ta, tb in itertools.product([False, True], [False, True]):
  a = rnd((K, M) if ta else (M, K)); b = rnd((N, K) if tb else (K, N)); c = rnd((M, N))
  A = (a.T if ta else a).astype(jnp.float32); B = (b.T if tb else b).astype(jnp.float32)
  ref = A @ B
  for split in ("n", "m"):
    cfg = mg.GemmConfig(wg_split=split, tile_n=64)
    try:
      out = jax.jit(functools.partial(mg.gemm, trans_a=ta, trans_b=tb, config=cfg))(a, b)
      e1 = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
      out2 = jax.jit(functools.partial(into, trans_a=ta, trans_b=tb, config=cfg))(c, a, b)
      e2 = float(jnp.max(jnp.abs(out2.astype(jnp.float32) - (c.astype(jnp.float32) + ref))))
      print(f"  trans_a={ta!s:5} trans_b={tb!s:5} split={split}: gemm {e1:.3f}  into {e2:.3f}"
            f"  (|ref| max {float(jnp.max(jnp.abs(ref))):.0f})", flush=True)
    except Exception as err:  # pylint: disable=broad-except
      print(f"  trans_a={ta} trans_b={tb} split={split}: {type(err).__name__}: {str(err)[:400]}", flush=True)

D, V = 4096, 128256
quick = "--quick" in sys.argv
for C in (512,):
  flops = 2 * C * D * V
  x = rnd((C, D)); g = rnd((C, V), 1e-3)
  for layout in ("vd", "dv"):
    w = rnd((V, D) if layout == "vd" else (D, V), 0.02)
    acc = rnd(w.shape, 0.01)
    if layout == "vd":  # logits x Wᵀ, dx G W, dW += Gᵀ x
      cases = [("logits", lambda x, w: x @ w.T, dict(trans_b=True), (x, w)),
               ("dx", lambda g, w: g @ w, dict(), (g, w)),
               ("dW+=", lambda c, g, x: c + jnp.dot(g.T, x, preferred_element_type=jnp.float32).astype(c.dtype),
                dict(trans_a=True), (acc, g, x))]
    else:  # logits x W, dx G Wᵀ, dW += xᵀ G
      cases = [("logits", lambda x, w: x @ w, dict(), (x, w)),
               ("dx", lambda g, w: g @ w.T, dict(trans_b=True), (g, w)),
               ("dW+=", lambda c, x, g: c + jnp.dot(x.T, g, preferred_element_type=jnp.float32).astype(c.dtype),
                dict(trans_a=True), (acc, x, g))]
    for name, xla_fn, trans, args in cases:
      xla_ms = _harness.time_jax(jax.jit(xla_fn), *args, inner=10)
      line = f"C={C} {layout} {name:6s} xla {xla_ms:6.3f} ms ({flops / xla_ms / 1e9:4.0f})"
      configs = [mg.GemmConfig(wg_split=s, minor=mi, tile_n=tn, tile_k=tk, max_concurrent_steps=st)
                 for s, mi, (tn, tk, st) in itertools.product(
                     ("n", "m"), ("n", "m"), ((64, 64, 4), (128, 32, 4), (128, 64, 2), (128, 64, 3)))]
      if quick:
        configs = configs[:4]
      best = None
      for cfg in configs:
        if name == "dW+=":
          fn = jax.jit(functools.partial(into, config=cfg, **trans), donate_argnums=0)
          run = lambda: fn(jnp.copy(args[0]), *args[1:])
          try:
            jax.block_until_ready(run())
            fn2 = jax.jit(functools.partial(into, config=cfg, **trans))
            ms = _harness.time_jax(fn2, *args, inner=10)
          except Exception as err:  # pylint: disable=broad-except
            ms = None; msg = f"{type(err).__name__}: {str(err)[:200]}"
        else:
          try:
            ms = _harness.time_jax(jax.jit(functools.partial(mg.gemm, config=cfg, **trans)), *args, inner=10)
          except Exception as err:  # pylint: disable=broad-except
            ms = None; msg = f"{type(err).__name__}: {str(err)[:200]}"
        if ms is None:
          print(f"    {cfg}: {msg}", flush=True)
        elif best is None or ms < best[0]:
          best = (ms, cfg)
        if ms is not None and not quick:
          print(f"    {ms:6.3f} ms split={cfg.wg_split} minor={cfg.minor} tn={cfg.tile_n} tk={cfg.tile_k} steps={cfg.max_concurrent_steps}", flush=True)
      if best:
        line += f"  mosaic best {best[0]:6.3f} ms ({flops / best[0] / 1e9:4.0f}) {best[1]}"
      print(line, flush=True)
    if name == "dW+=":
      cfg = best[1] if best else mg.GemmConfig()
      m = jax.jit(functools.partial(into, config=cfg, trans_a=True), donate_argnums=0).lower(*args).compile().memory_analysis()
      print(f"  in-place check: temp {m.temp_size_in_bytes / 2**20:.1f} MiB, alias {m.alias_size_in_bytes / 2**20:.1f} MiB", flush=True)
