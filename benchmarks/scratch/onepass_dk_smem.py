"""The pipelined one-pass backward with dK = dSᵀ Q reading dSᵀ from shared memory (device only).

    MOSAIC_GPU_DUMP_PTXAS=1 python benchmarks/scratch/onepass_dk_smem.py [--causal] [--rounds 5]

ncu (session 28) counts 57 M local-memory spill requests in the tuned one-pass kernel (ptxas:
104 B of spills at 240 registers) against 1 M in cuDNN's backward. With dq_pipelined a step's
dSᵀ is already in shared memory (exchanged for dQ) when dV, dK and dQ are issued, yet dK
takes it from registers: its 16 registers stay live until the WGMMA completes. This patches
dK to read the warpgroup's own rows of the dSᵀ slot instead (16 KB more shared-memory reads
per warpgroup and step) and times it beside the tuned kernel.
"""
import argparse
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import attention_backward_problem, rounds_then_power, try_variant  # noqa: E402
from onepass_ablate import patched  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402

D = 128
DK_SMEM = ((("plgpu.wgmma(dk_ref, dst, q_tile)",),
            "plgpu.wgmma(dk_ref, ds_buf.at[pl.ds(wg * bkv, bkv)], q_tile)"),)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--causal", action="store_true")
  args = parser.parse_args()
  *_, ct, opts, res, stats = attention_backward_problem(args.causal)
  cts = (ct, jnp.zeros_like(res.lse))
  cfg = mb.MosaicBackwardConfig.tuned(D, args.causal)
  print(cfg, flush=True)
  fns, outs = {}, {}
  for name, module in {"as is": mb, "dK from smem": patched(DK_SMEM)}.items():
    f = jax.jit(lambda res, ct, stats, m=module: m.backward(opts, cfg, res, (ct, cts[1]),
                                                            stats=stats)[:3])
    try_variant(fns, outs, name, f, res, ct, stats)
  if len(outs) == 2:
    err = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
           for a, b in zip(outs["dK from smem"], outs["as is"])]
    print(f"dK from smem: max |diff| to as is (dq, dk, dv) {err}", flush=True)
  rounds_then_power(fns, args.rounds, width=16)


if __name__ == "__main__":
  main()
