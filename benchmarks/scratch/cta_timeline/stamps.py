"""Per-CTA and per-step stamps of the Mosaic backward (MEMEFF_TRACE=1): python -m benchmarks.scratch.cta_timeline.stamps SHAPE... (SHAPE as profile_kernels.py --attention)."""
import os, sys, time
os.environ["MEMEFF_TRACE"] = "1"
import numpy as np, jax
from benchmarks.flash_attention import attention_fn, inputs, window_of
import jax.numpy as jnp
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb

def run(spec):
  sizes = {k: int(v) for k, v in (p.split("=") for p in spec.split(","))}
  causal = bool(sizes.pop("causal", 1))
  q, k, v, ct, seg = inputs(sizes, jnp.bfloat16)
  f = attention_fn(os.environ.get("PROVIDER", "memeff"), causal, seg, window_of(sizes, causal))
  g = jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1](ct))
  for _ in range(4):
    jax.block_until_ready(g(q, k, v))
  jax.effects_barrier()
  mb.TRACES.clear()
  for _ in range(3):
    jax.block_until_ready(g(q, k, v))
  jax.effects_barrier()
  return mb.TRACES[-1]

def analyze(name, tr):
  cta, st = tr
  cta = cta.astype(np.int64); st = st.astype(np.int64)
  gt = lambda w: cta[:, 2 * w]; ck = lambda w: cta[:, 2 * w + 1]
  def d(a, b):  # clock difference, wrap-safe
    return (b - a) % (1 << 32)
  span_ns = (gt(5) - gt(0)) % (1 << 32)
  span_ck = d(ck(0), ck(5))
  ghz = np.median(span_ck / np.maximum(span_ns, 1))
  us = lambda c: c / ghz / 1e3
  n = len(cta)
  sm = cta[:, 14]
  t0 = gt(0).min()
  start = (gt(0) - t0) % (1 << 32); end = (gt(5) - t0) % (1 << 32)
  kern = (end.max() - start.min()) / 1e3
  print(f"== {name}: {n} CTAs, kernel span {kern:.1f} us, clock {ghz:.3f} GHz, SMs {len(set(sm))}")
  pro = us(d(ck(0), ck(1))); loop = us(d(ck(1), ck(2))); pair = us(d(ck(2), ck(3)))
  put = us(d(ck(3), ck(4))); rd = us(d(ck(4), ck(5))); tot = us(span_ck)
  for nm, x in (("K/V wait", pro), ("loop", loop), ("pair", pair), ("put", put), ("stores read", rd), ("CTA", tot)):
    print(f"  {nm:12s} mean {x.mean():7.2f} us  median {np.median(x):7.2f}  p90 {np.percentile(x, 90):7.2f}  sum/132 {x.sum()/132:8.1f}")
  # steps
  flag = st[:, :, 14]
  rows = []
  for m, lab in ((1, "unmasked"), (2, "masked")):
    sel = flag == m
    if not sel.any():
      continue
    s0, s1, s2, s3 = (st[:, :, 2 * w + 1] for w in range(4))
    w_ = us(d(s0, s1))[sel]; sm_ = us(d(s1, s2))[sel]; gr = us(d(s2, s3))[sel]; tt = us(d(s0, s3))[sel]
    print(f"  {lab:9s} steps {sel.sum():6d}: total {tt.mean():6.2f} us (median {np.median(tt):6.2f})  Q wait {w_.mean():5.2f}  scores+softmax {sm_.mean():5.2f}  grads+dq {gr.mean():5.2f}  sum/132 {tt.sum()/132:8.1f}")
  # first step vs later
  s0, s1 = st[:, :, 1], st[:, :, 3]
  has = flag[:, 0] > 0
  fw = us(d(s0[has, 0], s1[has, 0]))
  print(f"  first step's Q/dO wait mean {fw.mean():.2f} us; later steps' {us(d(s0, s1))[:, 1:][flag[:, 1:] > 0].mean():.2f}")
  # gaps between steps: end of step i to start of step i+1
  s3 = st[:, :, 7]; nxt = st[:, :, 1]
  both = (flag[:, :-1] > 0) & (flag[:, 1:] > 0)
  gap = us(d(s3[:, :-1], nxt[:, 1:]))[both]
  print(f"  between steps mean {gap.mean():.2f} us; loop start -> first step {us(d(ck(1)[has], s0[has, 0])).mean():.2f}; last step end -> loop end {np.mean([us(d(st[i, (flag[i] > 0).sum() - 1, 7], ck(2)[i])) for i in range(n) if flag[i, 0] > 0 and (flag[i] > 0).sum() <= st.shape[1]]):.2f}")
  # per SM: gaps between consecutive CTAs, overlap
  gaps, over, busy = [], 0, 0
  for s in set(sm):
    idx = np.where(sm == s)[0]
    o = idx[np.argsort(start[idx])]
    busy += (end[o] - start[o]).sum()
    for a, b in zip(o[:-1], o[1:]):
      g_ = start[b] - end[a]
      if g_ < 0: over += 1
      else: gaps.append(g_)
  gaps = np.array(gaps) / 1e3
  print(f"  per SM: {len(gaps)} gaps between CTAs mean {gaps.mean():.2f} us median {np.median(gaps):.2f} (sum/132 {gaps.sum()/132:.1f}); overlapping pairs {over}; busy {busy/1e3/132/kern:.3f} of span")
  first = np.sort(start)[:132].max() / 1e3; last_end = np.sort(end)
  print(f"  first wave starts by {first:.2f} us; last CTA end {end.max()/1e3:.1f}; 132nd-last end {last_end[-132]/1e3:.1f}")

def rows(tr):
  n_kv = int(os.environ.get("N_KV", 0))
  if not n_kv:
    return
  cta, st = tr
  cta = cta.astype(np.int64); st = st.astype(np.int64)
  d = lambda a, b: (b - a) % (1 << 32)
  gt = cta[:, 0]; t0 = gt.min()
  start = (gt - t0) / 1e3; end = ((cta[:, 10] - t0) % (1 << 32)) / 1e3
  ghz = np.median(d(cta[:, 1], cta[:, 11]) / np.maximum(d(cta[:, 0], cta[:, 10]), 1))
  flag = st[:, :, 14]
  step = d(st[:, :, 1], st[:, :, 7]) / ghz / 1e3
  grads = d(st[:, :, 5], st[:, :, 7]) / ghz / 1e3
  qw = d(st[:, :, 1], st[:, :, 3]) / ghz / 1e3
  print(f"  per head row ({n_kv} CTAs each): start min/median/max, end max, step mean, Q wait, grads+dq; kv 0, n/2, n-1 starts")
  nr = len(cta) // n_kv
  for r in sorted(set(list(range(min(nr, 10))) + [nr - 2, nr - 1])):
    s_ = slice(r * n_kv, (r + 1) * n_kv)
    m = flag[s_] > 0
    print(f"   row {r}: start {start[s_].min():8.1f} {np.median(start[s_]):8.1f} {start[s_].max():8.1f} end {end[s_].max():8.1f}"
          f"  step {step[s_][m].mean():5.2f} qwait {qw[s_][m].mean():5.2f} grads {grads[s_][m].mean():5.2f}"
          f"  kv0 {start[r*n_kv]:8.1f} mid {start[r*n_kv+n_kv//2]:8.1f} last {start[(r+1)*n_kv-1]:8.1f}")

for spec in sys.argv[1:]:
  tr = run(spec)
  rows(tr)
  analyze(spec, tr)
