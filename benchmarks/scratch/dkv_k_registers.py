"""The dK/dV-only kernel with K as Sᵀ's register operand (MosaicBackwardConfig.k_registers,
which only benchmarks/scratch/patches/k_registers.diff adds: apply it first),
at the headline (B=4 T=4096 H=32 D=128 bf16), against the tuned config.

    MOSAIC_GPU_DUMP_PTXAS=1 python benchmarks/scratch/dkv_k_registers.py [--rounds 7] [--causal]

stream_ablate.py showed the kernel bound by shared-memory bandwidth (halving its Q/dO TMA
writes saved 8% of its energy); with K in registers the Sᵀ WGMMA reads only Qᵀ from shared
memory. Each variant alone in interleaved rounds, then 2 s back to back under nvidia-smi;
dK and dV are compared bit for bit with the same block_q's shared-memory variant.
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
from memeff_jax.ops.flash_attention import _common  # noqa: E402
from memeff_jax.ops.flash_attention import flash_attention  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402
from memeff_jax.ops.flash_attention.masks import MaskSpec  # noqa: E402

B, T, H, D = 4, 4096, 32, 128


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--causal", action="store_true")
  args = parser.parse_args()
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, ct = (jax.random.normal(kk, (B, T, H, D), jnp.float32).astype(jnp.bfloat16)
                 for kk in ks)
  opts = _common.AttentionOptions(mask=MaskSpec.make(args.causal, None, False), scale=D ** -0.5)
  out, lse = flash_attention(q, k, v, causal=args.causal, return_lse=True)
  res = _common.Residuals(q, k, v, None, None, out, jnp.swapaxes(lse, 1, 2))
  stats = mb.row_stats(opts, res, _common.softmax_delta(out, ct, jnp.zeros_like(res.lse)))
  tuned = mb.MosaicBackwardConfig.tuned(D, args.causal, with_dq=False)
  variants = {"tuned": tuned}
  for block_q in (64, 80):
    for pingpong in (False, True):
      base = dataclasses.replace(tuned, block_q=block_q, pingpong=pingpong)
      if base != tuned:
        variants[f"{block_q} rows{' pp' if pingpong else ''}"] = base
      variants[f"{block_q} rows{' pp' if pingpong else ''} K regs"] = dataclasses.replace(
          base, k_registers=True)
  fns, outs = {}, {}
  for name, cfg in variants.items():
    print(f"compiling {name}: {cfg}", flush=True)
    f = jax.jit(lambda res, ct, stats, cfg=cfg: mb.backward(
        opts, cfg, res, (ct, jnp.zeros_like(res.lse)), stats=stats)[1:3])
    try:
      outs[name] = jax.block_until_ready(f(res, ct, stats))
    except Exception as err:  # pylint: disable=broad-except
      print(f"{name}: {type(err).__name__}: {str(err)[:300]}", flush=True)
      continue
    fns[name] = f
  for name in fns:
    if name.endswith(" K regs"):
      twin = name[:-len(" K regs")]
      twin = twin if twin in outs else "tuned"
      same = [bool(jnp.array_equal(a, b)) for a, b in zip(outs[name], outs[twin])]
      print(f"{name}: dK, dV bitwise equal to {twin}: {same}", flush=True)
  times = _harness.interleaved(
      {name: (lambda f=f: _harness.time_jax(f, res, ct, stats, reps=20)) for name, f in fns.items()},
      args.rounds)
  for name, ts in times.items():
    print(f"{name:18} {statistics.median(ts):7.3f} ms   rounds " + " ".join(f"{t:.3f}" for t in ts),
          flush=True)
  for name, f in fns.items():
    sec, watts, mhz = power(f, res, ct, stats, seconds=2.0)
    print(f"{name:18} {sec * 1e3:7.3f} ms at {watts:5.1f} W, {mhz:.0f} MHz: "
          f"{watts * sec * 1e3:7.1f} mJ per call", flush=True)


if __name__ == "__main__":
  main()
