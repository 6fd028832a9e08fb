"""Shared benchmark plumbing: timing, memory, environment, JSON-lines output."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import threading
import time
import tomllib

import jax

from memeff_jax import memory

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# GPU memory allocated on demand, as benchmarks/gpu.sh runs every benchmark: read when JAX
# first touches a device, so a benchmark that then starts fresh-process workers
# (train_step.py, scaling.py's context-train) holds none of the memory they need.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def shape_sets(name: str) -> dict:
  with (ROOT / "configs" / "benchmarks" / f"{name}.toml").open("rb") as f:
    return tomllib.load(f)


def environment() -> dict:
  env = {
      "device": jax.devices()[0].device_kind,
      "platform": jax.devices()[0].platform,
      "jax": jax.__version__,
      "python": platform.python_version(),
      "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:  # what the allocator may hold (XLA_PYTHON_CLIENT_MEM_FRACTION)
    env["memory_limit_bytes"] = stats["bytes_limit"]
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if not f.startswith("--xla_force_host_platform_device_count"))
  if flags:  # a run under other compiler settings than the defaults says so
    env["xla_flags"] = flags
  try:
    import torch  # pylint: disable=import-outside-toplevel
    env["torch"] = torch.__version__
  except ImportError:
    pass
  return env


def time_jax(fn, *args, warmup: int = 2, reps: int = 10, inner: int | None = 1,
             batch_ms: float = 20.0) -> float:
  """Median milliseconds per call of fn(*args) over `reps` batches.

  A batch dispatches `inner` calls back to back and waits once, so short ops are not
  charged the host round trip (use inner > 1 below a few milliseconds), as an op queued
  behind the rest of a training step is not. inner=None: as many calls as take about
  `batch_ms` (one call's time after the warmup), at most 64.
  """
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  if inner is None:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    inner = max(1, min(64, round(batch_ms / ((time.perf_counter() - t0) * 1e3))))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner - 1):
      fn(*args)
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3 / inner)
  return statistics.median(times)


def interleaved(timers: dict, rounds: int, gpu: "GpuSampler | None" = None
                ) -> dict[str, list]:
  """{name: [timer() of each round]}: every timer once per round, the order rotated by one
  each round, so that no provider always runs first (coolest GPU) or last. Under sustained
  load the GPU's clock drifts by a few percent within a run; ratios of medians over
  interleaved rounds do not carry that drift, as ratios of providers timed one after
  another do. With `gpu`, each timer's calls are also marked as its windows there."""
  names = list(timers)
  out = {name: [] for name in names}
  for r in range(rounds):
    shift = r % len(names) if names else 0
    for name in names[shift:] + names[:shift]:
      start = time.perf_counter()
      out[name].append(timers[name]())
      if gpu is not None:
        gpu.mark(name, start, time.perf_counter())
  return out


def sampled_rounds(timers: dict, rounds: int, on_gpu: bool) -> tuple[dict, dict]:
  """(interleaved(timers, rounds), {name: GpuSampler.summary()'s figures}): on a GPU the clock and
  power over each timer's calls (GpuSampler), elsewhere no such figures."""
  if not on_gpu:
    return interleaved(timers, rounds), {}
  with GpuSampler() as gpu:
    times = interleaved(timers, rounds, gpu=gpu)
  return times, gpu.summary()


def parse_gpu_sample(line: str) -> tuple[float, float] | None:
  """(SM clock in MHz, board power in W) from one line of `nvidia-smi
  --query-gpu=clocks.sm,power.draw.instant --format=csv,noheader,nounits`, None where it
  holds no such pair (a header, "[N/A]")."""
  try:
    mhz, watts = (float(part) for part in line.split(","))
  except ValueError:
    return None
  return mhz, watts


class GpuSampler:
  """The SM clock and instant board power of the first GPU, read by nvidia-smi every
  `period_ms` (power.draw, the driver's average over about a second, would blur a timed
  window of a few hundred ms into its neighbours), averaged over the windows marked per
  provider. A GPU held at its power limit trades clock for power under sustained load (an
  H100 at 700 W runs the loss heads at 1.3-1.5 GHz, not its 1.98): a provider slower at a
  higher clock than another's waited more, one slower at the same clock and power spent
  more energy (the LCE design doc's H100 figures). Where nvidia-smi is missing, `summary()`
  is empty. Use as a context manager."""

  def __init__(self, period_ms: int = 100):
    self.period_ms = period_ms
    self.samples: list[tuple[float, float, float]] = []  # (perf_counter, MHz, W)
    self.windows: dict[str, list[tuple[float, float]]] = {}
    self._proc = None
    self._reader = None

  def __enter__(self):
    if shutil.which("nvidia-smi") is None:
      return self
    self._proc = subprocess.Popen(
        ["nvidia-smi", "--id=0", "--query-gpu=clocks.sm,power.draw.instant",
         "--format=csv,noheader,nounits", f"-lms={self.period_ms}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    return self

  def _read(self):
    for line in self._proc.stdout:
      if (sample := parse_gpu_sample(line)) is not None:
        self.samples.append((time.perf_counter(), *sample))

  def __exit__(self, *exc):
    if self._proc is not None:
      self._proc.terminate()
      self._proc.wait()
      self._reader.join(timeout=1.0)

  def mark(self, name: str, start: float, end: float) -> None:
    self.windows.setdefault(name, []).append((start, end))

  def summary(self) -> dict[str, dict[str, float]]:
    """{name: {"sm_mhz", "power_w", "gpu_samples"}}: the means of the samples inside its
    windows and how many there were (a provider whose windows total less than a period or
    two gets its figures from one or two samples), for the names whose windows hold any."""
    out = {}
    for name, windows in self.windows.items():
      inside = [(mhz, watts) for t, mhz, watts in self.samples
                if any(start <= t <= end for start, end in windows)]
      if inside:
        out[name] = {"sm_mhz": statistics.fmean(m for m, _ in inside),
                     "power_w": statistics.fmean(w for _, w in inside),
                     "gpu_samples": len(inside)}
    return out


def clock_text(row: dict) -> str:
  """" | 1,450 MHz 690 W (12 samples)" for a row with GpuSampler's figures, else ""."""
  if "sm_mhz" not in row:
    return ""
  count = row.get("gpu_samples")
  samples = "" if count is None else f" ({count} sample{'s' if count != 1 else ''})"
  return f" | {row['sm_mhz']:,.0f} MHz {row['power_w']:.0f} W{samples}"


def jax_temp_bytes(jitted, *args) -> int | None:
  """Temporary bytes XLA assigns to the compiled program (None if the backend gives none)."""
  return memory.analyze(jitted, *args).temp_bytes


def time_torch(fn, warmup: int = 2, reps: int = 10, lead_ms: float = 0.0) -> float:
  """Median milliseconds of fn() on torch's current stream, by CUDA events.

  lead_ms=0: each call starts on an idle GPU, so the time includes the host's latency from
  the call to its first kernel. lead_ms > 0: each call is queued behind that much other GPU
  work (bf16 matmuls), as a loss is behind the model's forward in a training step, and is
  timed from the end of that work: the host's dispatch latency is hidden, as it is while
  the host runs ahead, but a wait inside fn (a .item()) still counts.
  """
  import torch  # pylint: disable=import-outside-toplevel
  for _ in range(warmup):
    fn()
  lead = _lead_work(lead_ms) if lead_ms else None
  torch.cuda.synchronize()
  times = []
  for _ in range(reps):
    if lead:
      lead()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end))
  return statistics.median(times)


def torch_extra_bytes(step, leaves) -> int:
  """Bytes torch allocates at the peak of step() (a forward and backward, or a forward)
  beyond what was allocated before it and the gradients it leaves in `leaves`' .grad, as
  XLA's temporaries count. step() runs once before (compiling, autotuning), outside the
  measured peak."""
  import torch  # pylint: disable=import-outside-toplevel
  step()
  for x in leaves:  # the gradients are outputs: not held at the start
    x.grad = None
  torch.cuda.synchronize()
  torch.cuda.reset_peak_memory_stats()
  base = torch.cuda.memory_allocated()
  step()
  torch.cuda.synchronize()
  grads = sum(x.grad.numel() * x.grad.element_size() for x in leaves if x.grad is not None)
  return int(torch.cuda.max_memory_allocated() - base - grads)


def _lead_work(ms: float):
  """A function that queues about `ms` of matmuls on torch's current stream."""
  import torch  # pylint: disable=import-outside-toplevel
  a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
  out = torch.empty_like(a)
  torch.matmul(a, a, out=out)
  torch.cuda.synchronize()
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  start.record()
  for _ in range(10):
    torch.matmul(a, a, out=out)
  end.record()
  torch.cuda.synchronize()
  count = max(1, round(ms / (start.elapsed_time(end) / 10)))

  def lead():
    for _ in range(count):
      torch.matmul(a, a, out=out)
  return lead


def append(path: os.PathLike, rows: list[dict]) -> None:
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("a") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
