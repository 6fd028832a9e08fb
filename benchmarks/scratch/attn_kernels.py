"""Where one fwd+bwd's GPU time goes, kernel by kernel: the headline's vjp (as
benchmarks/flash_attention.py times it) run back to back under torch's profiler (CUPTI sees
JAX's kernels), per provider and mask; each kernel's mean µs per call, the kernels' sum and
the wall time per call.

    python benchmarks/scratch/attn_kernels.py [--providers memeff,cudnn] [--calls 20]
"""
import argparse
import collections
import sys
import time

import jax
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import attention_inputs, jitted_fwd_bwd  # noqa: E402
from benchmarks.flash_attention import attention_fn  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--providers", default="memeff,cudnn")
parser.add_argument("--masks", default="dense,causal")
parser.add_argument("--calls", type=int, default=20)
parser.add_argument("--shape", default="4,4096,32,128")
args = parser.parse_args()

q, k, v, ct = attention_inputs(tuple(int(x) for x in args.shape.split(",")))

for mask in args.masks.split(","):
  causal = mask == "causal"
  for provider in args.providers.split(","):
    fn = jitted_fwd_bwd(attention_fn(provider, causal, None), ct)
    for _ in range(5):
      jax.block_until_ready(fn(q, k, v))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
      t0 = time.perf_counter()
      for _ in range(args.calls):
        r = fn(q, k, v)
      jax.block_until_ready(r)
      wall = (time.perf_counter() - t0) / args.calls
    per = collections.defaultdict(float)
    count = collections.Counter()
    for ev in prof.events():
      if ev.device_type == torch.autograd.DeviceType.CUDA:
        per[ev.name] += ev.time_range.elapsed_us()
        count[ev.name] += 1
    total = sum(per.values()) / args.calls
    print(f"== {provider} {mask}: wall {wall * 1e3:.3f} ms per call, kernels {total / 1e3:.3f} ms",
          flush=True)
    for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
      print(f"  {us / args.calls:9.1f} µs  x{count[name] / args.calls:.1f}  {name[:110]}")
