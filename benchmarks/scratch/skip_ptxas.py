"""ptxas's view of the causal ordered backward with and without the unseen-step skip
(benchmarks/patches/skip_unseen.diff applied first; its last form: the step run before the
walk, its K columns at an offset of their own; all three forms gave the same 180 B of spills
and C7512, WGMMAs serialized): run with MOSAIC_GPU_DUMP_PTXAS=1 and
grep its spills, registers and WGMMA serialization warnings per variant.

    git apply benchmarks/patches/skip_unseen.diff
    MOSAIC_GPU_DUMP_PTXAS=1 python benchmarks/scratch/skip_ptxas.py 2>&1 | grep -E "==|spill|C75|Used"
"""
import dataclasses
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import attention_backward_problem, rounds_then_power  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402

q, k, v, ct, opts, res, _ = attention_backward_problem(True)
cts = (ct, jnp.zeros_like(res.lse))
ordered = dataclasses.replace(mb.MosaicBackwardConfig.tuned(128, True), dq_ordered=True,
                              dq_send_warp=True, dq_buffers=2)
fns = {}
for skip in (True, False):
  mb._SKIP_UNSEEN = skip  # pylint: disable=protected-access
  name = "skip" if skip else "no skip"
  print(f"== {name}", flush=True)
  f = jax.jit(lambda res, ct, s=skip: mb.backward(opts, ordered, res, (ct, cts[1]))[:3])
  jax.block_until_ready(f(res, ct))  # traced now, with this flag
  fns[name] = (f, (res, ct))
rounds_then_power(fns, 3, width=10)
