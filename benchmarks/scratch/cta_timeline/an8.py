import json, sys, numpy as np
D = sys.argv[1]
meta = json.load(open(D + "/traces.json"))
for tag, m in meta.items():
  z = np.load(f"{D}/{tag}.npz"); cta = z["cta"].astype(np.int64); st = z["steps"].astype(np.int64)
  n_kv = m["n_kv"]
  launch = np.arange(len(cta)); x = launch % n_kv; head = launch // n_kv
  kvi = n_kv - 1 - x if tag.endswith("_lf") else x
  steps = n_kv - kvi
  base = (cta[:, 0] & 0xffffffff).min()
  s = ((st & 0xffffffff) - base) % 2**32
  col = 4 if "ord" in tag else 3   # when the add is issued
  gaps = []; conc = []
  issue = {}
  for c in range(len(cta)):
    for i in range(steps[c]):
      qb = kvi[c] + i
      issue.setdefault((head[c], qb), []).append(s[c, i, col])
  for k, v in issue.items():
    v = np.sort(v)
    if len(v) > 1:
      gaps.extend(np.diff(v))
  gaps = np.array(gaps)
  print(f"{tag}: adds per tile gap p1/p10/p50: {np.percentile(gaps, [1, 10, 50]).round(0)}, frac gaps < 1us: {(gaps < 1000).mean():.3f}, < 2us: {(gaps < 2000).mean():.3f}")
  # Q/dO reads: the step's data-ready time per (head, qb); how many CTAs read the same block within 2 us
  rd = {}
  for c in range(len(cta)):
    for i in range(steps[c]):
      rd.setdefault((head[c], kvi[c] + i), []).append(s[c, i, 0])
  g2 = np.concatenate([np.diff(np.sort(v)) for v in rd.values() if len(v) > 1])
  print(f"    reads of one Q/dO block: gap p1/p10/p50 {np.percentile(g2, [1, 10, 50]).round(0)}")
