"""Diagnostic (device only): what the attention backward's pieces cost, by removing them.

    python benchmarks/scratch/bwd_ablate.py [causal|full ...]

Times fwd+bwd of one jax.vjp at the headline shape (B=4, H=32, T=4096, D=128, bf16) with
the Mosaic backward as is, and with its dq TMA reductions skipped (the gradients are then
wrong: an upper bound on what a cheaper dq path could gain). Nothing here is a library
option; the ablation patches the kernel module's `plgpu` for one trace.
"""
import sys
import types

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from benchmarks import _harness  # noqa: E402
from memeff_jax.ops import flash_attention as fa  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402

B, T, H, D = 4, 4096, 32, 128
real = mb.plgpu


class _WithoutReductions(types.ModuleType):
  """plgpu, except that copies with a reduction_op do nothing."""

  def __getattr__(self, name):
    return getattr(real, name)

  @staticmethod
  def copy_smem_to_gmem(src, dst, *args, reduction_op=None, **kw):
    if reduction_op is None:
      real.copy_smem_to_gmem(src, dst, *args, **kw)


def without_reductions():
  return _WithoutReductions("plgpu_without_reductions")


def determinism(q, k, v, ct, causal, runs=3):
  """Whether repeated backward passes give bitwise-identical gradients."""
  f = lambda q, k, v: fa.flash_attention(q, k, v, causal=causal,
                                         implementation="pallas_mosaic_gpu")
  step = jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1](ct))
  first = step(q, k, v)
  for _ in range(runs - 1):
    again = step(q, k, v)
    same = [bool(jnp.array_equal(a, b)) for a, b in zip(first, again)]
    diff = [int(jnp.sum(a != b)) for a, b in zip(first, again)]
    print(f"  repeat: bitwise equal (dq, dk, dv) {same}, differing elements {diff}", flush=True)


def main():
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, ct = (jax.random.normal(kk, (B, T, H, D), jnp.float32).astype(jnp.bfloat16) for kk in ks)
  for mode in sys.argv[1:] or ["full", "causal"]:
    causal = mode == "causal"
    determinism(q, k, v, ct, causal)
    flops = 3.5 * 4 * B * H * T * T * D / (2 if causal else 1)
    for name, module in (("as is", real), ("no dq reduction", without_reductions())):
      mb.plgpu = module
      f = lambda q, k, v: fa.flash_attention(q, k, v, causal=causal,
                                             implementation="pallas_mosaic_gpu")

      def fwd_bwd(q, k, v, f=f):
        out, pull = jax.vjp(f, q, k, v)
        return out, pull(ct)
      ms = _harness.time_jax(jax.jit(fwd_bwd), q, k, v, reps=10, inner=5)
      mb.plgpu = real
      print(f"{mode:6} {name:16} fwd+bwd {ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
  main()
