"""Diagnostics for the pallas_gpu path at one shape: largest XLA allocations, and the time
of each piece of one token chunk (logits GEMM, softmax kernel, dx GEMM, dW GEMM+add).

    python benchmarks/lce_breakdown.py --n 16384 --d 4096 --v 128256 --chunk 1024
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile

dump = tempfile.mkdtemp()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_dump_to={dump} --xla_dump_hlo_module_re=.*loss.*")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _harness  # noqa: E402
import memeff_jax  # noqa: E402
from memeff_jax.ops.linear_cross_entropy import _common  # noqa: E402
from memeff_jax.ops.linear_cross_entropy import pallas_gpu  # noqa: E402


def largest_allocations(pattern: str, top: int = 14):
  """The largest HLO values in XLA's buffer assignment dump (name, shape, bytes, allocation)."""
  files = sorted(glob.glob(os.path.join(dump, pattern)))
  if not files:
    print("  (no buffer assignment dumped)")
    return
  values = _harness.buffer_values(files[-1])
  for name, (size, shape, kind) in sorted(values.items(), key=lambda kv: -kv[1][0])[:top]:
    print(f"  {size / 2**30:8.3f} GiB  {kind:6s} {shape:28s} {name}")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--n", type=int, default=16384)
  p.add_argument("--d", type=int, default=4096)
  p.add_argument("--v", type=int, default=128256)
  p.add_argument("--chunk", type=int, default=1024)
  p.add_argument("--sweep", default="", help="kernel configs rows/v/warps/stages,...")
  a = p.parse_args()
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (a.n, a.d), jnp.bfloat16)
  w = (jax.random.normal(k[1], (a.d, a.v), jnp.float32) / a.d**0.5).astype(jnp.bfloat16)
  y = jax.random.randint(k[2], (a.n,), 0, a.v)

  def loss(x, w):
    return memeff_jax.linear_cross_entropy(x, w, y, chunk_size=a.chunk)

  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  m = f.lower(x, w).compile().memory_analysis()
  print(f"temp {m.temp_size_in_bytes / 2**30:.3f} GiB, out {m.output_size_in_bytes / 2**30:.3f}"
        f" GiB, alias {m.alias_size_in_bytes / 2**30:.3f} GiB")
  largest_allocations("*loss*after_optimizations-buffer-assignment.txt")

  c = a.chunk
  xc, yc = x[:c], y[:c]
  opts = _common.LossOptions(vocab_size=a.v)
  cfg = pallas_gpu.KernelConfig()
  r = jnp.full((c,), 1.0 / a.n, jnp.float32)
  logits = jax.jit(lambda xc, w: _common.logits_dot(xc, w, "dv", jnp.bfloat16))
  z = logits(xc, w)
  def fused(cfg):  # logits GEMM then the kernel writing G over them (no copy)
    return jax.jit(lambda xc, w, yc, r: pallas_gpu.softmax_pass(
        _common.logits_dot(xc, w, "dv", jnp.bfloat16), yc, r, jnp.zeros_like(r),
        opts=opts, config=cfg)[0])

  kern = fused(cfg)
  stats = jax.jit(lambda z, yc: pallas_gpu.softmax_pass(z, yc, opts=opts, config=cfg))
  g = kern(xc, w, yc, r)
  dx = jax.jit(lambda g, w: _common.dx_dot(g, w, "dv", jnp.bfloat16))
  dw_acc = jax.jit(lambda acc, xc, g: acc + _common.dw_dot(xc, g, "dv", jnp.bfloat16),
                   donate_argnums=0)
  dw_new = jax.jit(lambda xc, g: _common.dw_dot(xc, g, "dv", jnp.bfloat16))
  acc = jnp.zeros_like(w)
  gemm = 2.0 * c * a.d * a.v
  logit_bytes = c * a.v * 2
  rows = [("logits GEMM x@W", _harness.time_jax(logits, xc, w, inner=20), gemm, None),
          ("logits GEMM + kernel", _harness.time_jax(kern, xc, w, yc, r, inner=20), None, None),
          ("stats-only kernel", _harness.time_jax(stats, z, yc, inner=20), None, logit_bytes),
          ("dx GEMM G@Wᵀ", _harness.time_jax(dx, g, w, inner=20), gemm, None),
          ("dW GEMM xᵀ@G (new)", _harness.time_jax(dw_new, xc, g, inner=20), gemm, None)]
  state = {"acc": acc}

  def step():
    state["acc"] = dw_acc(state["acc"], xc, g)
    return state["acc"]

  rows.append(("dW GEMM + accumulate", _harness.time_jax(step, inner=20), gemm, None))
  for name, ms, flops, nbytes in rows:
    extra = (f"{flops / ms / 1e9:7.1f} TFLOP/s" if flops else
             f"{nbytes / ms / 1e6:7.1f} GB/s" if nbytes else "")
    print(f"  {name:28s} {ms:8.3f} ms  {extra}")
  gemm_ms = rows[0][1]
  if a.sweep:
    print("kernel sweep (logits GEMM + kernel, minus the GEMM; GB/s for 3 passes over z):")
    for spec in a.sweep.split(","):
      br, bv, nw, ns, hints = map(int, (spec.split("/") + ["1"])[:5])
      cfg = pallas_gpu.KernelConfig(block_rows=br, block_v=bv, num_warps=nw, num_stages=ns,
                                    l2_hints=bool(hints))
      try:
        ms = _harness.time_jax(fused(cfg), xc, w, yc, r, inner=20) - gemm_ms
        print(f"  rows={br} v={bv:5d} warps={nw:2d} stages={ns} hints={hints}  {ms:7.3f} ms "
              f"{3 * logit_bytes / ms / 1e6:7.1f} GB/s", flush=True)
      except Exception as err:  # pylint: disable=broad-except
        print(f"  {spec}: {type(err).__name__}: {str(err)[:200]}")


if __name__ == "__main__":
  main()
