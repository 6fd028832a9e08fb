"""Fast device check of the Mosaic attention backward: gradient errors per variant (small shapes)."""
import itertools
import sys
import time
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from memeff_jax.ops import flash_attention as fa  # noqa: E402
from tests.ops.flash_attention.test_flash_attention import make_problem, rel_err, run  # noqa: E402

for (split, stages), causal, d in itertools.product([(True, 2), (False, 2), (True, 3)], [False, True],
                                                     [128, 64]):
  if split and d == 64:
    continue
  cfg = fa.MosaicBackwardConfig(dq_split=split, stages=stages)
  q, k, v, _, ct = make_problem(jax.random.key(1), 2, 256, 384, 8, 2, d, jnp.bfloat16)
  t0 = time.time()
  try:
    _, _, g = run(fa.PallasMosaicGpu(backward_config=cfg), q, k, v, None, ct, dict(causal=causal))
    up = lambda x: x.astype(jnp.float32)
    _, _, r = run("reference", up(q), up(k), up(v), None, ct, dict(causal=causal))
    errs = [float(rel_err(a, b)) for a, b in zip(g, r)]
    print(f"split={split} stages={stages} causal={causal} d={d}: dq/dk/dv rel err "
          f"{errs[0]:.2e} {errs[1]:.2e} {errs[2]:.2e} ({time.time() - t0:.1f}s)", flush=True)
  except Exception:  # pylint: disable=broad-except
    print(f"split={split} stages={stages} causal={causal} d={d}: FAILED", flush=True)
    traceback.print_exc(limit=3)
