"""Where the chunked loss's time goes beyond the floor, at llama3-8b ("dv", bf16), at the cap.

    python benchmarks/scratch/lce_decompose.py [--rounds 3] [--chunks 1024,2048] [--seconds 3]

Each variant is one jitted function; all are timed in interleaved rounds, then each runs
back to back for 3 s while nvidia-smi samples power (energy per call = power × time):

  floor            x W, G Wᵀ, xᵀ G over all 16,384 tokens (G a random [N, V] input)
  gemms C          the same three GEMMs per chunk of C tokens, the chunk's logits standing
                   in for its G: W read twice and dW (bf16, cuBLAS's beta = 1 add) read and
                   written once per chunk, a [C, V] buffer; no softmax work at all
  gemms-noacc C    the same, each chunk's dW product overwriting the last (wrong dW: what
                   reading the running dW back costs)
  gemms+pass C     the same with one elementwise pass over the chunk's logits between the
                   logits GEMM and the other two (one read and one write of [C, V], behind
                   optimization barriers so that XLA fuses it into no GEMM): the bytes the
                   least softmax pass moves (fused_lse's single sweep)
  memeff C         linear_cross_entropy's value_and_grad with chunk_size=C (the default
                   implementation: until session 22 cuBLAS GEMMs and the two-sweep Pallas
                   softmax pass, since then exp_logits on Hopper, as "exp C")
  exp C            (--exp exp) the same with PallasGpu(exp_logits=True): no softmax pass
  exp-dwtma C      (--exp exp-dwtma) and its dW GEMM on ops.mosaic_gemm, by TMA adds

--autotune0 adds each variant again compiled with `xla_gpu_autotune_level=0` (cuBLAS's own
heuristic pick instead of XLA's autotuner, which times algorithms in short bursts, not at the
power cap), marked "at0".

So memeff − floor splits into the chunking of the GEMMs (gemms − floor), the minimal pass
(gemms+pass − gemms) and the rest (memeff − gemms+pass: the real pass's second read and
its arithmetic, the statistics, the small fusions per chunk).
"""
import argparse
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import power  # noqa: E402
from benchmarks import _harness  # noqa: E402
import memeff_jax  # noqa: E402
from memeff_jax.ops import linear_cross_entropy as lce  # noqa: E402

N, D, V = 16384, 4096, 128256


def chunked_gemms(chunk: int, with_pass: bool, accumulate: bool = True):
  n_chunks = N // chunk

  def one(x, w, i):
    x_c = jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=0)
    z = x_c @ w  # [C, V] bf16
    if with_pass:  # one read and one write of the chunk's logits, fused into no GEMM
      z = jax.lax.optimization_barrier(z)
      z = (z.astype(jnp.float32) * 0.999 + 1e-3).astype(z.dtype)
      z = jax.lax.optimization_barrier(z)
    dx_c = z @ w.T
    dw_c = jax.lax.dot_general(x_c, z, (((0,), (0,)), ((), ())),
                               preferred_element_type=w.dtype)
    return dx_c, dw_c

  def fn(x, w):
    dx = jnp.zeros_like(x)
    dx_c, dw = one(x, w, 0)  # the first chunk writes dW (no zero-filled dW to add to)
    dx = jax.lax.dynamic_update_slice_in_dim(dx, dx_c, 0, axis=0)

    def body(i, carry):
      dx, dw = carry
      dx_c, dw_c = one(x, w, i)
      dw = dw + dw_c if accumulate else dw_c  # without: each chunk's dW overwrites (beta = 0)
      return jax.lax.dynamic_update_slice_in_dim(dx, dx_c, i * chunk, axis=0), dw

    return jax.lax.fori_loop(1, n_chunks, body, (dx, dw))

  return fn


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--chunks", default="1024,2048")
  parser.add_argument("--seconds", type=float, default=3.0)
  parser.add_argument("--autotune0", action="store_true")
  parser.add_argument("--exp", default="", help="exp,exp-dwtma: the exp_logits variants too")
  args = parser.parse_args()
  k = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(k[0], (N, D), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(k[1], (D, V), jnp.float32) * D ** -0.5).astype(jnp.bfloat16)
  g = (jax.random.normal(k[2], (N, V), jnp.float32) * 1e-3).astype(jnp.bfloat16)
  y = jax.random.randint(k[3], (N,), 0, V)
  variants = {"floor": (jax.jit(lambda x, w, g: (x @ w, g @ w.T, x.T @ g)), (x, w, g))}
  for c in (int(s) for s in args.chunks.split(",")):
    variants[f"gemms {c}"] = (jax.jit(chunked_gemms(c, False)), (x, w))
    variants[f"gemms-noacc {c}"] = (jax.jit(chunked_gemms(c, False, False)), (x, w))
    variants[f"gemms+pass {c}"] = (jax.jit(chunked_gemms(c, True)), (x, w))
    impls = {"memeff": None, "exp": lce.PallasGpu(exp_logits=True),
             "exp-dwtma": lce.PallasGpu(exp_logits=True, mosaic_gemms=("dw",),
                                        dw_accumulation="tma_add")}
    for name, impl in impls.items():
      if name == "memeff" or name in args.exp.split(","):
        variants[f"{name} {c}"] = (jax.jit(jax.value_and_grad(
            lambda x, w, c=c, impl=impl: memeff_jax.linear_cross_entropy(
                x, w, y, chunk_size=c, implementation=impl), argnums=(0, 1))), (x, w))
  compiled = {}
  for name, (f, a) in variants.items():
    for suffix, options in [("", None)] + ([(" at0", {"xla_gpu_autotune_level": 0})]
                                           if args.autotune0 else []):
      compiled[name + suffix] = (f.lower(*a).compile(compiler_options=options), a)
  variants = compiled
  temps = {}
  for name, (f, a) in variants.items():
    temps[name] = f.memory_analysis().temp_size_in_bytes
    jax.block_until_ready(f(*a))
    print(f"compiled {name}: temp {temps[name] / 2**30:.3f} GiB", flush=True)
  timers = {name: (lambda f=f, a=a: _harness.time_jax(f, *a, reps=10))
            for name, (f, a) in variants.items()}
  times = _harness.interleaved(timers, args.rounds)
  floor = statistics.median(times["floor"])
  print(f"\n{'variant':16} {'ms (median of rounds)':>22} {'x floor':>8}  rounds")
  for name, ts in times.items():
    med = statistics.median(ts)
    print(f"{name:16} {med:22.2f} {med / floor:8.3f}  " + " ".join(f"{t:.2f}" for t in ts),
          flush=True)
  print(f"\n{'variant':16} {'ms':>7} {'W':>6} {'MHz':>5} {'J/call':>7} {'x floor J':>9}")
  energy = {}
  for name, (f, a) in variants.items():
    sec, watts, mhz = power(f, *a, seconds=args.seconds)
    energy[name] = watts * sec
    print(f"{name:16} {sec * 1e3:7.2f} {watts:6.1f} {mhz:5.0f} {energy[name]:7.2f} "
          f"{energy[name] / energy['floor']:9.3f}", flush=True)


if __name__ == "__main__":
  main()
