"""Causal attention with the query CTAs in grid order against heaviest first
(_mosaic.query_cta_index), and cuDNN, in one process: forward and fwd+bwd TFLOP/s, medians
of interleaved rounds.

    SHAPES=4x4096x32,1x16384x32 ROUNDS=5 python benchmarks/scratch/attn_cta_order.py
"""

import os
import statistics
import sys

import jax
from jax import lax

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks", "scratch"))
from _measure import attention_inputs  # noqa: E402
from benchmarks import _harness  # noqa: E402
from memeff_jax.ops.flash_attention import _mosaic  # noqa: E402
from memeff_jax.ops import flash_attention as fa  # noqa: E402

HEAVY_FIRST = _mosaic.query_cta_index


def grid_order(mask, n_ctas):
  del mask, n_ctas
  return lax.axis_index("q")


def build(provider, q, k, v, ct):
  if provider == "cudnn":
    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                     implementation="cudnn")
  else:
    _mosaic.query_cta_index = HEAVY_FIRST if provider == "heavy_first" else grid_order
    f = lambda q, k, v: fa.flash_attention(q, k, v, causal=True)
  fwd = jax.jit(f)
  fb = jax.jit(lambda q, k, v, ct: jax.vjp(f, q, k, v)[1](ct))
  jax.block_until_ready(fwd(q, k, v))  # traced (and compiled) with this provider's order
  jax.block_until_ready(fb(q, k, v, ct))
  _mosaic.query_cta_index = HEAVY_FIRST
  return (lambda: _harness.time_jax(fwd, q, k, v, reps=10, inner=5),
          lambda: _harness.time_jax(fb, q, k, v, ct, reps=10, inner=5))


def main():
  rounds = int(os.environ.get("ROUNDS", "5"))
  for shape in os.environ.get("SHAPES", "4x4096x32").split(","):
    b, t, h = map(int, shape.split("x"))
    d = 128
    q, k, v, ct = attention_inputs((b, t, h, d))
    flops = 4.0 * b * h * t * t * d * 0.5
    timers = {}
    for p in ("grid_order", "heavy_first", "cudnn"):
      fwd, fb = build(p, q, k, v, ct)
      timers[p + ":fwd"], timers[p + ":fwd+bwd"] = fwd, fb
    times = _harness.interleaved(timers, rounds)
    print(f"causal b={b} t={t} h={h} d={d}, medians of {rounds} interleaved rounds")
    for name, ts in times.items():
      ms = statistics.median(ts)
      # the fwd+bwd timer runs the vjp's backward only when given the forward's residuals;
      # time_jax of fb runs forward and backward together (one vjp): 3.5 × the forward FLOPs
      tf = flops * (3.5 if name.endswith("fwd+bwd") else 1.0) / ms / 1e9
      print(f"  {name:22s} {ms:8.3f} ms {tf:6.0f} TFLOP/s   " + " ".join(f"{x:.3f}" for x in ts))


if __name__ == "__main__":
  main()
