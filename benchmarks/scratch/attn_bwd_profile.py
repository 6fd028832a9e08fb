"""One warm fwd+bwd (jax.vjp) of memeff flash_attention at the headline shape, for ncu.

    ncu --clock-control none -k regex:bwd --set full python benchmarks/scratch/attn_bwd_profile.py causal

argv[1]: "causal" or "full"; argv[2] (optional): MosaicBackwardConfig fields as k=v,k=v (the
one-pass kernel, deterministic=False; "tuned" for its tuned config), "default" for the
library's default (deterministic) backward, or "cudnn" for jax.nn.dot_product_attention's.
The first call compiles (and runs); NVTX range "measured" marks the second.
"""
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from memeff_jax.ops import flash_attention as fa  # noqa: E402

B, T, H, D = 4, 4096, int(os.environ.get("H", 32)), int(os.environ.get("D", 128))
causal = sys.argv[1] == "causal"
mode = sys.argv[2] if len(sys.argv) > 2 else "tuned"
deterministic = mode in ("default", "cudnn")
if mode == "default":  # the library's default (deterministic) path
  impl = fa.PallasMosaicGpu()
  print("default PallasMosaicGpu (deterministic: dK/dV kernel + dq kernel)", flush=True)
elif mode == "cudnn":
  impl = None
  print("jax.nn.dot_product_attention(implementation='cudnn')", flush=True)
else:
  fields = dict(kv.split("=") for kv in mode.split(",")) if mode != "tuned" else {}
  fields = {k: (v.lower() in ("1", "true") if v.lower() in ("0", "1", "true", "false") else int(v))
            for k, v in fields.items()}
  config = fa.MosaicBackwardConfig(**fields) if fields else fa.MosaicBackwardConfig.tuned(D, causal)
  print("backward config:", config, flush=True)
  impl = fa.PallasMosaicGpu(backward_config=config)
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, ct = (jax.random.normal(kk, (B, T, H, D), jnp.float32).astype(jnp.bfloat16) for kk in ks)


def attention(q, k, v):
  if impl is None:
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
  return fa.flash_attention(q, k, v, causal=causal, implementation=impl,
                            deterministic=deterministic)


@jax.jit
def step(q, k, v, ct):
  out, vjp = jax.vjp(attention, q, k, v)
  return out, vjp(ct)


jax.block_until_ready(step(q, k, v, ct))
jax.block_until_ready(step(q, k, v, ct))
print("done", flush=True)
