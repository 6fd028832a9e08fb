"""Timing and power of a JAX function run back to back, for the scratch diagnostics:
try_variant (a variant run once, its failure printed rather than raised), per_call (seconds per call), power (median power and SM clock, nvidia-smi every 50 ms) and
rounds_then_power (interleaved rounds, then power, printed per variant), against
(short kernels in interleaved rounds, printed against a reference among them); the attention
backward's problem at the headline, attention_backward_problem; and the bridge diagnostics'
problem, bridge_loss_problem."""
import statistics
import subprocess
import time

import jax


def per_call(f, *args, reps=20):
  """Seconds per call of f(*args), compiled and run once first, over `reps` calls."""
  jax.block_until_ready(f(*args))
  t0 = time.perf_counter()
  for _ in range(reps):
    r = f(*args)
  jax.block_until_ready(r)
  return (time.perf_counter() - t0) / reps


def try_variant(fns, outs, name, f, *args):
  """Runs the jitted f(*args) once; where it builds and runs, fns[name] = (f, args) and
  outs[name] = its output, else the error is printed and the other variants go on."""
  try:
    outs[name] = jax.block_until_ready(f(*args))
  except Exception as err:  # pylint: disable=broad-except
    print(f"{name}: {type(err).__name__}: {str(err)[:600]}", flush=True)
    return
  fns[name] = (f, args)


def power(f, *args, seconds=3.0):
  """Median power (W) and SM clock (MHz) while f runs back to back for `seconds`."""
  jax.block_until_ready(f(*args))
  smi = subprocess.Popen(["nvidia-smi", "--query-gpu=power.draw,clocks.sm", "--format=csv,noheader,"
                          "nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
  t0 = time.perf_counter()
  n = 0
  while time.perf_counter() - t0 < seconds:
    r = f(*args)
    n += 1
    if n % 20 == 0:
      jax.block_until_ready(r)
  jax.block_until_ready(r)
  sec = (time.perf_counter() - t0) / n
  smi.terminate()
  rows = [line.split(", ") for line in smi.communicate()[0].splitlines() if line.strip()]
  busy = [(float(p), float(c)) for p, c in rows if float(p) > 300]
  if not busy:
    return sec, float("nan"), float("nan")
  return sec, statistics.median(p for p, _ in busy), statistics.median(c for _, c in busy)


def rounds_then_power(fns, rounds: int, *, width: int = 20, reps: int = 20, note=None):
  """fns: {name: (f, args)}. Prints each variant's median ms over `rounds` interleaved rounds
  (benchmarks/_harness.interleaved), then its time, power, clock and energy per call while it
  runs back to back for 2 s. note(name, ms) may add text to a variant's line (e.g. TFLOP/s)."""
  from benchmarks import _harness  # pylint: disable=import-outside-toplevel
  times = _harness.interleaved(
      {name: (lambda f=f, a=a: _harness.time_jax(f, *a, reps=reps))
       for name, (f, a) in fns.items()}, rounds)
  for name, ts in times.items():
    med = statistics.median(ts)
    extra = note(name, med) if note else ""
    print(f"{name:{width}} {med:7.3f} ms{extra}   rounds " + " ".join(f"{t:.3f}" for t in ts),
          flush=True)
  for name, (f, a) in fns.items():
    sec, watts, mhz = power(f, *a, seconds=2.0)
    print(f"{name:{width}} {sec * 1e3:7.3f} ms at {watts:5.1f} W, {mhz:.0f} MHz: "
          f"{watts * sec * 1e3:7.1f} mJ per call", flush=True)


# The attention headline: B=4 T=4096 H=32 D=128 bf16.
ATTN_SHAPE = (4, 4096, 32, 128)


def attention_inputs(shape=ATTN_SHAPE, kv_heads=None):
  """(q, k, v, ct): random bf16 q, k, v and output cotangent ct at `shape` ([B, T, H, D]; k
  and v with kv_heads heads if given), the same draws as benchmarks/flash_attention.py's."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  kv_shape = (*shape[:2], kv_heads or shape[2], shape[3])
  return tuple(jax.random.normal(kk, sh, jnp.float32).astype(jnp.bfloat16)
               for kk, sh in zip(jax.random.split(jax.random.key(0), 4),
                                 (shape, kv_shape, kv_shape, shape)))


def jitted_fwd_bwd(f, ct):
  """jit of (q, k, v) -> (out, (dq, dk, dv)): one forward pass of f and its vjp with ct, as
  benchmarks/flash_attention.py times fwd+bwd."""
  def fwd_bwd(q, k, v):
    out, pull = jax.vjp(f, q, k, v)
    return out, pull(ct)
  return jax.jit(fwd_bwd)


def against(timers, ref: str, rounds: int):
  """Interleaved rounds of {name: (jitted f, args)} (calls of a few milliseconds: 5 per
  timed batch), printed per name in µs with the ratio to `ref`'s median."""
  from benchmarks import _harness  # pylint: disable=import-outside-toplevel
  times = _harness.interleaved({n: (lambda f=f, a=a: _harness.time_jax(f, *a, reps=10, inner=5))
                                for n, (f, a) in timers.items()}, rounds)
  base = statistics.median(times[ref])
  for name, ts in times.items():
    med = statistics.median(ts)
    print(f"{name:18} {med * 1e3:8.1f} us  x {ref} {med / base:.3f}  "
          + " ".join(f"{t * 1e3:.0f}" for t in ts), flush=True)


def attention_backward_problem(causal: bool, shape=ATTN_SHAPE, kv_heads=None):
  """(q, k, v, ct, opts, res, stats): random bf16 q, k, v and output cotangent ct at `shape`
  ([B, T, H, D]; k and v with kv_heads heads if given), and what the Mosaic backward
  kernels take for them: the options, the forward's residuals (its out and lse) and
  mosaic_gpu_backward.row_stats (lse₂ and Δ)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from memeff_jax.ops.flash_attention import _common  # pylint: disable=import-outside-toplevel
  from memeff_jax.ops.flash_attention import flash_attention  # pylint: disable=import-outside-toplevel
  from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # pylint: disable=import-outside-toplevel
  from memeff_jax.ops.flash_attention.masks import MaskSpec  # pylint: disable=import-outside-toplevel
  q, k, v, ct = attention_inputs(shape, kv_heads)
  opts = _common.AttentionOptions(mask=MaskSpec.make(causal, None, False),
                                  scale=shape[-1] ** -0.5)
  out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
  res = _common.Residuals(q, k, v, None, None, out, jnp.swapaxes(lse, 1, 2))
  stats = mb.row_stats(opts, res, _common.softmax_delta(out, ct, jnp.zeros_like(res.lse)))
  return q, k, v, ct, opts, res, stats


# llama3-8b's LM head, and the bridge's lowest-memory setting's token chunk.
N, D, V, CHUNK = 16384, 4096, 128256, 512


def bridge_loss_problem():
  """(x, W, labels, implementation): torch CUDA tensors at llama3-8b (bf16 x [N, D] and W
  [V, D] requiring grad, int64 labels) and the light setting (all three GEMMs on
  ops.mosaic_gemm, tma_add, fused_lse), as torch_bridge's memeff:...:mosaic:tma:lse."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  from memeff_jax.ops import linear_cross_entropy as lce  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  xt = torch.randn(N, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
  wt = (torch.randn(V, D, device="cuda") / np.sqrt(D)).to(torch.bfloat16).requires_grad_()
  yt = torch.randint(0, V, (N,), device="cuda")
  impl = lce.PallasGpu(mosaic_gemms=("logits", "dx", "dw"), dw_accumulation="tma_add",
                       fused_lse=True)
  return xt, wt, yt, impl
