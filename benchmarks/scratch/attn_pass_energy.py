"""Energy per call of the headline fwd+bwd's passes around the Mosaic kernels (the row
statistics Δ and lse₂, and dq's float32 → bf16 conversion), each run back to back at the
700 W cap, beside whole fwd+bwd calls (ours and cuDNN): at the cap a pass costs the fwd+bwd
its energy / 700 W, not its time.

    python benchmarks/scratch/attn_pass_energy.py [--causal]
"""
import argparse
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import attention_backward_problem, jitted_fwd_bwd, rounds_then_power  # noqa: E402
from benchmarks.flash_attention import attention_fn  # noqa: E402
from memeff_jax.ops.flash_attention import _common  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--causal", action="store_true")
args = parser.parse_args()

q, k, v, ct, opts, res, _ = attention_backward_problem(args.causal)
d_lse = jnp.zeros_like(res.lse)
dq32 = jax.random.normal(jax.random.key(1), q.shape, jnp.float32)

stats = jax.jit(lambda res, ct: mb.row_stats(opts, res, _common.softmax_delta(res.out, ct, d_lse)))
convert = jax.jit(lambda x: (x * opts.scale).astype(q.dtype))
fns = {"row stats": (stats, (res, ct)), "dq convert": (convert, (dq32,))}
for provider in ("memeff", "cudnn"):
  fns[provider] = (jitted_fwd_bwd(attention_fn(provider, args.causal, None), ct), (q, k, v))
rounds_then_power(fns, 3, width=12)
