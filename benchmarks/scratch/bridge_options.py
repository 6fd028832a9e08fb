"""Diagnostic (device only): the bridged loss under XLA compiler options and allocators.

    python benchmarks/scratch/bridge_options.py CHUNK '{"xla_gpu_...": value}' [REPS]

Runs torch_bridge's loss worker in this process with the bridge's jitted functions compiled
with the given options; prints its row plus the compiled temp bytes. Run twice per variant
(with JAX_COMPILATION_CACHE_DIR set) so the second run measures without the autotuner.
"""
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import jax  # noqa: E402
import memeff_jax.interop.torch as mt  # noqa: E402
from benchmarks import torch_bridge  # noqa: E402

chunk, options = int(sys.argv[1]), json.loads(sys.argv[2])
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
orig_jit = jax.jit
orig_fns = mt._lce_fns.__wrapped__
compiled = {}


@functools.lru_cache(maxsize=None)
def fns(*key):
  jax.jit = functools.partial(orig_jit, compiler_options=options or None)
  try:
    out = orig_fns(*key)
  finally:
    jax.jit = orig_jit
  compiled["vg"] = out[1]
  return out


mt._lce_fns = fns
if os.environ.get("NO_SYNC"):  # upper bound of a sync-free backward: assume g_loss == 1
  def backward(ctx, g_loss, *unused):
    dx, dw, _ = ctx.saved_tensors
    return dx, dw, None, None, None, None, None, None, None, None, None
  mt._lce_op.register_autograd(backward, setup_context=mt._lce_setup)
row = torch_bridge.loss_worker(f"memeff:chunk={chunk}", reps)
import torch  # noqa: E402
N, D, V = torch_bridge.N, torch_bridge.D, torch_bridge.V
sds = lambda s, d: jax.ShapeDtypeStruct(s, d)
import jax.numpy as jnp  # noqa: E402
c = compiled["vg"].lower(sds((N, D), jnp.bfloat16), sds((V, D), jnp.bfloat16), None,
                         sds((N,), jnp.int32)).compile()
row["temp_bytes"] = c.memory_analysis().temp_size_in_bytes
row["stats"] = {k: v for k, v in (jax.devices()[0].memory_stats() or {}).items()
                if k in ("largest_alloc_size", "num_allocs", "pool_bytes", "peak_pool_bytes",
                         "bytes_reserved", "peak_bytes_in_use", "bytes_limit")}
print("ROW", chunk, os.environ.get("NO_SYNC", ""), json.dumps(options), os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default"),
      json.dumps(row))
