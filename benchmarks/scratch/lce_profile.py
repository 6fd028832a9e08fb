"""Two warm loss+gradient calls of linear_cross_entropy at llama3-8b (bf16), or of the floor's
three matmuls, for ncu's per-kernel durations.

    LCE_KERNEL=programs_per_sm=1,num_warps=16 python benchmarks/scratch/lce_profile.py memeff|floor [chunk_size]

LCE_GEMMS=logits+dx+dw puts those GEMMs on ops.mosaic_gemm; LCE_LAYOUT=vd stores W as [V, D].
"""
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
import memeff_jax  # noqa: E402

N, D, V = 16384, 4096, 128256
kx, kw, ky, kg = jax.random.split(jax.random.key(0), 4)
x = jax.random.normal(kx, (N, D), jnp.float32).astype(jnp.bfloat16)
LAYOUT = os.environ.get("LCE_LAYOUT", "dv")
w = (jax.random.normal(kw, (D, V) if LAYOUT == "dv" else (V, D), jnp.float32)
     * 0.02).astype(jnp.bfloat16)
y = jax.random.randint(ky, (N,), 0, V)
if sys.argv[1] == "floor":
  g = (jax.random.normal(kg, (N, V), jnp.float32) * 1e-3).astype(jnp.bfloat16)
  fn, args = jax.jit(lambda x, w, g: (x @ w, g @ w.T, x.T @ g)), (x, w, g)
else:
  chunk = int(sys.argv[2]) if len(sys.argv) > 2 else None
  impl = None
  if os.environ.get("LCE_KERNEL") or os.environ.get("LCE_GEMMS"):
    from memeff_jax.ops import linear_cross_entropy as lce  # pylint: disable=import-outside-toplevel
    kw = {}
    if os.environ.get("LCE_KERNEL"):
      fields = {k: int(v) for k, v in (kv.split("=") for kv in os.environ["LCE_KERNEL"].split(","))}
      kw["kernel"] = lce.KernelConfig(**fields)
    if os.environ.get("LCE_GEMMS"):
      kw["mosaic_gemms"] = tuple(os.environ["LCE_GEMMS"].split("+"))
    impl = lce.PallasGpu(**kw)
  fn = jax.jit(jax.value_and_grad(
      lambda x, w: memeff_jax.linear_cross_entropy(x, w, y, chunk_size=chunk, weight_layout=LAYOUT,
                                                   implementation=impl), argnums=(0, 1)))
  args = (x, w)
jax.block_until_ready(args)
for _ in range(2):
  jax.block_until_ready(fn(*args))
print("done", flush=True)
