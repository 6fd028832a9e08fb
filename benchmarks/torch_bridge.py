"""memeff_jax's ops called from PyTorch through the bridge, against the torch peers.

    python benchmarks/torch_bridge.py [--op loss,ppo,attention] [--providers ...]

Loss (llama3-8b shape, N=16384, D=4096, V=128256, bf16; forward+backward):
  memeff             memeff_jax.interop.torch.linear_cross_entropy (default chunking)
  memeff:chunk=C     the same with chunk_size=C tokens; modifiers (after more colons):
                     :mosaic  implementation=PallasMosaicGpu(mosaic_gemms=("logits", "dx", "dw")),
                              the three GEMMs off cuBLAS (no 32 MiB workspace; exp_logits
                              unless :lse)
                     :tma     with :mosaic, dw_accumulation="tma_add" (dW added by TMA
                              reduce stores)
                     :lse     with :mosaic, fused_lse=True (partial log-sum-exps from the
                              logits GEMM's epilogue; one read of the logits, not two)
                     :async   JAX's XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async instead of its
                              BFC allocator (whose peak counts ~22 MiB of its own slack)
  jax_direct         the same JAX function called on JAX arrays: what the bridge adds
                     (conversion, stream sync, scaling the unit gradients) is the difference
  floor              the three matmuls in torch (x Wᵀ, G W, Gᵀ x) with a given G
  torch_naive, torch_compile, liger, cce
PPO (the same shape; PPO's clipped surrogate, ε = 0.2, of each token's log-probability, one
advantage per 1,024-token sequence, averaged over the tokens): floor, memeff (a token_loss
through the bridge), jax_direct, liger (its fused GRPO loss), torch_naive, torch_compile.
Attention (B=4, H=32, T=4096, D=128, bf16; forward and forward+backward, causal and not):
  memeff             memeff_jax.interop.torch.flash_attention, layout "bthd"
  jax_direct         memeff_jax.flash_attention on JAX arrays
  sdpa_flash, sdpa_cudnn   F.scaled_dot_product_attention with that backend, [B, H, T, D]

Every provider runs in a fresh process, so its peak memory is its own: extra bytes are
torch.cuda.max_memory_allocated over the inputs plus JAX's peak_bytes_in_use over its
start, less the gradient outputs (which every provider must return); a memeff provider runs
twice, the first process filling a persistent compilation cache (JAX_COMPILATION_CACHE_DIR,
a temporary one where unset) so that the second's peak holds no autotuning. Times are CUDA-event
medians on torch's stream (JAX's work is ordered into it by DLPack): `ms` from an idle
GPU (the host's latency to the first kernel included), and for the torch-driven
providers also `queued_ms`, the step queued behind 20 ms of matmuls as behind a model's
forward (that latency hidden; waits inside the step, such as a .item(), still count).
Rows are appended to benchmarks/results/torch_bridge.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LOSS_PROVIDERS = "floor,memeff,memeff:chunk=512,jax_direct,liger,cce,torch_naive,torch_compile"
PPO_PROVIDERS = "floor,memeff,jax_direct,liger,torch_naive,torch_compile"
PPO_SEQUENCE = 1024
ATTENTION_PROVIDERS = "memeff,jax_direct,sdpa_flash,sdpa_cudnn"
N, D, V = 16384, 4096, 128256
B, H, T, HD = 4, 32, 4096, 128


def _jax_bytes():
  import jax  # pylint: disable=import-outside-toplevel
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("bytes_in_use", 0), stats.get("peak_bytes_in_use", 0)


def _modifiers(provider: str) -> list[str]:
  """"memeff:chunk=512:mosaic" -> ["chunk=512", "mosaic"]."""
  return provider.split(":")[1:]


def loss_worker(provider: str, reps: int, ppo: bool = False) -> dict:
  """One loss provider's row; with `ppo`, of PPO's clipped surrogate (a token_loss)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel

  from benchmarks import _harness  # pylint: disable=import-outside-toplevel
  from benchmarks.linear_cross_entropy import _ppo_clip, torch_loss_fn, torch_step  # pylint: disable=import-outside-toplevel

  torch.manual_seed(0)
  xt = torch.randn(N, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
  wt = (torch.randn(V, D, device="cuda") / np.sqrt(D)).to(torch.bfloat16).requires_grad_()
  yt = torch.randint(0, V, (N,), device="cuda")
  grads = (N * D + V * D) * 2
  ppo_args = _ppo_inputs(xt, wt, yt) if ppo else None
  token_loss = dict(token_loss=_ppo_clip, token_loss_args=ppo_args) if ppo else {}

  if provider == "floor":
    g = (torch.randn(N, V, device="cuda") * 1e-3).to(torch.bfloat16)
    x, w = xt.detach(), wt.detach()
    matmuls = lambda: (x @ w.T, g @ w, g.T @ x)
    return dict(ms=_harness.time_torch(matmuls, reps=reps),
                queued_ms=_harness.time_torch(matmuls, reps=reps, lead_ms=20.0))
  if provider == "jax_direct":
    import jax  # pylint: disable=import-outside-toplevel

    from memeff_jax import linear_cross_entropy  # pylint: disable=import-outside-toplevel
    from memeff_jax.interop import torch as mt  # pylint: disable=import-outside-toplevel
    x, w, y = mt.to_jax(xt), mt.to_jax(wt), mt.to_jax(yt.to(torch.int32))
    if ppo:
      token_loss["token_loss_args"] = tuple(mt.to_jax(t) for t in ppo_args)
    fn = jax.jit(jax.value_and_grad(
        lambda x, w: linear_cross_entropy(x, w, y, weight_layout="vd", **token_loss),
        argnums=(0, 1)))
    return dict(ms=_harness.time_jax(fn, x, w, reps=reps), loss=float(fn(x, w)[0]),
                extra_bytes=_harness.jax_temp_bytes(fn, x, w))
  if provider.startswith("memeff"):
    from memeff_jax.interop import torch as mt  # pylint: disable=import-outside-toplevel
    from memeff_jax.ops import linear_cross_entropy as lce  # pylint: disable=import-outside-toplevel
    mods = _modifiers(provider)
    chunk = next((int(m.split("=")[1]) for m in mods if m.startswith("chunk=")), None)
    impl = (lce.PallasMosaicGpu(mosaic_gemms=("logits", "dx", "dw"),
                          dw_accumulation="tma_add" if "tma" in mods else "weight",
                          fused_lse="lse" in mods)
            if "mosaic" in mods else None)
    loss_fn = lambda x, w, y: mt.linear_cross_entropy(x, w, y, chunk_size=chunk,
                                                      implementation=impl, **token_loss)
  else:
    loss_fn = torch_loss_fn(provider, ppo=(*ppo_args, PPO_SEQUENCE) if ppo else None)
  step, state = torch_step(loss_fn, xt, wt, yt)

  # JAX's peak cannot be reset: it counts from here, over a warm-up call and the timed ones
  # (which peak alike). torch's counts from after the warm-up, which allocates once-per-process
  # state (cuBLAS's workspace, Triton's autotuning) that a training step would already hold,
  # and without the gradients (outputs, subtracted below).
  jax_base = _jax_bytes()[0] if provider.startswith("memeff") else 0
  step()
  xt.grad = wt.grad = None
  torch.cuda.synchronize()
  torch.cuda.reset_peak_memory_stats()
  base = torch.cuda.memory_allocated()
  ms = _harness.time_torch(step, reps=reps)
  torch_extra = torch.cuda.max_memory_allocated() - base
  jax_extra = max(0, _jax_bytes()[1] - jax_base) if provider.startswith("memeff") else 0
  # The same step queued behind 20 ms of other GPU work, as behind a model's forward in a
  # training step (measured after the memory, which the lead's buffers would add to).
  queued_ms = _harness.time_torch(step, reps=reps, lead_ms=20.0)
  return dict(ms=ms, queued_ms=queued_ms, loss=float(state["loss"].detach()),
              torch_peak_bytes=int(torch_extra), jax_peak_bytes=int(jax_extra),
              extra_bytes=int(torch_extra + jax_extra - grads))


def _ppo_inputs(xt, wt, yt):
  """(advantages [N], old log-probs [N]) as benchmarks/linear_cross_entropy.py's
  `ppo_sequence` sets make them: one normal advantage per sequence, and the tokens'
  log-probabilities plus normal noise of 0.2. The log-probabilities come from torch, a
  sequence at a time, so that JAX's peak memory (which cannot be reset) holds the timed
  step's alone."""
  import torch  # pylint: disable=import-outside-toplevel
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel
  g = torch.Generator(device="cuda").manual_seed(2)
  advantages = torch.randn(N // PPO_SEQUENCE, device="cuda", generator=g)
  with torch.no_grad():
    log_p = torch.cat([
        -F.cross_entropy(F.linear(xt[i:i + PPO_SEQUENCE], wt).float(),
                         yt[i:i + PPO_SEQUENCE], reduction="none")
        for i in range(0, N, PPO_SEQUENCE)])
  noise = 0.2 * torch.randn(N, device="cuda", generator=g)
  return advantages.repeat_interleave(PPO_SEQUENCE), log_p + noise


def attention_worker(provider: str, causal: bool, reps: int) -> dict:
  import torch  # pylint: disable=import-outside-toplevel
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel
  from benchmarks import _harness  # pylint: disable=import-outside-toplevel

  torch.manual_seed(0)
  bthd = provider in ("memeff", "jax_direct")
  shape = (B, T, H, HD) if bthd else (B, H, T, HD)
  q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_()
             for _ in range(3))
  do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
  grads = 3 * q.numel() * 2
  if provider == "jax_direct":
    import jax  # pylint: disable=import-outside-toplevel
    from memeff_jax import flash_attention  # pylint: disable=import-outside-toplevel
    from memeff_jax.interop import torch as mt  # pylint: disable=import-outside-toplevel
    qj, kj, vj, doj = (mt.to_jax(t) for t in (q, k, v, do))
    fwd = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=causal))
    fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(lambda *a: flash_attention(
        *a, causal=causal), q, k, v)[1](do))
    return dict(fwd_ms=_harness.time_jax(fwd, qj, kj, vj, reps=reps),
                ms=_harness.time_jax(fwd_bwd, qj, kj, vj, doj, reps=reps),
                extra_bytes=_harness.jax_temp_bytes(fwd_bwd, qj, kj, vj, doj))
  if provider == "memeff":
    from memeff_jax.interop import torch as mt  # pylint: disable=import-outside-toplevel
    attend = lambda: mt.flash_attention(q, k, v, causal=causal)
  else:
    from torch.nn.attention import SDPBackend, sdpa_kernel  # pylint: disable=import-outside-toplevel
    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
               "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[provider]

    def attend():
      with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

  def fwd():
    with torch.no_grad():
      attend()

  def fwd_bwd():
    q.grad = k.grad = v.grad = None
    attend().backward(do)

  fwd_ms = _harness.time_torch(fwd, reps=reps)
  torch.cuda.synchronize()
  torch.cuda.reset_peak_memory_stats()
  base = torch.cuda.memory_allocated()
  jax_base = _jax_bytes()[0] if provider == "memeff" else 0
  ms = _harness.time_torch(fwd_bwd, reps=reps)
  torch_extra = torch.cuda.max_memory_allocated() - base
  jax_extra = max(0, _jax_bytes()[1] - jax_base) if provider == "memeff" else 0
  queued_ms = _harness.time_torch(fwd_bwd, reps=reps, lead_ms=20.0)
  return dict(fwd_ms=fwd_ms, ms=ms, queued_ms=queued_ms, torch_peak_bytes=int(torch_extra),
              jax_peak_bytes=int(jax_extra), extra_bytes=int(torch_extra + jax_extra - grads))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--op", default="loss,attention")
  p.add_argument("--providers", default=None, help="default: every provider of the op")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  p.add_argument("--causal", type=int, default=0, help=argparse.SUPPRESS)
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "torch_bridge.jsonl"))
  args = p.parse_args(argv)
  if args.worker:
    op, provider = args.worker.split("/", 1)
    row = (attention_worker(provider, bool(args.causal), args.reps) if op == "attention"
           else loss_worker(provider, args.reps, ppo=op == "ppo"))
    print(json.dumps(row), flush=True)
    # The row is out: skip the interpreter's teardown, where JAX's and torch's C++ state are
    # destroyed in no fixed order (an eager autograd.Function path of the
    # bridge, since removed, made workers abort there with "terminate called without an
    # active exception" after their results; the custom ops did not, in 12 processes).
    sys.stderr.flush()
    os._exit(0)
  from benchmarks import _harness  # pylint: disable=import-outside-toplevel
  env = _harness.environment()
  cache = (os.environ.get("JAX_COMPILATION_CACHE_DIR")
           or tempfile.mkdtemp(prefix="memeff-bridge-jax-cache-"))
  for op in args.op.split(","):
    providers = (args.providers or dict(loss=LOSS_PROVIDERS, ppo=PPO_PROVIDERS,
                                        attention=ATTENTION_PROVIDERS)[op]).split(",")
    for causal in ([False, True] if op == "attention" else [None]):
      print(f"{op}{'' if causal is None else f' causal={causal}'} on {env['device']}",
            flush=True)
      rows, floor = [], None
      for provider in providers:
        cmd = [sys.executable, __file__, "--worker", f"{op}/{provider}", "--causal",
               str(int(bool(causal)))]
        environ = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        if provider.startswith("memeff") and "async" in _modifiers(provider):
          environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = "cuda_async"
        if provider.startswith("memeff"):
          # JAX's peak_bytes_in_use cannot be reset and counts the autotuner's scratch
          # buffers of the first compile (2 GiB at the loss's shape, H100): a first process
          # fills the persistent cache, the second loads the executable and measures
          # steady-state memory.
          environ["JAX_COMPILATION_CACHE_DIR"] = cache
          subprocess.run(cmd + ["--reps", "1"], capture_output=True, check=False, env=environ)
        proc = subprocess.run(cmd + ["--reps", str(args.reps)], capture_output=True, text=True,
                              check=False, env=environ)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        row = dict(op=f"torch_bridge_{op}", provider=provider, **env)
        if op == "attention":
          row.update(b=B, t=T, h=H, d=HD, causal=causal)
          flops = 4 * B * H * T * T * HD / (2 if causal else 1)
        else:
          row.update(n=N, d=D, v=V, **(dict(ppo_sequence=PPO_SEQUENCE) if op == "ppo" else {}))
          flops = 6 * N * D * V
        if proc.returncode or not lines:
          tail = (proc.stderr.strip().splitlines() or ["failed"])[-1]
          row["error"] = tail[:300]
          print(f"  {provider:18s} ERROR {tail[:200]}", flush=True)
        else:
          row.update(json.loads(lines[-1]))
          if op == "attention":
            row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
            row["tflops"] = 3.5 * flops / row["ms"] / 1e9
          else:
            row["tflops"] = flops / row["ms"] / 1e9
            if provider == "floor":
              floor = row["ms"]
            row["ratio_to_floor"] = row["ms"] / floor if floor else None
          extra = row.get("extra_bytes")
          print(f"  {provider:18s} {row['ms']:8.2f} ms {row['tflops']:6.0f} TFLOP/s"
                + (f"  queued {row['queued_ms']:.2f} ms" if "queued_ms" in row else "")
                + (f"  fwd {row['fwd_ms']:.2f} ms {row['fwd_tflops']:.0f} TFLOP/s"
                   if "fwd_ms" in row else "")
                + ("" if extra is None else f"  extra {extra / 2**30:.3f} GiB"), flush=True)
        rows.append(row)
      direct = next((r for r in rows if r["provider"] == "jax_direct" and "ms" in r), None)
      bridged = next((r for r in rows if r["provider"] == "memeff" and "ms" in r), None)
      if direct and bridged:
        bridged["bridge_overhead"] = bridged["ms"] / direct["ms"] - 1
        print(f"  bridge overhead (memeff vs jax_direct): {bridged['bridge_overhead']:+.2%}")
      _harness.append(args.out, rows)


if __name__ == "__main__":
  main()
