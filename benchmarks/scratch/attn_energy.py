"""Energy per call of the attention pieces, ours against cuDNN's, at the headline shape
(B=4 T=4096 H=32 D=128 bf16): each runs back to back for 3 s while nvidia-smi samples power.

    CAUSAL=0,1 python benchmarks/scratch/attn_energy.py

Pieces: the forward; the backward alone (the vjp function of saved residuals); for ours also
the dK/dV kernel and the dq kernel alone. ONEPASS=1 instead: our one-pass backward
(deterministic=False) as is, and with its dq TMA reductions skipped (wrong gradients: what
the reductions cost; bwd_ablate.py's patch); SPLIT=1 with dq_split for every mask. Both GPUs' kernels run at the 700 W cap on an H200,
so time there is energy; this says which piece spends the difference.
"""
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import attention_backward_problem, power  # noqa: E402
from memeff_jax.ops import flash_attention as fa  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_dq as mdq  # noqa: E402
from bwd_ablate import without_reductions  # noqa: E402

B, T, H, D = 4, 4096, 32, 128
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, ct = (jax.random.normal(kk, (B, T, H, D), jnp.float32).astype(jnp.bfloat16) for kk in ks)

for causal in [c == "1" for c in os.environ.get("CAUSAL", "0,1").split(",")]:
  ours = lambda q, k, v: fa.flash_attention(q, k, v, causal=causal)
  cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                       implementation="cudnn")
  if os.environ.get("ONEPASS") == "1":
    # SPLIT=1: the one-pass kernel with dq_split (the causal default) whatever the mask.
    impl = (fa.PallasMosaicGpu(backward_config=mb.MosaicBackwardConfig(dq_split=True))
            if os.environ.get("SPLIT") == "1" else None)
    onepass = lambda q, k, v: fa.flash_attention(q, k, v, causal=causal, deterministic=False,
                                                 implementation=impl)
    _, vjp = jax.vjp(onepass, q, k, v)
    for name, patched in (("one-pass bwd", False), ("without reductions", True)):
      f = jax.jit(lambda vjp, ct: vjp(ct))  # a fresh function: traced with or without
      mb.plgpu = without_reductions() if patched else mb.plgpu
      try:
        sec, watts, mhz = power(f, vjp, ct)
      finally:
        mb.plgpu = mdq.plgpu
      print(f"causal={causal!s:5} {name:18} {sec * 1e3:7.3f} ms at {watts:5.1f} W, {mhz:.0f} "
            f"MHz: {watts * sec * 1e3:7.1f} mJ per call", flush=True)
    continue
  pieces = {}
  for name, f in (("ours", ours), ("cudnn", cudnn)):
    pieces[f"{name} fwd"] = (jax.jit(f), (q, k, v))
    _, vjp = jax.vjp(f, q, k, v)
    pieces[f"{name} bwd"] = (jax.jit(lambda vjp, ct: vjp(ct)), (vjp, ct))
  *_, opts, res, stats = attention_backward_problem(causal, (B, T, H, D))
  dkv = mb.MosaicBackwardConfig.tuned(D, causal, with_dq=False)
  pieces["ours dK/dV kernel"] = (jax.jit(lambda res, ct, stats: mb.backward(
      opts, dkv, res, (ct, jnp.zeros_like(res.lse)), stats=stats)[1:3]), (res, ct, stats))
  pieces["ours dq kernel"] = (jax.jit(lambda res, ct, stats: mdq.dq(
      opts, mdq.MosaicDqConfig.for_head_dim(D), res, ct, stats)), (res, ct, stats))
  for name, (f, args) in pieces.items():
    sec, watts, mhz = power(f, *args)
    print(f"causal={causal!s:5} {name:18} {sec * 1e3:7.3f} ms at {watts:5.1f} W, {mhz:.0f} MHz: "
          f"{watts * sec * 1e3:7.1f} mJ per call", flush=True)
