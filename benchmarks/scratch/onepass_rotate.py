"""Do the one-pass backward's dQ reductions queue on each other? (device only)

    python benchmarks/scratch/onepass_rotate.py [--rounds 5]

Non-causal, every CTA of a head walks the query blocks in the same order, so at any time
the 32 key-block CTAs of a head add their float32 dQ tiles into the same 32 KB of dq in L2.
Causal calls spread them by construction (key block j starts at query block 2j), and there
the reductions cost the same share of the kernel (~8%, onepass_ablate.py). This rotates each
CTA's walk by `rot` query blocks per key block (a patched copy of the kernel; the order of
the additions changes, nothing else) and times it beside the tuned kernel, with the
reduction cut from both (onepass_ablate's cuts, which reach dq_pipelined's steps), and the
dQ store cut too.
"""
import argparse
import inspect
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import attention_backward_problem, rounds_then_power, try_variant  # noqa: E402
from onepass_ablate import CUTS, patched  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402

D = 128
WALK = "first + _mosaic.rem(i, per_head)"


def rotated_source(rot: int) -> str:
  src = inspect.getsource(mb)
  assert src.count(WALK) == 2, "step_block changed"
  return src.replace(WALK, f"first + _mosaic.rem(i + kvi * {rot}, per_head)")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args()
  *_, ct, opts, res, stats = attention_backward_problem(False)
  cts = (ct, jnp.zeros_like(res.lse))
  cfg = mb.MosaicBackwardConfig.tuned(D, False)
  print(cfg, flush=True)
  fns, outs = {}, {}
  variants = {
      "as is": mb,
      "rot 1": patched([], rotated_source(1)),
      "rot 2": patched([], rotated_source(2)),
      "no reduction": patched(CUTS["no reduction"]),
      "rot 2, no reduction": patched(CUTS["no reduction"], rotated_source(2)),
      "no dQ store": patched(CUTS["no dQ store"]),
  }
  for name, module in variants.items():
    f = jax.jit(lambda res, ct, stats, m=module: m.backward(opts, cfg, res, (ct, cts[1]),
                                                            stats=stats)[:3])
    try_variant(fns, outs, name, f, res, ct, stats)
  for name in ("rot 1", "rot 2"):
    if name in outs and "as is" in outs:
      err = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
             for a, b in zip(outs[name], outs["as is"])]
      print(f"{name}: max |diff| to as is (dq, dk, dv) {err}", flush=True)
  rounds_then_power(fns, args.rounds, width=22)


if __name__ == "__main__":
  main()
