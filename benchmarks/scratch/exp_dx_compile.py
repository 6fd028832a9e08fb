"""Which shapes does PallasGpu(exp_logits=True) with a Mosaic dx GEMM compile at?
(Session 23: at llama3-8b XLA's compile raised IndexError raw_hash_map::at.)

    python benchmarks/scratch/exp_dx_compile.py
"""
import os
import sys
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
import memeff_jax  # noqa: E402
from memeff_jax.memory.analyze import report_of  # noqa: E402
from memeff_jax.ops import linear_cross_entropy as lce  # noqa: E402

CASES = [  # (N, D, V, chunk, gemms)
    (768, 256, 2048, 256, ("dx",)),
    (4096, 256, 2048, 1024, ("dx",)),
    (4096, 4096, 2048, 1024, ("dx",)),
    (4096, 256, 128256, 1024, ("dx",)),
    (16384, 4096, 128256, 1024, ("dx",)),
    (4096, 4096, 128256, 1024, ("dx",)),
    (2048, 4096, 128256, 1024, ("dx",)),
    (4096, 4096, 128256, 1024, ("dx", "dw")),
    (16384, 4096, 128256, 1024, ("dx", "dw")),
    (16384, 4096, 128256, 1024, ("dw",)),
]
for i, (n, d, v, chunk, gemms) in enumerate(CASES):
  if len(sys.argv) > 1 and str(i) not in sys.argv[1].split(","):
    continue
  x = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((d, v), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((n,), jnp.int32)
  kw = dict(dw_accumulation="tma_add") if "dw" in gemms else {}
  impl = lce.PallasGpu(exp_logits=True, mosaic_gemms=gemms, **kw)
  f = jax.jit(jax.value_and_grad(lambda x, w, y: memeff_jax.linear_cross_entropy(
      x, w, y, chunk_size=chunk, implementation=impl), argnums=(0, 1)))
  try:
    c = f.lower(x, w, y).compile()
    print(f"OK   N={n} D={d} V={v} C={chunk} {gemms}: temp "
          f"{c.memory_analysis().temp_size_in_bytes / 2**30:.4f} GiB", flush=True)
    if os.environ.get("OUT") and n == 16384:  # the optimized program and its buffers
      open(f"{os.environ['OUT']}/case{i}.hlo", "w").write(c.as_text())
      print(report_of(c), flush=True)
  except Exception as e:  # noqa: BLE001
    print(f"FAIL N={n} D={d} V={v} C={chunk} {gemms}: {type(e).__name__} {e}", flush=True)
    if "-v" in sys.argv:
      traceback.print_exc()
