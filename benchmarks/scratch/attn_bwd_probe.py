"""Probe (device only): why fwd+bwd with the Mosaic forward is slower than forward + backward.

Times the Triton backward on residuals from each forward, both compositions, and counts the
kernels in the compiled forward+backward.
"""
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from benchmarks import _harness  # noqa: E402
from memeff_jax.ops.flash_attention import flash_attention, flash_attention_backward  # noqa: E402

B, T, H, D = 4, 4096, 32, 128
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, do = (jax.random.normal(kk, (B, T, H, D), jnp.bfloat16) for kk in ks)
for causal in (False, True):
  flops = 4 * B * H * T * T * D / (2 if causal else 1)
  res = {}
  for impl in ("pallas_mosaic_gpu", "pallas_triton"):
    fwd = jax.jit(lambda q, k, v, impl=impl: flash_attention(q, k, v, causal=causal, return_lse=True, implementation=impl))
    out, lse = fwd(q, k, v)
    res[impl] = (out, lse)
    t_f = _harness.time_jax(fwd, q, k, v, reps=10, inner=5)
    fb = jax.jit(lambda q, k, v, do, impl=impl: jax.vjp(lambda *a: flash_attention(*a, causal=causal, implementation=impl), q, k, v)[1](do))
    t_fb = _harness.time_jax(fb, q, k, v, do, reps=10, inner=3)
    hlo = fb.lower(q, k, v, do).compile().as_text()
    calls = re.findall(r'custom_call_target="([^"]+)"', hlo)
    print(f"causal={causal} {impl:18s} fwd {t_f:6.2f} ms  fwd+bwd {t_fb:6.2f} ms  calls {calls}", flush=True)
  bwd = jax.jit(lambda q, k, v, o, l, do: flash_attention_backward(q, k, v, o, l, do, causal=causal, implementation="pallas_triton"))
  for src, (out, lse) in res.items():
    t_b = _harness.time_jax(bwd, q, k, v, out, lse, do, reps=10, inner=3)
    print(f"causal={causal} triton bwd on {src:18s} residuals {t_b:6.2f} ms", flush=True)
  a, b = res["pallas_mosaic_gpu"], res["pallas_triton"]
  print("  out max diff", float(jnp.max(jnp.abs(a[0].astype(jnp.float32) - b[0].astype(jnp.float32)))),
        "lse max diff", float(jnp.max(jnp.abs(a[1] - b[1]))), flush=True)
