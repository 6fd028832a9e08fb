"""Times the backward's row statistics (lse₂ and Δ = rowsum(dO ∘ O) − d_lse, stacked to
[B, H, 2, T]) in several formulations at the headline shape, and prints XLA's fusions."""
import re
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, ".")
from memeff_jax.ops.flash_attention import _common  # noqa: E402

B, T, H, D = 4, 4096, 32, 128
ks = jax.random.split(jax.random.key(0), 3)
out, d_out = (jax.random.normal(kk, (B, T, H, D), jnp.float32).astype(jnp.bfloat16) for kk in ks[:2])
lse = jax.random.normal(ks[2], (B, H, T), jnp.float32)
d_lse = jnp.zeros_like(lse)
f32 = lambda x: x.astype(jnp.float32)

VARIANTS = {
    "einsum_bht": lambda o, do, dl: jnp.einsum("bthd,bthd->bht", f32(do), f32(o)) - dl,
    "sum_swap": lambda o, do, dl: jnp.swapaxes(jnp.sum(f32(do) * f32(o), -1), 1, 2) - dl,
    "sum_barrier_swap": lambda o, do, dl: jnp.swapaxes(
        lax.optimization_barrier(jnp.sum(f32(do) * f32(o), -1)), 1, 2) - dl,
    "einsum_bth_swap": lambda o, do, dl: jnp.swapaxes(
        jnp.einsum("bthd,bthd->bth", f32(do), f32(o)), 1, 2) - dl,
    "library": _common.softmax_delta,
}
want = VARIANTS["einsum_bht"](out, d_out, d_lse)
for name, delta in VARIANTS.items():
  f = jax.jit(lambda o, do, l, dl, delta=delta: jnp.stack([l * 1.4426950408889634,
                                                           delta(o, do, dl)], axis=2))
  compiled = f.lower(out, d_out, lse, d_lse).compile()
  fusions = re.findall(r"kind=k(\w+)", compiled.as_text())
  r = f(out, d_out, lse, d_lse)
  err = float(jnp.max(jnp.abs(r[:, :, 1] - want)))
  jax.block_until_ready(f(out, d_out, lse, d_lse))
  t0 = time.perf_counter()
  for _ in range(50):
    r = f(out, d_out, lse, d_lse)
  jax.block_until_ready(r)
  ms = (time.perf_counter() - t0) / 50 * 1e3
  print(f"{name:18s} {ms:7.3f} ms  max diff {err:.1e}  fusions {fusions}", flush=True)
