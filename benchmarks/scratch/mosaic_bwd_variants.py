"""Times the Mosaic attention backward's variants at the headline shape, cuDNN alongside.

    MOSAIC_GPU_DUMP_PTXAS=1 python benchmarks/scratch/mosaic_bwd_variants.py

A variant is MosaicBackwardConfig fields plus module constants (e.g. registers=(240, 24));
each is timed as fwd+bwd of one jax.vjp (the forward is the same Mosaic kernel throughout).
"""
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from memeff_jax.ops import flash_attention as fa  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402

import os  # noqa: E402
B, T, H, D = 4, 4096, int(os.environ.get("H", 32)), int(os.environ.get("D", 128))
SOFTCAP = float(os.environ["SOFTCAP"]) if "SOFTCAP" in os.environ else None  # not for cudnn
VARIANTS = {
    "split": dict(),
    "pingpong": dict(dq_split=False, pingpong=True),
    "pingpong-regs240": dict(dq_split=False, pingpong=True, registers=(240, 24)),
    "pingpong-1stage": dict(dq_split=False, pingpong=True, stages=1),
    "nosplit": dict(dq_split=False),
    "split-1stage": dict(stages=1),
    "split-regs240": dict(registers=(240, 24)),
    "nosplit-regs240": dict(dq_split=False, registers=(240, 24)),
}
names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(VARIANTS) + ["cudnn", "triton"]
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, ct = (jax.random.normal(kk, (B, T, H, D), jnp.float32).astype(jnp.bfloat16) for kk in ks)


def timed(f, reps=20):
  jax.block_until_ready(f(q, k, v, ct))
  t0 = time.perf_counter()
  for _ in range(reps):
    r = f(q, k, v, ct)
  jax.block_until_ready(r)
  return (time.perf_counter() - t0) / reps


def check(impl):
  """Largest relative gradient error against the float32 reference at a small GQA shape."""
  from tests.ops.flash_attention.test_flash_attention import make_problem, rel_err, run  # noqa: E402,I001 pylint: disable=import-outside-toplevel
  worst = 0.0
  for causal in (False, True):
    q_, k_, v_, _, ct_ = make_problem(jax.random.key(7), 2, 256, 384, 8, 2, D, jnp.bfloat16)
    opts = dict(causal=causal, logit_softcap=SOFTCAP)
    _, _, g = run(impl, q_, k_, v_, None, ct_, opts)
    up = lambda x: x.astype(jnp.float32)
    _, _, r = run("reference", up(q_), up(k_), up(v_), None, ct_, opts)
    worst = max([worst] + [float(rel_err(a, b)) for a, b in zip(g, r)])
  return worst


for causal in (False, True):
  flops = 3.5 * 4 * B * H * T * T * D / (2 if causal else 1)
  for name in names:
    if name == "cudnn":
      attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                          implementation="cudnn")
    else:
      if name == "pallas_triton":  # forward and backward both Triton
        impl = "pallas_triton"
      elif name == "triton":
        impl = fa.PallasMosaicGpu(backward_config=fa.pallas_triton.default_config(D))
      else:
        opts = dict(VARIANTS[name])
        mb._REGISTERS = opts.pop("registers", (240, 24))  # pylint: disable=protected-access
        impl = fa.PallasMosaicGpu(backward_config=fa.MosaicBackwardConfig(**opts))
      if not causal:
        print(f"{name}: worst gradient rel err {check(impl):.2e}", flush=True)
      attn = lambda q, k, v, impl=impl: fa.flash_attention(q, k, v, causal=causal,
                                                           logit_softcap=SOFTCAP,
                                                           implementation=impl)

    @jax.jit
    def step(q, k, v, ct, attn=attn):
      out, vjp = jax.vjp(attn, q, k, v)
      return out, vjp(ct)

    try:
      sec = timed(step)
      print(f"causal={causal!s:5} {name:18} fwd+bwd {sec * 1e3:7.3f} ms "
            f"{flops / sec / 1e12:6.1f} TFLOP/s", flush=True)
    except Exception as e:  # pylint: disable=broad-except
      print(f"causal={causal!s:5} {name:18} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
