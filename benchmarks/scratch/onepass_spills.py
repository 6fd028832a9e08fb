"""The pipelined one-pass backward's register spills (device only).

    MOSAIC_GPU_DUMP_PTXAS=1 python benchmarks/scratch/onepass_spills.py [--causal] [--rounds 5]

ncu (session 28) counts 57 M local-memory spill requests in the tuned one-pass kernel (ptxas:
104 B of spills at 240 registers) against 1 M in cuDNN's backward. With dq_pipelined a step's
dSᵀ is already in shared memory (exchanged for dQ) when dV, dK and dQ are issued, yet dK
takes it from registers: its 16 registers stay live until the WGMMA completes. This patches
dK to read the warpgroup's own rows of the dSᵀ slot instead (16 KB more shared-memory reads
per warpgroup and step). Under ncu the spills' loads are the kernel's first stall reason
(long scoreboard 4.9 cycles per issued instruction against cuDNN's 1.7), so also: dSᵀ
computed before Pᵀ is cast to the input dtype ("dS first": Pᵀ in float32 and bf16 are then
never live together beside dPᵀ and Δ), and both. Each patched copy is timed beside the tuned
kernel.
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
DK_SMEM = (("plgpu.wgmma(dk_ref, dst, q_tile)",),
           "plgpu.wgmma(dk_ref, ds_buf.at[pl.ds(wg * bkv, bkv)], q_tile)")
CAST = "      pt = pt.astype(dtype)  # dV's operand\n"
DST = ("      dst = (p_ds * (dpt - lax.broadcast_in_dim(delta, st.shape, [1]))).astype(dtype)\n")
DS_FIRST = ((CAST + "      delta = _mosaic.load(stats_smem.at[slot, 1], col_layout)\n" + DST,),
            "      delta = _mosaic.load(stats_smem.at[slot, 1], col_layout)\n" + DST + CAST)
VARIANTS = {"dK from smem": [DK_SMEM], "dS first": [DS_FIRST], "both": [DK_SMEM, DS_FIRST]}


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
  modules = {"as is": mb, **{name: patched(cuts) for name, cuts in VARIANTS.items()}}
  for name, module in modules.items():
    f = jax.jit(lambda res, ct, stats, m=module: m.backward(opts, cfg, res, (ct, cts[1]),
                                                            stats=stats)[:3])
    try_variant(fns, outs, name, f, res, ct, stats)
  for name in [n for n in outs if n != "as is"]:
    err = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
           for a, b in zip(outs[name], outs["as is"])]
    print(f"{name}: max |diff| to as is (dq, dk, dv) {err}", flush=True)
  rounds_then_power(fns, args.rounds, width=16)


if __name__ == "__main__":
  main()
