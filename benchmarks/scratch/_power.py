"""power(f, *args): a JAX function's median power and SM clock while it runs back to back
(nvidia-smi sampled every 50 ms), for the scratch energy diagnostics."""
import statistics
import subprocess
import time

import jax


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
