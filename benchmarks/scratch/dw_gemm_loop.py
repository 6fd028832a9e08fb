"""The LCE GEMMs per chunk, timed the way linear_cross_entropy runs them.

dW += op(G) op(x) is timed inside a fori_loop over a carried accumulator (XLA fuses the add
into cuBLAS's epilogue, beta = 1; ops.mosaic_gemm.gemm_into updates a jax.Ref in place):
per-accumulate ms = (time of 1 + R iterations − time of 1) / R, so the copy of the
accumulator into the loop and the launch are not counted. The logits and dx GEMMs (no C)
are timed as single calls. An optimization barrier ties the operands to the loop carry, so
XLA cannot hoist the loop-invariant product out of the loop.

    python benchmarks/scratch/dw_gemm_loop.py       env: CHUNKS=512,1024 LAYOUTS=vd,dv
                                                         CASES=dw,logits,dx
                          CONFIGS=quick|all|pingpong|cluster|cluster2|cluster3
"""
import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, ".")
from benchmarks import _harness  # noqa: E402
from memeff_jax.ops import mosaic_gemm as mg  # noqa: E402

D, V = 4096, 128256
R = 8
key = iter(jax.random.split(jax.random.key(0), 64))
rnd = lambda shape, s=1.0: (jax.random.normal(next(key), shape, jnp.float32) * s).astype(jnp.bfloat16)


def loop_ms(step, acc, *operands):
  """Milliseconds per step(acc, *operands) -> acc, inside a fori_loop."""
  def run(n, acc, *ops):
    def body(_, carry):
      acc, ops = lax.optimization_barrier(carry)
      return step(acc, *ops), ops
    return lax.fori_loop(0, n, body, (acc, ops))[0]
  t1 = _harness.time_jax(jax.jit(functools.partial(run, 1)), acc, *operands, reps=7)
  tr = _harness.time_jax(jax.jit(functools.partial(run, 1 + R)), acc, *operands, reps=7)
  return (tr - t1) / R


def mosaic_step(cfg, trans):
  def step(acc, a, b):
    ref = jax.new_ref(acc)
    mg.gemm_into(ref, a, b, config=cfg, **trans)
    return ref[...]
  return step


def configs(which):
  """Tiles to try. A CTA's tiles run as one chained pipeline only when the pipeline depth
  divides the K steps (512 / 64 = 8 at a 512-token dW), so most depths here are 2 or 4."""
  G = mg.GemmConfig
  quick = [G(tile_n=128, max_concurrent_steps=2), G(tile_n=128, tile_k=32, max_concurrent_steps=4),
           G(tile_n=128, max_concurrent_steps=2, wg_split="m"),
           G(tile_n=128, max_concurrent_steps=2, minor="m"),
           G(tile_n=64, max_concurrent_steps=4), G(tile_n=64, max_concurrent_steps=4, wg_split="m"),
           G(tile_n=128, max_concurrent_steps=3),
           G(tile_n=128, tile_k=32, max_concurrent_steps=4, minor="m")]
  if which == "quick":
    return quick
  if which == "cluster":  # session 8: pairs of CTAs sharing one operand's blocks by multicast
    P = functools.partial(G, schedule="pingpong", tile_n=128, max_concurrent_steps=4, band=8)
    C = functools.partial(G, tile_n=128, max_concurrent_steps=3)
    return [P(), P(cluster="m"), P(cluster="n"), P(cluster="m", minor="m"),
            P(cluster="n", max_concurrent_steps=5),
            C(), C(cluster="m"), C(cluster="n"), C(cluster="m", minor="m")]
  if which == "cluster3":  # deeper pipelines: smaller CTA tiles leave room for more slots
    C = functools.partial(G, minor="m", cluster="m")
    return [C(tile_n=128, max_concurrent_steps=3),
            C(tile_n=64, max_concurrent_steps=5), C(tile_n=64, max_concurrent_steps=6),
            C(tile_n=64, max_concurrent_steps=5, cluster="n"),
            C(tile_n=64, max_concurrent_steps=4, band=8),
            C(tile_n=64, wg_split="m", max_concurrent_steps=4, cluster="n"),
            C(tile_n=64, wg_split="m", max_concurrent_steps=4, cluster="n", minor="n", band=8),
            C(tile_n=128, tile_k=32, max_concurrent_steps=6),
            G(schedule="pingpong", tile_n=128, max_concurrent_steps=5, band=8, cluster="n"),
            G(schedule="pingpong", tile_n=64, max_concurrent_steps=8, band=8, cluster="n")]
  if which == "cluster2":  # around the best of "cluster"
    C = functools.partial(G, tile_n=128, max_concurrent_steps=3, minor="m")
    W = functools.partial(G, tile_n=128, max_concurrent_steps=3, wg_split="m")
    P = functools.partial(G, schedule="pingpong", tile_n=128, max_concurrent_steps=5, band=8)
    return [C(), C(cluster="m"), C(cluster="m", max_concurrent_steps=2), C(cluster="m", band=4),
            C(cluster="m", band=8), C(cluster="m", band=16), C(cluster="m", minor="n", band=8),
            W(cluster="n"), W(cluster="n", minor="m"), W(cluster="m", minor="m"),
            P(cluster="n"), P(cluster="m", minor="m")]
  if which == "pingpong":
    P = functools.partial(G, schedule="pingpong", tile_n=128)
    return [G(tile_n=128, max_concurrent_steps=3), G(tile_n=128, max_concurrent_steps=2, minor="m"),
            G(tile_n=64, max_concurrent_steps=4),
            P(max_concurrent_steps=4), P(max_concurrent_steps=5), P(max_concurrent_steps=4, minor="m"),
            P(max_concurrent_steps=4, band=8), P(max_concurrent_steps=4, band=8, minor="m"),
            P(max_concurrent_steps=3), P(tile_n=64, max_concurrent_steps=6)]
  return quick + [G(tile_n=128, tile_k=32, max_concurrent_steps=2),
                  G(tile_n=128, max_concurrent_steps=2, band=8),
                  G(tile_n=128, max_concurrent_steps=2, wg_split="m", minor="m")]


def main():
  chunks = [int(c) for c in os.environ.get("CHUNKS", "512,1024").split(",")]
  layouts = os.environ.get("LAYOUTS", "vd,dv").split(",")
  cases = os.environ.get("CASES", "dw,logits,dx").split(",")
  cfgs = configs(os.environ.get("CONFIGS", "quick"))
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  for c in chunks:
    flops = 2 * c * D * V
    x = rnd((c, D)); g = rnd((c, V), 1e-3)
    for layout in layouts:
      w = rnd((V, D) if layout == "vd" else (D, V), 0.02)
      acc = rnd(w.shape, 0.01)
      # (xla step or fn, mosaic trans, operands); dW's step carries acc
      if layout == "vd":
        dw = (lambda a, g, x: a + jnp.dot(g.T, x, preferred_element_type=a.dtype),
              dict(trans_a=True), (g, x))
        logits = (lambda x, w: x @ w.T, dict(trans_b=True), (x, w))
        dx = (lambda g, w: g @ w, dict(), (g, w))
      else:
        dw = (lambda a, x, g: a + jnp.dot(x.T, g, preferred_element_type=a.dtype),
              dict(trans_a=True), (x, g))
        logits = (lambda x, w: x @ w, dict(), (x, w))
        dx = (lambda g, w: g @ w.T, dict(trans_b=True), (g, w))
      for case in cases:
        xla_fn, trans, ops = dict(dw=dw, logits=logits, dx=dx)[case]
        if case == "dw":
          xla_ms = loop_ms(xla_fn, acc, *ops)
          # the product alone, as a floor for the accumulate
          bare = _harness.time_jax(jax.jit(lambda a, b, f=xla_fn: f(jnp.zeros((), acc.dtype), a, b)),
                                   *ops, inner=10)
          print(f"C={c} {layout} dW+=  xla {xla_ms:6.3f} ms ({flops / xla_ms / 1e9:4.0f} TFLOP/s)"
                f"  xla product alone {bare:6.3f}", flush=True)
          ref = xla_fn(acc.astype(jnp.float32), *(o.astype(jnp.float32) for o in ops))
        else:
          xla_ms = _harness.time_jax(jax.jit(xla_fn), *ops, inner=10)
          print(f"C={c} {layout} {case:6s} xla {xla_ms:6.3f} ms ({flops / xla_ms / 1e9:4.0f})",
                flush=True)
          ref = xla_fn(*(o.astype(jnp.float32) for o in ops))
        scale = float(jnp.max(jnp.abs(ref)))
        for cfg in cfgs:
          try:
            if case == "dw":
              step = mosaic_step(cfg, trans)
              out = jax.jit(step)(acc, *ops)
              ms = loop_ms(step, acc, *ops)
            else:
              fn = jax.jit(functools.partial(mg.gemm, config=cfg, **trans))
              out = fn(*ops)
              ms = _harness.time_jax(fn, *ops, inner=10)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))) / scale
            print(f"    {ms:6.3f} ms ({flops / ms / 1e9:4.0f})  {ms / xla_ms:5.3f}x xla  "
                  f"rel err {err:.1e}  {cfg}", flush=True)
          except Exception as e:  # pylint: disable=broad-except
            print(f"    {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
  main()
