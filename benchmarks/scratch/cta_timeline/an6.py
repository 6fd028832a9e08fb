import json, sys, numpy as np
D = sys.argv[1]
meta = json.load(open(D + "/traces.json"))
for tag, m in meta.items():
  if tag.startswith("plain"): continue
  z = np.load(f"{D}/{tag}.npz"); cta = z["cta"].astype(np.int64); st = z["steps"].astype(np.int64)
  n_kv = m["n_kv"]
  x = np.arange(len(cta)) % n_kv
  lf = tag.endswith("_lf")
  kvi = n_kv - 1 - x if lf else x
  steps = n_kv - kvi
  base = (cta[:, 0] & 0xffffffff).min()
  norm = lambda a: ((a & 0xffffffff) - base) % 2**32
  start, end = norm(cta[:, 0]), norm(cta[:, 1])
  span = end.max() / 1e6
  dur = end - start
  per = dur.sum() / steps.sum()
  # step-level: valid where step < steps
  valid = np.arange(st.shape[1])[None, :] < steps[:, None]
  s = norm(st)
  # intervals (ns): load wait = c1-c0, compute to store = c2-c1, store wait = c3-c2, next step begin - c3
  lw = (s[:, :, 1] - s[:, :, 0])[valid]
  comp = (s[:, :, 2] - s[:, :, 1])[valid]
  sw = (s[:, :, 3] - s[:, :, 2])[valid]
  nxt = (s[:, 1:, 0] - s[:, :-1, 3])[valid[:, 1:]]
  out = f"{tag}: plain {m['plain_ms']:.3f} span {span:.3f} ms, per-step {per:.0f} ns | load wait {lw.mean():.0f}, compute→store {comp.mean():.0f}, store wait {sw.mean():.0f}, store→next {nxt.mean():.0f}"
  if "ord" in tag:
    full_to_cnt = (s[:, :, 5] - s[:, :, 4])[valid]
    cnt_to_read = (s[:, :, 6] - s[:, :, 5])[valid]
    read_to_land = (s[:, :, 7] - s[:, :, 6])[valid]
    # send warp's full seen vs compute's store end (c3) of same step
    lag = (s[:, :, 4] - s[:, :, 3])[valid]
    nextfull = (s[:, 1:, 4] - s[:, :-1, 7])[valid[:, 1:]]
    out += f"\n    send: store→full seen {lag.mean():.0f}, counter wait {full_to_cnt.mean():.0f}, issue+read {cnt_to_read.mean():.0f}, land {read_to_land.mean():.0f}, land→next full {nextfull.mean():.0f}"
    # compute's store wait (free) relative to the previous step's read done
  print(out)
  pct = lambda a: np.percentile(a, [10, 50, 90]).round(0)
  print("    load wait p10/50/90", pct(lw), " store wait", pct(sw), " compute", pct(comp))
