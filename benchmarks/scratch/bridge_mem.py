"""Diagnostic: where the bridge's memory goes, phase by phase (device only)."""
import os, sys
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import numpy as np
import torch
import jax
import memeff_jax.interop.torch as mt

N, D, V = 16384, 4096, 128256
if len(sys.argv) > 1: N, D, V = 4096, 1024, 32000
G = 2**30
ptrs = {}
orig = mt._lce_backward
def spy(ctx, g, *u):
  out = orig(ctx, g, *u)
  ptrs['dx'] = out[0].data_ptr(); ptrs['dw'] = out[1].data_ptr()
  ptrs['dx_uc'] = sys.getrefcount(out[0])
  return out
mt._lce_op.register_autograd(spy, setup_context=mt._lce_setup)
x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
w = (torch.randn(V, D, device="cuda") / np.sqrt(D)).to(torch.bfloat16).requires_grad_()
y = torch.randint(0, V, (N,), device="cuda")
def js():
  s = jax.devices()[0].memory_stats(); return f"jax in_use {s['bytes_in_use']/G:.3f} peak {s['peak_bytes_in_use']/G:.3f}"
def ts():
  return f"torch alloc {torch.cuda.memory_allocated()/G:.3f} peak {torch.cuda.max_memory_allocated()/G:.3f}"
torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); print("start", ts())
state = {}
for it in range(3):
  x.grad = w.grad = None
  torch.cuda.synchronize(); print(it, "grads cleared", js(), ts())
  loss = mt.linear_cross_entropy(x, w, y); state["loss"] = loss
  torch.cuda.synchronize(); print(it, "after fwd", js(), ts())
  loss.backward()
  torch.cuda.synchronize(); print(it, "after bwd", js(), ts(), "stolen", x.grad.data_ptr() == ptrs['dx'], w.grad.data_ptr() == ptrs['dw'])
  torch.cuda.synchronize(); print(it, "loss deleted", js(), ts())
