"""The training loop behind `memeff-jax demo` and `memeff-jax train`."""

from __future__ import annotations

import dataclasses
import sys
import time

from flax import nnx
import jax
import jax.numpy as jnp

from memeff_jax import memory
from memeff_jax.models import data
from memeff_jax.models.llama import Llama, LlamaConfig
from memeff_jax.models.train import make_train_step


@dataclasses.dataclass
class RunResult:
  kernels: str
  losses: list[float]
  temp_bytes: int | None  # XLA temporaries of the compiled train step
  peak_bytes: int | None  # device peak while training (GPU), None where not reported
  tokens_per_s: float
  predicted_peak_bytes: int | None = None  # memeff_jax.memory.analyze's peak of the step
  probes: dict[int, int | None] = dataclasses.field(default_factory=dict)


def batches(cfg: LlamaConfig, train: dict, batch: int, seq_len: int):
  if train.get("data", "synthetic") == "source":
    if cfg.vocab_size != 256:
      raise ValueError(f"data='source' is byte-level and needs vocab_size=256, got "
                       f"{cfg.vocab_size}")
    return data.packed_batches(batch, seq_len)
  return data.synthetic_batches(batch, seq_len, cfg.vocab_size)


def progress(prefix: str, i: int, n: int, loss: float, stream=sys.stderr):
  """A bar redrawn in place on a terminal; into a file or pipe, a line per tenth of the run."""
  width = 30
  done = int(width * i / n)
  line = f"{prefix} [{'#' * done}{'.' * (width - done)}] {i}/{n} loss {loss:.4f}"
  if stream.isatty():
    stream.write("\r" + line + ("\n" if i == n else ""))
  elif i == n or i % max(n // 10, 1) == 0:
    stream.write(line + "\n")
  stream.flush()


def train(cfg: LlamaConfig, train_cfg: dict, *, kernels: str, steps: int, batch: int,
          seq_len: int, seed: int = 0, show_progress: bool = True,
          probe_batches: tuple[int, ...] = (), on_compiled=None, on_trained=None, mesh=None,
          context_order: str = "contiguous", context_strategy: str = "all_gather",
          sequence_parallel: bool = False) -> RunResult:
  """Trains a fresh model (parameters from `seed`, so both kernel sets start equal).

  `probe_batches`: batch sizes whose train step is only compiled, after training, to
  report their predicted peak bytes (RunResult.probes); nothing runs at those sizes.
  `on_compiled(compiled, report)`: called with the compiled step and its MemoryReport
  before the first step runs (so a run that then fails still leaves its prediction);
  `on_trained(result)`: called with the result before the probes compile (so a run whose
  probes take too long still counts). `mesh`: train on this mesh (models.sharding: the
  batch over data × fsdp, weights by its rules); `context_order` and `context_strategy`:
  the attention's on a mesh with a context axis; `sequence_parallel`: the residual stream
  sharded on the sequence over a tensor axis (Llama).
  """
  model = Llama(cfg, kernels=kernels, context_order=context_order,
                context_strategy=context_strategy, sequence_parallel=sequence_parallel,
                rngs=nnx.Rngs(seed))
  state, step = make_train_step(model, learning_rate=train_cfg.get("learning_rate", 3e-3),
                                mesh=mesh)
  state = state.state
  stream = batches(cfg, train_cfg, batch, seq_len)
  if mesh is None:
    place = lambda b: {k: jnp.asarray(v) for k, v in b.items()}
  else:
    from memeff_jax.models import sharding  # pylint: disable=import-outside-toplevel
    place = lambda b: jax.device_put(sharding.context_batch(b, mesh, context_order),
                                     sharding.batch_sharding(mesh))
  first = place(next(stream))
  compiled = step.lower(state, first).compile()  # compiled once, run below
  report = memory.report_of(compiled)
  if on_compiled is not None:
    on_compiled(compiled, report)
  losses, t_start = [], None
  batch_data = first
  for i in range(steps):
    state, loss = compiled(state, batch_data)
    if i + 1 < steps:  # the next batch is made and sent while the step runs
      batch_data = place(next(stream))
    losses.append(float(loss))  # waits for the step
    if i == 0:
      t_start = time.perf_counter()  # the first step includes compilation
    if show_progress:
      progress(f"{kernels:6s}", i + 1, steps, losses[-1])
  elapsed = time.perf_counter() - t_start if steps > 1 else float("nan")
  stats = jax.devices()[0].memory_stats() or {}
  result = RunResult(kernels, losses, report.temp_bytes, stats.get("peak_bytes_in_use"),
                     (steps - 1) * batch * seq_len / elapsed if steps > 1 else float("nan"),
                     report.peak_bytes)
  if on_trained is not None:
    on_trained(result)
  for b in probe_batches:
    spec = {k: jax.ShapeDtypeStruct((b,) + v.shape[1:], v.dtype) for k, v in first.items()}
    result.probes[b] = memory.analyze(step, state, spec).peak_bytes
  return result


def plot(results: list[RunResult], path: str, title: str):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw=dict(width_ratios=[2, 1]))
  for r, style in zip(results, ("-", "--")):
    ax1.plot(range(1, len(r.losses) + 1), r.losses, style, label=f"{r.kernels} layers")
  ax1.set_xlabel("step")
  ax1.set_ylabel("training loss")
  ax1.legend()
  ax1.set_title("loss, step by step")
  names = [r.kernels for r in results]
  mib = [(r.temp_bytes or 0) / 2**20 for r in results]
  bars = ax2.bar(names, mib, color=["tab:gray", "tab:green"][:len(results)])
  ax2.bar_label(bars, fmt="%.0f MiB")
  ax2.set_ylabel("train-step temporaries (MiB)")
  ax2.set_title("compiled memory")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
