"""The bridged light-setting loss from an idle GPU: as it is, with the backward's host sync on
g (as before the Triton scale kernel), and Liger-Kernel, interleaved in one process (rounds
of each), so that host-latency differences are not lost in the power-capped run-to-run
spread. (Session 19 also measured an eager autograd.Function in place of the custom op:
~0.2 ms faster, but processes that used it sometimes aborted at exit; removed.)

    python benchmarks/scratch/bridge_ab.py [--rounds 5] [--reps 8] [--variants bridge,liger]
"""
import argparse
import statistics
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
import memeff_jax.interop.torch as mt  # noqa: E402
from _measure import CHUNK, bridge_loss_problem  # noqa: E402
from benchmarks import _harness  # noqa: E402
from benchmarks.linear_cross_entropy import torch_loss_fn, torch_step  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--reps", type=int, default=8)
parser.add_argument("--variants", default="bridge,host_sync,liger")
args = parser.parse_args()

xt, wt, yt, impl = bridge_loss_problem()
light = lambda x, w, y: mt.linear_cross_entropy(x, w, y, chunk_size=CHUNK, implementation=impl)
scale_kernel = mt._scale_kernel


def via_sync(x, w, y):
  """The backward reading g on the host (one sync), as without Triton."""
  mt._scale_kernel = lambda: None
  return light(x, w, y)


def restore(step):
  def run():
    try:
      step()
    finally:
      mt._scale_kernel = scale_kernel
  return run


steps = {"bridge": torch_step(light, xt, wt, yt)[0],
         "host_sync": restore(torch_step(via_sync, xt, wt, yt)[0]),
         "liger": torch_step(torch_loss_fn("liger"), xt, wt, yt)[0]}
steps = {k: steps[k] for k in args.variants.split(",")}
times = {k: [] for k in steps}
for r in range(args.rounds):
  for name, step in steps.items():
    times[name].append(_harness.time_torch(step, reps=args.reps))
  print(f"round {r}: " + "  ".join(f"{k} {v[-1]:.2f}" for k, v in times.items()), flush=True)
print("medians: " + "  ".join(f"{k} {statistics.median(v):.2f}" for k, v in times.items()))
