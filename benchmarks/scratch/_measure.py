"""Timing and power of a JAX function run back to back, for the scratch diagnostics:
per_call (seconds per call) and power (median power and SM clock, nvidia-smi every 50 ms);
and the bridge diagnostics' problem, bridge_loss_problem."""
import statistics
import subprocess
import time

import jax


def per_call(f, *args, reps=20):
  """Seconds per call of f(*args), compiled and run once first, over `reps` calls."""
  jax.block_until_ready(f(*args))
  t0 = time.perf_counter()
  for _ in range(reps):
    r = f(*args)
  jax.block_until_ready(r)
  return (time.perf_counter() - t0) / reps


def power(f, *args, seconds=3.0):
  """Median power (W) and SM clock (MHz) while f runs back to back for `seconds`."""
  jax.block_until_ready(f(*args))
  smi = subprocess.Popen(["nvidia-smi", "--query-gpu=power.draw,clocks.sm", "--format=csv,noheader,"
                          "nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
  t0 = time.perf_counter()
  n = 0
  while time.perf_counter() - t0 < seconds:
    r = f(*args)
    n += 1
    if n % 20 == 0:
      jax.block_until_ready(r)
  jax.block_until_ready(r)
  sec = (time.perf_counter() - t0) / n
  smi.terminate()
  rows = [line.split(", ") for line in smi.communicate()[0].splitlines() if line.strip()]
  busy = [(float(p), float(c)) for p, c in rows if float(p) > 300]
  if not busy:
    return sec, float("nan"), float("nan")
  return sec, statistics.median(p for p, _ in busy), statistics.median(c for _, c in busy)


# llama3-8b's LM head, and the bridge's lowest-memory setting's token chunk.
N, D, V, CHUNK = 16384, 4096, 128256, 512


def bridge_loss_problem():
  """(x, W, labels, implementation): torch CUDA tensors at llama3-8b (bf16 x [N, D] and W
  [V, D] requiring grad, int64 labels) and the light setting (all three GEMMs on
  ops.mosaic_gemm, tma_add, fused_lse), as torch_bridge's memeff:...:mosaic:tma:lse."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  from memeff_jax.ops import linear_cross_entropy as lce  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  xt = torch.randn(N, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
  wt = (torch.randn(V, D, device="cuda") / np.sqrt(D)).to(torch.bfloat16).requires_grad_()
  yt = torch.randint(0, V, (N,), device="cuda")
  impl = lce.PallasGpu(mosaic_gemms=("logits", "dx", "dw"), dw_accumulation="tma_add",
                       fused_lse=True)
  return xt, wt, yt, impl
