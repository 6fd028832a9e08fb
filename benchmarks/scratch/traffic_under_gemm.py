"""Does HBM traffic cost time at the power cap when it runs beside the GEMMs? (torch, H200)

    python benchmarks/scratch/traffic_under_gemm.py [--rounds 7] [--calls 4]

Times are per loop of 16, each timing `calls` loops back to back (long enough for the clock
to settle at the cap), medians of 3 per round, rounds interleaved.

The loss's softmax pass is one read and one write of the chunk's [1,024, 128,256] bf16
logits (526 MB) between its GEMMs, 2.6% of the floor when run in series (lce_decompose.py).
Here, 16 logits-sized GEMMs ([1,024, 4,096] x [4,096, 128,256], ~1.1 TFLOP each) run on one
stream while 16 device-to-device copies of a [1,024, 128,256] bf16 buffer (the pass's bytes)
run on another (and, as "scales", 16 in-place multiplications of it: the same bytes moved by
a kernel on the SMs), and against each alone and both on one stream. If the pair on two streams
takes about as long as the GEMMs alone, the pass's cost is its place in the series, and a
kernel that overlaps it would recover it; if not, the bytes themselves cost time at the cap.
cudaMemcpy between device buffers may run on the copy engines or as a kernel; the profile
of one round says which (the kernel names it prints).
"""
import argparse
import statistics

import torch

C, D, V, N_CHUNKS = 1024, 4096, 128256, 16


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--calls", type=int, default=4, help="loss-sized loops per timing")
  args = parser.parse_args()
  torch.manual_seed(0)
  x = torch.randn(C, D, device="cuda", dtype=torch.bfloat16)
  w = torch.randn(D, V, device="cuda", dtype=torch.bfloat16) / D**0.5
  z = torch.empty(C, V, device="cuda", dtype=torch.bfloat16)
  src = torch.randn(C, V, device="cuda", dtype=torch.bfloat16)
  dst = torch.empty_like(src)
  s_gemm, s_copy = torch.cuda.Stream(), torch.cuda.Stream()

  def gemms(stream):
    with torch.cuda.stream(stream):
      for _ in range(N_CHUNKS):
        torch.mm(x, w, out=z)

  def copies(stream):
    with torch.cuda.stream(stream):
      for _ in range(N_CHUNKS):
        dst.copy_(src)

  def scales(stream):  # the same bytes by an elementwise kernel on the SMs, in place
    with torch.cuda.stream(stream):
      for _ in range(N_CHUNKS):
        src.mul_(1.0)

  def timed(fn):
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    s_gemm.wait_stream(torch.cuda.current_stream())
    s_copy.wait_stream(torch.cuda.current_stream())
    for _ in range(args.calls):
      fn()
    torch.cuda.current_stream().wait_stream(s_gemm)
    torch.cuda.current_stream().wait_stream(s_copy)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / args.calls

  variants = {
      "gemms": lambda: gemms(s_gemm),
      "copies": lambda: copies(s_copy),
      "both, one stream": lambda: (gemms(s_gemm), copies(s_gemm)),
      "both, two streams": lambda: (gemms(s_gemm), copies(s_copy)),
      "scales": lambda: scales(s_copy),
      "gemms+scales, one": lambda: (gemms(s_gemm), scales(s_gemm)),
      "gemms+scales, two": lambda: (gemms(s_gemm), scales(s_copy)),
  }
  for fn in variants.values():  # warm up (cuBLAS heuristics, clocks)
    for _ in range(3):
      timed(fn)
  times = {name: [] for name in variants}
  names = list(variants)
  for r in range(args.rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      times[name].append(statistics.median(timed(variants[name]) for _ in range(3)))
  for name, ts in times.items():
    print(f"{name:18} {statistics.median(ts):8.2f} ms   rounds " + " ".join(f"{t:.2f}" for t in ts))
  with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    timed(variants["copies"])
  print("copy's device activity:", sorted({e.key for e in prof.key_averages()})[:6])


if __name__ == "__main__":
  main()
