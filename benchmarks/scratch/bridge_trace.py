"""One bridged loss step from an idle GPU, on the host's and the GPU's timelines (torch's
profiler; CUPTI sees JAX's kernels and driver calls too): when each piece of the host's work
runs, when the first kernel starts, where the GPU idles, relative to the step's start.

    python benchmarks/scratch/bridge_trace.py [light|default|liger] [--reps 4]

The bridge's pieces are annotated by wrapping mt._to_jax_call (the call's imports),
mt.to_torch and the jitted functions with torch.profiler.record_function (a scratch script
may monkeypatch). Its session-19 logs (-trace-*.log) predate _to_jax_call: they show the
three to_jax imports of that time one by one.
"""
import argparse
import json
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
import memeff_jax.interop.torch as mt  # noqa: E402
from _measure import CHUNK, bridge_loss_problem  # noqa: E402
from benchmarks.linear_cross_entropy import torch_loss_fn, torch_step  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("mode", nargs="?", default="light")
parser.add_argument("--reps", type=int, default=4)
args = parser.parse_args()


def annotated(name, fn):
  def wrapper(*a, **k):
    with record_function(name):
      return fn(*a, **k)
  return wrapper


mt._to_jax_call = annotated("imports", mt._to_jax_call)
mt.to_torch = annotated("to_torch", mt.to_torch)
_fns = mt._lce_fns


def _annotated_fns(*key):
  value, vg, vjp = _fns(*key)
  return value, annotated("jax_call", vg), vjp


mt._lce_fns = _annotated_fns

xt, wt, yt, impl = bridge_loss_problem()
if args.mode == "liger":
  loss_fn = torch_loss_fn("liger")
else:
  chunk = CHUNK if args.mode == "light" else None
  impl = impl if args.mode == "light" else None
  loss_fn = lambda x, w, y: mt.linear_cross_entropy(x, w, y, chunk_size=chunk,
                                                    implementation=impl)
step, _ = torch_step(loss_fn, xt, wt, yt)
for _ in range(3):
  step()
torch.cuda.synchronize()


def timed_step():
  start = torch.cuda.Event(enable_timing=True)
  end = torch.cuda.Event(enable_timing=True)
  with record_function("STEP"):
    start.record()
    with record_function("forward"):
      xt.grad = wt.grad = None
      loss = loss_fn(xt, wt, yt)
    with record_function("backward"):
      loss.backward()
    end.record()
  torch.cuda.synchronize()
  return start.elapsed_time(end)


with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
  ms = [timed_step() for _ in range(args.reps)]
path = tempfile.mktemp(suffix=".json")
prof.export_chrome_trace(path)
print(f"mode {args.mode}: event-timed ms per step {['%.2f' % m for m in ms]}")

events = json.load(open(path))
events = events["traceEvents"] if isinstance(events, dict) else events
xs = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
steps = sorted((e for e in xs if e["name"] == "STEP"), key=lambda e: e["ts"])
gpu_cats = ("kernel", "gpu_memcpy", "gpu_memset")
for i, s in enumerate(steps):
  t0, t1 = s["ts"], s["ts"] + s["dur"]
  nxt = steps[i + 1]["ts"] if i + 1 < len(steps) else float("inf")
  host = sorted((e for e in xs if t0 <= e["ts"] <= t1 and e.get("cat") not in gpu_cats),
                key=lambda e: e["ts"])
  gpu = sorted((e for e in xs if e.get("cat") in gpu_cats and t0 <= e["ts"] < nxt),
               key=lambda e: e["ts"])
  print(f"--- step {i}: host {s['dur'] / 1e3:.3f} ms, event-timed {ms[i]:.2f} ms")
  if gpu:
    print(f"first GPU op at +{(gpu[0]['ts'] - t0) / 1e3:.3f} ms ({gpu[0]['name'][:60]}), "
          f"last ends +{(max(g['ts'] + g['dur'] for g in gpu) - t0) / 1e3:.3f} ms, "
          f"{len(gpu)} GPU ops")
    end = gpu[0]["ts"] + gpu[0]["dur"]
    for g in gpu[1:]:
      if g["ts"] - end > 30:
        print(f"  GPU idle {(g['ts'] - end) / 1e3:.3f} ms from +{(end - t0) / 1e3:.3f} "
              f"before {g['name'][:60]}")
      end = max(end, g["ts"] + g["dur"])
  if i == len(steps) - 1:  # the driver calls inside the jitted call, and the first GPU ops
    calls = [e for e in xs if e["name"] == "jax_call" and t0 <= e["ts"] <= t1
             and e.get("cat") == "user_annotation"]
    if calls:
      c0, c1 = calls[0]["ts"], calls[0]["ts"] + calls[0]["dur"]
      inner = sorted((e for e in xs if c0 <= e["ts"] <= c1
                      and e.get("cat") in ("cuda_driver", "cuda_runtime")), key=lambda e: e["ts"])
      print(f"  jax_call +{(c0 - t0) / 1e3:.3f} .. +{(c1 - t0) / 1e3:.3f} ms, "
            f"{len(inner)} driver/runtime calls:")
      for e in inner[:40]:
        print(f"    +{(e['ts'] - t0) / 1e3:7.3f} {e['dur']:7.1f} us {e['name'][:50]}")
    for g in gpu[:6]:
      print(f"  gpu +{(g['ts'] - t0) / 1e3:7.3f} {g['dur']:9.1f} us {g['name'][:60]}")
  if i == len(steps) - 1 or i == 1:  # the host's pieces of one step, in order
    for e in host:
      if e["dur"] >= 15 or e["name"] in ("forward", "backward"):
        print(f"  host +{(e['ts'] - t0) / 1e3:7.3f} {e['dur'] / 1e3:7.3f} ms "
              f"[{e.get('cat', '')}] {e['name'][:80]}")
