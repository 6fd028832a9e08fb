"""Host time of each piece of the bridged loss's forward call on the GPU (light setting,
llama3-8b): the conversions, the jitted call's dispatch, the conversions back, and the
custom op around them; and the host time of the backward. Each piece is timed from an idle
GPU (torch.cuda.synchronize before), median of 7.

    python benchmarks/scratch/bridge_host.py
"""
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
import jax  # noqa: E402
import memeff_jax.interop.torch as mt  # noqa: E402
from _measure import CHUNK, bridge_loss_problem  # noqa: E402

xt, wt, yt, impl = bridge_loss_problem()
key = mt._lce_key("mean", -100, 0.0, 0.0, None, None, CHUNK, mt._implementation_key(impl))
vg = mt._lce_fns(*key)[1]


def host(label, fn, reps=7):
  """Median host ms of fn() from an idle GPU; returns fn's last result."""
  ts, out = [], None
  for _ in range(reps):
    torch.cuda.synchronize()
    jax.effects_barrier()
    t0 = time.perf_counter()
    out = fn()
    ts.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    jax.block_until_ready(jax.tree.leaves(out) if not isinstance(out, torch.Tensor) else [])
  print(f"{label:44} {statistics.median(ts):8.3f} ms  (min {min(ts):.3f})", flush=True)
  return out


args = (mt.to_jax(xt), mt.to_jax(wt), None, mt._labels_to_jax(yt))
jax.block_until_ready(vg(*args))  # compile
host("to_jax(x)", lambda: mt.to_jax(xt))
host("to_jax(w)", lambda: mt.to_jax(wt))
host("labels (int64 words)", lambda: mt._labels_to_jax(yt))
host("_on(x) enter", lambda: mt._on(xt).__enter__())
loss, grads = host("jitted value_and_grad dispatch", lambda: vg(*args))


def dispatch_in_on():
  with mt._on(xt):
    return vg(*args)


host("the same inside _on(x)", dispatch_in_on)


def dispatch_then_convert():
  l, g = vg(*args)
  return mt.to_torch(l), mt.to_torch(g[0]), mt.to_torch(g[1])


host("dispatch + to_torch of loss, dx, dW", dispatch_then_convert)
l, g = vg(*args)
jax.block_until_ready(g)
host("to_torch(loss) of a ready array", lambda: mt.to_torch(l))
host("to_torch(dW) of a ready array", lambda: mt.to_torch(g[1]))


def op_forward():
  xt.grad = wt.grad = None
  return mt.linear_cross_entropy(xt, wt, yt, chunk_size=CHUNK, implementation=impl)


host("the bridged forward call", op_forward)
ts = []
for _ in range(7):
  loss = op_forward()
  torch.cuda.synchronize()
  t0 = time.perf_counter()
  loss.backward()
  ts.append((time.perf_counter() - t0) * 1e3)
print(f"{'backward after the forward has finished':44} {statistics.median(ts):8.3f} ms", flush=True)

if "--profile" in sys.argv:  # Python profiles of the forward call and of the backward
  import cProfile  # pylint: disable=import-outside-toplevel
  import pstats  # pylint: disable=import-outside-toplevel
  fwd_prof, bwd_prof = cProfile.Profile(), cProfile.Profile()
  for _ in range(7):
    torch.cuda.synchronize()
    fwd_prof.enable()
    loss = op_forward()
    fwd_prof.disable()
    torch.cuda.synchronize()
    bwd_prof.enable()
    loss.backward()
    bwd_prof.disable()
  for name, prof in (("forward", fwd_prof), ("backward", bwd_prof)):
    print(f"--- {name}, 7 calls, by internal time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
