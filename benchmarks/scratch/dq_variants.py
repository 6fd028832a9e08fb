"""The deterministic backward's dq kernel: Mosaic variants against pallas_triton's, at the
headline shape (B=4 T=4096 H=32 D=128 bf16), with the one-pass (nondeterministic) backward
and cuDNN alongside.

    python benchmarks/scratch/dq_variants.py [names]

Per variant: the worst gradient error against the float32 reference at a small GQA shape
(causal and not), the dq kernel alone (ms), and fwd+bwd of one jax.vjp (TFLOP/s).
"""
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import per_call  # noqa: E402
from memeff_jax.ops import flash_attention as fa  # noqa: E402
from memeff_jax.ops.flash_attention import _common  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_dq as mdq  # noqa: E402
from memeff_jax.ops.flash_attention import pallas_triton  # noqa: E402
from memeff_jax.ops.flash_attention.masks import MaskSpec  # noqa: E402

B, T, H, D = 4, 4096, int(os.environ.get("H", 32)), int(os.environ.get("D", 128))
VARIANTS = {
    "kv64": fa.MosaicDqConfig(),
    "kv64-pp": fa.MosaicDqConfig(pingpong=True),
    "kv128": fa.MosaicDqConfig(block_kv=128),
    "kv128-pp": fa.MosaicDqConfig(block_kv=128, pingpong=True),
    "kv64-3st": fa.MosaicDqConfig(stages=3),
    "kv128-1st": fa.MosaicDqConfig(block_kv=128, stages=1),
    "kv64-1st": fa.MosaicDqConfig(block_kv=64, stages=1),
    "kv64-k2v1": fa.MosaicDqConfig(block_kv=64, stages=2, v_stages=1),
    "kv128-k2v1": fa.MosaicDqConfig(block_kv=128, stages=2, v_stages=1),
    "kv128-k3v1": fa.MosaicDqConfig(block_kv=128, stages=3, v_stages=1),
}
# The dK/dV-only Mosaic backward (with_dq=False), timed alone: "dkv:<name>".
DKV = {
    "pp2": dict(pingpong=True, stages=2),
    "pp3": dict(pingpong=True, stages=3),
    "pp4": dict(pingpong=True, stages=4),
    "seq2": dict(stages=2),
    "seq3": dict(stages=3),
    "seq4": dict(stages=4),
    "cs1": dict(column_split=True, stages=1),
    "cs2": dict(column_split=True, stages=2),
    "cs2pp": dict(column_split=True, stages=2, pingpong=True),
}
names = sys.argv[1].split(",") if len(sys.argv) > 1 else (
    ["triton"] + list(VARIANTS) + ["nondeterministic", "cudnn"])
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, ct = (jax.random.normal(kk, (B, T, H, D), jnp.float32).astype(jnp.bfloat16) for kk in ks)


def check(impl):
  from tests.ops.flash_attention.test_flash_attention import make_problem, rel_err, run  # noqa: E402,I001 pylint: disable=import-outside-toplevel
  worst = 0.0
  for causal in (False, True):
    for window, seg in ((None, False), ((100, 30), True)):
      q_, k_, v_, _, ct_ = make_problem(jax.random.key(7), 2, 256, 384, 8, 2, D, jnp.bfloat16)
      segs = None
      if seg:
        segs = (jnp.repeat(jnp.arange(4), 64)[None].repeat(2, 0),
                jnp.repeat(jnp.arange(4), 96)[None].repeat(2, 0))
      opts = dict(causal=causal, sliding_window=window)
      _, _, g = run(impl, q_, k_, v_, segs, ct_, opts)
      up = lambda x: x.astype(jnp.float32)
      _, _, r = run("reference", up(q_), up(k_), up(v_), segs, ct_, opts)
      worst = max([worst] + [float(rel_err(a, b)) for a, b in zip(g, r)])
  return worst


for causal in (False, True):
  flops = 3.5 * 4 * B * H * T * T * D / (2 if causal else 1)
  opts = _common.AttentionOptions(mask=MaskSpec.make(causal, None, False), scale=D ** -0.5)
  out, lse = fa.flash_attention(q, k, v, causal=causal, return_lse=True)
  lse = jnp.swapaxes(lse, 1, 2)  # [B, H, T] as the kernels save it
  res = _common.Residuals(q, k, v, None, None, out, lse)
  delta = _common.softmax_delta(out, ct, jnp.zeros_like(lse))
  stats = mb.row_stats(opts, res, delta)
  for name in names:
    det = True
    if name.startswith("dkv:"):
      cfg = fa.MosaicBackwardConfig(dq_split=False, with_dq=False, **DKV[name[4:]])
      alone = jax.jit(lambda res, ct, stats, cfg=cfg: mb.backward(
          opts, cfg, res, (ct, jnp.zeros_like(res.lse)), stats=stats)[1:3])
      try:
        if not causal:
          print(f"{name}: worst gradient rel err "
                f"{check(fa.PallasMosaicGpu(backward_config=cfg)):.2e}", flush=True)
        print(f"causal={causal!s:5} {name:18} dk/dv alone "
              f"{per_call(alone, res, ct, stats) * 1e3:7.3f} ms", flush=True)
      except Exception as e:  # pylint: disable=broad-except
        print(f"{name} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
        continue
      attn = lambda q, k, v, cfg=cfg: fa.flash_attention(
          q, k, v, causal=causal, implementation=fa.PallasMosaicGpu(backward_config=cfg))
    elif name == "cudnn":
      attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                          implementation="cudnn")
    else:
      if name == "nondeterministic":
        impl, det = fa.PallasMosaicGpu(), False
      elif name == "triton":
        cfg = pallas_triton.default_config(D)
        impl = fa.PallasMosaicGpu(dq_config=cfg)
        alone = jax.jit(lambda res, ct, delta: pallas_triton.dq_pass(
            pallas_triton.PallasTriton()._static(q, opts), res, ct, delta))  # pylint: disable=protected-access
        print(f"causal={causal!s:5} {name:18} dq alone {per_call(alone, res, ct, delta) * 1e3:7.3f} ms",
              flush=True)
      else:
        impl = fa.PallasMosaicGpu(dq_config=VARIANTS[name])
        try:
          if not causal:
            print(f"{name}: worst gradient rel err {check(impl):.2e}", flush=True)
          alone = jax.jit(lambda res, ct, stats, c=VARIANTS[name]: mdq.dq(opts, c, res, ct, stats))
          print(f"causal={causal!s:5} {name:18} dq alone "
                f"{per_call(alone, res, ct, stats) * 1e3:7.3f} ms", flush=True)
        except Exception as e:  # pylint: disable=broad-except
          print(f"{name} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
          continue
      attn = lambda q, k, v, impl=impl, det=det: fa.flash_attention(
          q, k, v, causal=causal, implementation=impl, deterministic=det)

    @jax.jit
    def step(q, k, v, ct, attn=attn):
      out, vjp = jax.vjp(attn, q, k, v)
      return out, vjp(ct)

    try:
      sec = per_call(step, q, k, v, ct)
      print(f"causal={causal!s:5} {name:18} fwd+bwd {sec * 1e3:7.3f} ms "
            f"{flops / sec / 1e12:6.1f} TFLOP/s", flush=True)
    except Exception as e:  # pylint: disable=broad-except
      print(f"causal={causal!s:5} {name:18} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
