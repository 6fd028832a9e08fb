"""Where the one-pass attention backward's dQ path spends its energy (device only).

    python benchmarks/scratch/onepass_ablate.py [--causal] [--rounds 5]

The one-pass kernel (mosaic_gpu_backward with dq, deterministic=False) does five matmul
units per call where the deterministic pair does seven, yet spends more energy at the
700 W cap (session 17: 4.28 J against 2.48 + 1.69). This takes its dQ path apart, cumulatively,
by compiling patched copies of the kernel module's source (the gradients are then wrong;
nothing here is a library option), and with two dQ tiles per warpgroup (dq_tiles=2):

  no read wait   only the wait for the last reduction to have read the tile (a race)
  no fence       only the proxy fence (commit_smem) between the tile's store and its
                 reduction (a race)
and, cumulatively:
  no reduction   the float32 dQ tile's TMA reduction into global memory skipped
  no red., no fence   also the fence
  no dQ store    also the tile's store from registers to shared memory
  no dQ WGMMA    also dQ = dS K itself (the dSᵀ store to shared memory and, with dq_split,
                 the warpgroups' exchange of it remain)

beside the kernel without dq (with_dq=False, 64-row steps as the one-pass kernel takes).
Each alone in interleaved rounds, then 2 s back to back under nvidia-smi.
"""
import argparse
import dataclasses
import importlib.util
import inspect
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import attention_backward_problem, rounds_then_power, try_variant  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402

D = 128
# Each line as session 27 measured it (before store_dq), then as with
# benchmarks/scratch/patches/dq_tiles.diff applied (which the "2 dQ tiles" variant needs),
# then as in store_dq (later main, where the cuts reach dq_pipelined's steps too).
REDUCE = ('plgpu.copy_smem_to_gmem(dq_smem.at[wg], dq_ref.at[b, rows, head, cols], '
          'reduction_op="add")',
          'plgpu.copy_smem_to_gmem(dq_tile, dq_ref.at[b, rows, head, cols], reduction_op="add")',
          'plgpu.copy_smem_to_gmem(dq_smem.at[wg], dq_ref.at[b, pl.ds(qb * bq, bq), head, cols],\n'
          '                              reduction_op="add")')
STORE = ("dq_smem.at[wg][...] = dq", "dq_tile[...] = dq")
FENCE = ("dq_smem.at[wg][...] = dq\n      plgpu.commit_smem()",
         "dq_tile[...] = dq\n      plgpu.commit_smem()")
READ_WAIT = ("plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last reduction has read",
             "plgpu.wait_smem_to_gmem(n_tiles - 1, wait_read_only=True)")
DQ_SPLIT = ("dq = lax.cond(wg == 0, lambda: dq_half(0), lambda: dq_half(half))",)
DQ_OWN = ("dq = pl.run_scoped(mm, plgpu.ACC((bq, oc), jnp.float32))",)
CUTS = {
    "no read wait": [(READ_WAIT, "pass")],
    "no fence": [(FENCE, STORE[0])],
    "no reduction": [(REDUCE, "pass")],
    "no red., no fence": [(REDUCE, "pass"), (FENCE, STORE[0])],
    "no dQ store": [(REDUCE, "pass"), (STORE, "pass")],
    "no dQ WGMMA": [(REDUCE, "pass"), (STORE, "pass"), (DQ_SPLIT, "pass"), (DQ_OWN, "pass")],
}


def patched(cuts, src=None):
  """A copy of mosaic_gpu_backward (or of its source as given) with each (old, new) line
  replaced."""
  src = inspect.getsource(mb) if src is None else src
  for olds, new in cuts:
    old = next(o for o in olds if src.count(o) == 1)
    src = src.replace(old, new + "  #" if old.endswith("has read") else new)
  spec = importlib.util.spec_from_loader(f"mb_{abs(hash(src))}", loader=None)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  exec(compile(src, mb.__file__, "exec"), module.__dict__)  # pylint: disable=exec-used
  return module


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--causal", action="store_true")
  args = parser.parse_args()
  *_, ct, opts, res, stats = attention_backward_problem(args.causal)
  cts = (ct, jnp.zeros_like(res.lse))
  fns, outs = {}, {}

  def add(name, module, cfg):
    f = jax.jit(lambda res, ct, stats: module.backward(opts, cfg, res, (ct, cts[1]),
                                                       stats=stats)[:3])
    try_variant(fns, outs, name, f, res, ct, stats)

  tuned = mb.MosaicBackwardConfig.tuned(D, args.causal)
  configs = {"pp" if tuned.pingpong else "split": tuned}
  other = (dataclasses.replace(tuned, pingpong=False, dq_split=True) if tuned.pingpong
           else dataclasses.replace(tuned, pingpong=True, dq_split=False))
  configs["pp" if other.pingpong else "split"] = other
  for tag, cfg in configs.items():
    print(f"{tag}: {cfg}", flush=True)
    add(f"{tag} as is", mb, cfg)
    if "dq_tiles" in mb.MosaicBackwardConfig.__dataclass_fields__ and mb.support_error(
        res.q.shape, res.k.shape, res.q.dtype, opts,
        two := dataclasses.replace(cfg, dq_tiles=2)) is None:
      add(f"{tag} 2 dQ tiles", mb, two)
    for cut, lines in CUTS.items():
      add(f"{tag} {cut}", patched(lines), cfg)
  add("dK/dV only, 64 rows", mb, dataclasses.replace(tuned, with_dq=False, dq_split=False,
                                                     pingpong=False, block_q=64))
  for name in [n for n in outs if n.endswith("2 dQ tiles")]:  # sums in arrival order: close
    twin = outs[name.replace("2 dQ tiles", "as is")]
    err = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
           for a, b in zip(outs[name], twin)]
    print(f"{name}: max |diff| to one tile (dq, dk, dv) {err}, max |dq| "
          f"{float(jnp.max(jnp.abs(twin[0].astype(jnp.float32)))):.3g}", flush=True)
  rounds_then_power(fns, args.rounds, width=24)


if __name__ == "__main__":
  main()
