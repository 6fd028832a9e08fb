"""How far gemm_into(add="tma") lands from C + op(A) op(B) rounded once and rounded twice."""
import jax
import jax.numpy as jnp
import numpy as np

from memeff_jax.ops import mosaic_gemm as mg

M, N, K = 256, 512, 256
for trans_a, trans_b in ((True, False), (False, True)):
  k = jax.random.split(jax.random.key(3), 3)
  a = jax.random.normal(k[0], (K, M) if trans_a else (M, K), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(k[1], (N, K) if trans_b else (K, N), jnp.float32).astype(jnp.bfloat16)
  c = jax.random.normal(k[2], (M, N), jnp.float32).astype(jnp.bfloat16)
  ref = ((a.T if trans_a else a).astype(jnp.float32) @ (b.T if trans_b else b).astype(jnp.float32))
  for add in ("epilogue", "tma"):
    def into(c, a, b):
      r = jax.new_ref(c)
      mg.gemm_into(r, a, b, trans_a=trans_a, trans_b=trans_b, add=add,
                   config=mg.GemmConfig(max_concurrent_steps=3))
      return r[...]
    out = np.asarray(jax.jit(into)(c, a, b).astype(jnp.float32))
    once = np.asarray((c.astype(jnp.float32) + ref).astype(jnp.bfloat16).astype(jnp.float32))
    twice = np.asarray((c.astype(jnp.float32) + ref.astype(jnp.bfloat16).astype(jnp.float32))
                       .astype(jnp.bfloat16).astype(jnp.float32))
    prod = np.asarray(ref.astype(jnp.bfloat16).astype(jnp.float32))
    cc = np.asarray(c.astype(jnp.float32))
    print(f"ta={trans_a} tb={trans_b} add={add}: max|out-once| {np.abs(out - once).max():.4g} "
          f"max|out-twice| {np.abs(out - twice).max():.4g} mismatches(twice) "
          f"{int((out != twice).sum())} max|out-c| {np.abs(out - cc).max():.4g} "
          f"max|out-prod| {np.abs(out - prod).max():.4g} max|once| {np.abs(once).max():.4g}")
    bad = np.argwhere(out != twice)[:3]
    for i, j in bad:
      print(f"   [{i},{j}] out {out[i, j]} twice {twice[i, j]} c {cc[i, j]} prod {prod[i, j]}")
