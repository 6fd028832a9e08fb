"""Timing and power of a JAX function run back to back, for the scratch diagnostics:
per_call (seconds per call) and power (median power and SM clock, nvidia-smi every 50 ms)."""
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
