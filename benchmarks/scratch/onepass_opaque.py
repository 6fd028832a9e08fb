"""The attention backward kernel with its K/V operands at an opaque offset (key_tiles in
mosaic_gpu_backward) against the source before it, both the one-pass kernel (tuned,
deterministic=False) and the dK/dV-only kernel of the deterministic default (device only).

    MOSAIC_GPU_DUMP_PTXAS=1 python benchmarks/scratch/onepass_opaque.py [--causal] [--rounds 5]

BASE: the kernel module's source before the change (a file; default
benchmarks/scratch/baseline_src/mosaic_gpu_backward.py). "rows only": the one-pass kernel
with dQ's K columns at a constant offset again (K and V rows opaque).
"""
import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import attention_backward_problem, rounds_then_power, try_variant  # noqa: E402
from onepass_ablate import patched  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402

D = 128
STATIC_COLS = (("dq_cols = pl.ds((wg + z) * half, half)",), "dq_cols = pl.ds(wg * half, half)")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--causal", action="store_true")
  args = parser.parse_args()
  *_, ct, opts, res, stats = attention_backward_problem(args.causal)
  cts = (ct, jnp.zeros_like(res.lse))
  with open(os.environ.get("BASE", "benchmarks/scratch/baseline_src/mosaic_gpu_backward.py")) as f:
    base = patched([], f.read())
  configs = {"one-pass": mb.MosaicBackwardConfig.tuned(D, args.causal),
             "dK/dV": mb.MosaicBackwardConfig.tuned(D, args.causal, with_dq=False)}
  fns, outs = {}, {}
  for tag, cfg in configs.items():
    print(f"{tag}: {cfg}", flush=True)
    variants = [("before", base), ("opaque", mb)]
    if cfg.with_dq:
      variants.append(("rows only", patched([STATIC_COLS])))
    for name, module in variants:
      c = module.MosaicBackwardConfig(**dataclasses.asdict(cfg))
      f = jax.jit(lambda res, ct, stats, m=module, c=c: m.backward(opts, c, res, (ct, cts[1]),
                                                                   stats=stats)[:3])
      try_variant(fns, outs, f"{tag} {name}", f, res, ct, stats)
    for name, _ in variants[1:]:
      if f"{tag} before" in outs and f"{tag} {name}" in outs:
        err = [None if a is None else
               float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
               for a, b in zip(outs[f"{tag} {name}"], outs[f"{tag} before"])]
        print(f"{tag} {name}: max |diff| to before (dq, dk, dv) {err}", flush=True)
  rounds_then_power(fns, args.rounds, width=18)


if __name__ == "__main__":
  main()
