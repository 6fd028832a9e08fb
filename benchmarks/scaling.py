"""Both ops on 1, 2, 4, ... devices of one host: every provider side by side on the same mesh.

    python benchmarks/scaling.py [--devices 1,2,4] [--cases attention,loss,vocab,context,train]
    python benchmarks/scaling.py --devices 1,4 --cases context-train
    python benchmarks/scaling.py --devices 1,2 --cases context-train --lengths 655360 --steps 2
    python benchmarks/scaling.py --devices 1,2 --cases train --match 'tensor$'

Cases (Auto meshes under jax.jit; the inputs sharded, the code single-device):
  attention  weak scaling, data parallel: B=4, T=4096, H=32, D=128 bf16 per device, the batch
             over "data"; fwd+bwd of memeff, and jax.nn.dot_product_attention on cuDNN (GPU)
             or XLA, both masks. Efficiency: one device's time / n devices' time.
  loss       weak scaling, data parallel: N=16,384 tokens per device at Llama-3-8B's head
             (D=4096, V=128,256), W replicated; fwd+bwd of memeff and the plain XLA loss
             (x @ W, optax), each with the dW all-reduce the step pays; that all-reduce of a
             [D, V] bf16 array is also timed alone ("dw_allreduce"), and each loss without
             it (":local_dw": every device its own copy of W and its own dW).
  vocab      strong scaling, vocab parallel: N=16,384 tokens in all, W's vocabulary over
             "tensor"; memeff. Efficiency: one device's time / (n · n devices' time).
  context    context parallelism: B=1, T = 8k and 32k tokens per device (the sequence n·T over
             "context", inside shard_map), GQA 32:8, D=128 bf16, fwd+bwd; causal in the
             contiguous and the zig-zag order, packed 4k-token documents (zig-zag) and a 4k
             sliding window, by the all-gather strategy, and the last three by the ring;
             and the packed documents in the contiguous order with a 4k left window, which
             leaves their mask as it is and has either strategy move only a 4k halo.
             Efficiency: per-device throughput in visible query-key pairs against one
             device's at the same T (pairs, not tokens: a causal sequence n times longer
             holds n² times the pairs); one device also runs cuDNN.
  train      the 1B model's train step (batch 4 × 4096 per data shard), memeff and plain
             (cuDNN attention) layers, on data × fsdp and fsdp × tensor meshes
             (models.sharding), the latter also with the model's sequence parallelism
             ("fsdp×tensor-sp"); ms per step, efficiency from tokens/s per device. One
             device runs once per layer set, every layout's first row; --match picks layouts.

n devices in weak scaling finish when the slowest one does, so attention's and the loss's
one-device case is also timed alone on each other device (rows with "device_index"):
their spread bounds the efficiency that any code could reach on this host.
  context-train  the 1B model's train step on one sequence of 32k and 128k tokens (or
             --lengths), over a "context" axis of n devices in the zig-zag order
             (all_gather, and the ring at the longest); memeff layers (cuDNN attention
             cannot shard the sequence). Tokens/s per device against one device's at the
             same length, its peak memory, and the first and last losses (the same data and
             parameters on every mesh); ms per step; a length one device cannot hold is
             recorded as out of memory. Each run is a fresh process (train_step.py's, JAX
             given 95% of a GPU as one preallocated pool unless
             XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise), stopped after
             --run-timeout seconds. Not in the default cases.

`--small` runs shapes a CPU can take (tests and a dry run: XLA_FLAGS=
--xla_force_host_platform_device_count=8 before the run). Rows (op="scaling": case,
provider, devices, ms, efficiency) are appended to benchmarks/results/scaling.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import _harness  # noqa: E402
import memeff_jax  # noqa: E402

SHAPES = {
    False: dict(attention=dict(b=4, t=4096, h=32, d=128), loss=dict(n=16384, d=4096, v=128256),
                context=dict(b=1, lengths=(8192, 32768), h=32, hkv=8, d=128, span=4096),
                train=dict(config="1b", batch=4, seq_len=4096, steps=6),
                context_train=dict(config="1b", lengths=(32768, 131072), steps=4)),
    True: dict(attention=dict(b=2, t=256, h=4, d=32), loss=dict(n=512, d=64, v=1024),
               context=dict(b=1, lengths=(256,), h=4, hkv=2, d=32, span=64),
               train=dict(config="tiny", batch=2, seq_len=128, steps=3),
               context_train=dict(config="tiny", lengths=(256, 512), steps=3)),
}

# Train-step meshes per device count: the first axis takes the data, the second splits
# each model copy (fsdp) or its layers (tensor).
# layout -> (the outer axis, the inner axis of 2 devices, the model's sequence parallelism)
TRAIN_MESHES = {"data×fsdp": ("data", "fsdp", False), "fsdp×tensor": ("fsdp", "tensor", False),
                "fsdp×tensor-sp": ("fsdp", "tensor", True)}


def _mesh(n: int, axis: str, first: int = 0):
  """An Auto mesh of one axis over devices first, ..., first + n - 1."""
  return jax.make_mesh((n,), (axis,), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[first:first + n])


def _fwd_bwd(attend):
  """jit of (q, k, v, g, *rest) -> (attend(q, k, v, *rest), its vjp at g for q, k, v)."""
  def f(q, k, v, g, *rest):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, *rest), q, k, v)
    return out, vjp(g)
  return jax.jit(f)


def attention_cases(n: int, shape: dict, causal: bool, first: int = 0):
  """{provider: (fn, args)} at n devices from `first`: per-device batch b, the global batch
  n·b."""
  mesh = _mesh(n, "data", first)
  b, t, h, d = shape["b"] * n, shape["t"], shape["h"], shape["d"]
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  keys = jax.random.split(jax.random.key(0), 4)
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
  q, k, v, g = (put(jax.random.normal(key, (b, t, h, d), dtype)) for key in keys)
  peer = "cudnn" if jax.default_backend() == "gpu" else "xla"
  attends = {
      "memeff": lambda q, k, v: memeff_jax.flash_attention(q, k, v, causal=causal),
      peer: lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                         implementation=peer),
  }

  return {name: (_fwd_bwd(a), (q, k, v, g)) for name, a in attends.items()}


# Context-parallel variants: (mask, token order, strategy).
CONTEXT_VARIANTS = {
    "causal": ("causal", "contiguous", "all_gather"),
    "causal-zigzag": ("causal", "zigzag", "all_gather"),
    "packed-zigzag": ("packed", "zigzag", "all_gather"),
    "window": ("window", "contiguous", "all_gather"),
    "causal-zigzag-ring": ("causal", "zigzag", "ring"),
    "packed-zigzag-ring": ("packed", "zigzag", "ring"),
    "window-ring": ("window", "contiguous", "ring"),
    # documents of at most `span` tokens: a left window of span keys leaves the mask as it is
    # and lets either strategy move only that halo (the order need not balance: the work per
    # token is the same everywhere)
    "packed-bounded": ("packed+window", "contiguous", "all_gather"),
    "packed-bounded-ring": ("packed+window", "contiguous", "ring"),
}


def visible_pairs(length: int, mask: str, span: int) -> int:
  """Query-key pairs a causal mask leaves visible over `length` tokens, with documents
  (`packed`) or a left window (`window`) of `span` tokens."""
  i = np.arange(length, dtype=np.int64)
  packed = i // span * span
  lo = {"causal": 0 * i, "packed": packed, "packed+window": packed,
        "window": np.maximum(i - span, 0)}[mask]
  return int(np.sum(i - lo + 1))


def context_cases(n: int, shape: dict, t: int, variant: str):
  """{provider: (fn, args)}: the sequence n·t over "context" (one device: the plain call)."""
  mask, order, strategy = CONTEXT_VARIANTS[variant]
  mesh = _mesh(n, "context")
  b, length, h, hkv, d = shape["b"], t * n, shape["h"], shape["hkv"], shape["d"]
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  keys = jax.random.split(jax.random.key(2), 4)
  spec = P(None, "context")
  put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
  q, g = (put(jax.random.normal(key, (b, length, h, d), dtype)) for key in keys[:2])
  k, v = (put(jax.random.normal(key, (b, length, hkv, d), dtype)) for key in keys[2:])
  seg = None
  if mask.startswith("packed"):  # document ids in the order the tokens lie in
    ids = (jnp.arange(length) // shape["span"])[None].repeat(b, 0)
    seg = put(memeff_jax.ops.flash_attention.zigzag(ids, n) if n > 1 and order == "zigzag"
              else ids)
  opts = dict(causal=True,
              sliding_window=(shape["span"], 0) if mask.endswith("window") else None)
  if n == 1:
    attend = lambda q, k, v, seg: memeff_jax.flash_attention(q, k, v, q_segment_ids=seg, **opts)
  else:
    attend = jax.shard_map(
        lambda q, k, v, seg: memeff_jax.flash_attention(
            q, k, v, q_segment_ids=seg, context_axis="context", context_order=order,
            context_strategy=strategy, **opts),
        mesh=mesh, in_specs=(spec, spec, spec, None if seg is None else spec), out_specs=spec)

  cases = {"memeff": (_fwd_bwd(attend), (q, k, v, g, seg))}
  if n == 1 and jax.default_backend() == "gpu" and not mask.startswith("packed"):
    cudnn = lambda q, k, v, seg: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn",
        local_window_size=(shape["span"], 0) if mask == "window" else None)
    cases["cudnn"] = (_fwd_bwd(cudnn), (q, k, v, g, seg))
  return cases


def loss_cases(n: int, shape: dict, vocab_parallel: bool, first: int = 0):
  """{provider: (fn, args)} at n devices from `first`: data parallel (tokens n·N over
  "data", W replicated), or vocab parallel (N tokens, W's vocabulary over "tensor")."""
  import optax  # pylint: disable=import-outside-toplevel
  axis = "tensor" if vocab_parallel else "data"
  mesh = _mesh(n, axis, first)
  tokens = shape["n"] * (1 if vocab_parallel else n)
  d, vocab = shape["d"], shape["v"]
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  kx, kw, ky = jax.random.split(jax.random.key(1), 3)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  x = put(jax.random.normal(kx, (tokens, d), dtype), P() if vocab_parallel else P("data"))
  w = put((jax.random.normal(kw, (d, vocab), jnp.float32) / np.sqrt(d)).astype(dtype),
          P(None, "tensor") if vocab_parallel else P())
  y = put(jax.random.randint(ky, (tokens,), 0, vocab), P() if vocab_parallel else P("data"))
  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
  memeff = lambda x, w, y: memeff_jax.linear_cross_entropy(x, w, y)
  cases = {"memeff": (grad(memeff), (x, w, y))}
  if not vocab_parallel:
    plain = lambda x, w, y: optax.softmax_cross_entropy_with_integer_labels(
        (x @ w).astype(jnp.float32), y).mean()
    cases["jax_naive"] = (grad(plain), (x, w, y))
    # The same without the dW all-reduce: each device its own copy of W and its own dW
    # (a stacked [n, D, V], one per device).
    copies = jax.jit(lambda w: jnp.broadcast_to(w, (n, *w.shape)),
                     out_shardings=NamedSharding(mesh, P("data")))(w)
    for name, f in (("memeff", memeff), ("jax_naive", plain)):
      local = jax.shard_map(lambda x, ws, y, f=f: f(x, ws[0], y)[None], mesh=mesh,
                            in_specs=(P("data"),) * 3, out_specs=P("data"))
      cases[f"{name}:local_dw"] = (grad(lambda x, ws, y, local=local: local(x, ws, y).sum()),
                                   (x, copies, y))
    if n > 1:  # the dW all-reduce alone: a [D, V] sum over the data shards
      parts = put(jnp.zeros((n, d, vocab), dtype), P("data"))
      cases["dw_allreduce"] = (jax.jit(lambda p: p.sum(0), out_shardings=NamedSharding(
          mesh, P())), (parts,))
  return cases


def train_rows(shape: dict, devices: list[int], env: dict, out, match: str = "") -> list[dict]:
  """The train step per mesh layout (those whose case name matches `match`) and device
  count: tokens/s per device against the first device count's (batch `shape["batch"]` per
  data shard). One device has no layout: it runs once per layer set, a row of every
  layout."""
  from memeff_jax.cli import _config_path  # pylint: disable=import-outside-toplevel
  # pylint: disable-next=import-outside-toplevel
  from memeff_jax.models import LlamaConfig, run as train_run, sharding
  cfg, train_cfg = LlamaConfig.from_toml(_config_path(shape["config"]))
  shards = lambda sizes: sizes.get("data", 1) * sizes.get("fsdp", 1)  # the batch's
  layouts = {layout: how for layout, how in TRAIN_MESHES.items()
             if re.search(match, f"train-{shape['config']}-{layout}")}

  def per_device(kernels: str, n: int, sizes: dict, sequence_parallel: bool) -> float:
    r = train_run.train(cfg, train_cfg, kernels=kernels, steps=shape["steps"],
                        batch=shape["batch"] * shards(sizes), seq_len=shape["seq_len"],
                        show_progress=False, mesh=sharding.make_mesh(sizes) if sizes else None,
                        sequence_parallel=sequence_parallel)
    return r.tokens_per_s / n

  alone = ({k: per_device(k, 1, {}, False) for k in ("memeff", "plain")}
           if layouts and 1 in devices else {})
  rows, base = [], {}
  for layout, (outer, inner, sequence_parallel) in layouts.items():
    for n in devices:
      sizes = {outer: max(n // 2, 1), inner: 2} if n > 1 else {}
      for kernels in ("memeff", "plain"):
        rate = alone[kernels] if n == 1 else per_device(kernels, n, sizes, sequence_parallel)
        first = base.setdefault((layout, kernels), rate)
        ms = 1e3 * shape["batch"] * shards(sizes) * shape["seq_len"] / (rate * n)
        row = dict(op="scaling", case=f"train-{shape['config']}-{layout}", provider=kernels,
                   devices=n, mesh=sizes, ms=ms, tokens_per_s_per_device=rate,
                   efficiency=rate / first, **env)
        rows.append(row)
        _harness.append(out, [row])
        print(f"  {row['case']:18s} {kernels:13s} {n} devices: {ms:9.1f} ms/step, "
              f"{rate:,.0f} tokens/s per device  efficiency {row['efficiency']:.3f}",
              flush=True)
  return rows


def context_train_rows(shape: dict, devices: list[int], env: dict, out,
                       timeout: float | None = None) -> list[dict]:
  """The train step with one sequence over a "context" axis (zig-zag order): tokens/s per
  device at each length against one device's, peak memory and losses. Each run is a fresh
  process (train_step.measure): one that runs out of memory leaves nothing behind for the
  next, and one not done within `timeout` seconds (a device out of memory can leave the
  others waiting in a collective) is recorded as such."""
  from benchmarks import train_step  # pylint: disable=import-outside-toplevel
  rows, longest = [], max(shape["lengths"])
  for seq_len in shape["lengths"]:
    base, label = None, f"{seq_len // 1024}k" if seq_len >= 1024 else str(seq_len)
    for n in sorted(devices):  # one device first: the others' efficiency is against it
      strategies = ["all_gather"] + (["ring"] if n > 1 and seq_len == longest else [])
      for strategy in strategies:
        row = dict(op="scaling", case=f"context-train-{shape['config']}-{label}",
                   provider="memeff" if strategy == "all_gather" else "memeff:ring", devices=n,
                   seq_len=seq_len, **env)
        failures = []
        r = train_step.measure(shape["config"], "memeff", 1, shape["steps"], seq_len,
                               mesh=f"context={n}" if n > 1 else None, timeout=timeout,
                               context=("zigzag", strategy), failures=failures)
        where = f"  {row['case']:22s} {row['provider']:18s} {n} devices:"
        if r is None:
          row.update(error=failures[-1])
          print(f"{where} {row['error']}", flush=True)
        else:
          per_device = r["tokens_per_s"] / n
          base = per_device if n == 1 else base
          row.update(ms=1e3 * seq_len / r["tokens_per_s"], tokens_per_s_per_device=per_device,
                     efficiency=None if base is None else per_device / base,
                     peak_bytes=r["peak_bytes"], memory_limit_bytes=r["bytes_limit"],
                     first_loss=r["first_loss"], last_loss=r["last_loss"])
          print(f"{where} {row['ms']:9.1f} ms/step, {per_device:,.0f} tokens/s per device, "
                f"peak {(r['peak_bytes'] or 0) / 2**30:.1f} GiB, losses "
                f"{r['first_loss']:.4f} → {r['last_loss']:.4f}", flush=True)
        rows.append(row)
        _harness.append(out, [row])
  return rows


def op_plans(cases: list[str], shapes: dict) -> list[tuple]:
  """(case name, make(n, first=0) -> {provider: (fn, args)}, work(n): the problem's size) of
  each op case (attention, loss, vocab, context; train and context-train are rows of their
  own)."""
  plans = []
  for case in cases:
    if case == "attention":
      plans += [("attention" + ("-causal" if c else ""), functools.partial(
          attention_cases, shape=shapes["attention"], causal=c), float) for c in (False, True)]
    elif case in ("loss", "vocab"):
      plans.append((case, functools.partial(loss_cases, shape=shapes["loss"],
                                            vocab_parallel=case == "vocab"),
                    (lambda n: 1.0) if case == "vocab" else float))
    elif case == "context":
      shape = shapes["context"]
      for t in shape["lengths"]:
        for variant, (mask, *_) in CONTEXT_VARIANTS.items():
          work = functools.partial(lambda n, t, mask: visible_pairs(n * t, mask, shape["span"]),
                                   t=t, mask=mask)
          label = f"{t // 1024}k" if t >= 1024 else str(t)
          plans.append((f"context-{variant}-{label}", functools.partial(
              context_cases, shape=shape, t=t, variant=variant), work))
    elif case not in ("train", "context-train"):
      raise ValueError(f"unknown case {case!r} (attention, loss, vocab, context, train, "
                       "context-train)")
  return plans


def run(cases: list[str], devices: list[int], rounds: int, small: bool, out,
        match: str = "", lengths: tuple[int, ...] | None = None,
        steps: int | None = None, run_timeout: float | None = None) -> list[dict]:
  env, rows = _harness.environment(), []
  shapes = SHAPES[small]
  if lengths:
    shapes = dict(shapes, context_train=dict(shapes["context_train"], lengths=lengths))
  if steps:
    shapes = dict(shapes, **{c: dict(shapes[c], steps=steps) for c in ("train", "context_train")})
  plans = op_plans(cases, shapes)
  if "train" in cases:
    rows += train_rows(shapes["train"], devices, env, out, match)
  if "context-train" in cases:
    rows += context_train_rows(shapes["context_train"], devices, env, out, run_timeout)
  for name, make, work in [p for p in plans if re.search(match, p[0])]:
    base = {}  # provider: throughput per device (work per ms) at the first device count
    # Weak scaling's n devices finish with the slowest of them: one device's case is also
    # timed alone on every other device of the largest mesh (rows with device_index).
    alone = range(1, max(devices)) if name.startswith(("attention", "loss")) else ()
    # Calls of a few milliseconds run back to back between waits, as in a train step: one
    # wait per call would charge each call the host's round trip to every device.
    inner = 1 if name.startswith(("loss", "vocab")) else 4
    runs = [(n, 0) for n in devices]
    if devices[0] == 1:
      runs[1:1] = [(1, i) for i in alone]
    for n, first_device in runs:
      providers = make(n, first=first_device) if first_device else make(n)
      timers = {p: functools.partial(_harness.time_jax, fn, *args, reps=5, inner=inner)
                for p, (fn, args) in providers.items()}
      times = _harness.interleaved(timers, rounds)
      for provider, ts in times.items():
        ms = float(np.median(ts))
        rate = work(n) / (ms * n)
        first = base.setdefault(provider, rate if n == devices[0] else None)
        eff = None if first is None or first_device else rate / first
        row = dict(op="scaling", case=name, provider=provider, devices=n, ms=ms,
                   efficiency=eff, small=small, rounds=rounds, inner=inner, **env,
                   **({"device_index": first_device} if first_device else {}))
        rows.append(row)
        _harness.append(out, [row])
        where = f"device {first_device} alone" if first_device else f"{n} devices"
        print(f"  {name:18s} {provider:13s} {where}: {ms:9.3f} ms"
              + ("" if eff is None else f"  efficiency {eff:.3f}"), flush=True)
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--devices", default=None, help="device counts (default: 1, 2, 4, ...)")
  parser.add_argument("--cases", default="attention,loss,vocab,context,train")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--small", action="store_true", help="CPU-sized shapes")
  parser.add_argument("--match", default="", help="only the cases whose name has a match for "
                      "this regular expression (e.g. 'zigzag-8k', 'tensor')")
  parser.add_argument("--lengths", default="", help="context-train's sequence lengths, e.g. "
                      "393216 (one that a single device cannot hold; default 32k and 128k)")
  parser.add_argument("--steps", type=int, default=None, help="train and context-train steps "
                      "(default 6 and 4; at least 2: the first one compiles)")
  parser.add_argument("--run-timeout", type=float, default=None, metavar="SECONDS",
                      help="context-train: a run not done by then is recorded as timed out")
  parser.add_argument("--out", default=str(_harness.RESULTS / "scaling.jsonl"))
  args = parser.parse_args(argv)
  if args.steps is not None and args.steps < 2:
    parser.error(f"--steps must be at least 2 (the first step compiles), got {args.steps}")
  counts = ([int(c) for c in args.devices.split(",")] if args.devices else
            [c for c in (1, 2, 4, 8) if c <= jax.device_count()])
  if max(counts) > jax.device_count():
    raise SystemExit(f"--devices {args.devices}: this process sees {jax.device_count()}")
  print(f"scaling on {jax.device_count()} × {jax.devices()[0].device_kind}")
  run(args.cases.split(","), counts, args.rounds, args.small, args.out, args.match,
      tuple(int(t) for t in args.lengths.split(",") if t), args.steps, args.run_timeout)


if __name__ == "__main__":
  main()
