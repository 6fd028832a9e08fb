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
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import attention_backward_problem, rounds_then_power  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402

D = 128


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--causal", action="store_true")
  args = parser.parse_args()
  *_, ct, opts, res, stats = attention_backward_problem(args.causal)
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
    fns[name] = (f, (res, ct, stats))
  for name in fns:
    if name.endswith(" K regs"):
      twin = name[:-len(" K regs")]
      twin = twin if twin in outs else "tuned"
      same = [bool(jnp.array_equal(a, b)) for a, b in zip(outs[name], outs[twin])]
      print(f"{name}: dK, dV bitwise equal to {twin}: {same}", flush=True)
  rounds_then_power(fns, args.rounds, width=18)


if __name__ == "__main__":
  main()
