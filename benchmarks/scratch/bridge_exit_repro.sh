# Session 19: does a process that ran the bridged attention abort at exit ("terminate called
# without an active exception")? Each mode a fresh process; prints mode, exit status and
# whether the abort message appeared (modes: see the script body).
. benchmarks/device_env.sh
for mode in A B C E F J K L; do
MODE=$mode timeout 100 python3 - > /tmp/o-$mode.txt 2>&1 <<'PY' 
import gc, os, sys
sys.path.insert(0, ".")
import torch, jax
import memeff_jax.interop.torch as mt
mode = os.environ["MODE"]
shape = (1, 256, 4, 64) if mode == "E" else (4, 4096, 32, 128)
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
res = None
for _ in range(3):
    with torch.no_grad():
        if mode == "B":
            mt._fa_op(q, k, v, None, None, False, None, -1, -1, None, True)
        elif mode == "C":
            mt._fa_forward(q.detach(), k.detach(), v.detach(), None, None, False, None, -1, -1, None, True)
        elif mode == "G":
            res = mt.flash_attention(q, k, v)
        elif mode == "H":
            x = torch.randn(64, 32, device="cuda"); w = torch.randn(100, 32, device="cuda")
            mt.linear_cross_entropy(x, w, torch.randint(0, 100, (64,), device="cuda"))
        elif mode == "I":
            jq = mt.to_jax(q); out = mt._fa_fwd(jq, jq, jq, None, None, causal=False, scale=None, sliding_window=None, logit_softcap=None, deterministic=True)
            mt.to_torch(out[0]); mt.to_torch(out[1])
        elif mode == "K":
            res = mt.flash_attention(q, k, v); del res; gc.collect()
        elif mode != "L":
            mt.flash_attention(q, k, v)
torch.cuda.synchronize()
if mode == "F":
    jax.effects_barrier(); gc.collect()
if mode in ("J", "K"):
    import time; time.sleep(2)
if mode == "L":  # the forward with grad enabled, inputs not requiring grad: the direct path
    for _ in range(3):
        mt.flash_attention(q.detach(), k.detach(), v.detach())
    torch.cuda.synchronize()
print("done", mode, flush=True)
PY
echo "$mode rc=$? $(grep -c terminate /tmp/o-$mode.txt)"
done
