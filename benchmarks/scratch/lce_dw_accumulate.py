"""What accumulating dW across chunks costs, per GEMM kind, at llama3-8b ("dv", 1,024-token
chunks, bf16), in interleaved rounds and under nvidia-smi (energy per call).

    python benchmarks/scratch/lce_dw_accumulate.py [--rounds 5]

Each variant runs the chunk loop's dW GEMM alone, 16 times per call, over one fixed [C, V]
G (as the loss's chunk buffer) and x's chunks:

  cublas store       dW = x_cᵀ G each chunk (each overwrites the last: beta = 0)
  cublas add         dW += x_cᵀ G (XLA fuses the add into cuBLAS's epilogue: beta = 1, the
                     default loss's dW)
  mosaic store       ops.mosaic_gemm.gemm (the tiles of dw_dv), storing
  mosaic epilogue    gemm_into(add="epilogue"): the running dW's tile fetched during the
                     tile's main loop and added in the epilogue (dw_accumulation="weight")
  mosaic tma         gemm_into(add="tma") with dw_tma_dv's tiles: the product stored by TMA
                     reduce-adds, so L2 adds it to dW (dw_accumulation="tma_add")

So "add − store" is what the read of the running dW costs each GEMM kind. `--flag NAME`
(session 24) adds "mosaic tma NAME=0/1": the TMA variant traced with the ops.mosaic_gemm
switch NAME off and on (an experiment's patch adds it); `--variants` picks variants,
`--no-power` skips the nvidia-smi pass, `--skew 1,2` adds the TMA variant with
GemmConfig(skew=...) (session 26; needs benchmarks/scratch/patches/skew.diff, not kept),
`--tiles pp128_s4,...` adds "tma NAME", the TMA variant with dx_gemm_tiles.DW_VARIANTS' tiles.
"""
import argparse
import dataclasses
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import power  # noqa: E402
from benchmarks import _harness  # noqa: E402
from memeff_jax.ops import linear_cross_entropy as lce  # noqa: E402
from memeff_jax.ops import mosaic_gemm  # noqa: E402

N, D, V, C = 16384, 4096, 128256, 1024


def configs():
  def one(accumulation):
    impl = lce.PallasGpu(mosaic_gemms=("dw",), dw_accumulation=accumulation)
    return dict(impl.gemm_configs(C, D, V, jnp.bfloat16, jnp.bfloat16, "dv"))["dw"]
  return one("weight"), one("tma_add")


def loop(dw_chunk):
  """fn(x, g): dW over the 16 chunks, dw_chunk(dw or None, x_c, g) -> dw."""
  def fn(x, g):
    dw = dw_chunk(None, x[:C], g)
    return jax.lax.fori_loop(
        1, N // C,
        lambda i, dw: dw_chunk(dw, jax.lax.dynamic_slice_in_dim(x, i * C, C, axis=0), g), dw)
  return fn


def xla(add: bool):
  def chunk(dw, x_c, g):
    p = jax.lax.dot_general(x_c, g, (((0,), (0,)), ((), ())), preferred_element_type=g.dtype)
    return p if dw is None or not add else dw + p
  return chunk


def mosaic(config, add: str | None):
  def chunk(dw, x_c, g):
    if dw is None or add is None:
      return mosaic_gemm.gemm(x_c, g, trans_a=True, out_dtype=g.dtype, config=config,
                              name="dw_probe")
    ref = jax.new_ref(dw)
    mosaic_gemm.gemm_into(ref, x_c, g, trans_a=True, config=config, name="dw_probe", add=add)
    return ref[...]
  return chunk


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--flag", default=None)
  parser.add_argument("--variants", default=None)
  parser.add_argument("--no-power", action="store_true")
  parser.add_argument("--skew", default="", help="e.g. 1,2,3: the TMA variant with that skew")
  parser.add_argument("--tiles", default="",
                      help="dx_gemm_tiles.DW_VARIANTS names: the TMA variant with those tiles")
  args = parser.parse_args()
  k = jax.random.split(jax.random.key(0), 2)
  x = jax.random.normal(k[0], (N, D), jnp.float32).astype(jnp.bfloat16)
  g = (jax.random.normal(k[1], (C, V), jnp.float32) * 1e-2).astype(jnp.bfloat16)
  weight_cfg, tma_cfg = configs()
  variants = {
      "cublas store": loop(xla(False)),
      "cublas add": loop(xla(True)),
      "mosaic store": loop(mosaic(weight_cfg, None)),
      "mosaic epilogue": loop(mosaic(weight_cfg, "epilogue")),
      "mosaic tma store": loop(mosaic(tma_cfg, None)),
      "mosaic tma": loop(mosaic(tma_cfg, "tma")),
  }
  for s in filter(None, args.skew.split(",")):
    variants[f"mosaic tma skew{s}"] = loop(mosaic(dataclasses.replace(tma_cfg, skew=int(s)), "tma"))
  if args.tiles:
    from dx_gemm_tiles import DW_VARIANTS  # pylint: disable=import-outside-toplevel
    for t in args.tiles.split(","):
      variants[f"tma {t}"] = loop(mosaic(dataclasses.replace(tma_cfg, **DW_VARIANTS[t]),
                                                "tma"))
  flags = {}
  if args.flag:
    for on in (0, 1):
      variants[f"mosaic tma {args.flag}={on}"] = loop(mosaic(tma_cfg, "tma"))
      flags[f"mosaic tma {args.flag}={on}"] = bool(on)
  if args.variants:
    variants = {n: f for n, f in variants.items()
                if n in args.variants.split(",") or n in flags or n.startswith("tma ")}
  fns = {}
  for name, f in variants.items():
    if name in flags:  # read when the GEMM is traced, at the first call below
      setattr(mosaic_gemm, args.flag, flags[name])
    fns[name] = jax.jit(f)
    out = jax.block_until_ready(fns[name](x, g))
    print(f"compiled {name}: |dW| {float(jnp.abs(out.astype(jnp.float32)).sum()):.6g}", flush=True)
  times = _harness.interleaved(
      {name: (lambda f=f: _harness.time_jax(f, x, g, reps=10)) for name, f in fns.items()},
      args.rounds)
  print(f"\n{'variant':18} {'ms':>7}  rounds")
  for name, ts in times.items():
    print(f"{name:18} {statistics.median(ts):7.2f}  " + " ".join(f"{t:.2f}" for t in ts),
          flush=True)
  if args.no_power:
    return
  print(f"\n{'variant':18} {'ms':>7} {'W':>6} {'MHz':>5} {'J/call':>7}")
  for name, f in fns.items():
    sec, watts, mhz = power(f, x, g, seconds=2.0)
    print(f"{name:18} {sec * 1e3:7.2f} {watts:6.1f} {mhz:5.0f} {watts * sec:7.2f}", flush=True)


if __name__ == "__main__":
  main()
