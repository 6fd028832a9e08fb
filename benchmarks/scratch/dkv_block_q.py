"""The deterministic backward's dK/dV kernel with wider query steps (MosaicBackwardConfig.block_q),
at the headline shape (B=4 T=4096 H=32 D=128 bf16), timed in interleaved rounds.

    ROUNDS=5 VARIANTS=64pp,64,80pp,80,96 python benchmarks/scratch/dkv_block_q.py

Per variant name "<block_q>[pp]" (pp: ping-pong): dK/dV alone (ms, median of the rounds) with
the largest difference from block_q = 64's dK and dV, then fwd+bwd of one jax.vjp of the
deterministic default with that dK/dV kernel (TFLOP/s), beside cuDNN's in the same rounds.
POWER=1 also runs each dK/dV kernel alone for 3 s while nvidia-smi samples power and clock.
"""
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import per_call, power  # noqa: E402
from memeff_jax.ops import flash_attention as fa  # noqa: E402
from memeff_jax.ops.flash_attention import _common  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402
from memeff_jax.ops.flash_attention.masks import MaskSpec  # noqa: E402

B, T, H, D = 4, int(os.environ.get("T", 4096)), 32, 128
ROUNDS = int(os.environ.get("ROUNDS", 5))
NAMES = os.environ.get("VARIANTS", "64pp,64,80pp,80,96").split(",")
CAUSAL = [c == "1" for c in os.environ.get("CAUSAL", "0,1").split(",")]
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, ct = (jax.random.normal(kk, (B, T, H, D), jnp.float32).astype(jnp.bfloat16) for kk in ks)


def config(name):
  return mb.MosaicBackwardConfig(dq_split=False, with_dq=False, pingpong=name.endswith("pp"),
                                 block_q=int(name.rstrip("p")))


for causal in CAUSAL:
  flops = 3.5 * 4 * B * H * T * T * D / (2 if causal else 1)
  opts = _common.AttentionOptions(mask=MaskSpec.make(causal, None, False), scale=D ** -0.5)
  out, lse = fa.flash_attention(q, k, v, causal=causal, return_lse=True)
  res = _common.Residuals(q, k, v, None, None, out, jnp.swapaxes(lse, 1, 2))
  stats = mb.row_stats(opts, res, _common.softmax_delta(out, ct, jnp.zeros_like(res.lse)))
  alone, whole = {}, {}
  for name in NAMES:
    cfg = config(name)
    why = mb.support_error(q.shape, k.shape, q.dtype, opts, cfg)
    if why:
      print(f"{name}: not served: {why}", flush=True)
      continue
    alone[name] = jax.jit(lambda res, ct, stats, cfg=cfg: mb.backward(
        opts, cfg, res, (ct, jnp.zeros_like(res.lse)), stats=stats)[1:3])
    impl = fa.PallasMosaicGpu(backward_config=cfg)
    whole[name] = jax.jit(lambda q, k, v, ct, impl=impl: jax.vjp(
        lambda q, k, v: fa.flash_attention(q, k, v, causal=causal, implementation=impl),
        q, k, v)[1](ct))
  whole["cudnn"] = jax.jit(lambda q, k, v, ct: jax.vjp(
      lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                   implementation="cudnn"), q, k, v)[1](ct))
  base = None
  for name in list(alone):
    try:
      got = alone[name](res, ct, stats)
    except Exception as e:  # pylint: disable=broad-except
      print(f"{name} FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
      del alone[name], whole[name]
      continue
    if base is None:
      base = got
    diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
               for a, b in zip(got, base))
    print(f"causal={causal} {name}: max |dK, dV - first variant's| {diff:.3e}", flush=True)
  if os.environ.get("POWER") == "1":
    for name in alone:
      sec, watts, mhz = power(alone[name], res, ct, stats)
      print(f"causal={causal!s:5} {name:6} dK/dV alone {sec * 1e3:7.3f} ms at {watts:5.1f} W, "
            f"{mhz:.0f} MHz: {watts * sec * 1e3:.2f} mJ per call", flush=True)
    for name in whole:
      sec, watts, mhz = power(whole[name], q, k, v, ct)
      print(f"causal={causal!s:5} {name:6} fwd+bwd     {sec * 1e3:7.3f} ms at {watts:5.1f} W, "
            f"{mhz:.0f} MHz: {watts * sec * 1e3:.2f} mJ per call", flush=True)
  times = {("alone", n): [] for n in alone} | {("whole", n): [] for n in whole}
  for r in range(ROUNDS):
    order = list(times)
    order = order[r % len(order):] + order[:r % len(order)]
    for kind, name in order:
      if kind == "alone":
        sec = per_call(alone[name], res, ct, stats)
      else:
        sec = per_call(whole[name], q, k, v, ct)
      times[(kind, name)].append(sec)
  for (kind, name), secs in times.items():
    med = statistics.median(secs)
    rounds = " ".join(f"{s * 1e3:.3f}" for s in secs)
    if kind == "alone":
      print(f"causal={causal!s:5} {name:6} dK/dV alone {med * 1e3:7.3f} ms  [{rounds}]")
    else:
      print(f"causal={causal!s:5} {name:6} fwd+bwd     {med * 1e3:7.3f} ms "
            f"{flops / med / 1e12:6.1f} TFLOP/s  [{rounds}]", flush=True)
