# Session 19: how often a process that ran the bridged attention aborts at exit ("terminate
# called without an active exception"), attention forwards (fn, op, keep) or the loss's
# forward+backward (lce-fn, lce-op). In session 19 "fn" was an eager autograd.Function /
# direct call of the op's forward, "op" the custom op, "keep" fn with every tensor handed to
# JAX's from_dlpack kept alive in Python until exit (fn 5/6, keep 1/6, op 0/6 aborted;
# lce-fn 1/6, lce-op 0/6); the Function was removed, so all modes now take the custom op.
# Prints counts of "mode aborted(0/1)".
. benchmarks/device_env.sh
for rep in 1 2 3 4 5 6; do
for mode in ${MODES:-fn op keep}; do
MODE=$mode timeout 100 python3 - 2>&1 <<'PY' | grep -c terminate | sed "s/^/$mode /"
import os, sys
sys.path.insert(0, ".")
import torch, jax
import memeff_jax.interop.torch as mt
mode = os.environ["MODE"]
if mode.endswith("op"):
    mt._plain_eager = lambda *a: False
if mode == "keep":
    kept, from_dlpack = [], jax.dlpack.from_dlpack
    def keeping(t, *a, **k):
        kept.append(t)
        return from_dlpack(t, *a, **k)
    jax.dlpack.from_dlpack = keeping
q, k, v = (torch.randn(4, 4096, 32, 128, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16).requires_grad_()
w = torch.randn(32000, 1024, device="cuda", dtype=torch.bfloat16).requires_grad_()
y = torch.randint(0, 32000, (4096,), device="cuda")
for _ in range(3):
    if mode.startswith("lce"):
        mt.linear_cross_entropy(x, w, y).backward()
    else:
        with torch.no_grad():
            mt.flash_attention(q, k, v)
torch.cuda.synchronize()
print("done", flush=True)
PY
done
done | sort | uniq -c
