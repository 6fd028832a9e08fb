"""The headline fwd+bwd with the deterministic default's backward kernel against variants of
its MosaicBackwardConfig (and cuDNN), in interleaved rounds, then each back to back at the
700 W cap (energy per call).

    python benchmarks/scratch/bwd_config_ab.py [--causal] [--arrival] [--rounds 5] \
        stages=3,dq_buffers=1 [more variants, each field=value,...]

A variant's `semantics=lane` (or `warpgroup`) lowers its kernels with that Mosaic GPU
lowering semantics (plgpu.CompilerParams patched while it compiles).
"""
import argparse
import dataclasses
import functools
import sys

import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import attention_inputs, jitted_fwd_bwd, rounds_then_power, try_variant  # noqa: E402
from benchmarks.flash_attention import attention_fn  # noqa: E402
from memeff_jax.ops import flash_attention as fa  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--causal", action="store_true")
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--arrival", action="store_true",
                    help="against the arrival-order kernel (deterministic=False's) instead")
parser.add_argument("variants", nargs="*")
args = parser.parse_args()

q, k, v, ct = attention_inputs()
if args.arrival:
  default = mb.MosaicBackwardConfig.tuned(128, args.causal)
else:
  default = mb.MosaicBackwardConfig.for_deterministic(128, args.causal)


def ours(config):
  impl = fa.PallasMosaicGpu(backward_config=config)
  return lambda q, k, v: fa.flash_attention(q, k, v, causal=args.causal, implementation=impl,
                                            deterministic=not args.arrival)


providers = {"default": ours(default)}
semantics = {}
for spec in args.variants:
  fields = dict(kv.split("=") for kv in spec.split(","))
  if "semantics" in fields:
    semantics[spec] = getattr(mb.plgpu.LoweringSemantics, fields.pop("semantics").capitalize())
  fields = {f: (v == "true" if v in ("true", "false") else int(v)) for f, v in fields.items()}
  providers[spec] = ours(dataclasses.replace(default, **fields))
providers["cudnn"] = attention_fn("cudnn", args.causal, None)
fns, outs = {}, {}
params = mb.plgpu.CompilerParams
for name, f in providers.items():
  print(f"== {name}", flush=True)
  if name in semantics:  # the kernels compile on this first call
    mb.plgpu.CompilerParams = functools.partial(params, lowering_semantics=semantics[name])
  try:
    try_variant(fns, outs, name, jitted_fwd_bwd(f, ct), q, k, v)
  finally:
    mb.plgpu.CompilerParams = params
for name in outs:
  if name != "default":
    errs = [float(jnp.linalg.norm((g - h).astype(jnp.float32)) / jnp.linalg.norm(h.astype(jnp.float32)))
            for g, h in zip(outs[name][1], outs["default"][1])]
    print(f"{name}: rel err (dq, dk, dv) to the default {['%.1e' % e for e in errs]}", flush=True)
rounds_then_power(fns, args.rounds, width=24)
