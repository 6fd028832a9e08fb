"""One headline fwd+bwd each of ours (the defaults) and cuDNN, compiled first, for ncu
(benchmarks/scratch/dev_s35_d.sh): each provider's kernels run exactly once.

    python benchmarks/scratch/ncu_attention.py [--causal]
"""
import argparse
import sys

import jax

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import attention_inputs, jitted_fwd_bwd  # noqa: E402
from benchmarks.flash_attention import attention_fn  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--causal", action="store_true")
args = parser.parse_args()
q, k, v, ct = attention_inputs()
calls = [jitted_fwd_bwd(attention_fn(p, args.causal, None), ct).lower(q, k, v).compile()
         for p in ("memeff", "cudnn")]
for call in calls:
  jax.block_until_ready(call(q, k, v))
