"""fused_delta against the XLA pass for Δ: the headline fwd+bwd with the deterministic
default's kernel with the pass, with MosaicBackwardConfig.fused_delta, and cuDNN, in
interleaved rounds, then each back to back at the 700 W cap (energy per call). Under
MOSAIC_GPU_DUMP_PTXAS=1 each variant's ptxas report follows its "== name" line.

    python benchmarks/scratch/fused_delta_ab.py [--causal] [--rounds 5]
"""
import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import attention_inputs, jitted_fwd_bwd, rounds_then_power  # noqa: E402
from benchmarks.flash_attention import attention_fn  # noqa: E402
from memeff_jax.ops import flash_attention as fa  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402
from memeff_jax.ops.flash_attention.masks import MaskSpec  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--causal", action="store_true")
parser.add_argument("--rounds", type=int, default=5)
args = parser.parse_args()

q, k, v, ct = attention_inputs()
default = mb.MosaicBackwardConfig.for_deterministic(128, args.causal)
fused = fa.PallasMosaicGpu(backward_config=dataclasses.replace(default, fused_delta=True))
fused_fn = lambda q, k, v: fa.flash_attention(q, k, v, causal=args.causal, implementation=fused)
pass_impl = fa.PallasMosaicGpu(backward_config=dataclasses.replace(default, fused_delta=False))
providers = {
    "pass": lambda q, k, v: fa.flash_attention(q, k, v, causal=args.causal,
                                               implementation=pass_impl),
    "fused": fused_fn,
    "cudnn": attention_fn("cudnn", args.causal, None),
}
fns, outs = {}, {}
for name, f in providers.items():
  print(f"== {name}", flush=True)
  fns[name] = (jitted_fwd_bwd(f, ct), (q, k, v))
  outs[name] = jax.block_until_ready(fns[name][0](q, k, v))  # compiled now
for name in ("fused", "cudnn"):
  for g, h, x in zip(outs[name][1], outs["pass"][1], "qkv"):
    err = float(jnp.linalg.norm((g - h).astype(jnp.float32)) / jnp.linalg.norm(h.astype(jnp.float32)))
    print(f"{name} d{x} vs the pass: rel err {err:.2e}")
mask = MaskSpec.make(args.causal, None, False)
applies = mb._fuses_delta(fused.backward_config, mask, 64, 32, 1)  # pylint: disable=protected-access
print(f"causal={args.causal}: the fused kernel applies: {applies}", flush=True)
rounds_then_power(fns, args.rounds, width=10)
