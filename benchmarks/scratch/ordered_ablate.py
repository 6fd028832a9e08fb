"""Where the deterministic backward's energy goes, by removing pieces (device only).

    python benchmarks/scratch/ordered_ablate.py [--causal] [--rounds 5] [--cuts "no exp2;..."]

The kernel of deterministic calls (MosaicBackwardConfig.for_deterministic: dq_ordered with
the send warp, two dQ slots and, without a mask, rotated walks), alone at the headline, as
is and with one piece cut from a patched copy of its module source (the gradients are then
wrong; nothing here is a library option):

  dq half       the send warp moves one of each step's two dQ tiles (half the float32
                traffic into L2, as a pair of CTAs that summed their dQ first would)
  no dq         the send warp moves no dQ tile (its counter waits and signals stay)
  no dq, store  also the compute warpgroups' dQ tile stores into shared memory
  Q,dO half     the memory warp loads the first half of each Q and dO tile's rows
  no exp2       Pᵀ = Sᵀ·c − lse₂ without the exponential
  z at use      (not a cut: the kernel before session 35) each step loads key_tiles' offset
                right before its first WGMMA, rather than the step before
  no turn wait  the send warp does not wait for the counter (its turn): the reductions add
                in arrival order, the counters still count
  no dS wait    the compute warpgroups do not wait for each other's dSᵀ (the lockstep
                that dq_split's exchange imposes; dQ then reads a half-written dSᵀ)

beside the dK/dV-only kernel (the pair's). Each in interleaved rounds, then 2 s back to
back under nvidia-smi: at the 700 W cap the energy per call is what a cut saves.
"""
import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import attention_backward_problem, rounds_then_power, try_variant  # noqa: E402
from onepass_ablate import patched  # noqa: E402
from stream_ablate import halving  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402

D = 128
SEND = ("            for w in range(2):\n"
        "              plgpu.copy_smem_to_gmem(dq_smem.at[slot * 2 + w],",)
SEND_HALF = ("            for w in range(1):\n"
             "              plgpu.copy_smem_to_gmem(dq_smem.at[slot * 2 + w],")
SEND_NONE = ("            for w in range(0):\n"
             "              plgpu.copy_smem_to_gmem(dq_smem.at[slot * 2 + w],")
STORE = ("          if not config.dq_convert:\n            dq_smem.at[tile][...] = dq",)
EXP = ("pt = jnp.exp2(zt - lax.broadcast_in_dim(lse2, st.shape, [1]))",)
Z_AHEAD = ("        return (*step_grads(i, dk, dv, z, masked=masked), z_next)",)
TURN = ('        plgpu.barrier_wait(full)\n'
        '        plgpu.semaphore_wait(counter, rank, decrement=False, memory_scope="gpu")',)
DS_WAIT = ("plgpu.barrier_wait(ds_ready.at[_mosaic.rem(i, 2)])",)
CUTS = {
    "dq half": [(SEND, SEND_HALF)],
    "no dq": [(SEND, SEND_NONE)],
    "no dq, store": [(SEND, SEND_NONE), (STORE, "          if not config.dq_convert:\n            pass")],
    "Q,dO half": [],
    "no exp2": [(EXP, "pt = zt - lax.broadcast_in_dim(lse2, st.shape, [1])")],
    "no dS wait": [(DS_WAIT, "pass")],
    "no turn wait": [(TURN, "        plgpu.barrier_wait(full)")],
    "z at use": [(Z_AHEAD, "        return (*step_grads(i, dk, dv, zero_ref[0], masked=masked), z)")],
}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--cuts", default=";".join(CUTS), help="names of CUTS, separated by ;")
  args = parser.parse_args()
  *_, ct, opts, res, stats = attention_backward_problem(args.causal)
  cts = (ct, jnp.zeros_like(res.lse))
  fns, outs = {}, {}
  cfg = dataclasses.replace(mb.MosaicBackwardConfig.for_deterministic(D, args.causal),
                            fused_delta=False)
  print(cfg, flush=True)

  def add(name, module, config):
    f = jax.jit(lambda res, ct, stats: module.backward(opts, config, res, cts, stats=stats)[:3])
    try_variant(fns, outs, name, f.lower(res, ct, stats).compile(), res, ct, stats)

  add("as is", mb, cfg)
  for name in args.cuts.split(";"):
    module = patched(CUTS[name])
    if name == "Q,dO half":
      module.plgpu = halving(cfg.block_q)
    add(name, module, cfg)
  add("dK/dV only", mb, mb.MosaicBackwardConfig.tuned(D, args.causal, with_dq=False))
  rounds_then_power(fns, args.rounds, width=14)


if __name__ == "__main__":
  main()
