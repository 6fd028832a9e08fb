"""Two warm loss+gradient calls of linear_cross_entropy at llama3-8b (bf16), or of the floor's
three matmuls, for ncu's per-kernel durations.

    LCE_KERNEL=block_v=4096,num_warps=4 python benchmarks/scratch/lce_profile.py memeff|floor|liger [chunk_size]

REPS=n makes n calls (default 2); TRACE=path.json traces the last n - 2 with torch's profiler
(kernel durations under sustained load, JAX's included; benchmarks/scratch/dev_lce_trace.sh).
LCE_GEMMS=logits+dx+dw puts those GEMMs on ops.mosaic_gemm; LCE_LAYOUT=vd stores W as [V, D];
LCE_DW=tma_add sets dw_accumulation; LCE_FUSED_LSE=1 sets fused_lse; LCE_EXP=1 sets
exp_logits; HLO=path writes the optimized program there and prints its temporaries and the
copies, scatters and conditionals of [C, V] arrays. Mode "bridge" runs the all-Mosaic loss ("vd", LCE_DW
default tma_add) through memeff_jax.interop.torch on torch tensors, backward included.
"""
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
import memeff_jax  # noqa: E402

N, D, V = 16384, 4096, 128256
REPS = int(os.environ.get("REPS", 2))  # calls (ncu: 2; a traced run under sustained load: more)
kx, kw, ky, kg = jax.random.split(jax.random.key(0), 4)
x = jax.random.normal(kx, (N, D), jnp.float32).astype(jnp.bfloat16)
LAYOUT = os.environ.get("LCE_LAYOUT", "dv")
w = (jax.random.normal(kw, (D, V) if LAYOUT == "dv" else (V, D), jnp.float32)
     * 0.02).astype(jnp.bfloat16)
y = jax.random.randint(ky, (N,), 0, V)


def run(call):
  """REPS calls; with $TRACE, the last REPS - 2 (warm, back to back) under torch's profiler
  (CUPTI sees every kernel of the process, JAX's too), as a Chrome trace at $TRACE."""
  walls = []

  def timed():
    t0 = time.perf_counter()
    call()
    walls.append((time.perf_counter() - t0) * 1e3)

  if not os.environ.get("TRACE"):
    for _ in range(REPS):
      timed()
  else:
    import torch  # pylint: disable=import-outside-toplevel
    for _ in range(2):
      timed()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
      for _ in range(REPS - 2):
        timed()
    prof.export_chrome_trace(os.environ["TRACE"])
  print(f"done; wall-clock per call (ms): {' '.join(f'{w:.2f}' for w in walls)}", flush=True)


if sys.argv[1] == "liger":  # Liger-Kernel's fused loss on the same shapes (W as [V, D])
  import torch  # pylint: disable=import-outside-toplevel
  from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  xt = torch.randn(N, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
  wt = (torch.randn(V, D, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
  yt = torch.randint(0, V, (N,), device="cuda")
  loss_fn = LigerFusedLinearCrossEntropyLoss()

  def call():
    xt.grad = wt.grad = None
    loss_fn(wt, xt, yt).backward()
    torch.cuda.synchronize()

  run(call)
  sys.exit(0)
if sys.argv[1] == "bridge":  # the all-Mosaic loss through the torch bridge ("vd": W [V, D])
  import torch  # pylint: disable=import-outside-toplevel
  from memeff_jax.interop import torch as mt  # pylint: disable=import-outside-toplevel
  from memeff_jax.ops import linear_cross_entropy as lce  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  xt = torch.randn(N, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
  wt = (torch.randn(V, D, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
  yt = torch.randint(0, V, (N,), device="cuda")
  impl = lce.PallasGpu(mosaic_gemms=("logits", "dx", "dw"),
                       dw_accumulation=os.environ.get("LCE_DW", "tma_add"),
                       fused_lse=os.environ.get("LCE_FUSED_LSE") == "1")
  chunk = int(sys.argv[2]) if len(sys.argv) > 2 else None

  def call():
    xt.grad = wt.grad = None
    mt.linear_cross_entropy(xt, wt, yt, chunk_size=chunk, implementation=impl).backward()
    torch.cuda.synchronize()

  run(call)
  sys.exit(0)
if sys.argv[1] == "floor":
  g = (jax.random.normal(kg, (N, V), jnp.float32) * 1e-3).astype(jnp.bfloat16)
  fn, args = jax.jit(lambda x, w, g: (x @ w, g @ w.T, x.T @ g)), (x, w, g)
else:
  chunk = int(sys.argv[2]) if len(sys.argv) > 2 else None
  impl = None
  if os.environ.get("LCE_KERNEL") or os.environ.get("LCE_GEMMS") or os.environ.get("LCE_EXP"):
    from memeff_jax.ops import linear_cross_entropy as lce  # pylint: disable=import-outside-toplevel
    kw = {}
    if os.environ.get("LCE_KERNEL"):
      fields = {k: int(v) for k, v in (kv.split("=") for kv in os.environ["LCE_KERNEL"].split(","))}
      kw["kernel"] = lce.KernelConfig(**fields)
    if os.environ.get("LCE_GEMMS"):
      kw["mosaic_gemms"] = tuple(os.environ["LCE_GEMMS"].split("+"))
    if os.environ.get("LCE_DW"):
      kw["dw_accumulation"] = os.environ["LCE_DW"]
    kw["fused_lse"] = os.environ.get("LCE_FUSED_LSE") == "1"
    kw["exp_logits"] = os.environ.get("LCE_EXP") == "1"
    impl = lce.PallasGpu(**kw)
  fn = jax.jit(jax.value_and_grad(
      lambda x, w: memeff_jax.linear_cross_entropy(x, w, y, chunk_size=chunk, weight_layout=LAYOUT,
                                                   implementation=impl), argnums=(0, 1)))
  args = (x, w)
jax.block_until_ready(args)
if os.environ.get("HLO"):  # temporaries, and the optimized program's [C, V]-sized copies
  compiled = fn.lower(*args).compile()
  print(f"temp bytes {compiled.memory_analysis().temp_size_in_bytes:,}")
  hlo = compiled.as_text()
  open(os.environ["HLO"], "w").write(hlo)
  for line in hlo.splitlines():
    if f",{V}]" in line and (" copy(" in line or "copy-start" in line or " scatter(" in line
                             or "conditional(" in line or "dynamic-update-slice(" in line):
      print("  ", line.strip()[:200])
run(lambda: jax.block_until_ready(fn(*args)))
