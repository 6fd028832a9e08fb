"""The exp_logits GEMM (mosaic_gemm.gemm(exp_out=True)) at llama3-8b's 1,024-token chunk,
[1024, 4096] @ [4096, 128256] bf16, in several tile settings, beside cuBLAS's plain x @ W
(XLA) and the same Mosaic kernel without the exponentials (plain, and with fused_lse's
carried statistics), in interleaved rounds; then chosen settings inside the whole loss.

    python benchmarks/scratch/exp_gemm_tiles.py [--rounds 5] [--variants a,b] [--loss a,b]
        [--all-mosaic]
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
BASE = mg.GemmConfig(**_tuning.lookup("linear_cross_entropy", "mosaic_gemm")["logits"])
VARIANTS = {
    "base": {},
    "cluster_m": dict(cluster="m"),
    "cluster_n": dict(cluster="n"),
    "minor_m_band8": dict(minor="m", band=8),
    "band4": dict(band=4),
    "inflight0": dict(in_flight=0),
    "split_m": dict(wg_split="m"),
    "cluster_m_band4": dict(cluster="m", band=4),
    # ping-pong (session 24): each warpgroup's epilogue, exponentials included, under the
    # other's main loop; one 128 x 128 tile per warpgroup
    "pp4": dict(schedule="pingpong"),
    "pp5": dict(schedule="pingpong", max_concurrent_steps=5),
    "pp6": dict(schedule="pingpong", max_concurrent_steps=6),
    "pp5_cluster_m": dict(schedule="pingpong", max_concurrent_steps=5, cluster="m"),
    "pp5_minor_m_band8": dict(schedule="pingpong", max_concurrent_steps=5, minor="m", band=8),
    "pp5_inflight0": dict(schedule="pingpong", max_concurrent_steps=5, in_flight=0),
}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--loss", default="", help="variants to time inside the whole loss too")
  parser.add_argument("--variants", default=None, help="comma-separated subset of VARIANTS")
  parser.add_argument("--all-mosaic", action="store_true",
                      help="time the loss with every GEMM on Mosaic (dW by TMA adds)")
  args = parser.parse_args()
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (C, D), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(k[1], (D, V), jnp.float32) * D ** -0.5).astype(jnp.bfloat16)
  timers = {"cublas x@W": (jax.jit(lambda x, w: x @ w), (x, w)),
            # the same kernel without the exponentials / without any statistics: what the
            # exp epilogue costs
            "plain (no exp)": (jax.jit(lambda x, w: mg.gemm(x, w, config=BASE)), (x, w)),
            "no exp, sums only": (jax.jit(lambda x, w: mg.gemm(x, w, config=BASE,
                                                               row_stats=V)), (x, w))}
  chosen = args.variants.split(",") if args.variants else list(VARIANTS)
  for name, kw in ((n, VARIANTS[n]) for n in chosen):
    config = dataclasses.replace(BASE, **kw)
    fn = jax.jit(lambda x, w, config=config: mg.gemm(x, w, config=config, row_stats=V,
                                                     exp_out=True))
    try:
      jax.block_until_ready(fn(x, w))
    except Exception as err:  # pylint: disable=broad-except
      print(f"{name}: {type(err).__name__}: {str(err)[:200]}")
      continue
    timers[name] = (fn, (x, w))
  against(timers, "cublas x@W", args.rounds)
  if not args.loss:
    return
  xs = jax.random.normal(k[2], (N, D), jnp.float32).astype(jnp.bfloat16)
  y = jax.random.randint(k[0], (N,), 0, V)
  loss_timers = {}
  more = (dict(mosaic_gemms=pallas_gpu.GEMMS, dw_accumulation="tma_add") if args.all_mosaic
          else {})
  for name in ["default"] + args.loss.split(","):
    impl = pallas_gpu.PallasGpu(exp_logits=True, **more) if more else None
    if name != "default":
      impl = _Tiled(impl or pallas_gpu.PallasGpu(exp_logits=True),
                    dataclasses.replace(BASE, **VARIANTS[name]))
    fn = jax.jit(jax.value_and_grad(lambda x, w, impl=impl: memeff_jax.linear_cross_entropy(
        x, w, y, implementation=impl), argnums=(0, 1)))
    jax.block_until_ready(fn(xs, w))
    loss_timers[name] = (lambda f=fn: _harness.time_jax(f, xs, w, reps=10))
  times = _harness.interleaved(loss_timers, args.rounds)
  for name, ts in times.items():
    print(f"loss {name:14} {statistics.median(ts):8.2f} ms  " + " ".join(f"{t:.2f}" for t in ts),
          flush=True)


class _Tiled:
  """PallasGpu(exp_logits=True) with the exp GEMM's tiles replaced."""

  def __init__(self, impl, config):
    self.impl, self.config = impl, config
    self.name = impl.name

  def __call__(self, *args, **kwargs):
    real = pallas_gpu.PallasGpu.gemm_configs

    def patched(this, *a, names=None):
      out = real(this, *a, names=names)
      return tuple((n, self.config if names == ("logits",) else c) for n, c in out)

    pallas_gpu.PallasGpu.gemm_configs = patched
    try:
      return self.impl(*args, **kwargs)
    finally:
      pallas_gpu.PallasGpu.gemm_configs = real


if __name__ == "__main__":
  main()
