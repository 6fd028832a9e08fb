"""Hopper (sm90) building blocks of the Pallas Mosaic GPU kernels, shared by both ops.

Shared-memory size, dtype checks, loads that work on jax 0.10 and 0.11, swizzled tiles,
kernel-index arithmetic, the memory warpgroup's ring of slots, ping-pong turns, fences, a
row scaling branched per warp, and persistent-kernel scheduling. Nothing here knows
attention or the loss.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax.experimental.mosaic import gpu as mgpu  # rows_scaled_where_needed's arrays
  from jax.experimental.mosaic.gpu import utils as mgpu_utils  # take_work_item's thread
except ImportError:  # pragma: no cover
  plgpu = mgpu = mgpu_utils = None
# fence_smem's and take_work_item's inline PTX, rows_scaled_where_needed's branch
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, scf, vector


def default_device() -> jax.Device:
  """The device a jitted call without committed inputs runs on: `jax.default_device`'s when
  set (as a device or a platform name), else the first device."""
  device = jax.config.jax_default_device
  if device is None:
    return jax.devices()[0]
  if isinstance(device, str):
    return jax.devices(device)[0]
  return device


def on_nvidia_gpu() -> bool:
  device = default_device()
  return device.platform == "gpu" and "nvidia" in device.device_kind.lower()


def hopper_error() -> str | None:
  """Why the default device is not an NVIDIA Hopper GPU (compute capability 9.0), or None."""
  if not on_nvidia_gpu():
    return f"needs an NVIDIA Hopper GPU (default device: {default_device().device_kind})"
  capability = getattr(default_device(), "compute_capability", None)
  if capability != "9.0":
    return f"needs compute capability 9.0 (Hopper), got {capability}"
  return None


def without_x64(fn):
  """fn traced with 64-bit types off. The kernels index with int32 (program ids, int32
  inputs); under jax_enable_x64 their Python-int offsets would become int64 and mix with
  them. Their inputs are 32 bits or narrower (the ops' checks see to it), so nothing
  changes but the index types."""
  if not hasattr(jax, "enable_x64"):  # a jax without the context: nothing to switch
    return fn

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.enable_x64(False):
      return fn(*args, **kwargs)
  return wrapped


@contextlib.contextmanager
def host_constants():
  """Evaluates jnp code while tracing (jax.ensure_compile_time_eval), for a kernel's static
  tables, with no mesh in context: inside jax.shard_map over an Explicit mesh the arrays
  it makes would carry the mesh's manual axes, on which eager ops do not dispatch. Tables
  that go into the program leave as NumPy arrays: shard_map refuses to close over a jax
  Array typed with the mesh's Explicit axes."""
  with jax.ensure_compile_time_eval(), jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((), ())):
    yield


def unavailable() -> str | None:
  """Why Mosaic GPU kernels cannot run on the default device, or None when they can."""
  if plgpu is None:
    return "jax.experimental.pallas.mosaic_gpu is not importable"
  return hopper_error()


SMEM_BYTES = 232_448  # shared memory per CTA on sm90

# Registers per thread (setmaxnreg) of the attention forward's and backward's two compute
# warpgroups and their memory warpgroup: 2·128·240 + 128·24 = 63Ki of the SM's 64Ki. The dq
# kernel keeps (232, 40), not measured at this split, and so do the GEMMs, where it moved the
# loss heads within the runs' spread (H200).
WARPGROUP_REGISTERS = (240, 24)

LOG2E = math.log2(math.e)  # the kernels' exponentials are exp2: e^x = 2^(x·log2 e)

LN2 = math.log(2.0)  # and back: log x = log2(x) · ln 2
# TMA moves a 16-bit array in tiles of 8 rows (of the swizzle's width): an array that a kernel
# reads or writes by TMA has a whole number of them.
TMA_ROWS = 8

def dtype_error(dtype) -> str | None:
  """Why the Mosaic kernels cannot take inputs of this dtype (they run bf16/f16 WGMMAs)."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"needs bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}"
  return None

def index_vector(shape, axis: int):
  """0, 1, ... along `axis` of a [rows, cols] tile in the WGMMA layout, as one int32 vector
  (the reduce layout that lax.broadcast_in_dim(v, shape, [axis]) spreads over the tile). Masks
  compare such vectors, broadcast: a full tile of indices takes a register per entry beside
  the accumulator, which made ptxas spill the GEMM's epilogue and the attention kernels."""
  return plgpu.broadcasted_iota(jnp.int32, (shape[axis],), 0,
                                layout=plgpu.Layout.WGMMA.reduce(1 - axis))

def load(ref, layout, optimized: bool = True):
  """A whole ref into registers with `layout`. jax 0.11 deprecates the index argument of
  plgpu.load that 0.10 requires. Mosaic GPU has optimized transfers for shared memory only:
  a global-memory ref needs optimized=False (plain per-thread loads)."""
  if _LOAD_TAKES_INDEX:
    return plgpu.load(ref, (), layout=layout, optimized=optimized)
  return plgpu.load(ref, layout=layout, optimized=optimized)

_LOAD_TAKES_INDEX = plgpu is not None and getattr(
    inspect.signature(plgpu.load).parameters.get("idx"), "default", None
) is inspect.Parameter.empty

def swizzled_tiles(swizzle: int = 128, dtype=jnp.bfloat16):
  """Swizzled tiles of `swizzle` bytes per row (64 bfloat16 elements by default, 32 of
  float32): what TMA writes and WGMMA reads. A WGMMA whose B operand is such a tile
  contracts over a multiple of swizzle / 2 of the tile's rows (Mosaic GPU issues its K steps
  per swizzle group)."""
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))

def row_swizzle(width: int, dtype=jnp.bfloat16) -> int:
  """The widest swizzle (bytes) of 128, 64 and 32 that divides a row of `width` elements;
  WGMMA takes no narrower one."""
  row = width * jnp.dtype(dtype).itemsize
  if row % 32:
    raise ValueError(f"a row of {width} {jnp.dtype(dtype).name} ({row} bytes) is no multiple "
                     "of 32 bytes")
  return next(sw for sw in (128, 64, 32) if row % sw == 0)

def div(x, n):
  """Integer division of kernel indices (Python ints or traced int32)."""
  return lax.div(jnp.asarray(x, jnp.int32), jnp.asarray(n, jnp.int32))

def rem(x, n):
  return lax.rem(jnp.asarray(x, jnp.int32), jnp.asarray(n, jnp.int32))

def snake(index, shape: tuple[int, int], minor: int, band: int):
  """The (row, column) of the index-th tile in plgpu.planar_snake's walk over a static
  `shape` of tiles: bands `band` tiles wide along dimension `minor`, walked across the band
  fastest and along the other dimension in turns (the last band narrower where `band` does
  not divide the shape). Integer arithmetic alone, no selects, so that it also lowers where
  a single warp computes it (under a WarpMesh, where Mosaic GPU lowers neither jnp's floor
  division nor lax.select)."""
  major_size, minor_size = shape[1 - minor], shape[minor]
  full = minor_size // band * band  # the minor extent of the whole bands
  first_rest = full * major_size  # the index where the narrower last band starts
  band_index = div(index, band * major_size)
  odd = rem(band_index, 2)  # walked backwards along the major dimension

  def coordinates(i, width):
    along, across = rem(div(i, width), major_size), rem(i, width)
    along = along + odd * (major_size - 1 - 2 * along)
    across = band_index * band + across
    return (across, along) if minor == 0 else (along, across)

  whole = lax.convert_element_type(lax.lt(index, first_rest), jnp.int32)
  return tuple(whole * a + (1 - whole) * b for a, b in zip(
      coordinates(index, band),
      coordinates(lax.max(index - first_rest, 0), max(minor_size - full, 1))))

def fence_smem() -> None:
  """Makes this thread's shared-memory writes visible to the async proxy (TMA, WGMMA), as
  plgpu.commit_smem does, but without its warpgroup barrier (a bar.sync, and the thread-id
  read that names it). Enough where each thread then arrives at an mbarrier that the reader
  waits on: Pallas counts every thread's arrival (a barrier of n arrivals expects 128·n under
  both lowering semantics), and each arrival releases its own thread's fenced writes."""
  @plgpu.inline_mgpu()
  def fence(_):
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.proxy.async.shared::cta;", "",
                    has_side_effects=True)

  fence()

def take_work_item(counter, slots, slot: int, first_taken: int) -> None:
  """One thread of the calling warpgroup adds 1 to `counter` (a global int32 semaphore that
  starts at zero in every call) and stores the value it found plus `first_taken` in
  `slots[slot]` (int32 shared memory): a persistent kernel's next work item, taken at run
  time. `first_taken`: the items the CTAs take before any count (their own CTA indices)."""

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
  def take(_, counter, slots):
    one = mgpu_utils.single_thread_predicate(mgpu_utils.ThreadSubset.WARPGROUP)
    smem = llvm.addrspacecast(llvm.PointerType.get(), mgpu_utils.memref_ptr(slots))
    llvm.inline_asm(
        ir.Type.parse("!llvm.void"), [mgpu_utils.memref_ptr(counter), smem, one],
        "{ .reg .b32 t; @$2 atom.relaxed.gpu.global.add.u32 t, [$0], 1; "
        f"@$2 add.u32 t, t, {first_taken}; @$2 st.u32 [$1+{4 * slot}], t; }}",
        "l,l,b", has_side_effects=True)

  take(counter, slots)

def wait_stores_read() -> None:
  """A CTA's last wait on its TMA stores: until they have read their shared memory, not
  until they land. The kernel's end makes its global writes visible to what follows (JAX's
  Hopper matmul and CUTLASS's epilogues end so too); waiting for the landing would keep the
  SM from its next CTA."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)

def sm_count() -> int:
  """The default device's SM count; 132, an H100's, where it has none (lowering on a CPU)."""
  return getattr(jax.devices()[0], "core_count", None) or 132

def persistent_ctas(num_sms: int | None, n_items: int) -> int:
  """A persistent kernel's CTAs: one per SM (num_sms, else sm_count()), at most one per
  work item."""
  return min(num_sms or sm_count(), n_items)

def greedy_schedule(costs, ctas: int, overhead: int):
  """(table [ctas, rounds], counts [ctas]) int32 for a persistent kernel: the work items
  (costs[i] for the one at launch position i, in any unit) dealt in launch order, each to
  the CTA that an estimate (its costs plus `overhead` per item) frees first, as the
  hardware's dispatcher would deal CTAs of a grid. Each CTA takes its items in launch
  order, so an item that waits on others (the ordered dq reduction) waits only on earlier
  ones, which the other CTAs reach first: no deadlock while all CTAs are resident."""
  free = [(0, c) for c in range(ctas)]
  lists = [[] for _ in range(ctas)]
  for i, n in enumerate(costs):
    at, c = heapq.heappop(free)
    lists[c].append(i)
    heapq.heappush(free, (at + int(n) + overhead, c))
  rounds = max(len(x) for x in lists)
  table = [x + [0] * (rounds - len(x)) for x in lists]
  return (jnp.asarray(table, jnp.int32).reshape(ctas, rounds),
          jnp.asarray([len(x) for x in lists], jnp.int32))

def when(cond, fn) -> None:
  """fn() where cond holds: a Python bool (static shapes) or a traced one."""
  if isinstance(cond, bool):
    if cond:
      fn()
  else:
    pl.when(cond)(fn)

def on_each_warp(body) -> None:
  """Runs body() on each of the warpgroup's four warps (`lax.axis_index("warp")` tells them
  apart), used as a decorator. `pl.kernel` over a WarpMesh is what jax 0.11 puts in place of
  `pl.core_map` there; jax 0.10 lowers both to the same module."""
  pl.kernel(body, mesh=plgpu.WarpMesh(axis_name="warp"))()

def fill_ring(load, n, stages: int, free, base=None, after_first=None) -> None:
  """The memory warpgroup's loop: load(i, slot) for steps 0..n-1 into `stages` shared-memory
  slots, refilling a slot once every barrier array in `free` has been arrived on for it.
  `n` may be traced (causal CTAs need fewer steps); the first fills are then guarded.

  base: where the ring continues from the walks before this one (their steps 0..base-1, a
  traced count, hold its slots): step i takes slot (base + i) mod stages, and waits for it
  unless base + i < stages. With base, after_first is called once the first
  min(stages, n) loads are issued (e.g. the next walk's keys, wanted after its first query
  tiles)."""
  def wait_free(slot):
    for barrier in free:
      plgpu.barrier_wait(barrier.at[slot])

  if base is not None:
    def step(i):
      gi = base + i
      slot = rem(gi, stages)
      pl.when(gi >= stages)(functools.partial(wait_free, slot))
      load(i, slot)

    ahead = jnp.minimum(stages, n)
    pl.loop(0, ahead)(step)
    if after_first is not None:
      after_first()
    pl.loop(ahead, n)(step)
    return
  assert after_first is None, "after_first goes with base"
  for i in range(stages):
    when(i < n, functools.partial(load, i, i))

  @pl.loop(stages, n)
  def _(i):
    slot = rem(i, stages)
    wait_free(slot)
    load(i, slot)

def floor_div(x, n):
  """Floor division of a possibly negative kernel index (lax.div truncates toward zero)."""
  q = div(x, n)
  return jnp.where(rem(x, n) < 0, q - 1, q)

def rows_scaled_where_needed(acc, alpha):
  """acc · alpha along its rows (acc in the WGMMA layout, alpha one value per row) where a
  warp's rows have an alpha other than 1; elsewhere acc unchanged (rows whose alpha is 1
  come out the same either way). A branch per warp, not a multiply per element: the online
  softmax's rescale, skipped where no row's maximum moved. The warp votes (a ballot of its
  threads' predicates), so its threads never diverge at the branch."""
  layout = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(layout, layout.reduce(1)),
                     return_type=plgpu.ShapeDtypeStruct(acc.shape, acc.dtype, layout=layout))
  def scaled(_, acc, alpha):
    f32 = ir.F32Type.get()
    one = arith.constant(f32, 1.0)
    moved = None
    for reg in alpha.registers.flat:
      for i in range(ir.VectorType(reg.type).shape[0]):
        ne = arith.cmpf(arith.CmpFPredicate.UNE, vector.extract(reg, [], [i]), one)
        moved = ne if moved is None else arith.ori(moved, ne)
    i32 = ir.IntegerType.get_signless(32)
    ballot = llvm.inline_asm(
        i32, [arith.extui(i32, moved)],
        "{ .reg .pred p; setp.ne.u32 p, $1, 0; vote.sync.ballot.b32 $0, p, 0xffffffff; }",
        "=r,r")
    moved = arith.cmpi(arith.CmpIPredicate.ne, ballot, arith.constant(i32, 0))
    branch = scf.IfOp(moved, [r.type for r in acc.registers.flat], has_else=True)
    with ir.InsertionPoint(branch.then_block):
      rows = alpha.broadcast_in_dim(acc.shape, (0,), acc.layout)
      scf.yield_(list((acc * rows).registers.flat))
    with ir.InsertionPoint(branch.else_block):
      scf.yield_(list(acc.registers.flat))
    registers = np.empty(acc.registers.shape, dtype=object)
    registers.flat[:] = list(branch.results)
    return mgpu.FragmentedArray(_registers=registers, _layout=acc.layout,
                                _is_signed=acc.is_signed)

  return scaled(acc, alpha)

def take_turn(barrier) -> None:
  """Ping-pong: both compute warpgroups arrive on `barrier`; neither passes until the other
  has."""
  plgpu.barrier_arrive(barrier)
  plgpu.barrier_wait(barrier)
