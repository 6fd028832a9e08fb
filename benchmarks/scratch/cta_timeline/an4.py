import json, sys, numpy as np
D = sys.argv[1]
meta_all = json.load(open(D + "/traces.json")); npz = np.load(D + "/traces.npz")
def table(tag):
  m = meta_all[tag]; buf = npz[tag].astype(np.int64)
  n_kv, b, h = m["n_kv"], m["b"], m["h"]
  launch = np.arange(len(buf))
  x = launch % n_kv
  last_first = tag.endswith("_lf") or (tag.endswith("_ord") and n_kv > 64)
  kvi = n_kv - 1 - x if last_first else x
  steps = n_kv - kvi
  s0 = buf[:, 0] & 0xffffffff; e0 = buf[:, 1] & 0xffffffff
  base = s0.min()
  start = ((s0 - base) % 2**32).astype(float); end = ((e0 - base) % 2**32).astype(float)
  return dict(tag=tag, m=m, kvi=kvi, steps=steps, start=start, end=end, sm=buf[:, 2], launch=launch)
def summary(t):
  dur = t["end"] - t["start"]
  span = t["end"].max(); nsm = len(np.unique(t["sm"]))
  # fit dur = a + c*steps by least squares
  A = np.stack([np.ones_like(dur), t["steps"]], 1)
  (a, c), *_ = np.linalg.lstsq(A, dur, rcond=None)
  print(f"{t['tag']}: plain {t['m']['plain_ms']:.3f} ms, span {span/1e6:.3f} ms, SMs {nsm}, util {dur.sum()/(nsm*span):.3f}, "
        f"fit: {a:.0f} ns + {c:.0f} ns/step")
  q = np.quantile(t["start"], np.linspace(0, 1, 11))
  out = []
  for lo, hi in zip(q[:-1], q[1:]):
    mm = (t["start"] >= lo) & (t["start"] <= hi)
    out.append(f"{(dur[mm] - a).sum()/t['steps'][mm].sum():.0f}")
  print("   per-step (less the fit's fixed) by start decile:", " ".join(out))
  edges = [1, 2, 4, 8, 16, 32, 64, 128, 256, 257]
  out = []
  for lo, hi in zip(edges[:-1], edges[1:]):
    mm = (t["steps"] >= lo) & (t["steps"] < hi)
    if mm.any():
      out.append(f"[{lo},{hi}) {dur[mm].sum()/t['steps'][mm].sum():.0f}")
  print("   ns/step by walk length:", ", ".join(out))
if __name__ == "__main__":
  for tag in meta_all:
    summary(table(tag))
