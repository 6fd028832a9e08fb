"""The dK/dV-only kernel in clusters of two key blocks sharing the Q/dO stream by TMA multicast
(MosaicBackwardConfig.kv_pairs, which only benchmarks/scratch/patches/kv_pairs.diff adds: apply
it first), at the headline (B=4 T=4096 H=32 D=128 bf16, non-causal).

    python benchmarks/scratch/dkv_pairs.py [--rounds 7]

stream_ablate.py: halving the kernel's Q/dO stream saved 8.5% of its energy; multicast halves
the stream's L2 reads (each CTA's shared memory still receives every tile). The kernel alone,
paired or not (tuned tiles, and ping-pong), then fwd+bwd of one vjp with the deterministic
default against the same with kv_pairs and against cuDNN, all in interleaved rounds; then each
kernel back to back for 2 s under nvidia-smi. dK and dV are compared bit for bit.
"""
import argparse
import dataclasses
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import power  # noqa: E402
from benchmarks import _harness  # noqa: E402
from memeff_jax.ops import flash_attention as fa  # noqa: E402
from memeff_jax.ops.flash_attention import _common  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402
from memeff_jax.ops.flash_attention.masks import MaskSpec  # noqa: E402

B, T, H, D = 4, 4096, 32, 128


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=7)
  args = parser.parse_args()
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, ct = (jax.random.normal(kk, (B, T, H, D), jnp.float32).astype(jnp.bfloat16)
                 for kk in ks)
  opts = _common.AttentionOptions(mask=MaskSpec.make(False, None, False), scale=D ** -0.5)
  out, lse = fa.flash_attention(q, k, v, return_lse=True)
  res = _common.Residuals(q, k, v, None, None, out, jnp.swapaxes(lse, 1, 2))
  stats = mb.row_stats(opts, res, _common.softmax_delta(out, ct, jnp.zeros_like(res.lse)))
  tuned = mb.MosaicBackwardConfig.tuned(D, False, with_dq=False)
  configs = {"dK/dV tuned": tuned,
             "dK/dV tuned pairs": dataclasses.replace(tuned, kv_pairs=True),
             "dK/dV pp": dataclasses.replace(tuned, pingpong=True),
             "dK/dV pp pairs": dataclasses.replace(tuned, pingpong=True, kv_pairs=True)}
  fns, outs, args_of = {}, {}, {}
  for name, cfg in configs.items():
    f = jax.jit(lambda res, ct, stats, cfg=cfg: mb.backward(
        opts, cfg, res, (ct, jnp.zeros_like(res.lse)), stats=stats)[1:3])
    outs[name] = jax.block_until_ready(f(res, ct, stats))
    fns[name], args_of[name] = f, (res, ct, stats)
  for name in configs:
    if name.endswith(" pairs"):
      twin = name[:-len(" pairs")]
      print(f"{name}: dK, dV bitwise equal to {twin}: "
            f"{[bool(jnp.array_equal(a, b)) for a, b in zip(outs[name], outs[twin])]}", flush=True)
  paired = fa.PallasMosaicGpu(backward_config=dataclasses.replace(tuned, kv_pairs=True))
  for name, attn in (("fwd+bwd default", lambda q, k, v: fa.flash_attention(q, k, v)),
                     ("fwd+bwd pairs", lambda q, k, v: fa.flash_attention(
                         q, k, v, implementation=paired)),
                     ("fwd+bwd cudnn", lambda q, k, v: jax.nn.dot_product_attention(
                         q, k, v, implementation="cudnn"))):
    fns[name] = jax.jit(lambda q, k, v, attn=attn: jax.vjp(attn, q, k, v)[1](
        jnp.ones_like(q)))
    args_of[name] = (q, k, v)
    jax.block_until_ready(fns[name](q, k, v))
  times = _harness.interleaved(
      {name: (lambda f=f, a=args_of[name]: _harness.time_jax(f, *a, reps=20))
       for name, f in fns.items()}, args.rounds)
  flops = 3.5 * 4 * B * H * T * T * D
  for name, ts in times.items():
    med = statistics.median(ts)
    extra = f"  {flops / med / 1e9:.0f} TFLOP/s" if name.startswith("fwd+bwd") else ""
    print(f"{name:20} {med:7.3f} ms{extra}   rounds " + " ".join(f"{t:.3f}" for t in ts),
          flush=True)
  for name, f in fns.items():
    sec, watts, mhz = power(f, *args_of[name], seconds=2.0)
    print(f"{name:20} {sec * 1e3:7.3f} ms at {watts:5.1f} W, {mhz:.0f} MHz: "
          f"{watts * sec * 1e3:7.1f} mJ per call", flush=True)


if __name__ == "__main__":
  main()
