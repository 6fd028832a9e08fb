"""Diagnostic: which step of the bridge's backward allocates torch memory (device only)."""
import os
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import numpy as np
import torch
import memeff_jax.interop.torch as mt

N, D, V = 16384, 4096, 128256
G = 2**30
x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
w = (torch.randn(V, D, device="cuda") / np.sqrt(D)).to(torch.bfloat16).requires_grad_()
y = torch.randint(0, V, (N,), device="cuda")
orig = mt._lce_backward

def plain_return(ctx, g, *u):
  dx, dw, db = ctx.saved_tensors
  return dx, dw, None, None, None, None, None, None, None, None, None

def mul_only(ctx, g, *u):
  torch.cuda.synchronize(); a = torch.cuda.max_memory_allocated()
  dx, dw, db = ctx.saved_tensors
  torch.cuda.synchronize(); b = torch.cuda.max_memory_allocated()
  dx.mul_(g); dw.mul_(g)
  torch.cuda.synchronize(); c = torch.cuda.max_memory_allocated()
  print(f"   in bwd: before unpack {a/G:.3f} after unpack {b/G:.3f} after mul_ {c/G:.3f}")
  return dx, dw, None, None, None, None, None, None, None, None, None

for name, fn in [("current", orig), ("plain_return", plain_return), ("mul_only", mul_only)]:
  mt._lce_op.register_autograd(fn, setup_context=mt._lce_setup)
  for it in range(2):
    x.grad = w.grad = None
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    loss = mt.linear_cross_entropy(x, w, y)
    torch.cuda.synchronize(); f = torch.cuda.max_memory_allocated()
    loss.backward()
    torch.cuda.synchronize()
    print(f"{name} it{it}: base {torch.cuda.memory_allocated()/G:.3f} after fwd peak {f/G:.3f} after bwd peak {torch.cuda.max_memory_allocated()/G:.3f}")
