"""The Mosaic forward's variants against cuDNN (and tokamax's Mosaic kernel where importable),
timed in interleaved rounds in one process, so that clock drift hits every provider alike.

    python benchmarks/scratch/fwd_variants.py [providers] [rounds]

providers: comma-separated; "default", "overlap" (MosaicConfig(overlap=True, pingpong=False)),
"nopp" (no ping-pong), "cudnn", "tokamax", and "vjp:<name>" for forward+backward in one
jax.vjp. Headline shape B=4 T=4096 H=32 D=128 bf16 (env D, H).
"""
import dataclasses
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from benchmarks import _harness  # noqa: E402
from memeff_jax.ops import flash_attention as fa  # noqa: E402

B, T, H, D = 4, 4096, int(os.environ.get("H", 32)), int(os.environ.get("D", 128))
_BASE = fa.MosaicConfig.for_head_dim(D)
CONFIGS = {
    "default": _BASE,
    "overlap": dataclasses.replace(_BASE, overlap=True, pingpong=False),
    "nopp": dataclasses.replace(_BASE, pingpong=False),
}


def provider_fn(name, causal):
  if name == "cudnn":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation="cudnn")
  if name == "tokamax":
    from benchmarks.linear_cross_entropy import import_tokamax  # pylint: disable=import-outside-toplevel
    tokamax = import_tokamax()
    return lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal,
                                                         implementation="mosaic")
  impl = fa.PallasMosaicGpu(config=CONFIGS[name])
  return lambda q, k, v: fa.flash_attention(q, k, v, causal=causal, implementation=impl)


def main():
  names = (sys.argv[1] if len(sys.argv) > 1 else "default,overlap,cudnn,tokamax").split(",")
  rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, ct = (jax.random.normal(kk, (B, T, H, D), jnp.float32).astype(jnp.bfloat16)
                 for kk in ks)
  for causal in (False, True):
    flops = 4 * B * H * T * T * D / (2 if causal else 1)
    fns = {}
    for name in names:
      try:
        if name.startswith("vjp:"):
          attn = provider_fn(name[4:], causal)
          fns[name] = jax.jit(lambda q, k, v, ct, attn=attn: jax.vjp(attn, q, k, v)[1](ct))
        else:
          fns[name] = jax.jit(provider_fn(name, causal))
        args = (q, k, v, ct) if name.startswith("vjp:") else (q, k, v)
        jax.block_until_ready(fns[name](*args))
      except Exception as e:  # pylint: disable=broad-except
        print(f"causal={causal} {name} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        fns.pop(name, None)
    times = {name: [] for name in fns}
    for _ in range(rounds):
      for name, f in fns.items():
        args = (q, k, v, ct) if name.startswith("vjp:") else (q, k, v)
        # One batch of 20 back-to-back calls per round (seconds per call).
        times[name].append(_harness.time_jax(f, *args, warmup=1, reps=1, inner=20) / 1e3)
    base = statistics.median(times["cudnn"]) if "cudnn" in times else None
    for name, ts in times.items():
      med = statistics.median(ts)
      scale = 3.5 if name.startswith("vjp:") else 1.0
      ratio = f"  {base / med:5.3f}x cuDNN fwd" if base and not name.startswith("vjp:") else ""
      print(f"causal={causal!s:5} {name:14} {med * 1e3:7.3f} ms (min {min(ts) * 1e3:.3f}, "
            f"max {max(ts) * 1e3:.3f})  {scale * flops / med / 1e12:6.1f} TFLOP/s{ratio}",
            flush=True)


if __name__ == "__main__":
  main()
