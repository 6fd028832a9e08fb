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
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import ATTN_SHAPE, attention_backward_problem, rounds_then_power  # noqa: E402
from memeff_jax.ops import flash_attention as fa  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402

B, T, H, D = ATTN_SHAPE


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=7)
  args = parser.parse_args()
  q, k, v, ct, opts, res, stats = attention_backward_problem(False)
  tuned = mb.MosaicBackwardConfig.tuned(D, False, with_dq=False)
  configs = {"dK/dV tuned": tuned,
             "dK/dV tuned pairs": dataclasses.replace(tuned, kv_pairs=True),
             "dK/dV pp": dataclasses.replace(tuned, pingpong=True),
             "dK/dV pp pairs": dataclasses.replace(tuned, pingpong=True, kv_pairs=True)}
  fns, outs = {}, {}
  for name, cfg in configs.items():
    f = jax.jit(lambda res, ct, stats, cfg=cfg: mb.backward(
        opts, cfg, res, (ct, jnp.zeros_like(res.lse)), stats=stats)[1:3])
    outs[name] = jax.block_until_ready(f(res, ct, stats))
    fns[name] = (f, (res, ct, stats))
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
    f = jax.jit(lambda q, k, v, attn=attn: jax.vjp(attn, q, k, v)[1](jnp.ones_like(q)))
    fns[name] = (f, (q, k, v))
    jax.block_until_ready(f(q, k, v))
  flops = 3.5 * 4 * B * H * T * T * D
  rounds_then_power(fns, args.rounds, note=lambda name, ms: (
      f"  {flops / ms / 1e9:.0f} TFLOP/s" if name.startswith("fwd+bwd") else ""))


if __name__ == "__main__":
  main()
