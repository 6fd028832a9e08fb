"""Context parallelism by all-gathering the keys: attention over a sequence sharded across a
mesh axis, inside jax.shard_map.

Shard i holds queries [i·T, (i+1)·T) and keys [i·S, (i+1)·S) of the whole sequence (contiguous
chunks in shard order). It gathers every shard's keys, values and key segment ids, then runs
the single-device attention of its queries against the span of keys its mask can reach. A
query at global position i·T + a sees the key at global position j where j ≤ i·T + a + right
and j ≥ i·T + a − left (causal is right = 0): against the keys [lo, hi) that any of its
queries can reach, lo = max(0, i·T − left), that is the window (left − (i·T − lo),
right + i·T − lo) of local positions, both sides ≥ 0. Where the model's lengths and window
are multiples of 128 so are the slices, as the Hopper kernels want (others fall through to
the next implementation). Each shard's bounds are static, so every shard's call is compiled
once and `lax.switch` on the shard index picks its own (without a window or causal mask
every shard makes the same call). The backward is autodiff's: the slice pads dk/dv back to
the whole sequence, and the gather's transpose reduce-scatters them over the axis, in
float32.

Under a causal mask shard i then does (i + ½)·T² of the work. The zig-zag order balances
it: the sequence cut into 2n chunks, shard i holds chunks i and 2n − 1 − i (`zigzag`
reorders tokens, positions, labels and segment ids so; the loss is order-invariant). Each
shard then runs its two query chunks, each against its own span of the keys, put back in
their natural order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from memeff_jax.ops import _vma


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gathered(x, axis):
  """x's shards concatenated along dim 1 over `axis`; the cotangent reduce-scattered back in
  float32 (a bf16 sum over many shards would round at every step)."""
  return jax.lax.all_gather(x, axis, axis=1, tiled=True)


def _gathered_fwd(x, axis):
  return _gathered(x, axis), None


def _gathered_bwd(axis, _, ct):
  summed = jax.lax.psum_scatter(ct.astype(jnp.float32), axis, scatter_dimension=1, tiled=True)
  return (summed.astype(ct.dtype),)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


ORDERS = ("contiguous", "zigzag")
STRATEGIES = ("all_gather", "ring")


def _chunks(x, pieces: int, axis: int):
  if x.shape[axis] % pieces:
    raise ValueError(f"the sequence ({x.shape[axis]} along axis {axis}) must split into "
                     f"{pieces} equal chunks for the zig-zag order")
  return jnp.split(x, pieces, axis=axis)


def zigzag_chunks(shards: int) -> list[int]:
  """The natural chunk held at each position of the zig-zag order over `shards`: shard i
  holds chunks i and 2·shards − 1 − i of the sequence cut into 2·shards."""
  return [c for i in range(shards) for c in (i, 2 * shards - 1 - i)]


def zigzag(x, shards: int, axis: int = 1):
  """x's sequence (along `axis`) in the zig-zag order over `shards` (see zigzag_chunks): cut
  it into 2·shards chunks and put chunks i and 2·shards − 1 − i on shard i, so a causal
  mask gives every shard the same work. Tokens, labels, positions and segment ids go
  through it alike; unzigzag undoes it."""
  pieces = _chunks(x, 2 * shards, axis)
  return jnp.concatenate([pieces[c] for c in zigzag_chunks(shards)], axis=axis)


def unzigzag(x, shards: int, axis: int = 1):
  """The natural order of a sequence in the zig-zag order over `shards`."""
  pieces = _chunks(x, 2 * shards, axis)
  where = {c: p for p, c in enumerate(zigzag_chunks(shards))}
  return jnp.concatenate([pieces[where[c]] for c in range(2 * shards)], axis=axis)


def key_span(start: int, t: int, s_total: int, window) -> tuple[int, int, tuple]:
  """(lo, hi, window) for queries [start, start + t) of the sequence: the keys [lo, hi) their
  mask can reach and their (left, right) window in positions local to them and to that
  slice, both sides ≥ 0 (None: unbounded)."""
  left, right = window
  lo = 0 if left is None else min(max(0, start - left), s_total)
  hi = s_total if right is None else max(lo, min(s_total, start + t + right))
  offset = start - lo
  local = (None if left is None else left - offset, None if right is None else right + offset)
  return lo, hi, local


def attention(attend, q, k, v, q_seg, kv_seg, *, axis, shards: int, window, order: str):
  """attend(q, k, v, q_seg, kv_seg, window) -> (out, lse [B, T, H]) over the whole sequence,
  for this shard's q (and segment ids) against every shard's keys. `window`: the (left,
  right) bounds of the call's mask (None: unbounded; causal is right = 0). `order`:
  "contiguous" (shard i holds the i-th of `shards` chunks) or "zigzag" (see zigzag)."""
  k, v = _gathered(k, axis), _gathered(v, axis)
  kv_seg = None if kv_seg is None else jax.lax.all_gather(kv_seg, axis, axis=1, tiled=True)
  if window == (None, None):  # every key for every query: the keys' order does not matter
    return attend(q, k, v, q_seg, kv_seg, None)
  t, s_total = q.shape[1], k.shape[1]
  if order == "zigzag":  # the keys in their natural order; q as its two chunks
    k, v = unzigzag(k, shards), unzigzag(v, shards)
    kv_seg = None if kv_seg is None else unzigzag(kv_seg, shards)
    t //= 2

  def span(q, k, v, q_seg, kv_seg, start):
    lo, hi, local = key_span(start, t, s_total, window)
    if hi == lo:  # no key in reach: output 0, lse -inf (as one device gives)
      return jnp.zeros(q.shape, q.dtype), jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
    cut = lambda a: None if a is None else a[:, lo:hi]
    return attend(q, cut(k), cut(v), q_seg, cut(kv_seg), local)

  def branch(shard):
    def run(q, k, v, q_seg, kv_seg):
      if order == "contiguous":
        return span(q, k, v, q_seg, kv_seg, shard * t)
      halves = [span(q[:, h * t:(h + 1) * t], k, v,
                     None if q_seg is None else q_seg[:, h * t:(h + 1) * t], kv_seg, c * t)
                for h, c in enumerate(zigzag_chunks(shards)[2 * shard:2 * shard + 2])]
      return tuple(jnp.concatenate(parts, axis=1) for parts in zip(*halves))
    return run

  index = jax.lax.axis_index(axis)
  return jax.lax.switch(index, [branch(i) for i in range(shards)], q, k, v, q_seg, kv_seg)


# The ring strategy: no shard ever holds more than its own keys and the ones passing through.


def pair_plan(q_start: int, tq: int, k_start: int, tk: int, window):
  """Queries [q_start, q_start + tq) against keys [k_start, k_start + tk) of the sequence
  under the (left, right) window (None: unbounded): None where no pair is visible, else
  (qa, qb, ka, kb, local): the query rows [qa, qb) and key rows [ka, kb), relative to the two
  chunks, that hold every visible pair, and their window relative to those slices, both
  sides ≥ 0, a side None where it masks nothing (so a chunk seen whole runs unmasked)."""
  left, right = window
  lo = k_start if left is None else max(k_start, q_start - left)
  hi = k_start + tk if right is None else min(k_start + tk, q_start + tq + right)
  qa = q_start if right is None else max(q_start, lo - right)  # the first query reaching lo
  qb = q_start + tq if left is None else min(q_start + tq, hi + left)  # ... hi - 1
  if hi <= lo or qb <= qa:
    return None
  offset = qa - lo
  local_left = None if left is None or left - offset >= qb - qa - 1 else left - offset
  local_right = None if right is None or right + offset >= hi - lo - 1 else right + offset
  return qa - q_start, qb - q_start, lo - k_start, hi - k_start, (local_left, local_right)


def _starts(shard: int, t: int, shards: int, order: str) -> list[tuple[int, int, int]]:
  """(start in the sequence, start in the shard, length) of each chunk shard `shard` holds."""
  if order == "contiguous":
    return [(shard * t, 0, t)]
  half = t // 2
  return [(c * half, h * half, half)
          for h, c in enumerate(zigzag_chunks(shards)[2 * shard:2 * shard + 2])]


def ring_plans(t: int, shards: int, window, order: str) -> list[tuple[list, list[int]]]:
  """Per ring step s (shard i then holds the keys of shard (i − s) mod n): the distinct
  plans of that step and which plan each shard runs. A plan is a tuple of pair_plan slices
  (rows of the shard's queries, rows of the visiting keys, window); shards with equal plans
  share a branch. Steps after the last one with any visible pair are dropped."""
  steps = []
  for s in range(shards):
    plans, which = [], []
    for i in range(shards):
      src = (i - s) % shards
      plan = tuple(
          (qo + p[0], qo + p[1], ko + p[2], ko + p[3], p[4])
          for qs, qo, tq in _starts(i, t, shards, order)
          for ks, ko, tk in _starts(src, t, shards, order)
          if (p := pair_plan(qs, tq, ks, tk, window)) is not None)
      if plan not in plans:
        plans.append(plan)
      which.append(plans.index(plan))
    steps.append((plans, which))
  while len(steps) > 1 and steps[-1][0] == [()]:
    steps.pop()
  return steps


def _merge(acc, lse_acc, out, lse):
  """Two partial softmax results over disjoint keys, merged through their log-sum-exps
  (rows that see no key in either stay 0 with lse -inf)."""
  new = jnp.logaddexp(lse_acc, lse)
  safe = jnp.where(jnp.isneginf(new), 0.0, new)
  weight = lambda l: jnp.exp(l - safe)[..., None]
  return acc * weight(lse_acc) + out.astype(jnp.float32) * weight(lse), new


def _switch(axis, which: list[int], branches, *operands):
  """branches[which[i]](*operands) on shard i of `axis` (one branch: no switch)."""
  if len(branches) == 1:
    return branches[0](*operands)
  index = jnp.asarray(which, jnp.int32)[jax.lax.axis_index(axis)]
  return jax.lax.switch(index, branches, *operands)


def _pass_on(axis, shards: int, x, shift: int = 1):
  """x from shard i to shard i + shift (mod n)."""
  return jax.lax.ppermute(x, axis, [(i, (i + shift) % shards) for i in range(shards)])


def _rows(a, lo, hi):
  return None if a is None else a[:, lo:hi]


def ring_attention(attend, attend_backward, q, k, v, q_seg, kv_seg, *, axis, shards: int,
                   window, order: str):
  """attention() by the ring: the keys, values and key segment ids travel shard to shard
  (ppermute), each step's pairs run as they arrive and merge through the log-sum-exp; the
  backward sends them round again with float32 dK/dV accumulators, which end at their
  shard. `attend_backward(q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, window) ->
  (dq, dk, dv)` is flash_attention_backward with the call's options."""
  steps = ring_plans(q.shape[1], shards, window, order)
  return _ring(attend, attend_backward, axis, shards, tuple(
      (tuple(plans), tuple(which)) for plans, which in steps), q, k, v, q_seg, kv_seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _ring(attend, attend_backward, axis, shards, steps, q, k, v, q_seg, kv_seg):
  return _ring_fwd(attend, attend_backward, axis, shards, steps, q, k, v, q_seg, kv_seg)[0]


def _ring_fwd(attend, attend_backward, axis, shards, steps, q, k, v, q_seg, kv_seg):
  """Each step's branch returns fresh arrays (its pairs merged, rows it does not reach 0 with
  lse -inf), merged into the running result outside it, so no branch returns an operand
  unchanged (XLA's GPU compiler crashed on a window's ring whose empty branch did)."""
  b, t, h, d = q.shape
  empty = lambda: _vma.varying_like((jnp.zeros((b, t, h, d), jnp.float32),
                                     jnp.full((b, t, h), -jnp.inf, jnp.float32)), q, k, v)
  acc = lse = None
  visiting = (k, v, kv_seg)
  for s, (plans, which) in enumerate(steps):
    arriving = _pass_on(axis, shards, visiting) if s + 1 < len(steps) else None

    def branch(plan):
      def run(q, q_seg, k, v, kv_seg):
        acc, lse = empty()
        for qa, qb, ka, kb, local in plan:
          o, l = attend(q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], _rows(q_seg, qa, qb),
                        _rows(kv_seg, ka, kb), local)
          merged = _merge(acc[:, qa:qb], lse[:, qa:qb], o, l)
          acc, lse = acc.at[:, qa:qb].set(merged[0]), lse.at[:, qa:qb].set(merged[1])
        return acc, lse
      return run

    step = _switch(axis, which, [branch(p) for p in plans], q, q_seg, *visiting)
    acc, lse = step if acc is None else _merge(acc, lse, *step)
    visiting = arriving
  out = acc.astype(q.dtype)
  return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _ring_bwd(attend, attend_backward, axis, shards, steps, residuals, cts):
  """Step s: the keys of step s + 1 are already on their way, and the float32 dK/dV
  accumulators of this step's keys arrive from the shard that held them at step s − 1; this
  step's contributions are computed apart (fresh arrays, as in the forward) and added to
  them after, so both transfers run under the kernels."""
  del attend
  q, k, v, q_seg, kv_seg, out, lse = residuals
  d_out, d_lse = cts
  zeros = lambda a: jnp.zeros(a.shape, jnp.float32)
  visiting, dq, dkv = (k, v, kv_seg), None, None
  for s, (plans, which) in enumerate(steps):
    arriving = _pass_on(axis, shards, visiting) if s + 1 < len(steps) else None
    carried = None if dkv is None else _pass_on(axis, shards, dkv)

    def branch(plan):
      def run(k, v, kv_seg):
        dq, dk, dv = _vma.varying_like((zeros(q), zeros(k), zeros(v)), q, k, v, d_out)
        for qa, qb, ka, kb, local in plan:
          r = lambda a: a[:, qa:qb]
          g = attend_backward(r(q), k[:, ka:kb], v[:, ka:kb], _rows(q_seg, qa, qb),
                              _rows(kv_seg, ka, kb), r(out), r(lse), r(d_out), r(d_lse), local)
          dq = dq.at[:, qa:qb].add(g[0].astype(jnp.float32))
          dk = dk.at[:, ka:kb].add(g[1].astype(jnp.float32))
          dv = dv.at[:, ka:kb].add(g[2].astype(jnp.float32))
        return dq, dk, dv
      return run

    dq_step, *mine = _switch(axis, which, [branch(p) for p in plans], *visiting)
    dq = dq_step if dq is None else dq + dq_step
    dkv = tuple(mine) if carried is None else tuple(a + b for a, b in zip(carried, mine))
    visiting = arriving
  # After the last step shard i holds the accumulators of shard i − (steps − 1): send them home.
  dk, dv = _pass_on(axis, shards, dkv, shift=1 - len(steps)) if len(steps) > 1 else dkv
  grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
  return (*_vma.cotangents_like(grads, (q, k, v)), None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)
