import json, sys, numpy as np
D = sys.argv[1]
meta = json.load(open(D + "/traces.json"))
for tag, m in meta.items():
  z = np.load(f"{D}/{tag}.npz"); cta = z["cta"].astype(np.int64); st = z["steps"].astype(np.int64)
  n_kv = m["n_kv"]
  x = np.arange(len(cta)) % n_kv
  kvi = n_kv - 1 - x if tag.endswith("lf") else x
  steps = n_kv - kvi
  base = (cta[:, 0] & 0xffffffff).min()
  norm = lambda a: ((a & 0xffffffff) - base) % 2**32
  start, end = norm(cta[:, 0]), norm(cta[:, 1])
  clk = ((cta[:, 4] & 0xffffffff) - (cta[:, 3] & 0xffffffff)) % 2**32
  F = clk / (end - start)
  dur = end - start
  valid = np.arange(st.shape[1])[None, :] < steps[:, None]
  s = norm(st)
  seg = lambda a, b: (s[:, :, b] - s[:, :, a])[valid].mean()
  print(f"{tag}: span {end.max()/1e6:.3f} ms, per-step {dur.sum()/steps.sum():.0f} ns, SM clock {np.median(F):.3f} GHz (p10 {np.percentile(F,10):.3f} p90 {np.percentile(F,90):.3f})")
  zg = (s[:, :, 12] - s[:, :, 0])[valid]
  print(f"   z arrival after step start: mean {zg.mean():.0f} p50 {np.median(zg):.0f} p90 {np.percentile(zg, 90):.0f}")
  print(f"   load wait {seg(0,1):.0f} | scores {seg(1,8):.0f} | softmax {seg(8,9):.0f} | dV,dK {seg(9,10):.0f} | dS exchange {seg(10,11):.0f} | dQ mm {seg(11,2):.0f} | store wait {seg(2,3):.0f} | to next {(s[:,1:,0]-s[:,:-1,3])[valid[:,1:]].mean():.0f}")
