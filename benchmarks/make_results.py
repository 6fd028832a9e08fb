"""Generates benchmarks/RESULTS.md (and the README's results table) from results/*.jsonl.

    python benchmarks/make_results.py

Rows are grouped by run (shape set, device, start time): ratios are only ever quoted
against the floor measured in the same run. RESULTS.md shows the latest run of each case
on each GPU; the JSON-lines files keep every run.
"""

from __future__ import annotations

import collections
import json
import math
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
JAX_PEERS = ("xla", "cudnn", "cudnn:deterministic", "tokamax:mosaic", "tokamax:triton")
DETERMINISTIC_CUDNN = "cudnn:deterministic"
ROWS = "rows:"  # flash_attention.py's prefix: a peer on packed documents cut into rows
# The README's attention table: memeff's default and the peers an informed user would run
# instead (RESULTS.md has every provider's rows).
README_ATTENTION = ("memeff", "cudnn", DETERMINISTIC_CUDNN, "tokamax:mosaic", "torch:cudnn")


def readme_block(name: str, text: str, block: str) -> str:
  mark = re.compile(rf"(<!-- results:{name} -->\n).*?(<!-- /results -->)", re.S)
  return mark.sub(lambda m: m.group(1) + block + m.group(2), text)


def load(op: str) -> list[dict]:
  path = RESULTS / f"{op}.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _gib(b):
  return "n/a" if b is None else f"{b / 2**30:.3f}"


def lce_table(rows: list[dict]) -> str:
  out = ["| provider | ms | × floor | TFLOP/s | extra memory (GiB) |", "|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      out.append(f"| {r['provider']} | error: {r['error'][:80]} | | | |")
      continue
    ratio = "—" if r.get("ratio_to_floor") is None else f"{r['ratio_to_floor']:.3f}"
    out.append(f"| {r['provider']} | {r['ms']:.2f} | {ratio} | {r['tflops']:.0f} | "
               f"{_gib(r.get('extra_bytes'))} |")
  return "\n".join(out)


def heads_section(rows: list[dict]) -> list[str]:
  """The `heads` set's latest figures on each GPU, one line per head: memeff's default against
  the three-matmul floor of the same run (the loss's target, ≤ 1.03×), its extra memory, and
  plain XLA where that run timed it. Heads are named after the one-head sets of
  configs/benchmarks/linear_cross_entropy.toml that share their shape."""
  with (ROOT / "configs" / "benchmarks" / "linear_cross_entropy.toml").open("rb") as f:
    sets = tomllib.load(f)
  shape = lambda x: (x["n"], x["d"], x["v"])
  names = {}
  for name, spec in sets.items():
    names.setdefault(shape(spec["shapes"][0]), name)
  order = [shape(x) for x in sets["heads"]["shapes"]]
  latest_run = collections.defaultdict(dict)  # device -> head -> (stamp, {provider: row})
  for (set_name, device, stamp, n, d, v, _), group in runs(rows):
    if set_name == "heads":
      latest_run[device][n, d, v] = (stamp, {r["provider"]: r for r in group if "error" not in r})
  out = []
  for device, heads in latest_run.items():
    found = [(head, heads[head][1]) for head in order
             if head in heads and {"floor", "memeff"} <= set(heads[head][1])]
    if not found:
      continue
    stamps = sorted({heads[head][0] for head, _ in found})
    naive = any("jax_naive" in run for _, run in found)
    out += [f"**heads** on {device}, {' and '.join(stamps)}"
            f"{_rounds([r for _, run in found for r in run.values()])}", "",
            "| head | N | D | V | floor ms | memeff ms | × floor | extra memory (GiB) |"
            + (" plain XLA × floor |" if naive else ""),
            "|---|---|---|---|---|---|---|---|" + ("---|" if naive else "")]
    for (n, d, v), run in found:
      floor, ours = run["floor"], run["memeff"]
      line = (f"| {names.get((n, d, v), '')} | {n:,} | {d:,} | {v:,} | {floor['ms']:.2f} | "
              f"{ours['ms']:.2f} | {ours['ms'] / floor['ms']:.3f} | "
              f"{_gib(ours.get('extra_bytes'))} |")
      if naive:
        plain = run.get("jax_naive")
        line += " — |" if plain is None else f" {plain['ms'] / floor['ms']:.3f} |"
      out.append(line)
    out.append("")
  return out


def fa_table(rows: list[dict]) -> str:
  """One attention run: ratios against the best JAX peer of the same run and mask (a peer on
  packed documents cut into rows, `rows:PEER`, among them)."""
  out = ["| provider | causal | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | "
         "fwd+bwd vs best JAX peer | extra memory (GiB) |", "|---|---|---|---|---|---|---|---|"]
  best = {}
  for r in rows:
    if r["provider"].removeprefix(ROWS) in JAX_PEERS and "error" not in r:
      best[r["causal"]] = max(best.get(r["causal"], 0.0), r["fwd_bwd_tflops"])
  for r in sorted(rows, key=lambda r: r["causal"]):
    if "error" in r:
      out.append(f"| {r['provider']} | {r['causal']} | error: {r['error'][:60]} | | | | | |")
      continue
    ratio = (f"{r['fwd_bwd_tflops'] / best[r['causal']]:.3f}×" if r["causal"] in best else "—")
    out.append(f"| {r['provider']} | {r['causal']} | {r['fwd_ms']:.2f} | {r['fwd_tflops']:.0f} | "
               f"{r['fwd_bwd_ms']:.2f} | {r['fwd_bwd_tflops']:.0f} | {ratio} | "
               f"{_gib(r.get('extra_bytes'))} |")
  notes = sorted({r["source"] for r in rows if r.get("source")})
  if any(r["provider"] == "memeff" and "deterministic" not in r for r in rows):
    notes.append("memeff rows before 2026-11-22T02:30 ran the one-pass Mosaic backward, which "
                 "sums dq in arrival order (not bitwise deterministic): today's "
                 "memeff:nondeterministic. memeff now defaults to deterministic=True")
  if any("fwd_bwd_timing" not in r for r in rows):
    notes.append("fwd+bwd timed before 2026-11-21 as a separate primal call plus a vjp; XLA "
                 "does not merge two Mosaic GPU or cuDNN calls, so those providers ran their "
                 "forward twice and their fwd+bwd figures here are understated")
  return "\n".join(out + [f"\nNote: {n}." for n in notes])


def latest(groups, stamp: int):
  """The newest of each case: groups (key, rows) sorted newest first, keeping the first of
  those whose keys agree but for the timestamp at position `stamp`."""
  seen, out = set(), []
  for key, rows in groups:
    case = key[:stamp] + key[stamp + 1:]
    if case not in seen:
      seen.add(case)
      out.append((key, rows))
  return out


def fa_runs(rows: list[dict]):
  """The latest run of each set's shape on each GPU, less the runs every one of whose masks
  a later run of any set measured again on that GPU."""
  grouped = collections.OrderedDict()
  for r in rows:
    key = (r["set"], r["device"], r["timestamp"], r["b"], r["t"], r["s"], r["h"], r["hkv"],
           r["d"], r["docs"], r["dtype"], (r.get("window") or [None])[0], r.get("doc_seed"))
    grouped.setdefault(key, []).append(r)
  runs = latest(sorted(grouped.items(), key=lambda kv: kv[0][2], reverse=True), 2)
  case = lambda key, r: (key[1], *key[3:], r["causal"])  # the run's key less set and time
  newest = {}
  for key, group in runs:
    for r in group:
      newest[case(key, r)] = max(newest.get(case(key, r), ""), key[2])
  return [(key, group) for key, group in runs
          if any(newest[case(key, r)] == key[2] for r in group)]


def fa_heading(key, rows) -> str:
  set_name, device, stamp, b, t, s, h, hkv, d, docs, dtype, _, seed = key
  docs = f", {docs} documents per row" if docs else ""
  if docs and seed is not None:
    docs += f" of random lengths (seed {seed})"
  if rows[0].get("window"):
    docs += f", sliding window {rows[0]['window'][0]} (to the right too unless causal)"
  return (f"**{set_name}** (B={b}, T={t:,}, S={s:,}, H={h}/{hkv}, D={d}{docs}, {dtype}) on "
          f"{device}, {stamp} (jax {rows[0]['jax']}){_rounds(rows)}")


def _grid_line(head: str, r: dict, peer: dict, det: dict | None = None,
               det_column: bool = False) -> tuple[float, str]:
  """(memeff's fwd+bwd ratio to peer, the grid table's line) for row r, `head` its first
  columns; with det_column, a last column against `det` (deterministic cuDNN), if it ran."""
  ratio = r["fwd_bwd_tflops"] / peer["fwd_bwd_tflops"]
  text = (f"{head} | {r['fwd_bwd_tflops']:.0f} | {peer['fwd_bwd_tflops']:.0f} | "
          f"{ratio:.3f}× | {r['fwd_tflops'] / peer['fwd_tflops']:.3f}× |")
  if det_column:
    text += f" {r['fwd_bwd_tflops'] / det['fwd_bwd_tflops']:.3f}× |" if det else " — |"
  return ratio, text


def grid_section(rows: list[dict]) -> list[str]:
  """The latest `grid` figures on each GPU: memeff against cuDNN per row, forward+backward
  and forward, and the geometric mean of the fwd+bwd ratios. Each row comes from the latest
  run of its case (a grid may be split over processes); memeff and cuDNN from the same run. A
  packed row compares TFLOP/s per visible pair with cuDNN's unpacked row of that run (issue
  54's measure, in the mean); where cuDNN ran the same documents too, in its packed layout
  or (`rows:cudnn`) with each document a row of its own, a line below it for each compares
  the two, outside the mean, and a second mean takes the faster of them in the packed row's
  place. Where deterministic cuDNN (`cudnn:deterministic`) ran, a last column
  and a mean of their own compare memeff's deterministic default with it."""
  case = lambda r: (r["b"], r["t"], r["h"], r["hkv"], r["d"], r["causal"], r["docs"],
                    tuple(r.get("window") or ()))
  latest_case = collections.defaultdict(dict)  # device -> case -> (stamp, {provider: row})
  runs = collections.defaultdict(dict)  # (device, case, stamp) -> {provider: row}
  for r in sorted((r for r in rows if r["set"] == "grid" and "error" not in r),
                  key=lambda r: r["timestamp"]):
    group = runs[r["device"], case(r), r["timestamp"]]
    group[r["provider"]] = r
    latest_case[r["device"]][case(r)] = (r["timestamp"], group)
  with (ROOT / "configs" / "benchmarks" / "flash_attention.toml").open("rb") as f:
    order = [(x["b"], x["t"], x["h"], x.get("hkv", x["h"]), x["d"], x.get("docs"),
              x.get("window")) for x in tomllib.load(f)["grid"]["shapes"]]

  def place(key):
    """A case's place: its shape's index in the grid set (unlisted shapes last), then the
    mask (full before causal)."""
    b, t, h, hkv, d, causal, docs, window = key
    shape = (b, t, h, hkv, d, docs, window[0] if window else None)
    return (order.index(shape) if shape in order else len(order)), causal

  out = []
  for device, cases in latest_case.items():
    cases = dict(sorted(cases.items(), key=lambda kv: place(kv[0])))
    stamps = sorted({stamp for stamp, _ in cases.values()})
    shown = [r for _, group in cases.values() for r in group.values()]
    det_column = any(r["provider"] == DETERMINISTIC_CUDNN for r in shown)
    out += [f"**grid** on {device}, {' and '.join(stamps)} (jax {shown[0]['jax']})"
            f"{_rounds(shown)}",
            "", "| B | T | H | D | mask | memeff fwd+bwd TFLOP/s | cuDNN | × cuDNN fwd+bwd | "
            "× cuDNN fwd |" + (" × deterministic cuDNN fwd+bwd |" if det_column else ""),
            "|---|---|---|---|---|---|---|---|---|" + ("---|" if det_column else "")]
    ratios = []  # fwd+bwd × cuDNN, the packed row against the unpacked one (in the mean)
    same_docs, packed_met = [], False  # the same, the packed row against cuDNN's packed layout
    det_ratios = []  # fwd+bwd × deterministic cuDNN, as `ratios`
    for key, (stamp, group) in cases.items():
      r = group.get("memeff")
      if r is None:
        continue
      peer, det = group.get("cudnn"), group.get(DETERMINISTIC_CUDNN)
      same = {}  # label -> (peer, deterministic peer) on the same documents
      if r["docs"]:  # the unpacked row's peers, from the same run (shown or not)
        same = {label: (group.get(p), group.get(d)) for label, p, d in (
            ("cuDNN packed", "cudnn", DETERMINISTIC_CUDNN),
            ("cuDNN, documents as rows", ROWS + "cudnn", ROWS + DETERMINISTIC_CUDNN))
            if group.get(p)}
        unpacked = runs.get((device, key[:6] + (None, ()), stamp), {})
        peer, det = (unpacked.get(p) for p in ("cudnn", DETERMINISTIC_CUDNN))
      mask = ("causal" if r["causal"] else "full") + (
          f", window {r['window'][0]}" if r.get("window") else "") + (
          f", {r['docs']} docs" if r["docs"] else "")
      shape = f"| {r['b']} | {r['t']} | {r['h']}/{r['hkv']} | {r['d']} | {mask}"
      label = " (vs unpacked)" if r["docs"] else ""
      if peer is None:
        out.append(f"{shape}{label} | {r['fwd_bwd_tflops']:.0f} | — | — | — |"
                   + (" — |" if det_column else ""))
      else:
        ratio, text = _grid_line(shape + label, r, peer, det, det_column)
        ratios.append(ratio)
        if det:
          det_ratios.append(r["fwd_bwd_tflops"] / det["fwd_bwd_tflops"])
        if not r["docs"]:
          same_docs.append(ratio)
        out.append(text)
      best = []
      for name, (same_peer, same_det) in same.items():
        ratio, text = _grid_line(f"{shape} (vs {name})", r, same_peer, same_det, det_column)
        best.append(ratio)
        out.append(text)
      if best:
        same_docs.append(min(best))
        packed_met = True
    geomean = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))
    if ratios:
      out.append(f"\nGeometric mean, fwd+bwd: {geomean(ratios):.3f}× cuDNN over {len(ratios)} "
                 "rows.")
    if packed_met:
      out.append(f"With the packed row against cuDNN on the same documents (the faster way): "
                 f"{geomean(same_docs):.3f}×.")
    if det_ratios:
      out.append(f"Against deterministic cuDNN (bitwise repeatable gradients, as memeff's "
                 f"default): {geomean(det_ratios):.3f}× over {len(det_ratios)} rows.")
    out.append("")
  return out


def _rounds(rows) -> str:
  """', median of R interleaved rounds' for runs timed with --rounds R > 1 (R as a range
  where the rows come from runs of different R)."""
  lo, hi = min(r.get("rounds", 1) for r in rows), max(r.get("rounds", 1) for r in rows)
  if hi <= 1:
    return ""
  return f", median of {lo if lo == hi else f'{lo}–{hi}'} interleaved rounds"


def runs(rows: list[dict]):
  grouped = collections.OrderedDict()
  for r in rows:
    key = (r["set"], r["device"], r["timestamp"], r["n"], r["d"], r["v"], r["dtype"])
    grouped.setdefault(key, []).append(r)
  return latest(sorted(grouped.items(), key=lambda kv: kv[0][2], reverse=True), 2)


def run_heading(key, rows) -> str:
  set_name, device, stamp, n, d, v, dtype = key
  versions = ", ".join(f"{k} {rows[0][k]}" for k in ("jax", "torch") if k in rows[0])
  cap, smoothing = rows[0].get("logit_softcap"), rows[0].get("label_smoothing")
  dtype = dtype if cap is None else f"{dtype}, logit softcap {cap:g}"
  dtype = dtype if not smoothing else f"{dtype}, label smoothing {smoothing:g}"
  if rows[0].get("reduction"):
    dtype = f"{dtype}, reduction {rows[0]['reduction']!r}"
  if rows[0].get("token_weights"):
    dtype = f"{dtype}, token weights"
  if rows[0].get("entropy_bonus") is not None:
    dtype = f"{dtype}, entropy bonus {rows[0]['entropy_bonus']:g}"
  if rows[0].get("ppo_sequence") is not None:
    dtype = f"{dtype}, PPO's clipped surrogate, advantages per {rows[0]['ppo_sequence']:,} tokens"
  passes = "forward+backward" if rows[0].get("backward", True) else "forward (no gradients)"
  return (f"**{set_name}** (N={n:,}, D={d:,}, V={v:,}, {dtype}) on {device}, {stamp} "
          f"({versions}), {passes}{_rounds(rows)}")


def _by_run(rows, *fields):
  grouped = collections.OrderedDict()
  for r in rows:
    grouped.setdefault(tuple(r.get(f) for f in fields), []).append(r)
  return sorted(grouped.items(), key=lambda kv: kv[0][-1] or "", reverse=True)


LAYERS = {"memeff": "memeff", "plain": "plain (cuDNN attention)",
          "plain_xla": "plain (XLA attention)"}


def train_step_section() -> tuple[list[str], str | None]:
  """Train steps of each model on each kernel set, every run of every search: (RESULTS.md
  lines, the README's summary table: the first model's, on an 80 GB H100 where one ran)."""
  rows = [r for r in load("train_step") if r.get("platform") == "gpu"
          and r["op"] in ("train_step", "train_step_run")]
  readme = None
  if not rows:
    return [], readme
  out = ["## Train step: plain Flax layers vs memeff layers", "",
         "`python benchmarks/train_step.py --config 1b`: each run a fresh process, "
         "`peak_bytes_in_use` of the device, tokens/s over the steps after the first. "
         "Predicted peak: `memeff_jax.memory.analyze` of the compiled step. Layers: "
         + "; ".join(f"{v}" for v in LAYERS.values()) + " (memeff_jax.models.llama).", ""]
  for (config, mesh, sp, device), group in _by_run(rows, "config", "mesh", "sequence_parallel",
                                                   "device"):
    # Runs on an allocator grown on demand ran out of memory below the limit: a kernel set's
    # runs on a preallocated pool, where it has some, replace them.
    pooled = {r["kernels"] for r in group if r.get("preallocated")}
    group = [r for r in group if r.get("preallocated") or r["kernels"] not in pooled]
    grown = sorted({r["kernels"] for r in group if not r.get("preallocated")})
    runs_ = [r for r in group if r["op"] == "train_step_run" or "tokens_per_s" in r]
    where = f"on {device}" if mesh is None else (
        f"on a {_mesh_name(mesh)} mesh{' (sequence parallel)' if sp else ''} of {device}s")
    out += [f"**{config}** {where} (jax {group[0]['jax']})", "",
            "| layers | batch | runs? | tokens/s | peak (GiB) | predicted peak (GiB) | "
            "temporaries (GiB) |", "|---|---|---|---|---|---|---|"]
    last = {(r["kernels"], r["batch"]): r for r in runs_}  # file order is time order
    for _, r in sorted(last.items()):
      if r.get("fits") is False:
        out.append(f"| {r['kernels']} | {r['batch']} | no: {r.get('error', '')[:40]} | | | | |")
        continue
      out.append(f"| {r['kernels']} | {r['batch']} | yes | {r['tokens_per_s']:,.0f} | "
                 f"{_gib(r.get('peak_bytes'))} | {_gib(r.get('predicted_peak_bytes'))} | "
                 f"{_gib(r.get('temp_bytes'))} |")
    table = _train_summary(runs_)
    out += [""] + table + [""]
    if mesh is None and (readme is None or "H100" in device and "H100" not in readme):
      # one GPU, the 80 GB card's where one ran
      readme = (f"**{config}** (sequence {runs_[0].get('seq_len', '?')}, bf16) on {device}:\n\n"
                + "\n".join(table) + "\n")
    notes = sorted({r["source"] for r in group if r.get("source")})
    notes = [f"Note: some rows are the {n}." for n in notes] + [
        f"Note: the runs of {', '.join(grown)} grew JAX's allocator on demand, which found "
        "no contiguous room for the step's temporaries well below the limit: the largest "
        "batch they found is a lower bound."] * bool(grown)
    out += notes + ([""] if notes else [])
  return out, readme


def _mesh_name(mesh) -> str:
  """"data=2,fsdp=2" (or {"data": 2, "fsdp": 2}) -> "data=2 × fsdp=2"."""
  parts = mesh.split(",") if isinstance(mesh, str) else [f"{k}={v}" for k, v in mesh.items()]
  return " × ".join(parts)


def _train_summary(runs_: list[dict]) -> list[str]:
  """Per kernel set (its latest run at each batch): the largest batch that runs (exact where
  the next one ran out of memory; another failure is named), and tokens/s and peak at one
  batch (the one most sets ran; of those, one plain ran, then the smallest) and at its
  largest batch."""
  latest = collections.defaultdict(dict)  # kernels -> batch -> its latest run
  for r in runs_:
    latest[r["kernels"]][r["batch"]] = r
  fits = {kernels: {b: r for b, r in by.items() if r.get("fits") is not False}
          for kernels, by in latest.items()}
  ran = collections.Counter(b for by in fits.values() for b in by)
  equal = min(ran, key=lambda b: (-ran[b], b not in fits.get("plain", {}), b), default=None)
  out = [f"| layers | largest batch that runs | tokens/s at batch {equal} | peak at batch "
         f"{equal} (GiB) | tokens/s at its largest batch |", "|---|---|---|---|---|"]
  for kernels in [k for k in LAYERS if k in fits]:
    by = fits[kernels]
    ok = max(by, default=None)
    if ok is None:
      continue
    bad = min((b for b in latest[kernels] if b not in by and b > ok), default=None)
    error = "" if bad is None else latest[kernels][bad].get("error", "")
    why = "" if error.startswith("out of memory") else f": {error}"
    largest = (f"{ok}" if bad == ok + 1 and not why else f"≥ {ok}" if bad is None
               else f"{ok} ({bad} fails{why})")
    at = by.get(equal)
    speed = "" if at is None else f"{at['tokens_per_s']:,.0f}"
    peak = "" if at is None else _gib(at.get("peak_bytes"))
    out.append(f"| {LAYERS[kernels]} | {largest} | {speed} | {peak} | "
               f"{by[ok]['tokens_per_s']:,.0f} |")
  return out


def train_curve_section() -> list[str]:
  """The same model trained from the same parameters on the same data by each kernel set."""
  rows = [r for r in load("train_step") if r.get("op") == "train_curve"]
  if not rows:
    return []
  out = ["## Loss curves: memeff vs plain layers", "",
         "`python benchmarks/train_step.py --config 125m --curve 1000 --batch 4`: each kernel set "
         "trains from the same parameters on the same data (the synthetic Markov chain, whose "
         "floor is ln 8 = 2.08).", ""]
  for (config, device), group in _by_run(rows, "config", "device"):
    base = next((r for r in group if r["kernels"] == "plain"), group[0])
    ref = base["losses"]
    means = lambda losses: [sum(losses[i:i + 50]) / 50 for i in range(len(losses) - 49)]
    ref_means = means(ref)
    out += [f"**{config}** on {device}, batch {base['batch']} × {base.get('seq_len')}, "
            f"{len(ref)} steps", "",
            "| layers | tokens/s | first loss | mean of the last 50 | max \\|Δ\\| vs plain, "
            "50-step means | where |", "|---|---|---|---|---|---|"]
    for r in group:
      losses = r["losses"]
      gaps = [abs(a - b) for a, b in zip(means(losses), ref_means)]
      worst = max(range(len(gaps)), key=gaps.__getitem__) if gaps else 0
      gap = ("— | —" if r is base else
             f"{gaps[worst]:.4f} | steps {worst + 1}–{worst + 50}")
      out.append(f"| {LAYERS.get(r['kernels'], r['kernels'])} | {r['tokens_per_s']:,.0f} | "
                 f"{losses[0]:.4f} | {sum(losses[-50:]) / 50:.4f} | {gap} |")
    out.append("")
  return out


def dw_precision_section() -> list[str]:
  rows = [r for r in load("lce_dw_precision") if r.get("platform") == "gpu"]
  if not rows:
    return []
  out = ["## Linear cross-entropy: gradient error against float32, by tokens per step", "",
         "`python benchmarks/linear_cross_entropy.py --set llama3-8b --dw-precision "
         "16384,32768,65536,131072`: relative Frobenius error of dW and dx against a float32 "
         "(HIGHEST precision) reference, bf16 inputs. `memeff:pallas_mosaic_gpu:dw=float32` "
         "accumulates dW in a float32 [D, V] buffer.", ""]
  for (set_name, device), group in _by_run(rows, "set", "device"):
    providers = list(dict.fromkeys(r["provider"] for r in group))
    tokens = sorted({r["n"] for r in group})
    cell = {(r["provider"], r["n"]): r for r in group}
    out += [f"**{set_name}** (D={group[0]['d']}, V={group[0]['v']}) on {device}", "",
            "| provider | " + " | ".join(f"N={n:,}: dW / dx" for n in tokens) + " |",
            "|---|" + "---|" * len(tokens)]
    for p in providers:
      cells = []
      for n in tokens:
        r = cell.get((p, n))
        cells.append("—" if r is None else r["error"][:20] if "error" in r
                     else f"{r['dw_rel_err']:.2e} / {r['dx_rel_err']:.2e}")
      out.append(f"| {p} | " + " | ".join(cells) + " |")
    out.append("")
  return out


def remat_fit_section() -> list[str]:
  rows = [r for r in load("remat_fit") if r.get("platform") == "gpu"]
  if not rows:
    return []
  out = ["## remat.fit on a train step", "",
         "`python benchmarks/remat_fit.py --config 1b`: every policy compiled (not run); for "
         "each budget the policy `fit` picks, then trained in a fresh process. Matmul GFLOP: "
         "counted on the step's jaxpr (scanned layers × their count, Pallas kernels by their "
         "cost estimate), what fit ranks by. XLA GFLOP: the compiled cost analysis, for "
         "contrast: it counts a loop body once, nothing inside a Pallas kernel and, on GPU, "
         "only the matmuls XLA emits as Triton fusions, not its cuBLAS calls; autotuning picks "
         "between them per compile, so the count moves between compiles of one step (the 1b "
         "step's jaxpr holds about 8,000 GFLOP with the forward recomputed) and cannot rank "
         "policies.", ""]
  for (config, batch, device, stamp), group in latest(
      _by_run(rows, "config", "batch", "device", "timestamp"), 3):
    out += [f"**{config}**, batch {batch} × {group[0]['seq_len']}, memeff layers, on {device}, "
            f"{stamp} (jax {group[0]['jax']})", "",
            "| policy | predicted peak (GiB) | matmul GFLOP | XLA GFLOP |", "|---|---|---|---|"]
    for c in group[0]["candidates"]:
      if c.get("error"):
        out.append(f"| {c['name']} | cannot compile: {c['error'][:60]} | | |")
      elif "xla_flops" in c:
        out.append(f"| {c['name']} | {_gib(c['peak_bytes'])} | {c['flops'] / 1e9:,.0f} | "
                   f"{c['xla_flops'] / 1e9:,.1f} |")
      else:  # rows from before the jaxpr count: `flops` was XLA's
        out.append(f"| {c['name']} | {_gib(c['peak_bytes'])} | — | {c['flops'] / 1e9:,.1f} |")
    out += ["", "| budget (GiB) | fit picks | predicted peak (GiB) | measured peak (GiB) | "
            "measured / predicted |", "|---|---|---|---|---|"]
    for r in group:
      if r.get("error"):
        out.append(f"| {_gib(r['budget_bytes'])} | {r['error'][:60]} | | | |")
        continue
      ratio = r.get("measured_over_predicted")
      out.append(f"| {_gib(r['budget_bytes'])} | {r['chosen']} | "
                 f"{_gib(r['predicted_peak_bytes'])} | {_gib(r.get('measured_peak_bytes'))} | "
                 f"{'n/a' if ratio is None else f'{ratio:.3f}'} |")
    out.append("")
  return out


def branches_section() -> list[str]:
  rows = load("branches")
  if not rows:
    return []
  out = ["## Ten independent branches", "",
         "`python benchmarks/branches.py`: relu → [2048×1024]@[1024×4096] → relu → "
         "@[4096×1024] per branch, float32; temporaries of the compiled function (MiB).", ""]
  for (device, stamp), group in latest(_by_run(rows, "device", "timestamp"), 1):
    flags = list(dict.fromkeys(r["xla_flags"] for r in group))
    out += [f"**{device}**, {stamp} (jax {group[0]['jax']})", "",
            "| written as | " + " | ".join(f"{f or 'default flags'}: fwd / fwd+bwd"
                                           for f in flags) + " |",
            "|---|" + "---|" * len(flags)]
    for variant in dict.fromkeys(r["variant"] for r in group):
      cells = []
      for f in flags:
        r = next(r for r in group if r["variant"] == variant and r["xla_flags"] == f)
        cells.append(f"{r['forward'] / 2**20:.0f} / {r['forward_backward'] / 2**20:.0f}")
      out.append(f"| {variant} | " + " | ".join(cells) + " |")
    out.append("")
  return out


def _latest_scaling(rows: list[dict]) -> list[dict]:
  """Each (case, provider)'s rows from its latest run (one timestamp per run) on each host
  (GPU kind and the most GPUs the run used: `host`, e.g. "4 × NVIDIA H200"); a run under
  XLA_FLAGS counts as a provider of its own, named with them."""
  rows = [dict(r, provider=f"{r['provider']} (XLA_FLAGS={r['xla_flags']})")
          if r.get("xla_flags") else r for r in rows]
  widest = {}
  for r in rows:
    widest[r["timestamp"]] = max(widest.get(r["timestamp"], 0), r["devices"])
  rows = [dict(r, host=f"{widest[r['timestamp']]} × {r['device']}") for r in rows]
  last = {}
  for r in rows:
    key = (r["case"], r["provider"], r["host"])
    last[key] = max(last.get(key, ""), r["timestamp"])
  return [r for r in rows if r["timestamp"] == last[(r["case"], r["provider"], r["host"])]]


def scaling_section() -> list[str]:
  rows = _latest_scaling([r for r in load("scaling")
                          if r.get("platform") == "gpu" and not r.get("small")])
  if not rows:
    return []
  out = ["## Scaling over the GPUs of one host", "",
         "`python benchmarks/scaling.py`: Auto meshes under jit, every provider on the same "
         "mesh; each case from its latest run. Weak scaling (attention, loss: a fixed shape "
         "per GPU; the loss with its dW all-reduce, and `:local_dw` without it, every GPU its "
         "own W and dW): efficiency = one GPU's time / n GPUs' time; strong scaling (vocab: "
         "one problem): one GPU's / (n · n GPUs'); "
         "context parallelism (context-*: T tokens per GPU, the sequence n·T over the GPUs): "
         "per-GPU throughput in visible query-key pairs / one GPU's at T; context-train-*: "
         "the 1B train step on one sequence of that length, ms per step, efficiency = "
         "tokens/s per GPU / one GPU's at the same length (ring: memeff:ring).", ""]
  if scaling_plot(ROOT / "docs" / "scaling.png"):
    out += ["![scaling efficiency](../docs/scaling.png)", ""]
  for (host,), group in sorted(_by_run(rows, "host"), key=lambda kv: kv[0][0].split(" × ")[::-1],
                               reverse=True):
    counts = sorted({r["devices"] for r in group})
    out += [f"**{host}** (jax {group[0]['jax']})", "",
            "| case | provider | " + " | ".join(f"{n} GPU ms (eff.)" for n in counts)
            + " | run |", "|---|---|" + "---|" * (len(counts) + 1)]
    cells = {(r["case"], r["provider"], r["devices"]): r for r in group
             if not r.get("device_index")}
    for case, provider in sorted(dict.fromkeys((r["case"], r["provider"]) for r in group),
                                 key=lambda cp: _scaling_order(cp[0])):
      row = []
      for n in counts:
        r = cells.get((case, provider, n))
        eff = "" if r is None or r.get("efficiency") is None else f" ({r['efficiency']:.3f})"
        row.append("—" if r is None else "out of memory" if r.get("error") else
                   f"{r['ms']:.2f}{eff}")
      run = max(r["timestamp"] for r in group if (r["case"], r["provider"]) == (case, provider))
      out.append(f"| {case} | {provider} | " + " | ".join(row) + f" | {run[:10]} |")
    out += [""] + _alone_table(group, cells, counts[-1])
  return out


def _scaling_order(case: str) -> int:
  """Scaling cases in the order scaling.py's docstring lists them (a stable sort keeps each
  family's own order)."""
  ranks = (("attention", 0), ("loss", 1), ("vocab", 2), ("context-train", 4),
           ("context", 3), ("train", 5), ("", 6))  # the first prefix that matches
  return next(rank for prefix, rank in ranks if case.startswith(prefix))


def _alone_table(group: list[dict], cells: dict, widest: int) -> list[str]:
  """Weak scaling's one-GPU case timed alone on each GPU, and the widest mesh's time as a
  fraction of the slowest one's (n GPUs finish when their slowest does)."""
  alone = {}
  for r in group:
    if r["devices"] == 1:
      alone.setdefault((r["case"], r["provider"]), {})[r.get("device_index", 0)] = r["ms"]
  alone = {k: v for k, v in alone.items() if len(v) > 1}
  if not alone:
    return []
  gpus = sorted({i for v in alone.values() for i in v})
  out = ["Each GPU alone (the one-GPU case on GPU i), ms; the widest mesh against the slowest:",
         "", "| case | provider | " + " | ".join(f"GPU {i}" for i in gpus)
         + f" | {widest} GPUs | eff. against the slowest |",
         "|---|---|" + "---|" * (len(gpus) + 2)]
  for (case, provider), times in alone.items():
    wide = cells.get((case, provider, widest))
    widest_cells = ("— | —" if wide is None else
                    f"{wide['ms']:.2f} | {max(times.values()) / wide['ms']:.3f}")
    out.append(f"| {case} | {provider} | " + " | ".join(
        f"{times[i]:.2f}" if i in times else "—" for i in gpus) + f" | {widest_cells} |")
  return out + [""]


def scaling_plot(path) -> bool:
  """Efficiency against GPU count on the GPU kind of the widest runs (of those, the kind with
  the most rows): every case and provider
  from its latest run on the most GPUs; the ops and the train step (left), context
  parallelism (right). False without matplotlib."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return False
  rows = [r for r in _latest_scaling([r for r in load("scaling")
                                      if r.get("platform") == "gpu" and not r.get("small")])
          if r.get("efficiency") is not None]
  if not rows:
    return False
  kinds = collections.Counter(r["device"] for r in rows)
  device = max(rows, key=lambda r: (r["devices"], kinds[r["device"]]))["device"]
  rows = [r for r in rows if r["device"] == device]
  widest = {}
  for r in rows:
    key = (r["case"], r["provider"])
    widest[key] = max(widest.get(key, 0), int(r["host"].split(" × ")[0]))
  curves = {}
  for r in rows:
    if r["host"].startswith(f"{widest[(r['case'], r['provider'])]} × "):
      curves.setdefault((r["case"], r["provider"]), []).append((r["devices"], r["efficiency"]))
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
  for ax in axes:  # more curves than the default cycle's ten colours
    ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
  for (case, provider), points in curves.items():
    if len(points) < 2:
      continue
    ax = axes[1] if case.startswith("context") else axes[0]
    points.sort()
    ax.plot(*zip(*points), marker="o", linestyle="-" if provider == "memeff" else "--",
            label=f"{case} ({provider})")
  for ax, title in zip(axes, (f"data, vocab and model parallel ({device})",
                              f"context parallel ({device})")):
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set(title=title, xlabel="GPUs", xticks=sorted({r["devices"] for r in rows}))
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=6)
  axes[0].set_ylabel("efficiency (see RESULTS.md)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def torch_bridge_section() -> list[str]:
  rows = load("torch_bridge")
  if not rows:
    return []
  out = ["## PyTorch bridge", "",
         "`python benchmarks/torch_bridge.py`: every provider in a fresh process; extra memory "
         "= torch's max_memory_allocated over the inputs + JAX's peak_bytes_in_use over its "
         "start − the gradient outputs. jax_direct is the same JAX function on JAX arrays "
         "(its extra memory: XLA temporaries). ms: each step from an idle GPU; queued ms "
         "(where measured): the step queued behind 20 ms of matmuls, as behind a model's "
         "forward, which hides the host's latency to the first kernel; for attention, a few "
         "ms long, those matmuls also leave the GPU at a lower clock (power cap), so every "
         "provider's queued time is longer than its idle one there.", ""]
  for (op, device, stamp), group in latest(_by_run(rows, "op", "device", "timestamp"), 2):
    attention = op.endswith("attention")
    queued = any("queued_ms" in r for r in group)
    head = ("| provider | causal | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |"
            if attention else "| provider | ms | × floor | TFLOP/s |") + (
                " queued ms |" if queued else "")
    out += [f"**{op}** on {device}, {stamp} (jax {group[0]['jax']}, torch "
            f"{group[0].get('torch', '?')})", "",
            head + " torch peak (GiB) | JAX peak (GiB) | extra (GiB) |",
            "|---" * ((9 if attention else 7) + queued) + "|"]
    for r in group:
      if "error" in r:
        out.append(f"| {r['provider']} | error: {r['error'][:60]} |")
        continue
      if attention:
        cells = (f"{r.get('causal')} | {r['fwd_ms']:.2f} | {r['fwd_tflops']:.0f} | "
                 f"{r['ms']:.2f} | {r['tflops']:.0f}")
      else:
        ratio = r.get("ratio_to_floor")
        cells = f"{r['ms']:.2f} | {'—' if ratio is None else f'{ratio:.3f}'} | {r['tflops']:.0f}"
      if queued:
        cells += f" | {r['queued_ms']:.2f}" if r.get("queued_ms") is not None else " | —"
      out.append(f"| {r['provider']} | {cells} | {_gib(r.get('torch_peak_bytes'))} | "
                 f"{_gib(r.get('jax_peak_bytes'))} | {_gib(r.get('extra_bytes'))} |")
    for r in group:
      if r.get("bridge_overhead") is not None:
        causal = f" (causal={r['causal']})" if attention else ""
        out.append(f"\nBridge overhead{causal} (memeff vs jax_direct): "
                   f"{r['bridge_overhead']:+.2%}.")
    out.append("")
  return out


def main():
  rows = load("linear_cross_entropy")
  lines = ["# Benchmark results", "",
           "Generated by `python benchmarks/make_results.py` from `benchmarks/results/*.jsonl`;"
           " do not edit by hand. Each table is the latest run of its case on its GPU: every "
           "provider measured side by side in one process, ratios against the three-matmul "
           "floor (or the best JAX attention peer) of that same run. Extra "
           "memory: XLA's temporary bytes for JAX providers, peak allocation over inputs and "
           "gradient outputs for torch ones.", "", "## linear_cross_entropy", ""]
  heads = heads_section(rows)
  if heads:
    lines += ["`python benchmarks/linear_cross_entropy.py --set heads`: the default against "
              "the three-matmul floor, each head's latest run.", ""] + heads
  latest = {}  # device -> (key, group)
  for key, group in runs(rows):
    lines += [run_heading(key, group), "", lce_table(group), ""]
    # The README shows the latest comparison run on each GPU kind: one that timed the
    # default provider next to the JAX and torch peers.
    providers = {r["provider"] for r in group}
    if key[0] == "llama3-8b" and {"memeff", "jax_naive", "torch_compile"} <= providers:
      latest.setdefault(key[1], (key, group))
  fa_rows = load("flash_attention")
  lines += ["## flash_attention", "",
            "TFLOP/s count 4·B·H·T·S·D for the forward (halved when causal) and 2.5× that for "
            "the backward; the window and packed sets (from 2026-11-21T22:30) count 4·H·D per "
            "(query, key) pair their mask lets through. JAX peers: jax.nn.dot_product_attention "
            "(xla, cudnn, cudnn:deterministic: cuDNN with XLA's nondeterministic ops excluded) "
            "and tokamax; torch peers: scaled_dot_product_attention on its cuDNN and flash "
            "backends. A shape's table leaves once a later run of any set on that GPU has "
            "measured each of its masks again.", ""]
  grid = grid_section(fa_rows)
  if grid:
    lines += ["`python benchmarks/flash_attention.py --set grid`: memeff (default, "
              "deterministic) against cuDNN through jax.nn.dot_product_attention.", ""] + grid
  fa_latest, halves = None, {}
  for key, group in fa_runs(fa_rows):
    lines += [fa_heading(key, group), "", fa_table(group), ""]
    # The README shows the latest headline: a run that timed both masks, or the latest
    # runs of its two halves (one device call each) on one device, if newer.
    if fa_latest is None and key[0] == "headline" and {r["causal"] for r in group} == {False, True}:
      fa_latest = [(key, group)]
    if key[0] in ("headline-noncausal", "headline-causal"):
      halves.setdefault(key[1], {}).setdefault(key[0], (key, group))
  for found in halves.values():
    if len(found) == 2 and (fa_latest is None or min(k[2] for k, _ in found.values())
                            > fa_latest[0][0][2]):
      fa_latest = [found["headline-noncausal"], found["headline-causal"]]
  train_lines, train_summary = train_step_section()
  lines += (train_lines + train_curve_section() + dw_precision_section() + remat_fit_section()
            + scaling_section() + branches_section() + torch_bridge_section())
  (ROOT / "benchmarks" / "RESULTS.md").write_text("\n".join(lines))
  readme = ROOT / "README.md"
  if readme.exists():
    text = readme.read_text()
    if latest:  # H200 first, as the issues' targets quote it
      order = sorted(latest, key=lambda device: ("H200" not in device, device))
      text = readme_block("linear_cross_entropy", text, "\n".join(
          run_heading(*latest[d]) + "\n\n" + lce_table(latest[d][1]) + "\n" for d in order))
    if fa_latest:
      text = readme_block("flash_attention", text, "\n".join(
          fa_heading(*run) + "\n\n"
          + fa_table([r for r in run[1] if r["provider"] in README_ATTENTION]) + "\n"
          for run in fa_latest))
    if train_summary:
      text = readme_block("train_step", text, train_summary)
    readme.write_text(text)
  print(f"wrote benchmarks/RESULTS.md ({len(rows)} + {len(fa_rows)} rows)")


if __name__ == "__main__":
  main()
