"""The one-pass attention backward with its dQ pipelined (MosaicBackwardConfig.dq_pipelined)
at the headline (B=4 T=4096 H=32 D=128 bf16), device only.

    MOSAIC_GPU_DUMP_PTXAS=1 python benchmarks/scratch/onepass_pipelined.py [--causal] [--rounds 5]

onepass_ablate.py found the one-pass kernel's dQ store path (wait for dQ's WGMMA, store the
float32 tile, reduce) costing ~1.3 ms of its ~6.3 ms: the compute warpgroups wait for it
with nothing else on the tensor cores. dq_pipelined leaves each step's dQ running under the
next step's softmax and stores it under that step's dV and dK. The kernel alone (with the
dq_split and ping-pong kernels it would replace, and the dK/dV-only kernel), then fwd+bwd
with deterministic=False against the default deterministic pair and cuDNN.
"""
import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import ATTN_SHAPE, attention_backward_problem, rounds_then_power, try_variant  # noqa: E402,E501
from memeff_jax.ops import flash_attention as fa  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402

B, T, H, D = ATTN_SHAPE


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--causal", action="store_true")
  args = parser.parse_args()
  causal = args.causal
  q, k, v, ct, opts, res, stats = attention_backward_problem(causal)
  cts = (ct, jnp.zeros_like(res.lse))
  flops = 4 * B * H * T * T * D * (0.5 if causal else 1.0)
  split = mb.MosaicBackwardConfig(dq_split=True)
  kernels = {
      "split": split,
      "split pipelined": dataclasses.replace(split, dq_pipelined=True),
      "split pipelined 3 st": dataclasses.replace(split, dq_pipelined=True, stages=3),
      "pp": mb.MosaicBackwardConfig(dq_split=False, pingpong=True),
      "dK/dV only (tuned)": mb.MosaicBackwardConfig.tuned(D, causal, with_dq=False),
  }
  fns, outs = {}, {}
  for name, cfg in kernels.items():
    print(f"compiling {name}: {cfg}", flush=True)
    f = jax.jit(lambda res, ct, stats, cfg=cfg: mb.backward(opts, cfg, res, (ct, cts[1]),
                                                            stats=stats)[:3])
    try_variant(fns, outs, name, f, res, ct, stats)
  for name in [n for n in outs if "pipelined" in n]:
    err = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
           for a, b in zip(outs[name], outs["split"])]
    print(f"{name}: max |diff| to split (dq, dk, dv) {err}", flush=True)
  rounds_then_power(fns, args.rounds, width=22,
                    note=lambda n, ms: f"  {flops * (4 if 'only' in n else 5) / 2 / ms / 1e9:6.1f}"
                                       " TFLOP/s")

  impls = {
      "ours default (det.)": (None, True),
      "ours one-pass split": (fa.PallasMosaicGpu(backward_config=split), False),
      "ours one-pass pipelined": (fa.PallasMosaicGpu(
          backward_config=kernels["split pipelined"]), False),
  }
  fns = {}
  for name, (impl, det) in impls.items():
    f = lambda q, k, v, impl=impl, det=det: fa.flash_attention(
        q, k, v, causal=causal, implementation=impl, deterministic=det)
    fns[name] = (jax.jit(lambda q, k, v, ct, f=f: jax.vjp(f, q, k, v)[1](ct)), (q, k, v, ct))
  cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                       implementation="cudnn")
  fns["cudnn"] = (jax.jit(lambda q, k, v, ct: jax.vjp(cudnn, q, k, v)[1](ct)), (q, k, v, ct))
  rounds_then_power(fns, args.rounds, width=24,
                    note=lambda n, ms: f"  {flops * 3.5 / ms / 1e9:6.1f} TFLOP/s fwd+bwd")


if __name__ == "__main__":
  main()
