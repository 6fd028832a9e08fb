"""Whether the last partial wave costs the headline its time (device only).

    python benchmarks/scratch/wave_tail.py [--causal] [--rounds 5]

At the headline (B=4 H=32 T=4096 D=128) the backward launches 4,096 CTAs of 128 keys and
the forward deals 4,096 query tiles: 31.03 per SM of an H100's 132, so four SMs run a 32nd
while the rest idle. With H=33 the same kernels have 4,224 (32 per SM exactly): if the
tail costs a whole CTA's time, H=33 takes about as long as H=32 (ideal ratio 33/32 =
1.031). Times forward and forward+backward of ours (the defaults) and cuDNN at both head
counts in interleaved rounds, and prints each ratio H=33 / H=32.
"""
import argparse
import statistics
import sys

import jax

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import attention_inputs, jitted_fwd_bwd  # noqa: E402
from benchmarks import _harness  # noqa: E402
from benchmarks.flash_attention import attention_fn  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--causal", action="store_true")
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--heads", default="32,33")
args = parser.parse_args()

timers = {}
heads = [int(h) for h in args.heads.split(",")]
for h in heads:
  q, k, v, ct = attention_inputs((4, 4096, h, 128))
  for provider in ("memeff", "cudnn"):
    f = attention_fn(provider, args.causal, None)
    fwd = jax.jit(f)
    both = jitted_fwd_bwd(f, ct)
    for tag, g in (("fwd", fwd), ("fwd+bwd", both)):
      jax.block_until_ready(g(q, k, v))
      timers[(provider, tag, h)] = (lambda g=g, a=(q, k, v): _harness.time_jax(g, *a, reps=20))
times = {key: statistics.median(ts) for key, ts in _harness.interleaved(timers, args.rounds).items()}
print(f"causal={args.causal}, ms (median of {args.rounds} interleaved rounds)")
for provider in ("memeff", "cudnn"):
  for tag in ("fwd", "fwd+bwd"):
    row = "  ".join(f"H={h}: {times[(provider, tag, h)]:.3f}" for h in heads)
    ratio = times[(provider, tag, heads[-1])] / times[(provider, tag, heads[0])]
    print(f"{provider:7} {tag:8} {row}   ratio {ratio:.3f} (work {heads[-1] / heads[0]:.3f})",
          flush=True)
