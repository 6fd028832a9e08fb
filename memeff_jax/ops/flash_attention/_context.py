"""Context parallelism: attention over a sequence sharded across a mesh axis, each shard's
queries against every shard's keys, by one of two strategies. The code runs per shard, with
the axis's collectives: inside jax.shard_map (`attention`, a custom_vjp) and inside the
custom_partitioning of an Auto mesh (`forward` and `backward` alone, _partition).

Shard i holds queries [i·T, (i+1)·T) and keys [i·S, (i+1)·S) of the sequence (contiguous
chunks in shard order). A query at position p sees the key at position j where
p − left ≤ j ≤ p + right (causal is right = 0), so against the keys [lo, hi) its chunk's
queries can reach, its mask is a window in positions local to the chunk and that span.

all_gather: every shard gathers all keys, values and key segment ids, then runs its queries
  against the span their mask reaches (`key_span`). Each shard's bounds are static: every
  shard's call is compiled once and `lax.switch` on the shard index picks its own. The
  backward gathers them again, runs each span's backward and reduce-scatters dK/dV over the
  axis in float32. Where a window keeps every shard's span within its neighbours (contiguous
  order, `halo_rows`), only those rows move: the previous shard's last keys and the next
  one's first come by ppermute (a halo exchange), and their dK/dV go back the same way, in
  the keys' dtype where no row lies in both halos (one neighbour's term to add: bf16's add
  rounds that sum once, as float32 would). Where each shard's queries read one span (the
  contiguous order), outputs and dQ are the kernel call's own, with no float32 buffer.
ring: keys, values and key segment ids pass from shard to shard (ppermute), the next transfer
  issued before the current step's kernels; each step's (query chunk, key chunk) pairs are
  planned statically (`pair_plan`, `ring_plans`), shards with equal plans sharing a branch,
  and partial results merge through their log-sum-exp, on the query rows the step reaches
  (`_step_rows`: under a window, the first w); a step of one call over all of them keeps
  the call's result as it is. Only the key rows that some step after the first reaches go
  round (`passed_rows`: under a window, the halo of the last w keys). The backward passes
  them round again with float32 dK/dV accumulators that end at their shard; each step calls
  the single-device backward with the final output and log-sum-exp, which gives exactly that
  step's share of the gradients. A shard holds at most two shards' keys, and a window stops
  the ring after the last step it reaches. With segment ids, a step whose visiting keys'
  ids cannot meet its query rows' (`_segments_meet`, by their ranges) runs no kernel and
  merges nothing, forward or backward: the keys still pass on, but packed documents
  shorter than a shard skip most steps' work.

Under a causal mask shard i does (i + ½)·T² of the work. The zig-zag order balances it: the
sequence cut into 2n chunks, shard i holds chunks i and 2n − 1 − i (`zigzag` reorders tokens,
positions, labels and segment ids so; the loss is order-invariant). Each of a shard's two
chunks then plans its own spans. Where lengths and windows are multiples of 128 so are the
slices, as the Hopper kernels want (others fall through to the next implementation).

`attend(q, k, v, q_seg, kv_seg, window) -> (out, lse [B, T, H])` and `attend_backward(q, k,
v, q_seg, kv_seg, out, lse, d_out, d_lse, window) -> (dq, dk, dv)` are the single-device
call with the call's other options; `window` is a (left, right) pair, a side None for
unbounded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from memeff_jax.ops import _vma

ORDERS = ("contiguous", "zigzag")
STRATEGIES = ("all_gather", "ring")
DEFAULT = ("contiguous", "all_gather")  # (order, strategy) of a call with nothing to shard


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


def check_lengths(order: str, t: int, s: int) -> None:
  """A clear error where `order` cannot hold a shard's t queries and s keys."""
  if order == "zigzag" and (t % 2 or s % 2):
    raise ValueError(f"context_order='zigzag' holds two chunks of the sequence per shard: the "
                     f"local lengths must be even, got T={t}, S={s} per shard")


def _starts(shard: int, length: int, shards: int, order: str) -> list[tuple[int, int, int]]:
  """(start in the sequence, start in the shard, length) of each chunk shard `shard` holds
  of a sequence `length` long per shard."""
  if order == "contiguous":
    return [(shard * length, 0, length)]
  half = length // 2
  return [(c * half, h * half, half)
          for h, c in enumerate(zigzag_chunks(shards)[2 * shard:2 * shard + 2])]


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


def ring_plans(t: int, s: int, shards: int, window, order: str) -> list[tuple[list, list[int]]]:
  """Per ring step k (shard i then holds the keys of shard (i − k) mod n; t queries and s
  keys per shard): the distinct plans of that step and which plan each shard runs. A plan
  is a tuple of pair_plan slices (rows of the shard's queries, rows of the visiting keys,
  window); shards with equal plans share a branch. Steps after the last one with any
  visible pair are dropped."""
  steps = []
  for step in range(shards):
    plans, which = [], []
    for i in range(shards):
      src = (i - step) % shards
      plan = tuple(
          (qo + p[0], qo + p[1], ko + p[2], ko + p[3], p[4])
          for qs, qo, tq in _starts(i, t, shards, order)
          for ks, ko, tk in _starts(src, s, shards, order)
          if (p := pair_plan(qs, tq, ks, tk, window)) is not None)
      if plan not in plans:
        plans.append(plan)
      which.append(plans.index(plan))
    steps.append((plans, which))
  while len(steps) > 1 and steps[-1][0] == [()]:
    steps.pop()
  return steps


def passed_rows(steps) -> tuple[int, int] | None:
  """The rows [lo, hi) of a shard's keys that any ring step after the first reaches, on any
  shard (None: one step). Only they go round the ring, and only their dK/dV: under a window
  of w ≤ S keys that is the last w rows, the halo the next shard needs."""
  spans = [(ka, kb) for plans, _ in steps[1:] for plan in plans for _, _, ka, kb, _ in plan]
  if not spans:
    return None
  return min(a for a, _ in spans), max(b for _, b in spans)


def _merge(acc, lse_acc, out, lse):
  """Two partial softmax results over disjoint keys, merged through their log-sum-exps
  (rows that see no key in either stay 0 with lse -inf)."""
  new = jnp.logaddexp(lse_acc, lse)
  safe = jnp.where(jnp.isneginf(new), 0.0, new)
  weight = lambda l: jnp.exp(l - safe)[..., None]
  return acc * weight(lse_acc) + out.astype(jnp.float32) * weight(lse), new


def _merge_rows(acc, lse_acc, lo, hi, out, lse):
  """acc and lse_acc with their rows lo:hi merged with a partial result over those rows."""
  merged = _merge(acc[:, lo:hi], lse_acc[:, lo:hi], out, lse)
  return _put(acc, lo, hi, merged[0]), _put(lse_acc, lo, hi, merged[1])


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


def _put(a, lo, hi, x, add: bool = False):
  """a with rows lo:hi (axis 1) set to x, or x added to them. A range covering all of a is
  the value itself: XLA's GPU partitioner (jaxlib 0.11) crashes on a whole-array `.at` update
  inside shard_map."""
  if (lo, hi) == (0, a.shape[1]):
    return a + x if add else x
  return a.at[:, lo:hi].add(x) if add else a.at[:, lo:hi].set(x)


def _empty(q, *like):
  """(output 0 in float32, lse -inf) for q's rows, typed varying like q and `like`."""
  b, t, h, d = q.shape
  return _vma.varying_like((jnp.zeros((b, t, h, d), jnp.float32),
                            jnp.full((b, t, h), -jnp.inf, jnp.float32)), q, *like)


def _gather(x, axis):
  return None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)


def _gathered_keys(k, v, kv_seg, *, axis, shards: int, order: str):
  """Every shard's keys, values and key segment ids, in the sequence's natural order."""
  k, v, kv_seg = _gather(k, axis), _gather(v, axis), _gather(kv_seg, axis)
  if order == "zigzag":
    k, v = unzigzag(k, shards), unzigzag(v, shards)
    kv_seg = None if kv_seg is None else unzigzag(kv_seg, shards)
  return k, v, kv_seg


def _gather_spans(t: int, s_total: int, shards: int, window, order: str):
  """Per shard: (rows of its queries, key span lo, hi, local window) of each of its chunks
  (hi == lo: no key in reach)."""
  return [[(qo, qo + tq) + key_span(qs, tq, s_total, window)
           for qs, qo, tq in _starts(i, t, shards, order)] for i in range(shards)]


def halo_rows(t: int, s: int, shards: int, window, order: str) -> tuple[int, int] | None:
  """(left, right): how many of the previous and of the next shard's keys (t queries and s
  keys per shard, contiguous order) some shard's window reaches, where no shard reaches past
  its neighbours and those rows are fewer than the other shards' keys; None otherwise (the
  keys are gathered whole)."""
  if order != "contiguous" or shards < 2:
    return None
  left = right = 0
  for i in range(shards):
    lo, hi, _ = key_span(i * t, t, shards * s, window)
    if hi > lo:
      left, right = max(left, i * s - lo), max(right, hi - (i + 1) * s)
  if left > s or right > s or left + right >= (shards - 1) * s:
    return None
  return left, right


def _halo_keys(k, v, kv_seg, *, axis, shards: int, halo):
  """The shard's keys, values and key segment ids with the previous shard's last `left` rows
  in front and the next shard's first `right` rows behind (a halo exchange)."""
  left, right = halo
  s, own = k.shape[1], (k, v, kv_seg)
  before = _pass_on(axis, shards, tuple(_rows(a, s - left, s) for a in own)) if left else None
  after = _pass_on(axis, shards, tuple(_rows(a, 0, right) for a in own), -1) if right else None
  def joined(i):
    parts = [p[i] for p in (before, own, after) if p is not None]
    return None if own[i] is None else jnp.concatenate(parts, axis=1)
  return joined(0), joined(1), joined(2)


def _halo_home(g, *, axis, shards: int, halo, s: int):
  """A [B, left + s + right, ...] gradient of _halo_keys' rows, its halo rows sent back to
  the shards that own them and added there: the shard's own [B, s, ...]."""
  left, right = halo
  own = g[:, left:left + s]
  if left:
    own = _put(own, s - left, s, _pass_on(axis, shards, g[:, :left], -1), add=True)
  if right:
    own = _put(own, 0, right, _pass_on(axis, shards, g[:, left + s:]), add=True)
  return own


def _keys_in_reach(k, v, kv_seg, *, axis, shards: int, window, order: str, t: int):
  """(k, v, kv_seg, halo, first): the keys the shard's spans read, by a halo exchange where
  halo_rows allows it, else every shard's (in the sequence's natural order); first(shard):
  the sequence position of their first row."""
  s = k.shape[1]
  halo = halo_rows(t, s, shards, window, order)
  if halo is None:
    return (*_gathered_keys(k, v, kv_seg, axis=axis, shards=shards, order=order), None,
            lambda shard: 0)
  return (*_halo_keys(k, v, kv_seg, axis=axis, shards=shards, halo=halo), halo,
          lambda shard: shard * s - halo[0])


def _one_span(spans, t: int) -> bool:
  """Every shard's queries all read one key span: each output row, and each key row's
  gradient on that shard, is one kernel call's, with nothing to add up."""
  return all(len(chunks) == 1 and chunks[0][:2] == (0, t) and chunks[0][3] > chunks[0][2]
             for chunks in spans)


def _gather_forward(attend, q, k, v, q_seg, kv_seg, *, axis, shards, window, order):
  s_total = shards * k.shape[1]
  k, v, kv_seg, _, first = _keys_in_reach(k, v, kv_seg, axis=axis, shards=shards,
                                          window=window, order=order, t=q.shape[1])
  if window == (None, None):  # every key for every query: one call, the same on every shard
    return attend(q, k, v, q_seg, kv_seg, None)
  spans = _gather_spans(q.shape[1], s_total, shards, window, order)
  one_span = _one_span(spans, q.shape[1])

  def branch(shard):
    def run(q, q_seg, k, v, kv_seg):
      if one_span:  # the call's output as it is (no float32 buffer to assemble)
        (_, _, lo, hi, local), = spans[shard]
        lo, hi = lo - first(shard), hi - first(shard)
        return attend(q, k[:, lo:hi], v[:, lo:hi], q_seg, _rows(kv_seg, lo, hi), local)
      out, lse = _empty(q, k, v)
      for qa, qb, lo, hi, local in spans[shard]:
        if hi > lo:
          lo, hi = lo - first(shard), hi - first(shard)
          o, l = attend(q[:, qa:qb], k[:, lo:hi], v[:, lo:hi], _rows(q_seg, qa, qb),
                        _rows(kv_seg, lo, hi), local)
          out, lse = _put(out, qa, qb, o.astype(jnp.float32)), _put(lse, qa, qb, l)
      return out, lse
    return run

  return _switch(axis, list(range(shards)), [branch(i) for i in range(shards)],
                 q, q_seg, k, v, kv_seg)


def _gather_backward(attend_backward, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, *,
                     axis, shards, window, order):
  s = k.shape[1]
  kf, vf, kv_seg_f, halo, first = _keys_in_reach(k, v, kv_seg, axis=axis, shards=shards,
                                                 window=window, order=order, t=q.shape[1])
  spans = (_gather_spans(q.shape[1], shards * s, shards, window, order)
           if window != (None, None) else [[(0, q.shape[1], 0, shards * s, None)]] * shards)
  one_span = _one_span(spans, q.shape[1])
  # A key row's gradient is a sum over the shards that read it, in float32 (bf16 would round
  # each add), except under a halo where no row is in both halos: there it is at most its own
  # shard's term and one neighbour's, and bf16's add rounds their sum once, as float32's
  # final cast would, at half the bytes sent.
  key_dtype = (k.dtype if one_span and halo is not None and sum(halo) <= s else jnp.float32)

  def branch(shard):
    def run(kf, vf, kv_seg_f):
      if one_span:  # dq as the call gives it; dK/dV rows placed in the keys' span
        (_, _, lo, hi, local), = spans[shard]
        lo, hi = lo - first(shard), hi - first(shard)
        g = attend_backward(q, kf[:, lo:hi], vf[:, lo:hi], q_seg, _rows(kv_seg_f, lo, hi),
                            out, lse, d_out, d_lse, local)
        place = lambda a, x: _put(_vma.varying_like(jnp.zeros(a.shape, key_dtype), q, a,
                                                    d_out), lo, hi, x.astype(key_dtype))
        return g[0], place(kf, g[1]), place(vf, g[2])
      zeros = lambda a: jnp.zeros(a.shape, jnp.float32)
      dq, dk, dv = _vma.varying_like((zeros(q), zeros(kf), zeros(vf)), q, kf, vf, d_out)
      for qa, qb, lo, hi, local in spans[shard]:
        if hi > lo:
          lo, hi = lo - first(shard), hi - first(shard)
          r = lambda a: a[:, qa:qb]
          g = attend_backward(r(q), kf[:, lo:hi], vf[:, lo:hi], _rows(q_seg, qa, qb),
                              _rows(kv_seg_f, lo, hi), r(out), r(lse), r(d_out), r(d_lse),
                              local)
          dq = _put(dq, qa, qb, g[0].astype(jnp.float32))
          dk = _put(dk, lo, hi, g[1].astype(jnp.float32), add=True)
          dv = _put(dv, lo, hi, g[2].astype(jnp.float32), add=True)
      return dq, dk, dv
    return run

  same = window == (None, None)
  dq, dk, dv = _switch(axis, [0] * shards if same else list(range(shards)),
                       [branch(i) for i in range(1 if same else shards)], kf, vf, kv_seg_f)
  if halo is not None:  # the halo rows' gradients go back to their shards
    return dq, *(_halo_home(g, axis=axis, shards=shards, halo=halo, s=s) for g in (dk, dv))
  if order == "zigzag":  # back to the order the shards hold their keys in
    dk, dv = zigzag(dk, shards), zigzag(dv, shards)
  # Each shard's keys get every shard's share, summed in float32 (bf16 would round each add).
  dk, dv = (jax.lax.psum_scatter(g, axis, scatter_dimension=1, tiled=True) for g in (dk, dv))
  return dq, dk, dv


def _next_visitor(axis, shards: int, visiting, step: int, rows):
  """The keys, values and segment ids ring step `step` passes on: after the first step the
  visitors hold only the rows later steps reach (passed_rows), so a shard's own are cut to
  them as they first leave."""
  return _pass_on(axis, shards, visiting if step else tuple(_rows(a, *rows) for a in visiting))


def _step_rows(plans) -> tuple[int, int]:
  """The query rows [r0, r1) that some plan of a ring step reaches ((0, 0): none). Only they
  are merged with the steps before: under a window, the halo step's first w rows."""
  spans = [(qa, qb) for plan in plans for qa, qb, *_ in plan]
  return (min(a for a, _ in spans), max(b for _, b in spans)) if spans else (0, 0)


def _whole(plan, rows, keys) -> bool:
  """The plan is one call over every one of the step's query rows and the visitor's keys."""
  return len(plan) == 1 and plan[0][:4] == (*rows, *keys)


def _skippable(step: int, q_seg, rows, visiting) -> bool:
  """Whether ring step `step` may find no pair to compute at run time: a step after the
  first, over some query rows, with segment ids on both sides."""
  return step > 0 and rows[1] > rows[0] and q_seg is not None and visiting[2] is not None


def _segments_meet(q_seg, kv_seg):
  """Whether a query's segment id ([B, R]) may equal a key's ([B, K]) in any batch row, by
  the ids' ranges: never false where a pair is visible, and exact for packed documents
  (ids that never decrease along the sequence)."""
  return jnp.any((kv_seg.min(1) <= q_seg.max(1)) & (q_seg.min(1) <= kv_seg.max(1)))


def _if_segments_meet(q_seg, kv_seg, run, *carry):
  """run(*carry) where the queries' segment ids may meet the keys' (at run time), else
  `carry` as it is: the kernels and merges of a step, or of one chunk pair, that would find
  no visible pair. Without ids on both sides, run(*carry)."""
  if q_seg is None or kv_seg is None:
    return run(*carry)
  return jax.lax.cond(_segments_meet(q_seg, kv_seg), run, lambda *carry: carry, *carry)


def _ring_forward(attend, q, k, v, q_seg, kv_seg, *, axis, shards, window, order):
  steps = ring_plans(q.shape[1], k.shape[1], shards, window, order)
  rows = passed_rows(steps)
  acc = lse = None
  visiting = (k, v, kv_seg)
  for step, (plans, which) in enumerate(steps):
    arriving = _next_visitor(axis, shards, visiting, step, rows) \
        if step + 1 < len(steps) else None
    first = rows[0] if step else 0  # the visiting keys' first row among their shard's
    r0, r1 = _step_rows(plans)

    def branch(plan, first=first, r0=r0, r1=r1):
      def run(q, q_seg, k, v, kv_seg):
        keys = (first, first + k.shape[1])
        if _whole(plan, (r0, r1), keys):  # the call's result as it is: nothing to merge
          o, l = attend(q[:, r0:r1], k, v, _rows(q_seg, r0, r1), kv_seg, plan[0][4])
          return _vma.varying_like((o.astype(jnp.float32), l), q, k, v)
        acc, lse = _empty(q[:, r0:r1], k, v)
        for qa, qb, ka, kb, local in plan:  # each pair skipped where its ids cannot meet
          ka, kb = ka - first, kb - first
          q_ids, kv_ids = _rows(q_seg, qa, qb), _rows(kv_seg, ka, kb)
          def pair(acc, lse, qa=qa, qb=qb, ka=ka, kb=kb, local=local, ids=(q_ids, kv_ids)):
            o, l = attend(q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], *ids, local)
            return _merge_rows(acc, lse, qa - r0, qb - r0, o, l)
          acc, lse = _if_segments_meet(q_ids, kv_ids, pair, acc, lse)
        return acc, lse
      return run

    def merged(acc, lse, plans=plans, which=which, visiting=visiting, r0=r0, r1=r1):
      partial = _switch(axis, which, [branch(p) for p in plans], q, q_seg, *visiting)
      if acc is None and (r0, r1) == (0, q.shape[1]):
        return partial
      if acc is None:
        acc, lse = _empty(q, k, v)
      return _merge_rows(acc, lse, r0, r1, *partial)

    if _skippable(step, q_seg, (r0, r1), visiting):  # no kernel, no merge where ids differ
      acc, lse = _if_segments_meet(q_seg[:, r0:r1], visiting[2], merged, acc, lse)
    else:
      acc, lse = merged(acc, lse)
    visiting = arriving
  return acc, lse


def _ring_backward(attend_backward, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, *, axis,
                   shards, window, order):
  """Step k: the keys of step k + 1 are already on their way, and the float32 dK/dV
  accumulators of this step's keys arrive from the shard that held them at step k − 1; this
  step's contributions are computed apart and added to them after, so both transfers run
  under the kernels. The first step's contributions, to the shard's own keys, stay home;
  the accumulators that go round hold only the passed rows (passed_rows)."""
  steps = ring_plans(q.shape[1], k.shape[1], shards, window, order)
  rows = passed_rows(steps)
  zeros = lambda a: jnp.zeros(a.shape, jnp.float32)
  visiting, dq, home, dkv = (k, v, kv_seg), None, None, None
  for step, (plans, which) in enumerate(steps):
    arriving = _next_visitor(axis, shards, visiting, step, rows) \
        if step + 1 < len(steps) else None
    carried = None if dkv is None else _pass_on(axis, shards, dkv)
    first = rows[0] if step else 0
    r0, r1 = _step_rows(plans)

    def branch(plan, first=first, r0=r0, r1=r1):
      def run(k, v, kv_seg):
        f32 = lambda g: _vma.varying_like(tuple(x.astype(jnp.float32) for x in g), q, k, v,
                                          d_out)
        if _whole(plan, (r0, r1), (first, first + k.shape[1])):  # the call's as they are
          r = lambda a: a[:, r0:r1]
          return f32(attend_backward(r(q), k, v, _rows(q_seg, r0, r1), kv_seg, r(out), r(lse),
                                     r(d_out), r(d_lse), plan[0][4]))
        dq, dk, dv = f32((zeros(q[:, r0:r1]), zeros(k), zeros(v)))
        for qa, qb, ka, kb, local in plan:  # each pair skipped where its ids cannot meet
          ka, kb = ka - first, kb - first
          q_ids, kv_ids = _rows(q_seg, qa, qb), _rows(kv_seg, ka, kb)
          def pair(dq, dk, dv, qa=qa, qb=qb, ka=ka, kb=kb, local=local, ids=(q_ids, kv_ids)):
            r = lambda a: a[:, qa:qb]
            g = attend_backward(r(q), k[:, ka:kb], v[:, ka:kb], *ids, r(out), r(lse),
                                r(d_out), r(d_lse), local)
            return (_put(dq, qa - r0, qb - r0, g[0].astype(jnp.float32), add=True),
                    _put(dk, ka, kb, g[1].astype(jnp.float32), add=True),
                    _put(dv, ka, kb, g[2].astype(jnp.float32), add=True))
          dq, dk, dv = _if_segments_meet(q_ids, kv_ids, pair, dq, dk, dv)
        return dq, dk, dv
      return run

    def added(dq, carried, plans=plans, which=which, visiting=visiting, r0=r0, r1=r1):
      """dq with this step's rows added, and this step's dK/dV (added to `carried`)."""
      dq_step, *mine = _switch(axis, which, [branch(p) for p in plans], *visiting)
      if dq is None and (r0, r1) == (0, q.shape[1]):
        dq = dq_step
      else:
        dq = _put(_vma.varying_like(zeros(q), q, d_out) if dq is None else dq, r0, r1,
                  dq_step, add=True)
      return dq, tuple(mine) if carried is None else tuple(a + b for a, b in zip(carried, mine))

    if _skippable(step, q_seg, (r0, r1), visiting):  # no kernel where ids differ
      if carried is None:  # what the step would carry on: nothing added yet
        carried = _vma.varying_like(tuple(zeros(a) for a in visiting[:2]), q, k, v, d_out)
      dq, dkv = _if_segments_meet(q_seg[:, r0:r1], visiting[2], added, dq, carried)
    else:
      dq, mine = added(dq, None if step == 0 else carried)
      if step == 0:
        home = mine
      else:
        dkv = mine
    visiting = arriving
  if dkv is None:
    return dq, *home
  # After the last step shard i holds the accumulators of shard i − (steps − 1): send them home.
  dkv = _pass_on(axis, shards, dkv, shift=1 - len(steps))
  dk, dv = (_put(h, *rows, a, add=True) for h, a in zip(home, dkv))
  return dq, dk, dv


def forward(attend, q, k, v, q_seg, kv_seg, *, strategy: str, **where):
  """(out in q's dtype, lse [B, T, H] float32) over the whole sequence for this shard's q.
  `where`: axis, shards, window (the call's (left, right)), order."""
  run = _gather_forward if strategy == "all_gather" else _ring_forward
  out, lse = run(attend, q, k, v, q_seg, kv_seg, **where)
  return out.astype(q.dtype), lse


def backward(attend_backward, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, *,
             strategy: str, **where):
  """(dq, dk, dv) of forward, in the inputs' dtypes, from its output and log-sum-exp."""
  run = _gather_backward if strategy == "all_gather" else _ring_backward
  dq, dk, dv = run(attend_backward, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, **where)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def attention(attend, attend_backward, q, k, v, q_seg, kv_seg, *, axis, shards: int, window,
              order: str, strategy: str):
  """forward, differentiable (backward as its custom_vjp), inside jax.shard_map."""
  where = (axis, shards, tuple(window), order, strategy)
  return _attention(attend, attend_backward, where, q, k, v, q_seg, kv_seg)


def _where(where) -> dict:
  axis, shards, window, order, strategy = where
  return dict(axis=axis, shards=shards, window=window, order=order, strategy=strategy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attention(attend, attend_backward, where, q, k, v, q_seg, kv_seg):
  return forward(attend, q, k, v, q_seg, kv_seg, **_where(where))


def _attention_fwd(attend, attend_backward, where, q, k, v, q_seg, kv_seg):
  out, lse = forward(attend, q, k, v, q_seg, kv_seg, **_where(where))
  return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _attention_bwd(attend, attend_backward, where, residuals, cts):
  del attend
  q, k, v, q_seg, kv_seg, out, lse = residuals
  grads = backward(attend_backward, q, k, v, q_seg, kv_seg, out, lse, *cts, **_where(where))
  return (*_vma.cotangents_like(grads, (q, k, v)), None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)
