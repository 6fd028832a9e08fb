"""Host time of each piece of a bridged attention call (B=4 H=32 T=4096 D=128 bf16), with
the GPU kept busy behind ~20 ms of matmuls before every measurement, so that no piece
waits for the GPU: what the host spends before the GPU can start (session 20).

    python benchmarks/scratch/bridge_attn_host.py [--reps 20] [--causal 1]
"""
import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
import jax  # noqa: E402

import memeff_jax.interop.torch as mt  # noqa: E402
from benchmarks import _harness  # noqa: E402
from bridge_attn_ab import lean_call  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--reps", type=int, default=20)
parser.add_argument("--causal", type=int, default=1)
args = parser.parse_args()

B, H, T, HD = 4, 32, 4096, 128
causal = bool(args.causal)
torch.manual_seed(0)
q, k, v = (torch.randn(B, T, H, HD, device="cuda", dtype=torch.bfloat16).requires_grad_()
           for _ in range(3))
do = torch.randn(B, T, H, HD, device="cuda", dtype=torch.bfloat16)
lead = _harness._lead_work(20.0)
kw = dict(causal=causal, scale=None, sliding_window=None, logit_softcap=None,
          deterministic=True)
opts = (causal, None, -1, -1, None, True)
body = getattr(mt._fa_op, "_init_fn", None)
out_t, lse_t = mt._fa_op(q.detach(), k.detach(), v.detach(), None, None, *opts)
args_f = mt._to_jax_call(q, k, v, None, None)
with mt._on(q):
  out_j, lse_j = mt._fa_fwd(*args_f, **kw)
args_b = mt._to_jax_call(q, k, v, out_t, lse_t, do, None, None, None)


def fwd_call():
  with mt._on(q):
    return mt._fa_fwd(*args_f, **kw)


def bwd_call():
  with mt._on(q):
    return mt._fa_bwd(*args_b, **kw)


def full_step():
  out = mt.flash_attention(q, k, v, causal=causal)
  out.backward(do)


pieces = {
    "import q,k,v (library)": lambda: mt._to_jax_call(q, k, v, None, None),
    "import q,k,v (lean)": lambda: lean_call(q, k, v, None, None),
    "import 6 for the backward (library)": lambda: mt._to_jax_call(q, k, v, out_t, lse_t, do,
                                                                   None, None, None),
    "import 6 for the backward (lean)": lambda: lean_call(q, k, v, out_t, lse_t, do, None,
                                                          None, None),
    "jitted forward, call returns": fwd_call,
    "jitted backward, call returns": bwd_call,
    "to_torch(out), to_torch(lse)": lambda: (mt.to_torch(out_j), mt.to_torch(lse_j)),
    "forward op body (no custom op)": (lambda: body(q.detach(), k.detach(), v.detach(), None,
                                                    None, *opts)) if body else None,
    "forward custom op, no grad": lambda: mt._fa_op(q.detach(), k.detach(), v.detach(), None,
                                                    None, *opts),
    "flash_attention, requires grad": lambda: mt.flash_attention(q, k, v, causal=causal),
    "fwd+bwd step": full_step,
}
for name, fn in pieces.items():
  if fn is None:
    continue
  fn()
  times = []
  for _ in range(args.reps):
    q.grad = k.grad = v.grad = None
    lead()
    t0 = time.perf_counter()
    fn()
    times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
  print(f"{name:40s} {statistics.median(times):7.3f} ms  (min {min(times):.3f})", flush=True)
