"""Times the LCE softmax-gradient pass alone on one chunk's logits ([C, 128256] bf16, C from
$LCE_C, default 1024) for several KernelConfigs, given as key=value,... arguments after the
default config (e.g. `block_v=4096,num_warps=4`). Each call's G is the next
call's logits (the buffer is donated, as in the loss, where G overwrites the logits in
place). Also times the statistics-only pass (the "none" forward)."""
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from memeff_jax.ops.linear_cross_entropy import _common  # noqa: E402
from memeff_jax.ops.linear_cross_entropy import pallas_gpu as pg  # noqa: E402

C, V = int(os.environ.get("LCE_C", 1024)), 128256
opts = _common.LossOptions(vocab_size=V)
CONFIGS = [dict()] + [dict(kv.split("=") for kv in spec.split(",")) for spec in sys.argv[1:]]
labels = jax.random.randint(jax.random.key(1), (C,), 0, V)
a, e = jnp.full((C,), 1.0 / 16384, jnp.float32), jnp.zeros((C,), jnp.float32)


def timed(f, z, reps=30):
  for _ in range(3):
    z = f(z)
  jax.block_until_ready(z)
  t0 = time.perf_counter()
  for _ in range(reps):
    z = f(z)
  jax.block_until_ready(z)
  return (time.perf_counter() - t0) / reps * 1e6


for fields in CONFIGS:
  config = pg.KernelConfig(**{k: (v == "1" if k in ("split", "l2_hints") else int(v))
                              for k, v in fields.items()})
  grad = jax.jit(lambda z, config=config: pg.softmax_pass(z, labels, a, e, opts=opts,
                                                           config=config)[0], donate_argnums=0)
  stats = jax.jit(lambda z, config=config: pg.softmax_pass(z, labels, opts=opts,
                                                           config=config)[0])
  z = jax.random.normal(jax.random.key(0), (C, V), jnp.float32).astype(jnp.bfloat16) * 3
  try:
    us = timed(grad, z)
    z = jax.random.normal(jax.random.key(0), (C, V), jnp.float32).astype(jnp.bfloat16) * 3
    us_stats = timed(lambda _: stats(z), None)  # reads z, returns only the statistics
    print(f"C={C} grad {us:7.1f} us {3 * C * V * 2 / us / 1e6:5.2f} TB/s (3 passes) | "
          f"stats only {us_stats:7.1f} us  {config}", flush=True)
  except Exception as err:  # pylint: disable=broad-except
    print(f"failed {config}: {str(err)[:300]}", flush=True)
