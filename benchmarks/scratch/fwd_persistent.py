"""The Mosaic forward on a grid against MosaicConfig(persistent=True), and cuDNN, in one
process: forward and fwd+bwd TFLOP/s (the default backward), medians of interleaved
rounds; first a bitwise check that both forwards give the same output and log-sum-exp.

    SHAPES=4x4096x32,64x1024x32 ROUNDS=5 MASKS=dense,causal [POWER=1] \
        python benchmarks/scratch/fwd_persistent.py

POWER=1 then runs each back to back for 2 s: time, power, SM clock and energy per call.
"""

import dataclasses
import os
import statistics
import sys

import jax
import numpy as np

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks", "scratch"))
from _measure import attention_inputs, power  # noqa: E402
from benchmarks import _harness  # noqa: E402
from memeff_jax.ops import flash_attention as fa  # noqa: E402
from memeff_jax.ops.flash_attention.masks import MaskSpec  # noqa: E402


def impl(causal, d, **changes):
  config = fa.MosaicConfig.for_call(d, MaskSpec.make(causal, None, False))
  return fa.PallasMosaicGpu(config=dataclasses.replace(config, **changes))


PROVIDERS = {
    "grid": lambda causal, d: impl(causal, d, persistent=False),
    "persistent": lambda causal, d: impl(causal, d, persistent=True),
    "persistent 128": lambda causal, d: impl(causal, d, persistent=True, num_sms=128),
    "cudnn": None,
}


def main():
  rounds = int(os.environ.get("ROUNDS", "5"))
  names = os.environ.get("PROVIDERS", ",".join(PROVIDERS)).split(",")
  for shape in os.environ.get("SHAPES", "4x4096x32").split(","):
    b, t, h = map(int, shape.split("x"))
    d = 128
    q, k, v, ct = attention_inputs((b, t, h, d))
    for mask in os.environ.get("MASKS", "dense,causal").split(","):
      causal = mask == "causal"
      flops = 4.0 * b * h * t * t * d * (0.5 if causal else 1.0)
      timers, outs, calls = {}, {}, {}
      for name in names:
        if name == "cudnn":
          f = lambda q, k, v, c=causal: jax.nn.dot_product_attention(
              q, k, v, is_causal=c, implementation="cudnn")
        else:
          i = PROVIDERS[name](causal, d)
          f = lambda q, k, v, i=i, c=causal: fa.flash_attention(q, k, v, causal=c,
                                                                implementation=i)
          outs[name] = jax.jit(lambda q, k, v, i=i, c=causal: fa.flash_attention(
              q, k, v, causal=c, implementation=i, return_lse=True))(q, k, v)
        fwd = jax.jit(f)
        fb = jax.jit(lambda q, k, v, ct, f=f: jax.vjp(f, q, k, v)[1](ct))
        jax.block_until_ready((fwd(q, k, v), fb(q, k, v, ct)))
        calls[name + ":fwd"], calls[name + ":fwd+bwd"] = (fwd, (q, k, v)), (fb, (q, k, v, ct))
        timers[name + ":fwd"] = lambda fwd=fwd: _harness.time_jax(fwd, q, k, v, reps=10, inner=5)
        timers[name + ":fwd+bwd"] = lambda fb=fb: _harness.time_jax(fb, q, k, v, ct, reps=10,
                                                                   inner=5)
      ref = outs.get("grid")
      for name, out in outs.items():
        if ref is not None and name != "grid":
          same = all(np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
                     for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
          print(f"{mask} {shape}: {name} identical to grid: {same}")
      times = _harness.interleaved(timers, rounds)
      print(f"{mask} b={b} t={t} h={h} d={d}, medians of {rounds} interleaved rounds")
      for name, ts in times.items():
        ms = statistics.median(ts)
        tf = flops * (3.5 if name.endswith("fwd+bwd") else 1.0) / ms / 1e9
        print(f"  {name:24s} {ms:8.3f} ms {tf:6.0f} TFLOP/s   " + " ".join(f"{x:.3f}" for x in ts),
              flush=True)
      if os.environ.get("POWER") == "1":
        for name, (f, a) in calls.items():
          sec, watts, mhz = power(f, *a, seconds=2.0)
          print(f"  {name:24s} {sec * 1e3:8.3f} ms at {watts:5.1f} W, {mhz:.0f} MHz: "
                f"{watts * sec * 1e3:7.1f} mJ per call", flush=True)


if __name__ == "__main__":
  main()
