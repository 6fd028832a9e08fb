"""A schedule model of the one-pass attention backward with dq_ordered (CPU, no JAX):
132 SMs of one CTA each, CTAs started in launch order as SMs free up; each step takes one
unit and stores its dQ STORE into it; with an add order, a store waits for the previous
adder's release, RELEASE after that adder's step ends (TAIL after its last step). The add
order of a query block is by (step of the visit, launch position).

    python benchmarks/scratch/ordered_schedule_model.py

Modes: "arrival" (no order; each head's CTAs launched first key block first, as without
dq_ordered), "desc" (dq_ordered: launched and added last key block first, every CTA walking
its query blocks in order) and "rotate" (CTA j starts its walk at query block c·j: ranks by
visit step; CTAs may wait on ones launched after them, and a head larger than the SMs
deadlocks). Prints makespan ratios to arrival order and the share of step time idle.
"""
import heapq
import itertools

def simulate(n_heads, n_kv, n_q, causal, mode, sms=132, STORE=0.85, RELEASE=0.3, TAIL=0.2):
  launch_kv = list(range(n_kv))[::-1] if mode != "arrival" else list(range(n_kv))
  c = max(1, n_q // n_kv)
  def walk(kv):
    base = list(range(2 * kv if causal else 0, n_q))
    if mode == "rotate" and base:
      k = (c * kv) % len(base)
      return base[k:] + base[:k]
    return base
  walks = [walk(kv) for kv in range(n_kv)]
  pos = {kv: p for p, kv in enumerate(launch_kv)}
  pred = {}
  if mode != "arrival":
    for qb in range(n_q):
      adders = sorted((walks[kv].index(qb), pos[kv], kv) for kv in range(n_kv) if qb in walks[kv])
      for (_, _, a), (_, _, b) in zip(adders, adders[1:]):
        pred[(b, qb)] = a
  ctas = [(h, kv) for h in range(n_heads) for kv in launch_kv if walks[kv]]
  state = {"next": 0}
  ev, cnt = [], itertools.count()
  release, waiters, step = {}, {}, {}
  idle = finish = 0.0
  def launch(t):
    if state["next"] < len(ctas):
      cta = ctas[state["next"]]
      state["next"] += 1
      step[cta] = 0
      heapq.heappush(ev, (t + STORE, next(cnt), cta, False))
  for _ in range(sms):
    launch(0.0)
  while ev:
    T, _, cta, cleared = heapq.heappop(ev)
    h, kv = cta
    s = step[cta]
    qb = walks[kv][s]
    p = pred.get((kv, qb))
    if p is not None and not cleared:
      key = (h, p, qb)
      if key not in release:
        waiters.setdefault(key, []).append((T, cta))
        continue
      if release[key] > T:
        idle += release[key] - T
        T = release[key]
    end = T + (1 - STORE)
    last = s + 1 == len(walks[kv])
    r = end + (TAIL if last else RELEASE)
    release[(h, kv, qb)] = r
    for Tw, w in waiters.pop((h, kv, qb), []):
      idle += max(Tw, r) - Tw
      heapq.heappush(ev, (max(Tw, r), next(cnt), w, True))
    if last:
      finish = max(finish, end)
      launch(end)
    else:
      step[cta] = s + 1
      heapq.heappush(ev, (end + STORE, next(cnt), cta, False))
  if state["next"] < len(ctas) or waiters:
    raise RuntimeError("deadlock")
  busy = sum(len(walks[kv]) for _, kv in ctas)
  return finish, idle / busy


def main():
  for heads, n_kv, n_q in ((512, 8, 16), (256, 16, 32), (128, 32, 64), (64, 64, 128),
                           (32, 128, 256), (16, 256, 512)):
    for causal in (False, True):
      base, _ = simulate(heads, n_kv, n_q, causal, "arrival")
      row = [f"n_kv={n_kv:3} {'causal' if causal else 'dense '}"]
      for mode in ("desc", "rotate"):
        for rel in (0.6, 0.3):
          try:
            fin, idle = simulate(heads, n_kv, n_q, causal, mode, RELEASE=rel)
            row.append(f"{mode}@{rel} {fin / base:.3f}x ({idle:.3f} idle)")
          except RuntimeError:
            row.append(f"{mode}@{rel} deadlock")
      print("  ".join(row), flush=True)


if __name__ == "__main__":
  main()
