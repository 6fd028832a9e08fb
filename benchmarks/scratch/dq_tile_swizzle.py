"""The one-pass backward's float32 dQ tile, swizzled (now) or row-major (before), at the
headline shape (B=4 T=4096 H=32 D=128 bf16): backward alone, interleaved rounds, then power.

    ROUNDS=5 python benchmarks/scratch/dq_tile_swizzle.py

Row-major, a WGMMA accumulator's store puts a warp's eight rows in the same shared-memory
banks; "row-major" patches mosaic_gpu_backward._dq_tile_transforms for one trace. Variants:
the one-pass kernel's non-causal default (ping-pong), dq_split, and the causal default
(dq_split); the deterministic default and cuDNN for scale.
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
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402

B, T, H, D = 4, 4096, 32, 128
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, ct = (jax.random.normal(kk, (B, T, H, D), jnp.float32).astype(jnp.bfloat16) for kk in ks)
swizzled = mb._dq_tile_transforms  # pylint: disable=protected-access


def bwd(causal, config=None, deterministic=False, cudnn=False, row_major=False):
  """A compiled backward (vjp of saved residuals) and its argument."""
  if cudnn:
    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                     implementation="cudnn")
  else:
    impl = fa.PallasMosaicGpu(backward_config=config) if config else None
    f = lambda q, k, v: fa.flash_attention(q, k, v, causal=causal, deterministic=deterministic,
                                           implementation=impl)
  _, vjp = jax.vjp(f, q, k, v)
  g = jax.jit(lambda vjp, ct: vjp(ct))
  mb._dq_tile_transforms = (lambda c: ()) if row_major else swizzled
  try:
    jax.block_until_ready(g(vjp, ct))  # compiled under the patch
  finally:
    mb._dq_tile_transforms = swizzled
  return g, vjp


split = mb.MosaicBackwardConfig(dq_split=True)
pingpong = mb.MosaicBackwardConfig(dq_split=False, pingpong=True)
variants = {}
for causal in [c == "1" for c in os.environ.get("CAUSAL", "0,1").split(",")]:
  tag = "causal" if causal else "non-causal"
  configs = {"split": split} if causal else {"pingpong": pingpong, "split": split}
  for name, config in configs.items():
    for row_major in (True, False):
      layout = "row-major" if row_major else "swizzled"
      variants[f"{tag} one-pass {name} {layout}"] = bwd(causal, config, row_major=row_major)
  variants[f"{tag} deterministic default"] = bwd(causal, deterministic=True)
  variants[f"{tag} cudnn"] = bwd(causal, cudnn=True)

# Gradients of the two layouts must agree to float32 reduction order.
for causal_tag in ("non-causal", "causal"):
  pair = [n for n in variants if n.startswith(causal_tag + " one-pass split")]
  if len(pair) == 2:
    a, b = (variants[n][0](variants[n][1], ct) for n in pair)
    err = [float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))) for x, y in
           zip(a, b)]
    print(f"{causal_tag} split row-major vs swizzled: max |diff| dq, dk, dv {err}", flush=True)

times = {n: [] for n in variants}
for r in range(int(os.environ.get("ROUNDS", "5"))):
  for name, (g, vjp) in variants.items():
    times[name].append(per_call(g, vjp, ct) * 1e3)
for name, ts in times.items():
  print(f"{name:42} median {statistics.median(ts):7.3f} ms  ({' '.join(f'{t:.3f}' for t in ts)})",
        flush=True)
if os.environ.get("POWER", "1") == "1":
  for name, (g, vjp) in variants.items():
    sec, watts, mhz = power(g, vjp, ct)
    print(f"{name:42} {sec * 1e3:7.3f} ms at {watts:5.1f} W, {mhz:.0f} MHz: "
          f"{watts * sec * 1e3:7.1f} mJ per call", flush=True)
