"""Diagnostic (device only): what the deterministic backward's operand streams cost, by halving them.

    python benchmarks/scratch/stream_ablate.py [--rounds 7]

At the headline (B=4 T=4096 H=32 D=128 bf16, non-causal) the dK/dV kernel streams each
step's Q and dO tiles from L2 (80 rows each) and the dq kernel each step's K and V blocks
(128 rows each): ~2.5 TB/s of L2-to-SM traffic for the dK/dV kernel. A pair of CTAs sharing
those streams by TMA multicast would halve it. This ablation halves them without the pair:
the patched copies move only the first half of each tile's rows (the rest of the slot keeps
stale data: wrong gradients, same matmuls), an upper bound on what multicast could gain.
Each kernel alone, base and halved, in interleaved rounds, then 2 s back to back under
nvidia-smi (energy per call).
"""
import argparse
import sys
import types

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import attention_backward_problem, rounds_then_power  # noqa: E402
from memeff_jax.ops.flash_attention import _mosaic  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_dq as mdq  # noqa: E402

D = 128
real = mb.plgpu


def halving(rows: int):
  """plgpu, except that a copy into a [rows, D] shared-memory tile moves its first half."""

  class Halved(types.ModuleType):
    def __getattr__(self, name):
      return getattr(real, name)

    @staticmethod
    def copy_gmem_to_smem(src, dst, *args, **kw):
      if tuple(dst.shape) == (rows, D):
        half = pl_ds(rows // 2)
        return real.copy_gmem_to_smem(src.at[half], dst.at[half], *args, **kw)
      return real.copy_gmem_to_smem(src, dst, *args, **kw)

  return Halved(f"plgpu_halving_{rows}")


def pl_ds(n):
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  return pl.ds(0, n)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=7)
  args = parser.parse_args()
  *_, ct, opts, res, stats = attention_backward_problem(False)
  dkv_cfg = mb.MosaicBackwardConfig.tuned(D, False, with_dq=False)
  dq_cfg = mdq.MosaicDqConfig.for_head_dim(D)
  print(f"dK/dV config {dkv_cfg}\ndq config {dq_cfg}", flush=True)
  fns = {}
  for name, module, patch in (("dK/dV", mb, None), ("dK/dV halved Q,dO", mb, dkv_cfg.block_q),
                              ("dq", mdq, None), ("dq halved K,V", mdq, dq_cfg.block_kv)):
    if name.startswith("dK/dV"):
      f = jax.jit(lambda res, ct, stats: mb.backward(
          opts, dkv_cfg, res, (ct, jnp.zeros_like(res.lse)), stats=stats)[1:3])
    else:
      f = jax.jit(lambda res, ct, stats: mdq.dq(opts, dq_cfg, res, ct, stats))
    # The dq kernel's K/V ring is _mosaic.stream_key_blocks's, which copies through
    # _mosaic's plgpu: patch both modules.
    module.plgpu = _mosaic.plgpu = halving(patch) if patch else real
    try:
      compiled = f.lower(res, ct, stats).compile()  # traced now, with the patch in place
    finally:
      module.plgpu = _mosaic.plgpu = real
    fns[name] = (compiled, (res, ct, stats))
    jax.block_until_ready(compiled(res, ct, stats))
  rounds_then_power(fns, args.rounds)


if __name__ == "__main__":
  main()
