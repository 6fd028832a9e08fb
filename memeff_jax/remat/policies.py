"""Named `jax.checkpoint` policies for transformer blocks, and `fit()`.

The names refer to what memeff_jax tags with `checkpoint_name`: flash_attention's residuals
attention_out and attention_lse (the float32 log-sum-exp), and in memeff_jax.models' blocks
query_proj, key_proj, value_proj, attention_out, mlp_gate and mlp_up. linear_cross_entropy
keeps nothing large.

  nothing                 keep nothing; recompute the whole block in the backward pass
  attention               keep the attention output and log-sum-exp, so the backward never
                          reruns the attention forward (the block's dearest recompute)
  attention_projections   keep q, k, v and the attention output and log-sum-exp
  dots_no_batch           keep every matmul without batch dimensions (jax's policy)
  everything              keep everything (no recomputation)
  offload_attention       move the attention output and log-sum-exp to host memory and back
                          (backends with pinned host memory: GPU/TPU)
"""

from __future__ import annotations

import dataclasses

import jax

cp = jax.checkpoint_policies

_ATTN = ("attention_out", "attention_lse")
_PROJ = ("query_proj", "key_proj", "value_proj") + _ATTN

POLICIES = {
    "nothing": cp.nothing_saveable,
    "attention": cp.save_only_these_names(*_ATTN),
    "attention_projections": cp.save_only_these_names(*_PROJ),
    "dots_no_batch": cp.dots_with_no_batch_dims_saveable,
    "everything": cp.everything_saveable,
    "offload_attention": cp.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=_ATTN,
        offload_src="device", offload_dst="pinned_host"),
}


def resolve(name: str):
  """A policy by name: ours first, then jax.checkpoint_policies; "none" means no remat."""
  if name == "none":
    return None
  if name in POLICIES:
    return POLICIES[name]
  if hasattr(cp, name):
    return getattr(cp, name)
  raise ValueError(f"unknown remat policy {name!r}; ours are {sorted(POLICIES)}, or any "
                   "jax.checkpoint_policies name, or 'none'")


@dataclasses.dataclass
class Candidate:
  """One policy's compiled cost."""

  name: str
  peak_bytes: int | None = None
  flops: float | None = None  # matmul FLOPs on the jaxpr, recomputation included (flops.py)
  error: str | None = None
  xla_flops: float | None = None  # XLA's compiled cost analysis (loop bodies counted once)

  @property
  def fits(self):
    return self.error is None


def table(cands: list[Candidate], budget_bytes: int | None = None) -> str:
  """The candidates as a table: peak, matmul and XLA FLOPs, and with a budget whether each
  fits it."""
  fits = "" if budget_bytes is None else f"  fits {budget_bytes / 2**30:.3f} GiB"
  rows = [f"{'policy':24s} {'peak':>12s} {'matmul GFLOP':>13s} {'XLA GFLOP':>10s}{fits}"]
  for c in cands:
    if c.error:
      rows.append(f"{c.name:24s} {'—':>12s} {'—':>13s} {'—':>10s}  cannot compile: "
                  f"{c.error[:60]}")
      continue
    row = (f"{c.name:24s} {c.peak_bytes / 2**30:8.3f} GiB {c.flops / 1e9:13.1f} "
           f"{c.xla_flops / 1e9:10.1f}")
    if budget_bytes is not None:
      row += f"  {'yes' if c.peak_bytes <= budget_bytes else 'no'}"
    rows.append(row)
  return "\n".join(rows)


def _step_for(make_step, name: str):
  """make_step(name), or a TypeError that says what make_step must be."""
  want = ("make_step must take a policy name and return the step to compile, e.g. "
          "`lambda policy: make_train_step(remat_policy=policy)`")
  try:
    fn = make_step(name)
  except Exception as err:  # pylint: disable=broad-except
    raise TypeError(f"{want}; make_step({name!r}) raised {type(err).__name__}: "
                    f"{str(err).splitlines()[0] if str(err) else ''}") from err
  if not callable(fn):
    raise TypeError(f"{want}; make_step({name!r}) returned {fn!r}")
  return fn


def candidates(make_step, *args, policies=None) -> list[Candidate]:
  """Compiles `make_step(name)` for `args` (arrays or ShapeDtypeStructs), for every policy
  name, without running it: each one's peak bytes (memeff_jax.memory.analyze) and FLOPs.
  `flops` counts the matmuls of the traced step (memeff_jax.remat.flops: scanned layers
  times their count, Pallas kernels by their cost estimate), so recomputation shows up as
  extra FLOPs; `xla_flops` is XLA's compiled cost analysis, which counts a loop body once
  and sees no Pallas kernel (nor, on GPU, a cuBLAS call). A policy that does not compile is
  kept with its error."""
  from memeff_jax.memory import report_of  # pylint: disable=import-outside-toplevel
  from memeff_jax.remat.flops import matmul_flops  # pylint: disable=import-outside-toplevel

  out = []
  for name in policies or POLICIES:
    fn = _step_for(make_step, name)
    try:
      jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
      compiled = jitted.lower(*args).compile()
      cost = compiled.cost_analysis()
      cost = cost[0] if isinstance(cost, (list, tuple)) else cost
      report = report_of(compiled)
      out.append(Candidate(name, report.peak_bytes, matmul_flops(jitted, *args),
                           xla_flops=float(cost.get("flops", 0.0))))
    except Exception as err:  # pylint: disable=broad-except
      out.append(Candidate(name, error=f"{type(err).__name__}: {err}".splitlines()[0]))
  return out


def choose(cands: list[Candidate], budget_bytes: int) -> str:
  """The fitting candidate with the fewest (matmul) FLOPs, ties to the smaller peak.

  Raises:
    ValueError: if no candidate fits, with every candidate's peak in the message.
  """
  fitting = [c for c in cands if c.fits and c.peak_bytes <= budget_bytes]
  if not fitting:
    raise ValueError(f"no remat policy fits budget_bytes={budget_bytes:,}:\n"
                     f"{table(cands, budget_bytes)}")
  return min(fitting, key=lambda c: (c.flops, c.peak_bytes)).name


def fit(make_step, *args, budget_bytes: int, policies=None, verbose: bool = True):
  """The policy with the least recomputation whose compiled peak fits `budget_bytes`.

  Args:
    make_step: policy name -> the function to compile (e.g. a train step built with that
      remat policy); it is compiled for `args` (arrays or ShapeDtypeStructs), never run.
    budget_bytes: the memory the step may use (memeff_jax.memory.analyze's peak).
    policies: names to try (default: every entry of POLICIES).
    verbose: print the table of candidates.

  Returns:
    (best name, [Candidate per policy]): see `candidates` and `choose`.

  Raises:
    ValueError: if no candidate fits, with every candidate's peak in the message.
  """
  cands = candidates(make_step, *args, policies=policies)
  if verbose:
    print(table(cands, budget_bytes))
  return choose(cands, budget_bytes), cands
