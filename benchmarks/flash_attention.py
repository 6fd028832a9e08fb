"""Attention forward and forward+backward: every provider side by side in one run.

    python benchmarks/flash_attention.py --set headline [--providers a,b,...]

Providers: memeff (default implementation, deterministic backward), memeff:nondeterministic
(default implementation with deterministic=False: on Hopper the one-pass Mosaic backward),
memeff:NAME[:key=value] (e.g. memeff:pallas_triton:block_q=128,
memeff:pallas_mosaic_gpu:bwd=triton or :bwd_dq_split=0; a Mosaic backward runs with
deterministic=False), memeff:tuned:key=value (the default dispatch, deterministic, with
fields of the Mosaic configs it picks replaced: bwd_KEY of the backward's, KEY of the
forward's; e.g. memeff:tuned:bwd_dq_heavy_first=0 beside memeff times one tuned setting on
every shape of a set), xla and cudnn (jax.nn.dot_product_attention; packed documents on
cudnn through its packed layout, jax's cuDNN attention with sequence lengths and offsets),
cudnn:deterministic (cudnn compiled with XLA's nondeterministic ops excluded: its backward
otherwise adds dq in arrival order, and its gradients differ from call to call),
rows:PROVIDER (a JAX provider on packed documents of equal length cut into rows of their
own, [B, T] as [B·m, T / m]: what a caller who does not pack runs; the same visible pairs),
tokamax:mosaic and tokamax:triton (if importable), and on CUDA torch's
scaled_dot_product_attention on one of its backends: torch:cudnn, torch:flash,
torch:efficient (if torch imports). A provider that cannot express a case (segment ids for
xla, tokamax and torch, a window for torch) is skipped with a note. memeff:chunked_xla is
not in the default list: on a GPU it compiles for minutes at T=4096 (memeff is chunked_xla
on CPU anyway).

TFLOP/s count 4·B·H·T·S·D for the forward (halved when causal; with a sliding window or
packed documents, 4·H·D per visible (query, key) pair) and 2.5× that for the backward;
extra memory is XLA's temporary bytes of the compiled forward+backward; on a GPU the SM clock
and instant board power over the provider's timed forward and forward+backward calls
(sm_mhz, power_w and the count of samples they average, gpu_samples: _harness.GpuSampler).
Every provider of a case is compiled first; then `--rounds R` interleaved rounds time each once
per round (the order rotated each round), and each figure is the median over rounds: the GPU's
clock drifts under sustained load, and providers timed one after another carry that drift into
their ratios. A JAX provider's calls are queued in batches of about 20 ms and waited for once:
a call queued behind the rest of a train step is not charged the host's round trip (the torch
peers start behind queued matmuls for the same reason). Rows are appended to
benchmarks/results/flash_attention.jsonl (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import pathlib
import sys
import traceback
from typing import NamedTuple
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import _harness  # noqa: E402
from memeff_jax.ops import flash_attention as fa  # noqa: E402
from memeff_jax.ops.flash_attention import masks  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward, pallas_mosaic_gpu  # noqa: E402
from memeff_jax.ops.flash_attention.masks import MaskSpec  # noqa: E402

DEFAULT_PROVIDERS = ("memeff,memeff:nondeterministic,xla,cudnn,cudnn:deterministic,rows:cudnn,"
                     "tokamax:mosaic,tokamax:triton,torch:cudnn,torch:flash")
# XLA options of a provider's programs: cudnn:deterministic's make cuDNN's backward
# bitwise repeatable (XLA's GPU determinism switch, per program rather than per process).
COMPILER_OPTIONS = {"cudnn:deterministic": {"xla_gpu_exclude_nondeterministic_ops": True}}
ROWS = "rows:"  # a provider's prefix: packed documents run as rows of their own
# torch providers: scaled_dot_product_attention held to one of these SDPBackend members.
TORCH_BACKENDS = {"torch:cudnn": "CUDNN_ATTENTION", "torch:flash": "FLASH_ATTENTION",
                  "torch:efficient": "EFFICIENT_ATTENTION", "torch:math": "MATH"}
# Each torch call is timed queued behind this much GPU work, so that, as for the JAX
# providers' batches of calls, the host's dispatch is not charged to it.
TORCH_LEAD_MS = 2.0


class Tuned(NamedTuple):
  """memeff:tuned's fields of the forward's and the backward's Mosaic configs."""
  forward: dict
  backward: dict


@contextlib.contextmanager
def tuned_fields(tuned: Tuned):
  """While a call is traced: the Mosaic configs that the default dispatch picks
  (MosaicConfig.for_call, MosaicBackwardConfig.for_deterministic and for_nondeterministic)
  with tuned's fields replaced; what the dispatch does after them (split_group,
  fit_shared_memory, the support checks) runs as for the default, except that a changed
  config its kernel cannot run is an error, not a fall back to another kernel (a row timing
  pallas_triton under the tuned name). The backward's config is picked with the forward's
  (the custom_vjp's static argument)."""
  with contextlib.ExitStack() as stack:
    for cls, names, fields, checks in (
        (fa.MosaicConfig, ("for_call",), tuned.forward, pallas_mosaic_gpu),
        (fa.MosaicBackwardConfig, ("for_deterministic", "for_nondeterministic"),
         tuned.backward, mosaic_gpu_backward)):
      if not fields:
        continue
      for name in names:
        picked = getattr(cls, name)
        replaced = lambda *a, picked=picked, fields=fields, **kw: dataclasses.replace(
            picked(*a, **kw), **fields)
        stack.enter_context(mock.patch.object(cls, name, staticmethod(replaced)))
      stack.enter_context(mock.patch.object(checks, "support_error",
                                            _refusing(checks.support_error, fields)))
    yield


def _refusing(support_error, fields: dict):
  """support_error that raises where the config with `fields` cannot serve the call."""
  def check(*args, **kwargs):
    if (why := support_error(*args, **kwargs)) is not None:
      raise ValueError(f"memeff:tuned: {fields} do not run here: {why}")
  return check


def _config_fields(opts: dict) -> tuple[dict, dict]:
  """KEY=V options as integer fields of the forward's and (bwd_KEY) the backward's config."""
  return ({k: int(v) for k, v in opts.items() if not k.startswith("bwd_")},
          {k[4:]: int(v) for k, v in opts.items() if k.startswith("bwd_")})


def parse_memeff(provider: str):
  """(implementation, deterministic) of a memeff provider; the implementation is a Tuned
  for memeff:tuned."""
  parts = provider.split(":")
  if len(parts) == 1:
    return None, True
  if parts[1:] == ["nondeterministic"]:
    return None, False
  name, opts = parts[1], dict(p.split("=", 1) for p in parts[2:])
  if name == "tuned":
    return Tuned(*_config_fields(opts)), True
  if name == "pallas_triton" and opts:
    from memeff_jax.ops.flash_attention.pallas_triton import BlockConfig, default_config  # pylint: disable=import-outside-toplevel
    return fa.PallasTriton(config=BlockConfig(**{**default_config(128).__dict__,
                                                 **{k: int(v) for k, v in opts.items()}})), True
  if name == "pallas_mosaic_gpu" and opts:
    # bwd=triton runs pallas_triton's backward (with its D = 128 tiles: the head dim is not
    # known here); bwd_KEY=V sets MosaicBackwardConfig's KEY.
    bwd_kind = opts.pop("bwd", "mosaic")
    fwd, bwd = _config_fields(opts)
    if bwd_kind == "triton":
      from memeff_jax.ops.flash_attention.pallas_triton import default_config  # pylint: disable=import-outside-toplevel
      backward = default_config(128)
    else:
      backward = fa.MosaicBackwardConfig(**bwd) if bwd else None
    return (fa.PallasMosaicGpu(config=fa.MosaicConfig(**fwd) if fwd else None,
                               backward_config=backward), bwd_kind == "triton")
  if opts:
    raise ValueError(f"options {opts} not understood for {provider!r}")
  return name, True


def attention_fn(provider, causal, seg, window=None):
  """f(q, k, v) -> out for a provider, or None where it cannot express the case. `window` is
  a (left, right) sliding window (jax.nn's local_window_size)."""
  if provider.startswith(ROWS):
    docs = None if seg is None else documents_as_rows(seg)
    inner = None if docs is None else attention_fn(provider[len(ROWS):], causal, None, window)
    if inner is None:
      return None

    def attend_rows(q, k, v):
      rows = lambda x: x.reshape(x.shape[0] * docs, x.shape[1] // docs, *x.shape[2:])
      return inner(rows(q), rows(k), rows(v)).reshape(q.shape)
    return attend_rows
  if provider == "cudnn:deterministic":  # cudnn's call; COMPILER_OPTIONS make it repeatable
    provider = "cudnn"
  if provider.startswith("memeff"):
    impl, deterministic = parse_memeff(provider)
    kw = {} if seg is None else dict(q_segment_ids=seg, kv_segment_ids=seg)
    tuned = impl if isinstance(impl, Tuned) else None

    def attend(q, k, v):
      with tuned_fields(tuned) if tuned else contextlib.nullcontext():
        return fa.flash_attention(q, k, v, causal=causal, sliding_window=window,
                                  deterministic=deterministic,
                                  implementation=None if tuned else impl, **kw)
    return attend
  if provider == "cudnn" and seg is not None:
    return cudnn_packed_fn(causal, seg, window)
  if provider in ("xla", "cudnn"):
    if seg is not None:
      return None
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, local_window_size=window, implementation=provider)
  if provider.startswith("tokamax:"):
    if seg is not None:
      return None
    from benchmarks.linear_cross_entropy import import_tokamax  # pylint: disable=import-outside-toplevel
    tokamax = import_tokamax()
    impl = provider.split(":", 1)[1]
    kw = {} if window is None else dict(local_window_size=window)
    return lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal,
                                                         implementation=impl, **kw)
  raise KeyError(provider)


def torch_case(provider, q, k, v, ct, causal, device="cuda"):
  """(fwd, fwd_bwd, leaves) for a torch provider: scaled_dot_product_attention on its one
  backend (TORCH_BACKENDS), on copies of q, k, v in memeff's [B, T, H, D] layout, viewed as
  torch's [B, H, T, D] (the transpose a model makes), K/V heads shared under GQA
  (enable_gqa). fwd() runs the forward without autograd; fwd_bwd() the forward and its
  gradients into the leaves' (q, k, v) cleared .grad, and returns the output."""
  import torch  # pylint: disable=import-outside-toplevel
  from torch.nn.attention import SDPBackend, sdpa_kernel  # pylint: disable=import-outside-toplevel
  backend = getattr(SDPBackend, TORCH_BACKENDS[provider])
  dtype = getattr(torch, jnp.dtype(q.dtype).name)
  copy = lambda x: torch.from_numpy(np.array(x, np.float32)).to(device, dtype)
  leaves = tuple(copy(x).requires_grad_() for x in (q, k, v))
  cotangent = copy(ct).transpose(1, 2)
  gqa = q.shape[2] != k.shape[2]

  def attend():
    with sdpa_kernel(backend):
      return torch.nn.functional.scaled_dot_product_attention(
          *(x.transpose(1, 2) for x in leaves), is_causal=causal, enable_gqa=gqa)

  def fwd():
    with torch.no_grad():
      return attend()

  def fwd_bwd():
    for x in leaves:
      x.grad = None
    out = attend()
    out.backward(cotangent)
    return out

  return fwd, fwd_bwd, leaves


def cudnn_packed_layout(seg):
  """(sequence lengths [B, M], offsets [B, M + 1]) of segment ids [B, T] in the packed layout
  of jax's cuDNN attention: row b's documents start at offsets[b, :m] and run lengths[b, :m]
  tokens, -1 past its m documents (M the most in a row). None where a row's ids are not
  contiguous runs of distinct ids (one id in two runs is one document for segment ids, two
  for the packed layout)."""
  ids = np.asarray(seg)
  b, t = ids.shape
  starts = [np.flatnonzero(np.r_[True, row[1:] != row[:-1]]) for row in ids]
  if any(len(np.unique(row[st])) != len(st) for row, st in zip(ids, starts)):
    return None
  m = max(len(st) for st in starts)
  lengths = np.full((b, m), -1, np.int32)
  offsets = np.full((b, m + 1), -1, np.int32)
  for i, st in enumerate(starts):
    lengths[i, :len(st)] = np.diff(np.r_[st, t])
    offsets[i, :len(st)] = st
  return jnp.asarray(lengths), jnp.asarray(offsets)


def documents_as_rows(seg) -> int | None:
  """m where each row of segment ids [B, T] holds m contiguous documents of T / m tokens
  (so that [B, T] reshapes to [B·m, T / m] with one document a row), else None."""
  layout = cudnn_packed_layout(seg)
  if layout is None:
    return None
  lengths = np.asarray(layout[0])
  docs, t = lengths.shape[1], seg.shape[1]
  return docs if t % docs == 0 and (lengths == t // docs).all() else None


def cudnn_packed_fn(causal, seg, window):
  """f(q, k, v) on cuDNN with the documents of `seg` in its packed layout (what the jax.nn
  entry point cannot express), or None for a window or ids that are not contiguous runs."""
  layout = cudnn_packed_layout(seg)
  if window is not None or layout is None:
    return None
  # pylint: disable-next=import-outside-toplevel
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  lengths, offsets = layout
  mask = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
  return lambda q, k, v: cudnn.dot_product_attention(
      q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
      scale=1.0 / np.sqrt(q.shape[-1]), mask_type=mask)


def document_ids(b: int, t: int, docs: int, seed: int | None = None):
  """[B, T] int32 segment ids of `docs` documents per row: equal ones, or with `seed` of
  random lengths (each row cut at docs − 1 distinct points drawn uniformly), as a packing
  loader leaves them."""
  if seed is None:
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) * docs // t, (b, t))
  rng = np.random.default_rng(seed)
  cuts = np.stack([np.sort(rng.choice(np.arange(1, t), docs - 1, replace=False))
                   for _ in range(b)])
  return jnp.asarray((np.arange(t)[None, None, :] >= cuts[:, :, None]).sum(1), jnp.int32)


def inputs(shape: dict, dtype):
  """(q, k, v, the output's cotangent, segment ids or None) of a shape set's row: b, t, h,
  d, and optionally s, hkv, docs (that many documents per row) and doc_seed (their lengths
  random, drawn with that seed; equal without)."""
  b, t, h, d = shape["b"], shape["t"], shape["h"], shape["d"]
  s, hkv, docs = shape.get("s", t), shape.get("hkv", h), shape.get("docs")
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, h, d), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (b, s, hkv, d), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (b, s, hkv, d), jnp.float32).astype(dtype)
  ct = jax.random.normal(keys[3], q.shape, jnp.float32).astype(dtype)
  seg = None if docs is None else document_ids(b, t, docs, shape.get("doc_seed"))
  return q, k, v, ct, seg


def window_of(shape: dict, causal: bool):
  """A row's `window` keys to the left as a (left, right) pair (a causal mask: none to the
  right), or None."""
  left = shape.get("window")
  return None if left is None else (left, 0 if causal else left)


def visible_pairs(causal, window, seg, b, t, s) -> int:
  """Pairs a masked call computes (all rows of the batch), counted from the mask itself."""
  spec = MaskSpec.make(causal, window, seg is not None)
  ids = None if seg is None else np.asarray(seg)
  total = 0
  for row in range(b):
    ok = np.asarray(masks.visible(spec, jnp.arange(t), jnp.arange(s)))
    if ids is not None:
      ok = ok & (ids[row][:, None] == ids[row][None, :s])
    total += int(ok.sum())
  return total


def torch_timer(provider, row, q, k, v, ct, causal, reps):
  """A torch provider's timer (fwd ms, fwd+bwd ms), its case run first (failing here,
  outside the timing) to set row["extra_bytes"]."""
  fwd, fwd_bwd, leaves = torch_case(provider, q, k, v, ct, causal)
  row["extra_bytes"] = _harness.torch_extra_bytes(fwd_bwd, leaves)
  return lambda: (_harness.time_torch(fwd, reps=reps, lead_ms=TORCH_LEAD_MS),
                  _harness.time_torch(fwd_bwd, reps=reps, lead_ms=TORCH_LEAD_MS))


def selected_shapes(text: str) -> slice | list[int]:
  """--shapes: a Python slice of the set's shapes (`0:3`, `5:`) or their indices (`0,5,6`)."""
  if ":" in text:
    return slice(*(int(i) if i else None for i in text.split(":")))
  return [int(i) for i in text.split(",")]


def run(set_name: str, providers: list[str], out, reps: int, rounds: int = 1,
        shapes: slice | list[int] = slice(None)):
  spec = _harness.shape_sets("flash_attention")[set_name]
  dtype = jnp.dtype(spec.get("dtype", "bfloat16"))
  env = _harness.environment()
  rows = []
  picked = (spec["shapes"][shapes] if isinstance(shapes, slice)
            else [spec["shapes"][i] for i in shapes])
  for shape in picked:
    b, t, h, d = shape["b"], shape["t"], shape["h"], shape["d"]
    s, hkv, docs = shape.get("s", t), shape.get("hkv", h), shape.get("docs")
    q, k, v, ct, seg = inputs(shape, dtype)
    for causal in shape.get("causal", spec.get("causal", [False])):
      window = window_of(shape, causal)
      if window is None and docs is None:
        flops = 4.0 * b * h * t * s * d * (0.5 if causal else 1.0)
      else:  # the (query, key) pairs the window or the documents let through
        flops = 4.0 * h * d * visible_pairs(causal, window, seg, b, t, s)
      cases = {}  # provider -> (row, timer), built and compiled before any timing
      for provider in providers:
        row = dict(op="flash_attention", set=set_name, b=b, t=t, s=s, h=h, hkv=hkv, d=d,
                   docs=docs, doc_seed=shape.get("doc_seed"), window=window, causal=causal,
                   dtype=dtype.name, provider=provider, fwd_bwd_timing="one vjp",
                   rounds=rounds, **env)
        try:
          if provider.startswith("torch:"):
            if env["platform"] != "gpu" or seg is not None or window is not None:
              print(f"  skip {provider}: torch peers run on CUDA, without segment ids or a "
                    "window")
              continue
            cases[provider] = (row, torch_timer(provider, row, q, k, v, ct, causal, reps))
            continue
          base = provider.removeprefix(ROWS)  # the provider that rows: wraps, or itself
          if base.startswith("memeff"):
            row["deterministic"] = parse_memeff(base)[1]
          f = attention_fn(provider, causal, seg, window)
          if f is None:
            print(f"  skip {provider}: cannot express this mask")
            continue
          jit = functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS.get(base))
          fwd = jit(f)
          # The cotangent is an argument, as in a train step: a constant one would be folded
          # into the program (with any padding of it) at compile time.
          step = jit(lambda q, k, v, ct, f=f: jax.vjp(f, q, k, v)[1](ct))

          def fwd_bwd(q, k, v, ct, f=f):  # the output and the gradients of one forward pass
            out, pull = jax.vjp(f, q, k, v)
            return out, pull(ct)

          fwd_bwd = jit(fwd_bwd)
          jax.block_until_ready((fwd(q, k, v), fwd_bwd(q, k, v, ct)))  # compile; fail here
          row["extra_bytes"] = _harness.jax_temp_bytes(step, q, k, v, ct)
          cases[provider] = (row, lambda fwd=fwd, fwd_bwd=fwd_bwd: (
              _harness.time_jax(fwd, q, k, v, reps=reps, inner=None),
              _harness.time_jax(fwd_bwd, q, k, v, ct, reps=reps, inner=None)))
        except ImportError as err:
          print(f"  skip {provider}: {err}")
        except Exception as err:  # pylint: disable=broad-except
          traceback.print_exc(limit=2)
          row["error"] = f"{type(err).__name__}: {err}"[:500]
          rows.append(row)
          _harness.append(out, [row])
          print(f"  {provider:28s} causal={causal!s:5s} ERROR {row['error'][:160]}")

      timers = {p: timer for p, (_, timer) in cases.items()}
      times_of, clocks = _harness.sampled_rounds(timers, rounds, env["platform"] == "gpu")
      for provider, times in times_of.items():
        row = cases[provider][0]
        row.update(clocks.get(provider, {}))
        row["fwd_ms"] = float(np.median([f for f, _ in times]))
        row["fwd_bwd_ms"] = float(np.median([fb for _, fb in times]))
        if rounds > 1:
          row["fwd_bwd_ms_rounds"] = [round(fb, 4) for _, fb in times]
        row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
        row["fwd_bwd_tflops"] = 3.5 * flops / row["fwd_bwd_ms"] / 1e9
        rows.append(row)
        _harness.append(out, [row])
        extra = row["extra_bytes"]
        print(f"  {provider:28s} B={b} T={t} H={h}/{hkv} D={d} causal={causal!s:5s} "
              f"fwd {row['fwd_ms']:7.2f} ms {row['fwd_tflops']:6.1f} TFLOP/s | fwd+bwd "
              f"{row['fwd_bwd_ms']:7.2f} ms {row['fwd_bwd_tflops']:6.1f} TFLOP/s | extra "
              f"{'n/a' if extra is None else f'{extra / 2**30:.3f} GiB'}"
              f"{_harness.clock_text(row)}", flush=True)
      del cases, timers, times_of
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--set", default="small")
  parser.add_argument("--providers", default=DEFAULT_PROVIDERS)
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--rounds", type=int, default=1,
                      help="interleaved rounds per case; each figure is the median over them")
  parser.add_argument("--shapes", default=":",
                      help="which of the set's shapes to run, as a Python slice (e.g. 0:3) "
                      "or indices (0,5,6): "
                      "a long set split over several processes or GPUs")
  parser.add_argument("--out", default=str(_harness.RESULTS / "flash_attention.jsonl"))
  args = parser.parse_args(argv)
  shapes = selected_shapes(args.shapes)
  print(f"flash_attention [{args.set}] on {jax.devices()[0].device_kind}")
  run(args.set, [p for p in args.providers.split(",") if p], args.out, args.reps, args.rounds,
      shapes)


if __name__ == "__main__":
  main()
