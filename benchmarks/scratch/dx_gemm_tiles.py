"""The dx GEMM of llama3-8b's 1,024-token chunk, [1024, 128256] @ [128256, 4096] bf16 (G Wᵀ
with W stored [D, V]: B as [N, K]), in several tile settings of ops.mosaic_gemm beside
cuBLAS (XLA), in interleaved rounds; then chosen settings inside the whole all-Mosaic loss
(exp_logits, the default), which session 23 found 3% slower with this GEMM on Mosaic.

    python benchmarks/scratch/dx_gemm_tiles.py [--rounds 5] [--loss a,b]
    python benchmarks/scratch/dx_gemm_tiles.py --gemm dw_tma_dv --loss a,b  (loss only)

With --gemm dw_tma_dv the variants (DW_VARIANTS) replace the dW GEMM's tiles (TMA adds)
inside the same loss instead, with no isolated timing.
"""
import argparse
import dataclasses
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from _measure import against  # noqa: E402
from benchmarks import _harness  # noqa: E402
import memeff_jax  # noqa: E402
from memeff_jax import _tuning  # noqa: E402
from memeff_jax.ops import mosaic_gemm as mg  # noqa: E402
from memeff_jax.ops.linear_cross_entropy import pallas_gpu  # noqa: E402

C, D, V, N = 1024, 4096, 128256, 16384
TUNED = _tuning.lookup("linear_cross_entropy", "mosaic_gemm")
BASE = mg.GemmConfig(**TUNED["dx_dv"])
VARIANTS = {
    "base": {},
    "cluster_m": dict(cluster="m"),
    "cluster_n": dict(cluster="n"),
    "steps5": dict(max_concurrent_steps=5),
    "steps6_ep64": dict(max_concurrent_steps=6, epilogue_rows=64),
    "band4": dict(band=4),
    "band16": dict(band=16),
    "minor_n": dict(minor="n", band=1),
    "inflight0": dict(in_flight=0),
    "ring_n": dict(schedule="ring", epilogue_rows=64),
    "ring_m": dict(schedule="ring", wg_split="m", epilogue_rows=64),
    "ring_n_cm": dict(schedule="ring", epilogue_rows=64, cluster="m"),
    "tk128_s2": dict(tile_k=128, max_concurrent_steps=2),
    "tk128_s3_ep64": dict(tile_k=128, max_concurrent_steps=3, epilogue_rows=64),
    # round 2, around the ring schedule (ring_n: 1.027x cuBLAS against base's 1.048)
    "ring_n_s5": dict(schedule="ring", epilogue_rows=64, max_concurrent_steps=5),
    "ring_n_s3": dict(schedule="ring", epilogue_rows=64, max_concurrent_steps=3),
    "ring_n_b4": dict(schedule="ring", epilogue_rows=64, band=4),
    "ring_n_b16": dict(schedule="ring", epilogue_rows=64, band=16),
    "ring_n_minor_n": dict(schedule="ring", epilogue_rows=64, minor="n", band=1),
    "ring_n_cn": dict(schedule="ring", epilogue_rows=64, cluster="n"),
    "ring_m_cm": dict(schedule="ring", wg_split="m", epilogue_rows=64, cluster="m"),
    "ring_m_cn": dict(schedule="ring", wg_split="m", epilogue_rows=64, cluster="n"),
    "ring_n_full_ep": dict(schedule="ring"),
    "ring_n_cm_s5": dict(schedule="ring", epilogue_rows=64, cluster="m", max_concurrent_steps=5),
}


DW_VARIANTS = {
    "band8": dict(band=8),
    "band16": dict(band=16),
    "minor_n": dict(minor="n", band=1),
    "no_cluster": dict(cluster=None),
    "cluster_n": dict(cluster="n"),
    "split_m": dict(wg_split="m"),
    "steps3": dict(max_concurrent_steps=3),
    "pingpong": dict(schedule="pingpong", epilogue_rows=None),
    # session 24: narrower CTA tiles, as cuBLAS's first-chunk store (nvjet 128x160, 5 stages)
    "n64_s6": dict(tile_n=64, max_concurrent_steps=6),
    "m64_n160_s5": dict(tile_m=64, tile_n=160, wg_split="m", max_concurrent_steps=5),
    "m64_n192_s4": dict(tile_m=64, tile_n=192, wg_split="m"),
    "m64_n256_s3": dict(tile_m=64, tile_n=256, wg_split="m", max_concurrent_steps=3),
    "splitm_n160_s3": dict(tile_n=160, wg_split="m", max_concurrent_steps=3),
    "n80_s5": dict(tile_n=80, max_concurrent_steps=5),
    # the whole tile in one epilogue buffer: no wait for the TMA store between its halves
    "s3_fullep": dict(max_concurrent_steps=3, epilogue_rows=None),
    "tk32_s6_fullep": dict(tile_k=32, max_concurrent_steps=6, epilogue_rows=None),
    "tk32_s8": dict(tile_k=32, max_concurrent_steps=8),
    # ping-pong (one warpgroup's epilogue under the other's main loop) with deeper rings
    "pp_s5_ep64": dict(schedule="pingpong", max_concurrent_steps=5),
    "pp_s6_ep64": dict(schedule="pingpong", max_concurrent_steps=6),
    "pp_s6_ep64_nocl": dict(schedule="pingpong", max_concurrent_steps=6, cluster=None),
}

# Session 26: the second compute warpgroup a few K steps behind the first (GemmConfig.skew,
# from benchmarks/scratch/patches/skew.diff, not kept: level in the loss), for any of the
# loss's ring GEMMs (--gemm dw_tma_dv, logits or dx_dv).
SKEW_VARIANTS = {f"skew{s}": dict(skew=s) for s in (1, 2, 3)}
VARIANTS.update(SKEW_VARIANTS)
DW_VARIANTS.update(SKEW_VARIANTS)
# Session 26: ping-pong where each warpgroup keeps to its own tiles' slots (K steps a multiple
# of twice the slots: mosaic_gemm's own_slots), so one's epilogue holds up none of the
# other's main loop. For --gemm dw_tma_dv and logits.
PP_VARIANTS = {
    "pp128_s4_ep64": dict(schedule="pingpong", tile_n=128, max_concurrent_steps=4,
                          epilogue_rows=64),
    "pp128_s4": dict(schedule="pingpong", tile_n=128, max_concurrent_steps=4, epilogue_rows=None),
    "pp192_s4_ep64": dict(schedule="pingpong", tile_n=192, max_concurrent_steps=4,
                          epilogue_rows=64),
    "pp128_s4_nocl": dict(schedule="pingpong", tile_n=128, max_concurrent_steps=4,
                          epilogue_rows=64, cluster=None),
    "pp128_s4_b8": dict(schedule="pingpong", tile_n=128, max_concurrent_steps=4,
                        epilogue_rows=64, band=8),
}
# round 2, around the 192-wide ping-pong tiles (dW alone 26.98 against the ring's 29.27 ms)
PP192 = dict(schedule="pingpong", tile_n=192, max_concurrent_steps=4, epilogue_rows=64)
PP_VARIANTS.update({
    "pp192_nocl": dict(PP192, cluster=None),
    "pp192_cn": dict(PP192, cluster="n"),
    "pp192_b8": dict(PP192, band=8),
    "pp192_minor_n": dict(PP192, minor="n", band=1),
    "pp64x256": dict(schedule="pingpong", tile_m=64, tile_n=256, max_concurrent_steps=4,
                     epilogue_rows=64),
})
DW_VARIANTS.update(PP_VARIANTS)
LOGITS_VARIANTS = {**SKEW_VARIANTS, **PP_VARIANTS}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--loss", default="", help="variants to time inside the whole loss too")
  parser.add_argument("--only", default="", help="comma-separated variants (default all)")
  parser.add_argument("--gemm", default="dx_dv",
                      help="dx_dv, or dw_tma_dv or logits (loss only)")
  args = parser.parse_args()
  if args.gemm == "logits":
    return time_losses(args, args.gemm, LOGITS_VARIANTS)
  if args.gemm != "dx_dv":
    return time_losses(args, args.gemm, DW_VARIANTS)
  k = jax.random.split(jax.random.key(0), 3)
  g = jax.random.uniform(k[0], (C, V), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(k[1], (D, V), jnp.float32) * D ** -0.5).astype(jnp.bfloat16)
  timers = {"cublas G@Wt": (jax.jit(lambda g, w: g @ w.T), (g, w))}
  only = set(args.only.split(",")) if args.only else set(VARIANTS)
  for name, kw in VARIANTS.items():
    if name not in only:
      continue
    try:
      config = dataclasses.replace(BASE, **kw)
      fn = jax.jit(lambda g, w, config=config: mg.gemm(g, w, trans_b=True, config=config))
      jax.block_until_ready(fn(g, w))
    except Exception as err:  # pylint: disable=broad-except
      print(f"{name}: {type(err).__name__}: {str(err)[:200]}", flush=True)
      continue
    timers[name] = (fn, (g, w))
  against(timers, "cublas G@Wt", args.rounds)
  if args.loss:
    time_losses(args, "dx_dv", VARIANTS)


def time_losses(args, key, variants):
  """The all-Mosaic exp_logits loss at 1,024-token chunks with `key`'s tiles replaced by
  each of args.loss's variants (beside the default and with dx on cuBLAS)."""
  k = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(k[0], (N, D), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(k[1], (D, V), jnp.float32) * D ** -0.5).astype(jnp.bfloat16)
  y = jax.random.randint(k[2], (N,), 0, V)
  table = _tuning._table("linear_cross_entropy")["mosaic_gemm"]["default"]  # pylint: disable=protected-access
  saved = dict(table[key])
  base = mg.GemmConfig(**{k: v for k, v in saved.items() if k != "fallback"})
  loss_timers = {}
  for name in ["default", "cublas-dx", "base"] + args.loss.split(","):
    gemms = ("logits", "dw") if name == "cublas-dx" else pallas_gpu.GEMMS
    impl = None if name == "default" else pallas_gpu.PallasGpu(
        mosaic_gemms=gemms, dw_accumulation="tma_add")
    if name in variants:  # read when the loss is traced, below
      table[key] = dataclasses.asdict(dataclasses.replace(base, **variants[name]))
    fn = jax.jit(jax.value_and_grad(lambda x, w, impl=impl: memeff_jax.linear_cross_entropy(
        x, w, y, implementation=impl, chunk_size=1024), argnums=(0, 1)))
    try:
      jax.block_until_ready(fn(x, w))
    except Exception as err:  # pylint: disable=broad-except
      print(f"loss {name}: {type(err).__name__}: {str(err)[:200]}", flush=True)
      continue
    finally:
      table[key] = saved
    loss_timers[name] = (lambda f=fn: _harness.time_jax(f, x, w, reps=10))
  times = _harness.interleaved(loss_timers, args.rounds)
  for name, ts in times.items():
    print(f"loss {name:14} {statistics.median(ts):8.2f} ms  " + " ".join(f"{t:.2f}" for t in ts),
          flush=True)


if __name__ == "__main__":
  main()
