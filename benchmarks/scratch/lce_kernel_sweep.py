"""Times the LCE softmax-gradient kernel alone on one chunk's logits ([1024, 128256] bf16)
for several KernelConfigs. Each call's G is the next call's logits (the buffer is donated,
as in the loss, where G overwrites the logits in place)."""
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from memeff_jax.ops.linear_cross_entropy import _common  # noqa: E402
from memeff_jax.ops.linear_cross_entropy import pallas_gpu as pg  # noqa: E402

C, V = 1024, 128256
opts = _common.LossOptions(vocab_size=V)
CONFIGS = [dict()] + [dict(kv.split("=") for kv in spec.split(",")) for spec in sys.argv[1:]]
labels = jax.random.randint(jax.random.key(1), (C,), 0, V)
a, e = jnp.full((C,), 1.0 / 16384, jnp.float32), jnp.zeros((C,), jnp.float32)
for fields in CONFIGS:
  config = pg.KernelConfig(**{k: int(v) for k, v in fields.items()})
  f = jax.jit(lambda z, config=config: pg.softmax_pass(z, labels, a, e, opts=opts,
                                                        config=config)[0], donate_argnums=0)
  z = jax.random.normal(jax.random.key(0), (C, V), jnp.float32).astype(jnp.bfloat16) * 3
  try:
    for _ in range(3):
      z = f(z)
    jax.block_until_ready(z)
    t0 = time.perf_counter()
    for _ in range(30):
      z = f(z)
    jax.block_until_ready(z)
    us = (time.perf_counter() - t0) / 30 * 1e6
    print(f"{us:8.1f} us  {3 * C * V * 2 / us / 1e6:5.2f} TB/s (3 passes)  {config}", flush=True)
  except Exception as err:  # pylint: disable=broad-except
    print(f"failed {config}: {str(err)[:200]}", flush=True)
