"""Register operands in the attention forward and dq kernels (MosaicConfig.q_registers,
MosaicDqConfig.operand_registers, which only benchmarks/scratch/patches/register_operands.diff
adds: apply it first) at the headline (B=4 T=4096 H=32 D=128 bf16).

    MOSAIC_GPU_DUMP_PTXAS=1 python benchmarks/scratch/attn_registers.py [--rounds 7] [--causal]

Both kernels run at the 700 W cap, and stream_ablate.py tied the energy of the dK/dV kernel
to the bytes going through shared memory. A WGMMA whose A operand comes from registers reads
only its B tile there: Q as QKᵀ's register operand takes a third off that WGMMA's reads in
the forward; Q and dO as the register operands of S and dP in the dq kernel leave every
WGMMA of the kernel reading only K or V. Each kernel alone in interleaved rounds, then 2 s
back to back under nvidia-smi; outputs compared bit for bit with the shared-memory twin;
then the whole deterministic fwd+bwd with the best pair against today's default and cuDNN.
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
from memeff_jax.ops.flash_attention import mosaic_gpu_dq as mdq  # noqa: E402
from memeff_jax.ops.flash_attention import pallas_mosaic_gpu as pmg  # noqa: E402

B, T, H, D = ATTN_SHAPE


def compile_all(variants, make, args):
  """{name: (jitted f, args)} of the variants that compile, and their outputs."""
  fns, outs = {}, {}
  for name, cfg in variants.items():
    print(f"compiling {name}: {cfg}", flush=True)
    try_variant(fns, outs, name, jax.jit(make(cfg)), *args)
  return fns, outs


def compare(outs, twins):
  for name, twin in twins.items():
    if name in outs and twin in outs:
      a, b = jax.tree.leaves(outs[name]), jax.tree.leaves(outs[twin])
      same = [bool(jnp.array_equal(x, y)) for x, y in zip(a, b)]
      diff = max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
                 for x, y in zip(a, b))
      print(f"{name}: bitwise equal to {twin}: {same} (max |diff| {diff:.3g})", flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--only", default="fwd,dq,both")
  args = parser.parse_args()
  only = args.only.split(",")
  causal = args.causal
  q, k, v, ct, opts, res, stats = attention_backward_problem(causal)
  flops = 4 * B * H * T * T * D * (0.5 if causal else 1.0)
  tflops = lambda units: (lambda name, ms: f"  {flops * units / 2 / ms / 1e9:6.1f} TFLOP/s")

  fwd_default = pmg.MosaicConfig.for_call(D, opts.mask)
  fwd = {"fwd default": fwd_default,
         "fwd q regs": dataclasses.replace(fwd_default, q_registers=True)}
  if fwd_default.overlap:  # ping-pong too, with and without
    pp = dataclasses.replace(fwd_default, overlap=False, pingpong=True)
    fwd |= {"fwd pingpong": pp, "fwd pingpong q regs": dataclasses.replace(pp, q_registers=True)}
  if "fwd" in only:
    fns, outs = compile_all(
        fwd, lambda cfg: lambda q, k, v: fa.flash_attention(
            q, k, v, causal=causal, return_lse=True,
            implementation=pmg.PallasMosaicGpu(config=cfg)), (q, k, v))
    compare(outs, {"fwd q regs": "fwd default", "fwd pingpong q regs": "fwd pingpong"})
    rounds_then_power(fns, args.rounds, width=22, note=tflops(2))

  dq_default = mdq.MosaicDqConfig.for_head_dim(D)
  dq = {"dq default": dq_default,
        "dq 64": dataclasses.replace(dq_default, block_kv=64),
        "dq 64 regs": dataclasses.replace(dq_default, block_kv=64, operand_registers=True),
        "dq 64 3st regs": dataclasses.replace(dq_default, block_kv=64, stages=3,
                                              operand_registers=True),
        "dq 128 regs": dataclasses.replace(dq_default, operand_registers=True)}
  if "dq" in only:
    fns, outs = compile_all(
        dq, lambda cfg: lambda res, ct, stats: mdq.dq(opts, cfg, res, ct, stats),
        (res, ct, stats))
    compare(outs, {"dq 64 regs": "dq 64", "dq 64 3st regs": "dq 64",
                   "dq 128 regs": "dq default"})
    rounds_then_power(fns, args.rounds, width=22, note=tflops(3))

  if "both" in only:
    impls = {
        "ours default": None,
        "ours q regs": pmg.PallasMosaicGpu(config=fwd["fwd q regs"]),
        "ours dq 64 regs": pmg.PallasMosaicGpu(dq_config=dq["dq 64 regs"]),
        "ours both regs": pmg.PallasMosaicGpu(config=fwd["fwd q regs"],
                                              dq_config=dq["dq 64 regs"]),
    }
    fns = {}
    for name, impl in impls.items():
      f = lambda q, k, v, impl=impl: fa.flash_attention(q, k, v, causal=causal,
                                                        implementation=impl)
      g = jax.jit(lambda q, k, v, ct, f=f: jax.vjp(f, q, k, v)[1](ct))
      try_variant(fns, {}, name, g, q, k, v, ct)
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                         implementation="cudnn")
    fns["cudnn"] = (jax.jit(lambda q, k, v, ct: jax.vjp(cudnn, q, k, v)[1](ct)), (q, k, v, ct))
    rounds_then_power(fns, args.rounds, width=22, note=tflops(7))


if __name__ == "__main__":
  main()
