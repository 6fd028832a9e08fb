"""Where a case's GPU time goes: kernel by kernel, on each GPU, from a JAX profile.

    python benchmarks/profile_kernels.py --case attention-causal --devices 1,4
    python benchmarks/profile_kernels.py --case loss --devices 4 --provider memeff:local_dw
    python benchmarks/profile_kernels.py --case context-window-ring-32k --devices 2
    python benchmarks/profile_kernels.py --attention b=4,t=4096,h=64,d=64,causal=1
    python benchmarks/profile_kernels.py --loss n=16384,d=2304,v=256000
    python benchmarks/profile_kernels.py --train 1b --mesh fsdp=2,tensor=2

--case names one of scaling.py's op cases (its shapes; --small for a CPU's), --attention
one GPU's attention forward+backward at a shape (flash_attention.py's providers), --loss one
GPU's linear cross-entropy and its gradients at a head (linear_cross_entropy.py's); after two
warm-up calls, --calls calls run under `jax.profiler.trace`, each waited for, as
scaling.py times them. --train profiles that many steps of the model's train step
(models.run, --mesh as `memeff-jax train` takes it; the first step compiles, then runs the
same kernels as the others).

Per call: its time as the host sees it; the compiled program's collectives (op, shape and
dtype, count); per GPU, busy time (at least one kernel running, over all streams) and the
kernels by total time, collectives (NCCL) apart, with the part of the collectives' time in
which no other kernel ran, copies aside (exposed: the call waits on it). A GPU whose busy
time is the one-GPU figure while the call takes longer waits (launches, host syncs, other
GPUs); busy time that grows with the GPU count is slower kernels. Summaries go to --out as
JSON lines.
"""

from __future__ import annotations

import argparse
import glob
import json
import pathlib
import re
import statistics
import sys
import tempfile
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import scaling  # noqa: E402

ALL_CASES = ["attention", "loss", "vocab", "context"]


def _union_ns(intervals: list[tuple[int, int]]) -> int:
  """The length of the union of [start, end) intervals."""
  total, reach = 0, None
  for start, end in sorted(intervals):
    if reach is None or start > reach:
      total, reach = total + end - start, end
    elif end > reach:
      total, reach = total + end - reach, end
  return total


def summarize(data: jax.profiler.ProfileData, calls: int, top: int = 12) -> dict[str, dict]:
  """{GPU plane: {busy_ms, kernels: [(name, ms, launches)], collectives_ms}} per call, from
  the kernels on the planes' stream lines (a profile's derived lines, such as "XLA Ops",
  repeat them and are skipped)."""
  out = {}
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    events = [(e.name, e.start_ns, e.end_ns) for line in plane.lines
              if line.name.startswith("Stream") for e in line.events]
    if not events:
      continue
    kernels = {}
    for name, start, end in events:
      total = kernels.setdefault(name, [0, 0])
      total[0], total[1] = total[0] + end - start, total[1] + 1
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    collective = lambda name: "nccl" in name.lower()
    # Kernels that do the call's work: neither collectives nor copies (memcpy, memset).
    computing = [(s, e) for n, s, e in events
                 if not collective(n) and not n.startswith(("Memcpy", "Memset"))]
    collectives = [(s, e) for n, s, e in events if collective(n)]
    exposed = _union_ns(computing + collectives) - _union_ns(computing)
    out[plane.name] = dict(
        busy_ms=_union_ns([(s, e) for _, s, e in events]) / 1e6 / calls,
        collectives_ms=sum(t for n, (t, _) in kernels.items() if collective(n)) / 1e6 / calls,
        exposed_collectives_ms=exposed / 1e6 / calls,
        kernels=[(n, t / 1e6 / calls, c / calls) for n, (t, c) in ranked[:top]])
  return out


def collectives(text: str) -> dict[str, int]:
  """{"op shape": count} of a compiled program's collectives (its HLO text): what moves,
  in which dtype, how often."""
  found = {}
  for shape, op in re.findall(r"= (\(?[^=]*?\)?) (all-gather|all-reduce|reduce-scatter|"
                              r"all-to-all|collective-permute)(?:-start)?\(", text):
    key = f"{op} {re.sub(r'[{][^}]*[}]', '', shape)}"
    found[key] = found.get(key, 0) + 1
  return dict(sorted(found.items()))


def profile(fn, calls: int) -> tuple[jax.profiler.ProfileData, float]:
  """fn() run `calls` times under the profiler, each call waited for: its profile, and the
  median milliseconds from a call's dispatch to its end as the host sees them (the profiler
  adds a little)."""
  times = []
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir):
      for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(1e3 * (time.perf_counter() - start))
    path, = glob.glob(f"{log_dir}/plugins/profile/*/*.xplane.pb")
    return jax.profiler.ProfileData.from_file(path), statistics.median(times)


def _print(title: str, summary: dict[str, dict], moved: dict[str, int]) -> None:
  print(title)
  for what, count in moved.items():
    print(f"  {count:4d}× {what}")
  if not summary:
    print("  no GPU kernels in the profile (a CPU run has none)")
  for plane, s in summary.items():
    print(f"  {plane}: busy {s['busy_ms']:.3f} ms per call, collectives "
          f"{s['collectives_ms']:.3f} ms ({s['exposed_collectives_ms']:.3f} ms of it with no "
          "other kernel running)")
    for name, ms, launches in s["kernels"]:
      print(f"    {ms:9.3f} ms  {launches:6.1f}×  {name[:100]}")


def _case(name: str, small: bool):
  plans = {p[0]: p[1] for p in scaling.op_plans(ALL_CASES, scaling.SHAPES[small])}
  if name not in plans:
    raise SystemExit(f"--case {name!r}: one of {', '.join(plans)}")
  return plans[name]


def _one_device(cases: dict, flag: str):
  """make(n) -> cases, for one device only."""
  def make(n):
    if n != 1:
      raise SystemExit(f"{flag} runs on one device, not {n}")
    return cases
  return make


def _attention(shape: str, provider: str | None):
  """make(n) -> {provider: (fwd+bwd, args)} of flash_attention.py's providers (memeff and
  cudnn on a GPU, memeff and xla elsewhere, or --provider) at `shape` on one device."""
  # pylint: disable-next=import-outside-toplevel
  from benchmarks.flash_attention import attention_fn, inputs, window_of
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  sizes = {k: int(v) for k, v in (part.split("=") for part in shape.split(","))}
  causal = bool(sizes.pop("causal", 1))
  unknown = set(sizes) - {"b", "t", "s", "h", "d", "hkv", "docs", "window"}
  if unknown:
    raise SystemExit(f"--attention: unknown sizes {sorted(unknown)} (b, t, s, h, d, hkv, "
                     "window, causal)")
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  q, k, v, ct, seg = inputs(sizes, dtype)
  window = window_of(sizes, causal)
  peer = "cudnn" if jax.default_backend() == "gpu" else "xla"
  cases = {}
  for name in [provider] if provider else ["memeff", peer]:
    f = attention_fn(name, causal, seg, window)
    if f is not None:  # (the peers take no segment ids)
      cases[name] = (jax.jit(lambda q, k, v, f=f: jax.vjp(f, q, k, v)[1](ct)), (q, k, v))
  return _one_device(cases, "--attention")


def _loss(shape: str, provider: str | None):
  """make(n) -> {provider: (loss and grads, args)} of linear_cross_entropy.py's JAX providers
  (memeff, the three-matmul floor and plain XLA, or --provider: any of them, memeff's
  options included) at `shape` (n tokens, d, v) on one device."""
  # pylint: disable-next=import-outside-toplevel
  from benchmarks.linear_cross_entropy import jax_case, make_inputs
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  sizes = {k: int(v) for k, v in (part.split("=") for part in shape.split(","))}
  if set(sizes) != {"n", "d", "v"}:
    raise SystemExit(f"--loss: give n, d and v (e.g. n=16384,d=2304,v=256000), got {shape!r}")
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  inputs = make_inputs(sizes["n"], sizes["d"], sizes["v"], dtype)
  names = [provider] if provider else ["memeff", "floor", "jax_naive"]
  cases = {name: jax_case(name, *inputs) for name in names}
  return _one_device(cases, "--loss")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--case", help="a scaling.py op case, e.g. attention-causal")
  p.add_argument("--devices", default="1", help="device counts, e.g. 1,4")
  p.add_argument("--provider", default=None, help="only this provider (default: all)")
  p.add_argument("--attention", metavar="SHAPE", help="one GPU's attention fwd+bwd at a shape "
                 "of configs/benchmarks/flash_attention.toml's kind, e.g. b=4,t=4096,h=64,d=64,"
                 "causal=1 (also hkv, docs, window)")
  p.add_argument("--loss", metavar="SHAPE", help="one GPU's linear cross-entropy with its "
                 "gradients at a head, e.g. n=16384,d=2304,v=256000: memeff, the three-matmul "
                 "floor and plain XLA (--provider: one of linear_cross_entropy.py's JAX ones)")
  p.add_argument("--train", metavar="CONFIG", help="profile the model's train step instead")
  p.add_argument("--mesh", default=None, help="with --train: e.g. fsdp=2,tensor=2")
  p.add_argument("--kernels", default="memeff", help="with --train: memeff or plain")
  p.add_argument("--sequence-parallel", action="store_true",
                 help="with --train and a tensor axis: the model's sequence parallelism")
  p.add_argument("--calls", type=int, default=5)
  p.add_argument("--top", type=int, default=12, help="kernels listed per GPU")
  p.add_argument("--small", action="store_true", help="CPU-sized shapes")
  p.add_argument("--out", default=None, help="append the summaries here as JSON lines")
  args = p.parse_args(argv)
  if sum(map(bool, (args.case, args.train, args.attention, args.loss))) != 1:
    raise SystemExit("give one of --case, --attention, --loss or --train")
  rows = []
  if args.train:
    rows.append(_train_row(args))
  else:
    if args.case:
      make, name = _case(args.case, args.small), args.case
    elif args.attention:
      make, name = _attention(args.attention, args.provider), f"attention {args.attention}"
    else:
      make, name = _loss(args.loss, args.provider), f"loss {args.loss}"
    for n in (int(c) for c in args.devices.split(",")):
      for provider, (fn, fn_args) in make(n).items():
        if args.provider not in (None, provider):
          continue
        compiled = fn.lower(*fn_args).compile()  # run below as compiled, not again by jit
        for _ in range(2):
          jax.block_until_ready(compiled(*fn_args))
        data, wall_ms = profile(lambda c=compiled, a=fn_args: c(*a), args.calls)
        summary = summarize(data, args.calls, args.top)
        moved = collectives(compiled.as_text())
        _print(f"{name} {provider} on {n} devices: {wall_ms:.3f} ms per call", summary, moved)
        rows.append(dict(case=name, provider=provider, devices=n, wall_ms=wall_ms,
                         collectives=moved, gpus=summary))
  if args.out:
    with open(args.out, "a", encoding="utf-8") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")


def _train_row(args) -> dict:
  """The train step's kernels per step, over `calls` steps (the first one compiles, then
  runs the same kernels)."""
  # pylint: disable-next=import-outside-toplevel
  from memeff_jax.cli import _config_path
  # pylint: disable-next=import-outside-toplevel
  from memeff_jax.models import LlamaConfig, run, sharding
  cfg, train_cfg = LlamaConfig.from_toml(_config_path(args.train))
  sizes = sharding.parse_mesh(args.mesh) if args.mesh else {}
  mesh = sharding.make_mesh(sizes) if sizes else None
  batch = train_cfg["batch"] * sizes.get("data", 1) * sizes.get("fsdp", 1)
  moved = {}
  with tempfile.TemporaryDirectory() as log_dir:
    jax.profiler.start_trace(log_dir)
    result = run.train(cfg, train_cfg, kernels=args.kernels, steps=args.calls, batch=batch,
                       seq_len=train_cfg["seq_len"], show_progress=False, mesh=mesh,
                       sequence_parallel=args.sequence_parallel,
                       on_compiled=lambda c, _: moved.update(collectives(c.as_text())))
    jax.profiler.stop_trace()
    path, = glob.glob(f"{log_dir}/plugins/profile/*/*.xplane.pb")
    summary = summarize(jax.profiler.ProfileData.from_file(path), args.calls, args.top)
  sp = ", sequence parallel" if args.sequence_parallel else ""
  _print(f"train step of {args.train} ({args.kernels} layers) on {args.mesh or 'one device'}"
         f"{sp}, {result.tokens_per_s:,.0f} tokens/s", summary, moved)
  return dict(train=args.train, kernels=args.kernels, mesh=args.mesh,
              sequence_parallel=args.sequence_parallel,
              tokens_per_s=result.tokens_per_s, collectives=moved, gpus=summary)


if __name__ == "__main__":
  main()
