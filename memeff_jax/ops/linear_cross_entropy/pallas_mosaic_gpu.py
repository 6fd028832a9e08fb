"""Linear cross-entropy on NVIDIA GPUs: on Hopper, Mosaic GPU GEMMs with the softmax folded
into their epilogues; elsewhere, cuBLAS GEMMs around a Pallas Triton softmax kernel (in XLA,
xla_softmax, where JAX no longer has Pallas Triton).

Per token chunk (see _chunked for the loop and the custom_vjp), the loss and its gradients
cost the three matmuls they cannot avoid. On Hopper with bfloat16 inputs (the default,
`exp_logits`):

  1. E = exp(x_c @ W), its rows' sums   kernels.mosaic_gemm, exp in the epilogue, [C, V]
  2. one scatter per row                patches the label entry: G = diag(s) E, s per row
  3. dx_c = diag(s) E Wᵀ,               kernels.mosaic_gemm, s applied in the epilogue, dx's
     dW += (diag(s) x_c)ᵀ E             rows written in place, dW added by TMA reduce-adds

No pass reads or writes the chunk's buffer between the GEMMs, and E and its row sums are the
only chunk-sized buffers (0.247 GiB at Llama-3-8B's shape). PallasMosaicGpu.auto_gemms says
where all three GEMMs are ours (measured level with cuBLAS there); a chunk whose
exponentials leave the safe range takes the softmax pass instead (ChunkBackend._exp_chunk).

With a logit softcap c, step 1 stores exp(ẑ) times ẑ's slope (ẑ = c·tanh(z / c)), which
keeps G = diag(s) E. With label smoothing, G's uniform share −a ε / V goes to dx and dW after
the chunks (LossOptions.smoothing_apart), which keeps it too. Without gradients (the loss
alone, or reduction="none"'s forward) step 1 stores the row sums alone, and the label
logits are dots of x's rows with W's label columns (ChunkBackend._exp_stats).

The softmax pass (other GPUs, float16, calls with a bias, label smoothing under a cap):
z = x_c @ W (cuBLAS or kernels.mosaic_gemm), then triton_softmax's kernel overwrites z
with G = ∂loss/∂z, then dx_c = G Wᵀ and dW += x_cᵀ G.
Memory: one [C, V] buffer in the compute dtype; dW accumulates in the weight's dtype (one
rounding per chunk with cuBLAS, two with the Mosaic GEMM's TMA adds) unless
`dw_accumulation="float32"`. With `fused_lse` the Mosaic logits GEMM also hands over each
row's partial log-sum-exps, stored in dx's rows before the dx GEMM writes them (as
bfloat16 words, mosaic_gemm.StatsWords), so the pass reads the logits once and the partials
hold no memory: the lowest-memory setting.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from memeff_jax import _tuning
from memeff_jax.kernels import hopper
from memeff_jax.kernels import mosaic_gemm
from memeff_jax.ops import _dispatch
from memeff_jax.ops.linear_cross_entropy import _chunked
from memeff_jax.ops.linear_cross_entropy import _common
from memeff_jax.ops.linear_cross_entropy import triton_softmax
from memeff_jax.ops.linear_cross_entropy import xla_softmax
from memeff_jax.ops.linear_cross_entropy._common import LossOptions, Stats
from memeff_jax.ops.linear_cross_entropy._vocab_parallel import VocabShards


GEMMS = ("logits", "dx", "dw")


def tuned_gemm_config(key: str, layout: str, k: int, output: tuple[int, int] | None = None,
                      sms: int | None = None) -> mosaic_gemm.GemmConfig:
  """The tuned tiles (configs/tuning, [mosaic_gemm]) of the loss's GEMM `key` ("logits",
  "dx", "dw" or "dw_tma") for a weight `layout` and contraction size k: the section
  `<key>_<layout>`, else `<key>`. A ping-pong section may name in `fallback` the section to
  run where a tile's k steps fill each slot an odd number of times (they are no multiple
  of twice the slots: _fills_evenly), which may name a further one: the first whose slots
  k fills evenly runs.
  A section may also name in `narrow` the fields of narrower tiles that take over where
  they finish the [M, N] `output` sooner on `sms` SMs (mosaic_gemm.wave_span, each tile
  counted `tile_cost` columns more than its width)."""
  tuned = _tuning.lookup("linear_cross_entropy", "mosaic_gemm")
  section = dict(tuned.get(f"{key}_{layout}", tuned.get(key, {})))
  for _ in range(len(tuned) + 1):
    fallback, narrow = section.pop("fallback", None), section.pop("narrow", None)
    tile_cost = section.pop("tile_cost", 0)
    config = mosaic_gemm.GemmConfig(**section)
    if fallback is None or _fills_evenly(config, k):
      if narrow is not None and output is not None:
        narrower = dataclasses.replace(config, **narrow)
        if (mosaic_gemm.wave_span(narrower, *output, sms, tile_cost)
            < mosaic_gemm.wave_span(config, *output, sms, tile_cost)):
          return narrower
      return config
    section = dict(tuned[fallback])
  raise ValueError(f"tuning/linear_cross_entropy.toml: the fallbacks of {key}_{layout} "
                   "form a cycle")


def _fills_evenly(config: mosaic_gemm.GemmConfig, k: int) -> bool:
  """Whether a ping-pong tile's K steps (K = k) fill each of its slots an even number of
  times: the shape class on which some GPUs' tables keep their ping-pong tiles."""
  return (config.schedule == "pingpong"
          and (k // config.tile_k) % (2 * config.max_concurrent_steps) == 0)


@dataclasses.dataclass(frozen=True)
class PallasMosaicGpu:
  """Chunked implementation whose per-chunk softmax pass is a Pallas Triton kernel (XLA's
  where JAX has no Pallas Triton), around Mosaic GPU or cuBLAS GEMMs.

  Attributes:
    memory_budget_bytes: bytes for the chunk's logits/G buffer and its rows' partial sums
      (4 bytes per 128 logits); decides the token chunk. None (the default): 256 MiB, or
      as many as the tuning table's `min_chunk_tokens` tokens take where that is more
      (Gemma-2's 256,000-entry vocabulary: 0.5 GiB for 1,024 tokens; the GEMM tiles are
      tuned at 1,024-token chunks, and 512 run them far slower).
    dw_accumulation: "weight" (accumulate dW in the weight's dtype, no extra buffer: each
      chunk's product is added to the running dW in float32 and rounded once), "float32"
      (a float32 [D, V] accumulator, cast once at the end: D·V·4 bytes more) or "tma_add"
      (in the weight's dtype, with "dw" in mosaic_gemms: each chunk's product is rounded to
      the weight's dtype and added to the running dW by TMA reduce-add stores in L2, so the
      GEMM never reads dW into the SMs; two roundings per chunk instead of one). None (the
      default): "tma_add" where the dW GEMM is Mosaic's, else "weight"; a call of more
      chunks than the tuning table's `max_rounded_chunks` (a 16-bit sum's error grows with
      the tokens it adds up) takes them in groups of that many, each group's dW added up so
      and the groups' sums in a float32 [D, V] buffer (dw_group: D·V·4 bytes more).
    kernel: the softmax pass's tiles (triton_softmax's Pallas Triton kernel); None looks
      up configs/tuning for the device. Where JAX has no Pallas Triton (it deprecates that
      backend) the pass runs in XLA (xla_softmax), and a kernel given raises Unsupported.
    vocab_multiple: pad the vocabulary of W (with zero columns) to a multiple of this, so
      that GEMM rows are 16-byte aligned (V = 50,257 otherwise leaves cuBLAS on slow
      kernels). Costs a copy of W when V is not already a multiple.
    interpret: run the kernel in the Pallas interpreter (any backend, for tests).
    mosaic_gemms: which of the chunk's GEMMs ("logits", "dx", "dw") run on kernels.mosaic_gemm
      instead of cuBLAS; tiles from configs/tuning/linear_cross_entropy.toml's
      [mosaic_gemm] sections (`<gemm>_<layout>`, else `<gemm>`; the dW GEMM's under
      dw_accumulation="tma_add" are `dw_tma_<layout>`). Needs a Hopper GPU, 16-bit
      x and weight, and shapes that are multiples of the tiles; a call that cannot have them
      raises NotImplementedError. None (the default, with dw_accumulation None too): all
      three where they are as fast as cuBLAS and hold less memory, else none (see
      auto_gemms: on Hopper with bfloat16 inputs, at Llama-3-8B's shape in the default
      layout, the chunk's exponentials and their rows' sums are then the only temporaries,
      0.248 GiB against 0.29 with cuBLAS's workspace and [C, D] products).
    fused_lse: with "logits" in mosaic_gemms, the logits GEMM's epilogue also reduces each
      row of its tiles to partial log-sum-exps (mosaic_gemm.gemm's row_stats), so the
      softmax pass of the gradients reads the chunk's logits once instead of twice (no
      sweep 1). Calls with a bias or a logit softcap raise NotImplementedError.
    exp_logits: no softmax pass at all where the gradients are made in the loop (see
      ChunkBackend._exp_chunk): a logits GEMM on kernels.mosaic_gemm (whatever
      mosaic_gemms says; in interpret mode its XLA equivalent) stores exp(z) and its rows'
      sums, the label entries are patched, and the softmax's per-row factor is applied to
      dx's rows and to x's rows before the dW GEMM (where that GEMM is Mosaic's, x's
      scaled rows wait in dx's rows; where dx's is, it writes them in place and scales
      them in its epilogue, mosaic_gemm's row_scale). Statistics without gradients take
      the GEMM's row sums alone (ChunkBackend._exp_stats). A chunk whose exponentials
      leave the safe range falls back to the softmax pass. Calls with a bias, the entropy,
      or label smoothing under a logit softcap, use the softmax pass throughout (a softcap
      alone does not: E then holds each exponential times the cap's slope; nor does
      smoothing alone, vocab parallel or not: its uniform share of G goes to dx and dW
      after the chunks, LossOptions.smoothing_apart). None (the default): wherever that
      GEMM can run (a Hopper GPU, x and weight both bfloat16, as float16 cannot hold E's
      range; a chunk that fits its tiles; never in interpret mode), unless fused_lse is
      set (the softmax pass whose partials take no memory: the lowest-memory setting);
      True: always, NotImplementedError where it cannot run; False: never.
  """

  memory_budget_bytes: int | None = None
  dw_accumulation: str | None = None
  vocab_multiple: int = 64
  kernel: triton_softmax.SoftmaxKernelConfig | None = None
  interpret: bool = False
  mosaic_gemms: tuple[str, ...] | None = None
  fused_lse: bool = False
  exp_logits: bool | None = None
  name: str = "pallas_mosaic_gpu"

  def __post_init__(self):
    if self.dw_accumulation not in (None, "weight", "float32", "tma_add"):
      raise ValueError(f"dw_accumulation must be 'weight', 'float32' or 'tma_add' (or None), "
                       f"got {self.dw_accumulation!r}")
    if self.mosaic_gemms is not None and (isinstance(self.mosaic_gemms, str)
                                          or not set(self.mosaic_gemms) <= set(GEMMS)):
      raise ValueError(f"mosaic_gemms must be a tuple of names from {GEMMS} (or None), got "
                       f"{self.mosaic_gemms!r}")
    gemms = self.mosaic_gemms or ()
    if self.dw_accumulation == "tma_add" and "dw" not in gemms:
      raise ValueError("dw_accumulation='tma_add' is done by the Mosaic dW GEMM's stores; "
                       f"it needs 'dw' in mosaic_gemms, got {self.mosaic_gemms!r}")
    if self.fused_lse and "logits" not in gemms:
      raise ValueError("fused_lse is done by the Mosaic logits GEMM's epilogue; it needs "
                       f"'logits' in mosaic_gemms, got {self.mosaic_gemms!r}")
    if "dw" in gemms and self.dw_accumulation == "float32":
      raise ValueError("mosaic_gemms with 'dw' accumulates dW in the weight's 16-bit dtype; "
                       "it excludes dw_accumulation='float32'")

  def gemm_configs(self, tokens: int, d: int, vocab: int, dtype, weight_dtype,
                   layout: str, names: tuple[str, ...] | None = None, sms: int | None = None
                   ) -> tuple[tuple[str, mosaic_gemm.GemmConfig], ...]:
    """(name, tiles) of each GEMM in `names` (default mosaic_gemms); NotImplementedError
    when one cannot run. dx's [tokens, d] output is a few tiles, so its tiles are narrowed
    where that fills the waves of the GPU's `sms` SMs (default: the default device's) in
    less time (mosaic_gemm.narrowed_to_fill_waves); the others take the narrower tiles
    their tuned section names where those fill the waves sooner (tuned_gemm_config)."""
    names = self.mosaic_gemms if names is None else names
    if not names:
      return ()
    why = ("interpret mode runs no Mosaic GPU kernel" if self.interpret
           else hopper.unavailable())
    if why is None and (jnp.dtype(dtype) != jnp.dtype(weight_dtype)
                        or jnp.dtype(dtype).itemsize != 2):
      why = (f"needs x and weight in one 16-bit dtype, got {jnp.dtype(dtype)} and "
             f"{jnp.dtype(weight_dtype)}")
    if why is not None:
      raise _dispatch.Unsupported(f"pallas_mosaic_gpu mosaic_gemms={names}: {why}")
    shapes = dict(logits=(tokens, vocab, d), dx=(tokens, d, vocab),
                  dw=(d, vocab, tokens) if layout == "dv" else (vocab, d, tokens))
    configs = []
    for name in GEMMS:
      if name in names:
        # dW added by TMA reads no C: its tiles have their own sections ("dw_tma_<layout>").
        key = "dw_tma" if name == "dw" and self.dw_accumulation == "tma_add" else name
        config = tuned_gemm_config(key, layout, shapes[name][2], shapes[name][:2], sms)
        if name == "dx":
          config = mosaic_gemm.narrowed_to_fill_waves(config, tokens, d, sms=sms,
                                                      trans_b=layout == "dv")
        if (why := mosaic_gemm.shape_error(*shapes[name], config)) is not None:
          raise _dispatch.Unsupported(
              f"pallas_mosaic_gpu's {name} GEMM on kernels.mosaic_gemm, [M, N, K] = "
              f"{list(shapes[name])} at a chunk of {tokens} tokens: {why}")
        configs.append((name, config))
    return tuple(configs)

  def auto_gemms(self, shapes: tuple, *, exp: bool, sms: int | None = None
                 ) -> tuple[tuple[str, ...], str]:
    """The (mosaic_gemms, dw_accumulation) that a call runs with where either is None.

    All three GEMMs go on kernels.mosaic_gemm, dW added by TMA, where that is as fast as cuBLAS
    and holds less memory: the exp_logits path (`exp`, on Hopper), a weight layout listed in
    configs/tuning's [mosaic_default] `layouts` (those whose Mosaic tiles were measured level
    with cuBLAS at 1,024-token chunks), every GEMM within its tiles, and a dx GEMM whose
    tiles (narrowed where that fills the waves sooner, see gemm_configs) fill the GPU's SMs
    in whole waves to `min_wave_fill` (it has no split-K: a [C, D] output of a few tiles
    would leave most SMs idle). Where only that last fails and the dW GEMM's tuned tiles
    run ping-pong (not their ring `fallback`), the logits and dW GEMMs go on
    kernels.mosaic_gemm and dx on cuBLAS (Gemma-2-2b's head, whose dx takes 72 tiles of
    128 × 256: faster than all three on cuBLAS). Either way, where a chunk holds at least
    the table's `cublas_dw_tokens` (an H100's: its dW GEMM's K steps are many enough for
    cuBLAS's main loop to beat ours) and the memory budget also holds x's scaled rows,
    which dW then reads from a buffer of their own, dW goes on cuBLAS, its product added to
    a 16-bit dW by the GEMM's epilogue ("weight"). Where the chunks do not
    divide the tokens, the ragged rest runs on the same GEMMs with tiles chosen for its own
    rows, or on cuBLAS where those do not fit (see __call__). Elsewhere cuBLAS, with dW
    added in the weight's dtype ("weight"). A call of more chunks than a 16-bit dW may be
    rounded in takes the same choice, its chunks in groups (dw_group). `shapes` as
    gemm_configs takes them; `sms`: the GPU's SM count (default: the default device's),
    which mosaic_gemm.ctas turns into the dx launch's CTAs."""
    tokens, d = shapes[0], shapes[1]
    rule = _tuning.lookup("linear_cross_entropy", "mosaic_default")
    if self.mosaic_gemms is not None:  # only the accumulation is open
      return self.mosaic_gemms, "tma_add" if "dw" in self.mosaic_gemms else "weight"
    if self.dw_accumulation is not None:
      return (), self.dw_accumulation
    cublas = ((), "weight")
    if (not exp or self.interpret or self.fused_lse
        or shapes[-1] not in rule.get("layouts", ())):
      return cublas
    auto = dataclasses.replace(self, mosaic_gemms=GEMMS, dw_accumulation="tma_add")
    try:
      configs = dict(auto.gemm_configs(*shapes, sms=sms))
    except _dispatch.Unsupported:
      return cublas
    tiles = mosaic_gemm.cta_tiles(configs["dx"], tokens, d)
    sms = mosaic_gemm.ctas(configs["dx"], sms)  # as the dx GEMM's launch will have them
    fills = tiles / (-(-tiles // sms) * sms) >= rule.get("min_wave_fill", 1.0)
    if not fills and configs["dw"].schedule != "pingpong":
      return cublas
    itemsize = jnp.dtype(shapes[3]).itemsize
    per_token = _per_token(shapes[2], itemsize) + d * itemsize  # E, its sums, x's rows
    if (tokens >= rule.get("cublas_dw_tokens", math.inf)
        and tokens * per_token <= self._budget(shapes[2], itemsize)):
      return ("logits", "dx") if fills else ("logits",), "weight"
    return GEMMS if fills else ("logits", "dw"), "tma_add"  # without dx, it is cuBLAS's

  def dw_group(self, n_tokens: int, tokens: int, itemsize: int) -> int | None:
    """How many chunks of `tokens` a call of n_tokens adds up in a 16-bit dW before a
    float32 sum takes that dW over (_chunked.run_chunks' groups): the tuning table's
    `max_rounded_chunks` where dw_accumulation is the default's and the call has more
    chunks, as a 16-bit sum's error grows with the tokens it adds up. None: one sum."""
    limit = self._rounding_limit(itemsize)
    return limit if limit is not None and -(-n_tokens // tokens) > limit else None

  def rounded_tokens(self, vocab: int, itemsize: int, chunk_size) -> int | None:
    """The most tokens whose dW a call adds up in the weight's 16-bit dtype alone: its
    chunks, at most the tuning table's `max_rounded_chunks` of them (beyond that the
    default adds the groups' sums in float32, see dw_group). None where no such limit
    applies."""
    limit = self._rounding_limit(itemsize)
    if limit is None:
      return None
    return limit * self.plan(2**31, vocab + -vocab % self.vocab_multiple, itemsize, chunk_size)

  def _rounding_limit(self, itemsize: int) -> int | None:
    """The tuning table's `max_rounded_chunks` where the default picks dW's accumulation for
    a 16-bit weight, else None."""
    if itemsize != 2 or self.dw_accumulation is not None:
      return None
    return _tuning.lookup("linear_cross_entropy", "mosaic_default").get("max_rounded_chunks")

  def plan(self, n_tokens: int, vocab: int, itemsize: int, chunk_size) -> int:
    """Tokens per chunk: `chunk_size` as given, else as many as the memory budget holds
    (a multiple of 128), balanced over the chunks needed. A call under one chunk is one
    chunk, rounded up to whole 128-row tiles (more than n_tokens: _chunked pads it)."""
    if chunk_size is not None:
      if not isinstance(chunk_size, int):
        tokens, cols = chunk_size
        if cols < vocab:
          raise _dispatch.Unsupported("pallas_mosaic_gpu does not chunk the vocabulary; "
                                      f"got {chunk_size=} with vocab size {vocab}")
        chunk_size = tokens
      return min(chunk_size, n_tokens)
    min_tokens = _tuning.lookup("linear_cross_entropy", "mosaic_default").get(
        "min_chunk_tokens", 0)
    budget = self._budget(vocab, itemsize)
    tokens = budget // _per_token(vocab, itemsize)
    if tokens < 16:
      raise _dispatch.Unsupported(
          f"a vocabulary of {vocab} leaves fewer than 16 tokens per chunk in "
          f"memory_budget_bytes={budget}; pallas_mosaic_gpu does not chunk the "
          "vocabulary (chunked_xla does)")
    if tokens >= 128:
      tokens = tokens // 128 * 128
      if n_tokens < tokens and n_tokens % 128:
        # One chunk, padded to whole 128-row tiles (see __call__): the Mosaic GEMMs run on
        # whole tiles, and a few zero rows cost less than cuBLAS and the softmax pass.
        return -(-n_tokens // 128) * 128
    return _chunked.balanced_chunk(n_tokens, tokens, min_exact=min_tokens)

  def _budget(self, vocab: int, itemsize: int) -> int:
    """The bytes a chunk's temporaries may take: memory_budget_bytes, else 256 MiB, or
    min_chunk_tokens' logits and sums where those take more."""
    if self.memory_budget_bytes is not None:
      return self.memory_budget_bytes
    min_tokens = _tuning.lookup("linear_cross_entropy", "mosaic_default").get(
        "min_chunk_tokens", 0)
    return max(256 * 2**20, min_tokens * _per_token(vocab, itemsize))

  def __call__(self, x, weight, bias, labels, valid, weights=None, *, opts: LossOptions,
               chunk_size=None, vocab: VocabShards | None = None):
    if not self.interpret and not hopper.on_nvidia_gpu():
      raise _dispatch.Unsupported(
          f"pallas_mosaic_gpu needs a GPU, an NVIDIA one (default device: "
          f"{jax.devices()[0].device_kind}); PallasMosaicGpu(interpret=True) runs the kernel in "
          "the Pallas interpreter")
    kernel = self._softmax_kernel()
    whole, opts = opts, opts if vocab is None else vocab.options(opts, weight)
    pad = -opts.vocab_size % self.vocab_multiple
    rows = x.shape[0]
    tokens = self.plan(rows, opts.vocab_size + pad, jnp.dtype(x.dtype).itemsize, chunk_size)
    shapes = (tokens, x.shape[1], opts.vocab_size + pad, x.dtype, weight.dtype,
              opts.weight_layout)
    wanted = self.exp_logits or (self.exp_logits is None and not self.fused_lse)
    if wanted and jnp.dtype(x.dtype) == jnp.float16:  # E's entries reach e^64 > 65,504
      if self.exp_logits:
        raise _dispatch.Unsupported("pallas_mosaic_gpu exp_logits stores exp(z) up to e^64 in "
                                    "x's dtype, which float16 cannot hold; got float16 x")
      wanted = False
    # Label smoothing's uniform share of G goes to dx and dW after the chunks
    # (LossOptions.smoothing_apart); under a cap it is not uniform. The entropy's Σ p ẑ is
    # no row sum of E's.
    wanted = wanted and bias is None and not opts.entropy and not (
        opts.label_smoothing and opts.logit_softcap is not None)
    if wanted and opts.label_smoothing:
      whole, opts = (dataclasses.replace(o, smoothing_apart=True) for o in (whole, opts))
    if self.fused_lse and (bias is not None or opts.logit_softcap is not None):
      raise _dispatch.Unsupported("pallas_mosaic_gpu fused_lse: the logits GEMM's epilogue adds "
                                  "no bias and applies no logit_softcap")
    chosen = self.mosaic_gemms is not None and self.dw_accumulation is not None
    impl = self
    if not chosen:
      gemms, accumulation = self.auto_gemms(shapes, exp=wanted)
      impl = dataclasses.replace(self, mosaic_gemms=gemms, dw_accumulation=accumulation)
    backend = impl._chunk_backend(shapes, opts, kernel, wanted)
    tail = None
    if rows > tokens and rows % tokens:  # the ragged chunk: GEMM tiles for its own rows
      multiple = backend.row_multiple
      tail_shapes = (-(-(rows % tokens) // multiple) * multiple, *shapes[1:])
      try:
        tail = impl._chunk_backend(tail_shapes, opts, kernel, wanted)
      except _dispatch.Unsupported:
        if chosen:
          raise
        # On cuBLAS instead, dW still added in the weight's dtype where it was by TMA.
        accumulation = "weight" if impl.dw_accumulation == "tma_add" else impl.dw_accumulation
        tail = dataclasses.replace(impl, mosaic_gemms=(), dw_accumulation=accumulation
                                   )._chunk_backend(tail_shapes, opts, kernel, wanted)
    # Zero columns give zero logits, which the kernel never overwrites: G is 0 there, so
    # they add nothing to dx and their dW columns are sliced away by pad's transpose.
    if pad:
      axis = 1 if opts.weight_layout == "dv" else 0
      weight = jnp.pad(weight, [(0, pad if i == axis else 0) for i in range(2)])
      bias = None if bias is None else jnp.pad(bias, (0, pad))
    static = _chunked.Static(backend, whole, tokens, vocab, tail,
                             self.dw_group(rows, tokens, jnp.dtype(weight.dtype).itemsize))
    return _chunked.chunked_loss(static, x, weight, bias, labels, valid, weights)

  def _softmax_kernel(self) -> triton_softmax.SoftmaxKernelConfig | None:
    """The Triton softmax pass's tiles; None where this JAX has no Pallas Triton."""
    if triton_softmax.plgpu is None:
      if self.kernel is not None:
        raise _dispatch.Unsupported(
            f"kernel={self.kernel} configures the Pallas Triton softmax pass, and "
            "jax.experimental.pallas.triton is not importable (leave kernel=None: the pass "
            "then runs in XLA)")
      return None
    return self.kernel or triton_softmax.SoftmaxKernelConfig(**_tuning.lookup(
        "linear_cross_entropy", "triton_softmax", fields=triton_softmax.SoftmaxKernelConfig))

  def _chunk_backend(self, shapes: tuple, opts: LossOptions, kernel, wanted: bool
                     ) -> ChunkBackend:
    """The ChunkBackend of chunks of shapes[0] tokens (`shapes` as gemm_configs takes
    them): this object's GEMMs, and the exp_logits path where `wanted` and its GEMM runs."""
    gemms = self.gemm_configs(*shapes)
    exp_logits, exp_gemm = False, None
    if wanted:
      if self.interpret:  # the GEMM's XLA equivalent, when asked for
        exp_logits = bool(self.exp_logits)
      else:
        try:
          (_, exp_gemm), = self.gemm_configs(*shapes, names=("logits",))
          if exp_gemm.schedule == "cooperative":  # no row_stats, no `enabled`
            raise _dispatch.Unsupported(
                "pallas_mosaic_gpu exp_logits needs the logits GEMM's tiles on the 'ring' or "
                f"'pingpong' schedule, got {exp_gemm}")
          exp_logits = True
        except _dispatch.Unsupported:
          if self.exp_logits:
            raise
          exp_gemm = None
    # Tokens are the M of the logits and dx GEMMs and the K of dW's.
    tiles = [config.cluster_tile()[0] for name, config in gemms if name != "dw"]
    tiles += [config.tile_k for name, config in gemms if name == "dw"]
    tiles += [] if exp_gemm is None else [exp_gemm.cluster_tile()[0]]
    return ChunkBackend(opts=opts, kernel=kernel, interpret=self.interpret,
                        dw_accumulation=self.dw_accumulation, gemms=gemms,
                        fused_lse=self.fused_lse, exp_logits=exp_logits, exp_gemm=exp_gemm,
                        row_multiple=math.lcm(1, *tiles))


@dataclasses.dataclass(frozen=True)
class ChunkBackend:
  """Per-chunk work of PallasMosaicGpu (see _chunked for the protocol)."""

  implementation = "pallas_mosaic_gpu"  # its name in errors (a class attribute, not a field)

  opts: LossOptions
  kernel: triton_softmax.SoftmaxKernelConfig | None  # None: the softmax pass in XLA
  interpret: bool
  dw_accumulation: str
  gemms: tuple[tuple[str, mosaic_gemm.GemmConfig], ...] = ()  # those on kernels.mosaic_gemm
  fused_lse: bool = False  # partial log-sum-exps from the logits GEMM (PallasMosaicGpu.fused_lse)
  exp_logits: bool = False  # no softmax pass where grads makes G (PallasMosaicGpu.exp_logits)
  exp_gemm: mosaic_gemm.GemmConfig | None = None  # its logits GEMM's; None: XLA's
  row_multiple: int = 1  # a ragged chunk's rows padded to a multiple (the GEMMs' row tiles)

  def dw_dtype(self, w):
    return jnp.float32 if self.dw_accumulation == "float32" else w.dtype

  def _mosaic(self, name: str) -> mosaic_gemm.GemmConfig | None:
    return dict(self.gemms).get(name)

  def takes_rows(self, n_tokens: int, chunk: int) -> tuple[str, ...]:
    """With Mosaic GEMMs, x's chunk is read in place, and dx's rows are written in place
    where a Mosaic GEMM is on the dW or dx side: the dx GEMM writes them (or, with
    exp_logits, cuBLAS's product lands there), and where both are Mosaic's the dW GEMM
    first reads x's scaled rows from them (see _apply and _chunked). Not where the tokens
    are no whole number of TMA's 8-row tiles (mosaic_gemm.TMA_ROWS): then each chunk is an
    array of its own."""
    if (not (self.gemms or self.exp_gemm) or n_tokens < chunk
        or n_tokens % mosaic_gemm.TMA_ROWS):
      return ()
    if self._mosaic("dx") is not None or (self.exp_logits and self._mosaic("dw") is not None):
      return ("x", "dx")
    return ("x",)

  def _logits(self, x_c, w, bias, partials: bool = False, partials_into=None):
    """The chunk's logits; with `partials` (fused_lse) also their partial log-sum-exps,
    as an array or, stored in the `partials_into` window, as mosaic_gemm.StatsWords."""
    layout = self.opts.weight_layout
    if partials:
      return mosaic_gemm.gemm(x_c, w, trans_b=layout == "vd", config=self._mosaic("logits"),
                              name="lce_logits_gemm", row_stats=self.opts.vocab_size,
                              row_stats_into=partials_into)
    if (config := self._mosaic("logits")) is not None:
      z = mosaic_gemm.gemm(x_c, w, trans_b=layout == "vd", config=config,
                           name="lce_logits_gemm")
    else:
      x_c = _sliced(x_c)
      z = _common.logits_dot(x_c, w, layout, x_c.dtype)
    if bias is not None:
      z = (z.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x_c.dtype)
    return z

  def _softmax(self, z, labels_c, *args, **kwargs):
    """The softmax pass over the chunk's logits: triton_softmax's kernel with this backend's
    settings, or XLA's (xla_softmax) where this JAX has no Pallas Triton (kernel None)."""
    if self.kernel is None:
      return xla_softmax.softmax_pass(z, labels_c, *args, opts=self.opts, **kwargs)
    return triton_softmax.softmax_pass(z, labels_c, *args, opts=self.opts, config=self.kernel,
                                       interpret=self.interpret, **kwargs)

  def stats(self, x_c, w, bias, labels_c) -> Stats:
    if self.exp_logits:
      return self._exp_stats(x_c, w, labels_c)
    return Stats(*self._softmax(self._logits(x_c, w, bias), labels_c))

  # The chunk loop runs the first chunk on its own with dw_acc=None: its GEMM writes dW, so
  # that dW (1 GiB at llama3-8b) is neither zero-filled nor read back by that chunk's GEMM.
  first_chunk_writes_dw = True
  runs_kernels = True  # Pallas kernels: traced without check_vma inside shard_map (_vma)

  def grads(self, x_c, w, bias, labels_c, a_c, e_c, lse_c, dw_acc, db_acc, need,
            dx_into=None, vocab: VocabShards | None = None, needed=None, entropy=None):
    need_dx, need_dw, need_db = need
    # dx's rows of the chunk, written in place (no [C, D] buffer where the dx GEMM is
    # Mosaic's); until then they are scratch, where fused_lse's partials or exp_logits'
    # scaled rows of x go.
    dx_rows = None
    if need_dx and dx_into is not None:
      dx_rows = dx_into._replace(array=jax.new_ref(dx_into.array))
    scale = None  # exp_logits: the per-row factor of G that the buffer does not hold
    if self.exp_logits:
      g, scale, stats = self._exp_chunk(x_c, w, labels_c, a_c, e_c, vocab, lse_c, needed)
    elif lse_c is None and (vocab is not None or self.opts.token_loss is not None):
      # The statistics (the slice's, merged), then G: a token_loss's coefficients need them.
      z = self._logits(x_c, w, bias)
      stats = Stats(*self._softmax(z, labels_c))
      stats = stats if vocab is None else vocab.merge(stats)
      a_c, own_entropy = _common.resolve_stats(a_c, stats, self.opts)
      g, *_ = self._softmax(z, labels_c, a_c, e_c, stats.lse, entropy=own_entropy or entropy)
    else:
      if self.fused_lse and lse_c is None:
        fits = self._mosaic("dx") is not None and mosaic_gemm.stats_window_error(
            dx_rows, x_c.shape[0], self._mosaic("logits")) is None
        z, partials = self._logits(x_c, w, bias, partials=True,
                                   partials_into=dx_rows if fits else None)
      else:
        z, partials = self._logits(x_c, w, bias), None
      g, *stats = self._softmax(z, labels_c, a_c, e_c, lse_c, partials=partials,
                                entropy=entropy)
      stats = Stats(*stats)
    dx_c, dw_acc = self._apply(g, x_c, w, dw_acc, (need_dx, need_dw), dx_rows, scale)
    if need_db:
      db_acc = db_acc + jnp.sum(g, axis=0, dtype=jnp.float32)
    return stats, dx_c, dw_acc, db_acc

  def _apply(self, g, x_c, w, dw_acc, need, dx_rows, scale):
    """(dx_c, dW) with dx_c = diag(scale) G Wᵀ and dW += (diag(scale) x_c)ᵀ G, G the
    chunk's buffer (scale None: 1). With dx_rows (a Rows window of a jax.Ref of dx) dx_c is
    all of dx, the chunk's rows written in place; where the dW and dx GEMMs are both
    Mosaic's, x's scaled rows wait in them for the dW GEMM (no [C, D] operand of their
    own), so dW comes first, ordered by a data dependence. Not where dx is cuBLAS's: its
    [C, D] product is a buffer of its own anyway, so the rows would save nothing (written
    there, unordered, it made XLA copy all of dx twice a chunk: the design doc's GPT-2
    section)."""
    need_dx, need_dw = need
    scratch = (need_dw and scale is not None and dx_rows is not None
               and self._mosaic("dw") is not None and self._mosaic("dx") is not None)
    if need_dw and scale is not None:
      x_c = (scale[:, None] * _sliced(x_c).astype(jnp.float32)).astype(w.dtype)
      if scratch:
        dx_rows.array[_window(dx_rows)] = x_c
        x_c = dx_rows
    dx_c = None
    if need_dx and not scratch:
      dx_c = self._dx(g, w, dx_rows, scale)
    if need_dw:
      dw_acc = self._dw(g, x_c, w, dw_acc)
    if need_dx and scratch:
      # The dx GEMM overwrites the rows the dW GEMM reads, and no operand orders the two
      # kernels: through the barrier the dx GEMM's buffer waits for dW's result. Without it
      # XLA's schedule decided, and where it put dx first, XLA copied all of dx twice a chunk.
      dw_acc, rows = jax.lax.optimization_barrier((dw_acc, dx_rows.array[...]))
      dx_rows.array[...] = rows
      dx_c = self._dx(g, w, dx_rows, scale)
    return dx_c, dw_acc

  def _dx(self, g, w, dx_rows, scale):
    """diag(scale) G Wᵀ; with dx_rows written into them, returning all of dx. A Mosaic dx
    GEMM on a ring or ping-pong schedule applies the scale in its epilogue, to the float32
    product (one rounding, no pass over the rows)."""
    layout = self.opts.weight_layout
    config = self._mosaic("dx")
    in_epilogue = config is not None and scale is not None and config.schedule != "cooperative"
    row_scale, scale = (scale, None) if in_epilogue else (None, scale)
    if config is not None and dx_rows is not None:
      mosaic_gemm.gemm_into(dx_rows, g, w, trans_b=layout == "dv", accumulate=False,
                            config=config, name="lce_dx_gemm", row_scale=row_scale)
      dx = dx_rows.array[...]
      if scale is not None:  # in place: the rows are read and written by one XLA fusion
        # The barrier hides the kernel from XLA's dynamic-slice fusion, which otherwise
        # takes the kernel's output as the update's target and fails to compile.
        dx = jax.lax.optimization_barrier(dx)
        start = dx_rows.block * dx_rows.size
        rows = jax.lax.dynamic_slice_in_dim(dx, start, dx_rows.size, axis=0)
        dx = jax.lax.dynamic_update_slice_in_dim(
            dx, (scale[:, None] * rows.astype(jnp.float32)).astype(dx.dtype), start, axis=0)
      return dx
    if config is not None:
      dx_c = mosaic_gemm.gemm(g, w, trans_b=layout == "dv", config=config, name="lce_dx_gemm",
                              row_scale=row_scale)
    else:
      dx_c = _common.dx_dot(g, w, layout, g.dtype)
    if scale is not None:
      dx_c = scale[:, None] * dx_c.astype(jnp.float32)
    if dx_rows is None:
      return dx_c
    dx_rows.array[_window(dx_rows)] = dx_c.astype(dx_rows.dtype)
    return dx_rows.array[...]

  def _dw(self, g, x_c, w, dw_acc):
    """dW += x_cᵀ G (dW = x_cᵀ G where dw_acc is None); x_c an array or Rows."""
    layout = self.opts.weight_layout
    if (config := self._mosaic("dw")) is not None:
      # op(A) = Aᵀ: dW = x_cᵀ G ("dv") or Gᵀ x_c ("vd"), both operands as stored.
      a, b = (x_c, g) if layout == "dv" else (g, x_c)
      if dw_acc is None:
        return mosaic_gemm.gemm(a, b, trans_a=True, out_dtype=w.dtype, config=config,
                                name="lce_dw_gemm")
      ref = jax.new_ref(dw_acc)
      mosaic_gemm.gemm_into(ref, a, b, trans_a=True, config=config, name="lce_dw_gemm",
                            add="tma" if self.dw_accumulation == "tma_add" else "epilogue")
      return ref[...]
    dw_c = _common.dw_dot(_sliced(x_c), g, layout, self.dw_dtype(w))
    # Same dtype on both sides of the add, so XLA fuses it into the GEMM (beta = 1).
    return dw_c if dw_acc is None else dw_acc + dw_c

  def _exp_logits(self, x_c, w, store: bool = True):
    """(E, partials): E [C, V] = exp(min(ẑ, EXP_CLAMP)) in x's dtype, partials [P, C]
    float32 sums of those exponentials over disjoint column sets of E's rows (mosaic_gemm.
    gemm's exp_out, or the same in XLA in interpret mode). With a logit softcap c, ẑ =
    c·tanh(z / c) and E holds each exponential times ẑ's slope, 1 − tanh²(z / c), which
    G carries (_common.block_grad). With store=False E is None: the GEMM writes the
    partials alone."""
    layout, vocab, cap = self.opts.weight_layout, self.opts.vocab_size, self.opts.logit_softcap
    if (config := self.exp_gemm) is not None:  # per-tile sums: no tail tiles
      out = mosaic_gemm.gemm(x_c, w, trans_b=layout == "vd",
                             config=dataclasses.replace(config, tail_n=None),
                             name="lce_exp_logits_gemm", row_stats=vocab, exp_out=True,
                             softcap=cap, store=store)
      return out if store else (None, out)
    x_c = _sliced(x_c)
    z = _common.logits_dot(x_c, w, layout, jnp.float32)
    t = None if cap is None else jnp.tanh(z / cap)
    e = jnp.exp(jnp.minimum(z if cap is None else cap * t, mosaic_gemm.EXP_CLAMP))
    stored = e if cap is None else e * ((1.0 - t) * (1.0 + t))
    in_vocab = jnp.arange(e.shape[1]) < vocab
    partials = jnp.sum(jnp.where(in_vocab, e, 0.0), axis=1)[None]
    return stored.astype(x_c.dtype) if store else None, partials

  def _exp_chunk(self, x_c, w, labels_c, a_c, e_c, vocab: VocabShards | None = None,
                 lse_c=None, needed=None):
    """G of the chunk without a softmax pass: (buffer, scale, Stats) with G = diag(scale)
    buffer.

    With E = exp(z) from the logits GEMM and lse from its row sums, G = b·p − a'·onehot
    (block_grad; b = a (1 + 2λ lse) + e, a' = a (1 − ε), label smoothing's uniform share
    apart: LossOptions.smoothing_apart) is diag(b e^-lse) E with each row's label entry
    replaced by e^lse (p_y − a'/b): one scattered write per row. The label logit is
    log E[n, y]. With a logit softcap E holds exp(ẑ) times ẑ's slope s (see _exp_logits),
    the label entry is e^lse (p_y − a'/b) s_y, and the label logit comes from a dot of x's
    row with W's label column (log E[n, y] would hold s_y too). Exact up to E's rounding
    (the softmax pass rounds G and the logits), provided every row that counts (a or b ≠ 0,
    or `needed`: its statistics are outputs, as a counted token's of weight 0) has lse in
    LSE_RANGE (so nothing it needs was clamped or flushed to zero), b ≠ 0 where a ≠ 0, and
    the label logit ≥ MIN_LABEL_LOGIT. When a row does not, the chunk takes the softmax
    pass instead (a second logits GEMM written over E, then the pass over it) and the scale
    is 1. That choice is made by the kernels themselves (their `enabled`, and the patch's
    indices dropped), not by lax.cond, whose branches would each copy the [C, V] buffer.

    Vocab parallel, E's row sums need no shift to be merged: one psum gives the whole
    vocabulary's, with the label logit and the label checks of the shard holding the label,
    so every shard makes the same choice; the fallback merges its pass's statistics
    (VocabShards.merge) before making G. With `lse_c` (a backward pass, the forward's
    whole-vocabulary log-sum-exps) G is made from it and the row sums go unused.
    """
    opts = self.opts
    rows = jnp.arange(labels_c.shape[0])
    e, partials = self._exp_logits(x_c, w)
    in_range, col, e_y, e, z_y, slope_y = self._at_labels(x_c, w, labels_c, e)
    coefficients = a_c  # with a token_loss, resolved from whichever statistics G is made of
    counts = _common.base(a_c) != 0
    counts = counts if needed is None else counts | needed
    low = in_range & counts & (z_y < MIN_LABEL_LOGIT)
    # Per row: Σ E (0 where every entry underflowed), the label logit, whether the label is
    # in the vocabulary and whether its entry is too small to patch.
    rowwise = jnp.stack([jnp.sum(partials, axis=0), jnp.where(in_range, z_y, 0.0),
                         in_range.astype(jnp.float32), low.astype(jnp.float32)])
    if vocab is not None:
      rowwise = vocab.sum(rowwise)
    lse = jnp.log(rowwise[0]) if lse_c is None else lse_c
    label_logit = rowwise[1]
    a_c, _ = _common.resolve(a_c, label_logit - lse, None, opts)  # (no entropy on this path)
    b = _common.grad_scale(a_c, e_c, lse, opts)
    counts, labelled = counts | (b != 0), (rowwise[2] > 0) & (a_c != 0)
    lo, hi = LSE_RANGE
    ok = (jnp.all(~counts | ((lse >= lo) & (lse <= hi)))
          & jnp.all(~labelled | (b != 0)) & jnp.all(rowwise[3] == 0))

    # Fallback: the logits over E (every kernel a no-op where ok), then the softmax pass.
    e = self._logits_unless(ok, x_c, w, e)
    if lse_c is not None or (vocab is None and opts.token_loss is None):
      e, *slow = self._softmax(e, labels_c, a_c, e_c, lse_c, enabled=~ok)
    else:  # the statistics (merged, vocab parallel) first, then G
      slow = Stats(*self._softmax(e, labels_c, enabled=~ok))
      slow = slow if vocab is None else vocab.merge(slow)
      a_slow, _ = _common.resolve(coefficients, slow.label_logit - slow.lse, None, opts)
      e, *_ = self._softmax(e, labels_c, a_slow, e_c, slow.lse, enabled=~ok)

    patch = in_range & (a_c != 0)
    safe_b = jnp.where(b != 0, b, 1.0)
    label_weight = a_c * (1.0 - opts.label_smoothing)  # a': the uniform share is apart
    entry = jnp.exp(lse) * (jnp.expm1(z_y - lse) + (1.0 - label_weight / safe_b)) * slope_y
    target = jnp.where(ok, rows, rows + rows.shape[0])  # out of bounds: dropped
    e = e.at[target, col].set(jnp.where(patch, entry, e_y).astype(e.dtype), mode="drop",
                              unique_indices=True, indices_are_sorted=True)
    scale = jnp.where(counts, b * jnp.exp(-jnp.where(counts, lse, 0.0)), 0.0)
    fast = Stats(lse, label_logit, jnp.zeros_like(lse))
    stats = Stats(*(jnp.where(ok, f, s) for f, s in zip(fast[:3], slow[:3])))  # (no μ here)
    return e, jnp.where(ok, scale, 1.0), stats

  def _at_labels(self, x_c, w, labels_c, e):
    """(in_range, col, e_y, e, z_y, slope_y) at each row's label: whether it is in the
    vocabulary, its column (0 where not), E's entry there, E (after a barrier), the label
    logit and ẑ's slope there (1 without a cap). Without a cap the label logit is log E[n,
    y]; with one, E's entry holds the slope too, and the logit is a dot of x's row with W's
    label column."""
    opts = self.opts
    in_range = (labels_c >= 0) & (labels_c < opts.vocab_size)
    col = jnp.where(in_range, labels_c, 0)
    # The barrier keeps XLA from gathering E[n, y] again inside later fusions, after the
    # fallback may have written over E (which would make it copy E to keep it).
    e_y, e = jax.lax.optimization_barrier(
        (e[jnp.arange(labels_c.shape[0]), col].astype(jnp.float32), e))
    if opts.logit_softcap is None:
      return in_range, col, e_y, e, jnp.log(e_y), 1.0
    return in_range, col, e_y, e, *self._label_logits(x_c, w, col)

  def _label_logits(self, x_c, w, col):
    """(ẑ, ẑ's slope) at column `col` of each row, from a dot of x's row with W's column
    there (_label_dots), capped as the logits are (slope 1 without a cap)."""
    z = _label_dots(_sliced(x_c), w, col, self.opts.weight_layout)
    if (cap := self.opts.logit_softcap) is None:
      return z, 1.0
    t = jnp.tanh(z / cap)
    return cap * t, (1.0 - t) * (1.0 + t)

  def _logits_unless(self, ok, x_c, w, e):
    """E where `ok`, else the chunk's logits written over it: the exp path's fallback (the
    logits GEMM a no-op where ok)."""
    if (config := self.exp_gemm) is not None:
      ref = jax.new_ref(e)
      mosaic_gemm.gemm_into(ref, x_c, w, trans_b=self.opts.weight_layout == "vd",
                            accumulate=False, config=config, name="lce_logits_gemm",
                            enabled=~ok)
      return ref[...]
    return jnp.where(ok, e, self._logits(x_c, w, None))  # interpret mode: XLA's, no in place

  def _exp_stats(self, x_c, w, labels_c) -> Stats:
    """The chunk's statistics (a loss without gradients, or reduction="none"'s forward)
    from the exp GEMM's row sums alone: it stores no [C, V] buffer. lse is the log of the
    sums, the label logit a dot of x's row with W's label column (_label_logits), Σ ẑ is
    left to the chunk loop (LossOptions.smoothing_apart; 0 without smoothing). Where a
    row's lse leaves LSE_RANGE (an exponential may have met the clamp) the chunk's logits
    are computed and the softmax pass finds the statistics instead, both no-ops elsewhere
    (mosaic_gemm.gemm's `enabled`). Vocab parallel these are the slice's statistics, which
    the chunk loop merges; each slice decides its own fallback."""
    _, partials = self._exp_logits(x_c, w, store=False)
    lse = jnp.log(jnp.sum(partials, axis=0))
    in_range = (labels_c >= 0) & (labels_c < self.opts.vocab_size)
    z_y, _ = self._label_logits(x_c, w, jnp.where(in_range, labels_c, 0))
    lo, hi = LSE_RANGE
    ok = jnp.all((lse >= lo) & (lse <= hi))
    if (config := self.exp_gemm) is not None:
      z = mosaic_gemm.gemm(x_c, w, trans_b=self.opts.weight_layout == "vd", config=config,
                           name="lce_logits_gemm", enabled=~ok)
    else:  # interpret mode: XLA's logits
      z = self._logits(x_c, w, None)
    slow = self._softmax(z, labels_c, enabled=~ok)
    fast = Stats(lse, jnp.where(in_range, z_y, 0.0), jnp.zeros_like(lse))
    return Stats(*(jnp.where(ok, f, s) for f, s in zip(fast[:3], slow[:3])))  # (no μ)


# exp_logits' safe range (see ChunkBackend._exp_chunk). A row's largest logit is at
# most its lse, so lse ≤ 60 keeps every entry below the clamp (mosaic_gemm.EXP_CLAMP = 64);
# and at least lse − log V, so lse ≥ -25 keeps it above -37 at V up to 10^6: what E loses to
# zero (z < -87) then has p < e^-50.
LSE_RANGE = (-25.0, 60.0)
MIN_LABEL_LOGIT = -80.0


def _per_token(vocab: int, itemsize: int) -> int:
  """A chunk's bytes per token: its logits and, on the exp_logits path, its row's float32
  sums over E's column tiles (128 columns at the narrowest)."""
  return vocab * itemsize + 4 * -(-vocab // 128)


def _label_dots(x_c, w, col, layout: str):
  """[C] float32 z[n, col[n]] = x_c[n] · (W's column col[n]): the logits at the labels."""
  w_col = w[:, col].T if layout == "dv" else w[col]
  return jnp.einsum("cd,cd->c", x_c, w_col, preferred_element_type=jnp.float32)


def _window(rows: mosaic_gemm.Rows):
  """The index of a Rows window's rows in its array (or jax.Ref)."""
  return pl.ds(rows.block * rows.size, rows.size)


def _sliced(x_c):
  """x's chunk as an array (x_c is that already, or a mosaic_gemm.Rows window of x)."""
  if isinstance(x_c, mosaic_gemm.Rows):
    return jax.lax.dynamic_slice_in_dim(x_c.array, x_c.block * x_c.size, x_c.size, axis=0)
  return x_c


