"""Compile a function without running it and report where its memory goes.

Totals come from XLA's compiled memory analysis (arguments, outputs, aliased bytes,
temporaries, peak). The largest buffers come from the optimized HLO: every instruction that
materializes an array (in the entry computation, loop bodies and other called computations,
but not inside fusions, whose intermediates stay in registers), with its shape, dtype, bytes,
the op that produced it and the source line where XLA's metadata gives one.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
# Instructions that name an existing buffer rather than making a new one.
_NO_NEW_BUFFER = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
                  "after-all", "opt-barrier", "copy-start", "copy-done"}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\](?:\{[^}]*\})?\s+"
                    r"([\w\-]+)\(")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_FUSION_CALL = re.compile(r"\bfusion\(.*calls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SOURCE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')


@dataclasses.dataclass(frozen=True)
class Buffer:
  """One materialized array of the compiled program."""

  name: str  # HLO instruction
  dtype: str
  shape: tuple[int, ...]
  nbytes: int
  opcode: str  # HLO opcode (fusion, custom-call, dot, ...)
  op_name: str  # the JAX op path XLA recorded, if any
  source: str  # "file:line" if XLA recorded it, else ""

  def __str__(self):
    where = f"  ({self.source})" if self.source else ""
    return (f"{_fmt(self.nbytes):>10s}  {self.dtype}{list(self.shape)}  {self.opcode}"
            f"  {self.op_name}{where}")


def _fmt(n: int | None) -> str:
  if n is None:
    return "n/a"
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


def parse_buffers(hlo_text: str) -> list[Buffer]:
  """Materialized arrays of an optimized HLO module, largest first."""
  fused = set(_FUSION_CALL.findall(hlo_text))
  buffers, skip = [], False
  for line in hlo_text.splitlines():
    comp = _COMP.match(line)
    if comp:
      skip = comp.group(2) in fused
      continue
    if skip:
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    name, dtype, dims, opcode = m.groups()
    if opcode in _NO_NEW_BUFFER or dtype not in _DTYPE_BYTES:
      continue
    shape = tuple(int(d) for d in dims.split(",") if d)
    op = _OP_NAME.search(line)
    src = _SOURCE.search(line)
    buffers.append(Buffer(name, dtype, shape, math.prod(shape) * _DTYPE_BYTES[dtype], opcode,
                          op.group(1) if op else "",
                          f"{src.group(1).rsplit('/', 1)[-1]}:{src.group(2)}" if src else ""))
  buffers.sort(key=lambda b: -b.nbytes)
  return buffers


@dataclasses.dataclass
class MemoryReport:
  """Where a compiled program's bytes go. Byte counts are None where the backend gives none."""

  backend: str
  argument_bytes: int | None
  output_bytes: int | None
  alias_bytes: int | None
  temp_bytes: int | None
  peak_bytes: int | None
  buffers: list[Buffer]

  def largest(self, n: int = 10) -> list[Buffer]:
    return self.buffers[:n]

  def assert_peak_below(self, nbytes: int) -> None:
    if self.peak_bytes is None:
      raise AssertionError(f"the {self.backend} backend reports no peak memory")
    if self.peak_bytes >= nbytes:
      raise AssertionError(f"peak {_fmt(self.peak_bytes)} is not below {_fmt(nbytes)}\n{self}")

  def assert_no_buffer_larger_than(self, nbytes: int) -> None:
    big = [b for b in self.buffers if b.nbytes > nbytes]
    if big:
      raise AssertionError(f"{len(big)} buffer(s) larger than {_fmt(nbytes)}:\n" +
                           "\n".join(f"  {b}" for b in big[:10]))

  def __str__(self):
    rows = [f"memory report ({self.backend})",
            f"  arguments   {_fmt(self.argument_bytes):>10s}",
            f"  outputs     {_fmt(self.output_bytes):>10s}",
            f"  aliased     {_fmt(self.alias_bytes):>10s}",
            f"  temporaries {_fmt(self.temp_bytes):>10s}",
            f"  peak        {_fmt(self.peak_bytes):>10s}",
            "  largest buffers:"]
    rows += [f"    {b}" for b in self.largest(10)] or ["    (none)"]
    if self.temp_bytes is None:
      rows.append(f"  note: the {self.backend} backend gives no memory analysis")
    return "\n".join(rows)


def analyze(fn, *args, **kwargs) -> MemoryReport:
  """Compiles `fn` (jitted or not) for `args` (arrays or ShapeDtypeStructs), without running
  it, and reports argument, output, alias, temporary and peak bytes and the largest buffers.

  >>> import jax, jax.numpy as jnp
  >>> report = analyze(lambda x: jnp.sin(x) @ x.T, jax.ShapeDtypeStruct((256, 64), jnp.float32))
  >>> report.largest(1)[0].shape
  (256, 256)
  """
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  return report_of(jitted.lower(*args, **kwargs).compile())


def report_of(compiled) -> MemoryReport:
  """The MemoryReport of an already compiled executable (`jax.jit(f).lower(...).compile()`)."""
  stats = compiled.memory_analysis()
  get = lambda name: None if stats is None else int(getattr(stats, name, 0) or 0)
  peak = None
  if stats is not None:
    # Arguments + outputs + the temporary arena - aliased bytes is what the executable
    # holds at once. Some backends report a separate peak that leaves the arena out (the
    # CPU client does): take the larger.
    parts = get("argument_size_in_bytes") + get("output_size_in_bytes") + \
        get("temp_size_in_bytes") - get("alias_size_in_bytes")
    peak = max(parts, get("peak_memory_in_bytes"))
  try:
    text = compiled.as_text()
  except Exception:  # pylint: disable=broad-except
    text = ""
  return MemoryReport(jax.default_backend(), get("argument_size_in_bytes"),
                      get("output_size_in_bytes"), get("alias_size_in_bytes"),
                      get("temp_size_in_bytes"), peak, parse_buffers(text or ""))

