"""Bridged attention (B=4 H=32 T=4096 D=128 bf16) against one jitted JAX vjp: where the
bridge's extra time goes (session 20). In one process, interleaved rounds of fwd+bwd from
an idle GPU (CUDA events on torch's stream), and the host's own time per call measured
while the GPU is busy behind ~20 ms of matmuls (so no wait for the GPU is counted).

Variants of the bridge, monkeypatched here:
  bridge      as the library is
  nocb        its two jitted functions compiled without XLA command buffers (CUDA graphs),
              whose kernel arguments must be updated when buffer addresses change
  lean        imports through jaxlib's dlpack_managed_tensor_to_buffer directly, without
              jax.dlpack.from_dlpack's Python (device lookup, jnp.asarray)
  lean_nocb   both
and jax_direct (one jitted vjp on imported arrays, wall clock) and sdpa_cudnn.

    python benchmarks/scratch/bridge_attn_ab.py [--causal 0,1] [--rounds 5] [--reps 10]
"""
import argparse
import functools
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
import jax  # noqa: E402
from jax._src import xla_bridge  # noqa: E402
from jax._src.lib import _jax  # noqa: E402

import memeff_jax.interop.torch as mt  # noqa: E402
from memeff_jax import flash_attention  # noqa: E402
from benchmarks import _harness  # noqa: E402

B, H, T, HD = 4, 32, 4096, 128
ORIG = dict(fwd=mt._fa_fwd, bwd=mt._fa_bwd, call=mt._to_jax_call)
NOCB = {"xla_gpu_enable_command_buffer": ""}
NOCB_FNS = dict(
    fwd=jax.jit(mt._fa_fwd.__wrapped__, static_argnames=mt._FA_STATIC, compiler_options=NOCB),
    bwd=jax.jit(mt._fa_bwd.__wrapped__, static_argnames=mt._FA_STATIC, compiler_options=NOCB))


@functools.lru_cache(maxsize=None)
def _device(kind, index):
  t = torch.empty(1, device=torch.device(kind, index))
  dl_type, dev_id = t.__dlpack_device__()
  platform = "cuda" if kind == "cuda" else "cpu"
  return xla_bridge.get_backend(platform).device_from_local_hardware_id(dev_id), int(dl_type)


def lean_call(*tensors):
  out, synced = [], False
  for t in tensors:
    if t is None:
      out.append(None)
      continue
    t = mt._exportable(t)
    dev, dl_type = _device(t.device.type, t.device.index or 0)
    stream = dev.get_stream_for_external_ready_events() if t.is_cuda else None
    capsule = t.__dlpack__(stream=-1 if synced else stream) if t.is_cuda else t.__dlpack__()
    out.append(_jax.dlpack_managed_tensor_to_buffer(capsule, dev, stream, None, dl_type))
    synced = synced or t.is_cuda
  return out


def use(variant):
  mt._fa_fwd, mt._fa_bwd = ((NOCB_FNS["fwd"], NOCB_FNS["bwd"]) if "nocb" in variant
                            else (ORIG["fwd"], ORIG["bwd"]))
  mt._to_jax_call = lean_call if "lean" in variant else ORIG["call"]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--causal", default="0,1")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--variants", default="bridge,nocb,lean,lean_nocb,jax_direct,sdpa_cudnn")
  args = parser.parse_args()
  torch.manual_seed(0)
  q, k, v = (torch.randn(B, T, H, HD, device="cuda", dtype=torch.bfloat16).requires_grad_()
             for _ in range(3))
  do = torch.randn(B, T, H, HD, device="cuda", dtype=torch.bfloat16)
  qh, kh, vh = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
  doh = do.transpose(1, 2).contiguous()
  lead = _harness._lead_work(20.0)

  def bridged(variant, causal):
    def step():
      use(variant)
      q.grad = k.grad = v.grad = None
      mt.flash_attention(q, k, v, causal=causal).backward(do)

    def host():
      """(forward, backward) host ms while the GPU is busy."""
      use(variant)
      q.grad = k.grad = v.grad = None
      lead()
      t0 = time.perf_counter()
      out = mt.flash_attention(q, k, v, causal=causal)
      t1 = time.perf_counter()
      out.backward(do)
      t2 = time.perf_counter()
      torch.cuda.synchronize()
      return (t1 - t0) * 1e3, (t2 - t1) * 1e3
    return step, host

  def check(causal):
    """The variants' gradients equal the bridge's bit for bit."""
    grads = {}
    for variant in ("bridge", "nocb", "lean", "lean_nocb"):
      use(variant)
      q.grad = k.grad = v.grad = None
      mt.flash_attention(q, k, v, causal=causal).backward(do)
      grads[variant] = [t.grad.clone() for t in (q, k, v)]
    base = grads.pop("bridge")
    for name, g in grads.items():
      same = all(torch.equal(a, b) for a, b in zip(g, base))
      print(f"  {name}: grads {'bitwise equal' if same else 'DIFFER'} to the bridge's")

  for causal in (bool(int(c)) for c in args.causal.split(",")):
    print(f"causal={causal}", flush=True)
    check(causal)
    variants = args.variants.split(",")
    timers, hosts = {}, {}
    for variant in variants:
      if variant == "jax_direct":
        qj, kj, vj, doj = (mt.to_jax(t) for t in (q, k, v, do))
        fb = jax.jit(lambda q_, k_, v_, do_, c=causal: jax.vjp(
            lambda *a: flash_attention(*a, causal=c), q_, k_, v_)[1](do_))
        timers[variant] = functools.partial(_harness.time_jax, fb, qj, kj, vj, doj, reps=args.reps)
      elif variant == "sdpa_cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel  # pylint: disable=import-outside-toplevel

        def sdpa_step(c=causal):
          qh.grad = kh.grad = vh.grad = None
          with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(qh, kh, vh, is_causal=c).backward(doh)
        timers[variant] = functools.partial(_harness.time_torch, sdpa_step, reps=args.reps)
      else:
        step, host = bridged(variant, causal)
        timers[variant] = functools.partial(_harness.time_torch, step, reps=args.reps)
        hosts[variant] = host
    times = _harness.interleaved(timers, args.rounds)
    print("  fwd+bwd ms from an idle GPU, medians of rounds: " + "  ".join(
        f"{name} {statistics.median(ts):.3f}" for name, ts in times.items()))
    for name, ts in times.items():
      print(f"    {name}: " + " ".join(f"{x:.3f}" for x in ts))
    for variant, host in hosts.items():
      host()
      runs = [host() for _ in range(args.reps)]
      print(f"  host ms while queued, {variant}: forward "
            f"{statistics.median(r[0] for r in runs):.3f}, backward "
            f"{statistics.median(r[1] for r in runs):.3f}", flush=True)
  use("bridge")


if __name__ == "__main__":
  main()
