"""Where the bridge's time goes: the light setting's loss (llama3-8b, "vd" 512, all-Mosaic,
tma_add, fused_lse) through the bridge, the same JAX function called directly, and Liger,
in one process and interleaved rounds.

    ROUNDS=5 python benchmarks/scratch/bridge_overhead.py

Timers (ms per forward+backward, wall clock from the call to the GPU's end):
  bridge            torch_bridge's step: mt.linear_cross_entropy(...).backward()
  jax int64 labels  the bridge's own jitted value_and_grad on to_jax views (Int64Labels)
  jax int32 labels  the same loss with int32 labels (what torch_bridge's jax_direct runs)
  liger             LigerFusedLinearCrossEntropyLoss forward+backward
  ... busy          the same after ~20 ms of torch matmuls queued on the stream, timed by
                    CUDA events from the end of that work: the host's dispatch latency
                    hidden, as in a training step whose model forward runs first
Also the host time of one bridged forward call (to its return, no wait).
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
import jax  # noqa: E402
import memeff_jax.interop.torch as mt  # noqa: E402
from _measure import CHUNK, bridge_loss_problem  # noqa: E402
from benchmarks import _harness  # noqa: E402
from memeff_jax import linear_cross_entropy  # noqa: E402

xt, wt, yt, impl = bridge_loss_problem()


def bridge():
  xt.grad = wt.grad = None
  loss = mt.linear_cross_entropy(xt, wt, yt, chunk_size=CHUNK, implementation=impl)
  loss.backward()
  return loss


def liger_fn():
  from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # pylint: disable=import-outside-toplevel
  module = LigerFusedLinearCrossEntropyLoss()

  def step():
    xt.grad = wt.grad = None
    loss = module(wt, xt, yt)
    loss.backward()
    return loss
  return step


class _Direct(torch.autograd.Function):
  """The bridge's forward and backward without the custom op around them (eager only)."""

  @staticmethod
  def forward(ctx, *inputs):
    out = mt._lce_op._init_fn(*inputs)
    mt._lce_setup(ctx, inputs, out)
    ctx.mark_non_differentiable(*out[1:])
    return out

  @staticmethod
  def backward(ctx, *grads):
    return mt._lce_backward(ctx, *grads)


def bridge_fn():
  xt.grad = wt.grad = None
  loss = _Direct.apply(xt, wt, yt, None, -100, "mean", 0.0, 0.0, None, CHUNK,
                       mt._implementation_key(impl), True)[0]
  loss.backward()
  return loss


key = mt._lce_key("mean", -100, 0.0, 0.0, None, None, CHUNK, mt._implementation_key(impl))
bridge_vg = mt._lce_fns(*key)[1]
xj, wj = mt.to_jax(xt), mt.to_jax(wt)
y64 = mt._labels_to_jax(yt)
y32 = mt.to_jax(yt.to(torch.int32))
direct32 = jax.jit(jax.value_and_grad(
    lambda x, w, y: linear_cross_entropy(x, w, y, weight_layout="vd", chunk_size=CHUNK,
                                         implementation=impl), argnums=(0, 1)))


def wall(fn):
  def timer():
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3
  return timer


def busy(fn):
  """CUDA-event time of fn on torch's stream queued behind ~20 ms of matmuls (torch_bridge's
  queued_ms)."""
  return lambda: _harness.time_torch(fn, warmup=0, reps=1, lead_ms=20.0)


timers = {
    "bridge": wall(bridge),
    "jax int64 labels": wall(lambda: bridge_vg(xj, wj, None, y64)),
    "jax int32 labels": wall(lambda: direct32(xj, wj, y32)),
}
try:
  liger = liger_fn()
  timers["liger"] = wall(liger)
except ImportError as e:
  print("no liger:", e)
  liger = None
timers["bridge, autograd.Function"] = wall(bridge_fn)
timers["bridge busy"] = busy(bridge)
timers["bridge, autograd.Function busy"] = busy(bridge_fn)
if liger:
  timers["liger busy"] = busy(liger)

for t in timers.values():  # compile, autotune, warm
  t(); t()
host = []
for _ in range(5):
  torch.cuda.synchronize()
  xt.grad = wt.grad = None
  t0 = time.perf_counter()
  loss = mt.linear_cross_entropy(xt, wt, yt, chunk_size=CHUNK, implementation=impl)
  host.append((time.perf_counter() - t0) * 1e3)
  loss.backward()
print(f"host time of the bridged forward call: {statistics.median(host):.3f} ms", flush=True)
host = []
for _ in range(5):
  torch.cuda.synchronize()
  xt.grad = wt.grad = None
  t0 = time.perf_counter()
  loss = _Direct.apply(xt, wt, yt, None, -100, "mean", 0.0, 0.0, None, CHUNK,
                       mt._implementation_key(impl), True)[0]
  host.append((time.perf_counter() - t0) * 1e3)
  loss.backward()
print(f"host time of the same through an autograd.Function: {statistics.median(host):.3f} ms",
      flush=True)
dispatch = []
for _ in range(5):
  torch.cuda.synchronize()
  t0 = time.perf_counter()
  out = direct32(xj, wj, y32)
  dispatch.append((time.perf_counter() - t0) * 1e3)
  jax.block_until_ready(out)
print(f"host time of the direct jitted call (to its return): {statistics.median(dispatch):.3f} ms"
      f" (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})", flush=True)

times = {n: [] for n in timers}
names = list(timers)
for r in range(int(os.environ.get("ROUNDS", "5"))):
  for name in names[r % len(names):] + names[:r % len(names)]:
    times[name].extend(timers[name]() for _ in range(int(os.environ.get("REPS", "5"))))
base = statistics.median(times["jax int32 labels"])
for name, ts in times.items():
  med = statistics.median(ts)
  print(f"{name:32} median {med:8.3f} ms ({med / base - 1:+.2%} vs jax int32)  "
        f"min {min(ts):.3f} max {max(ts):.3f}", flush=True)
