"""Sliding window and segment ids through the Mosaic GPU kernels: one line per case (forward,
then gradients) against the float32 reference, printed as it goes so that a hang names its case."""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from memeff_jax.ops.flash_attention import flash_attention

CASES = [  # (name, causal, window, segments, d, hkv)
    ("window", False, (100, 30), None, 128, 2),
    ("causal_window", True, 200, None, 128, 2),
    ("segments_sorted", True, None, "sorted", 128, 2),
    ("segments_unsorted", False, None, "random", 128, 2),
    ("everything", True, 150, "sorted", 128, 1),
    ("d64_everything", True, 150, "sorted", 64, 4),
    ("d256_window", True, 100, "sorted", 256, 2),
]


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  fin = np.isfinite(b)
  return np.linalg.norm((a - b)[fin]) / max(np.linalg.norm(b[fin]), 1e-30)


def main():
  b, t, s, hq = 2, 512, 640, 4
  for name, causal, window, segments, d, hkv in CASES:
    if len(sys.argv) > 1 and name not in sys.argv[1:]:
      continue
    keys = jax.random.split(jax.random.key(len(name)), 6)
    q = jax.random.normal(keys[0], (b, t, hq, d)).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, hkv, d)).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, hkv, d)).astype(jnp.bfloat16)
    ct = jax.random.normal(keys[3], (b, t, hq, d))
    kw = dict(causal=causal, sliding_window=window)
    if segments == "sorted":
      kw.update(q_segment_ids=jnp.sort(jax.random.randint(keys[4], (b, t), 0, 5), 1),
                kv_segment_ids=jnp.sort(jax.random.randint(keys[5], (b, s), 0, 5), 1))
    elif segments == "random":
      kw.update(q_segment_ids=jax.random.randint(keys[4], (b, t), 0, 3),
                kv_segment_ids=jax.random.randint(keys[5], (b, s), 0, 3))

    def loss(impl, q, k, v):
      out, lse = flash_attention(q, k, v, return_lse=True, implementation=impl, **kw)
      return (jnp.sum(out.astype(jnp.float32) * ct)
              + 0.25 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))), (out, lse)

    up = [x.astype(jnp.float32) for x in (q, k, v)]
    (_, (r_out, r_lse)), r_g = jax.value_and_grad(
        lambda *a: loss("reference", *a), argnums=(0, 1, 2), has_aux=True)(*up)
    t0 = time.perf_counter()
    out, lse = jax.jit(lambda q, k, v: flash_attention(
        q, k, v, return_lse=True, implementation="pallas_mosaic_gpu", **kw))(q, k, v)
    out.block_until_ready()
    print(f"{name:20s} fwd out {rel(out, r_out):.1e} lse {rel(lse, r_lse):.1e} "
          f"inf-match {bool(np.all(np.isinf(lse) == np.isinf(r_lse)))} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    (_, _), g = jax.jit(jax.value_and_grad(lambda *a: loss("pallas_mosaic_gpu", *a),
                                           argnums=(0, 1, 2), has_aux=True))(q, k, v)
    print(f"{name:20s} bwd " + " ".join(f"d{n} {rel(x, y):.1e}" for n, x, y in zip("qkv", g, r_g))
          + f" finite {all(bool(np.all(np.isfinite(np.asarray(x, np.float32)))) for x in g)}",
          flush=True)


if __name__ == "__main__":
  main()
