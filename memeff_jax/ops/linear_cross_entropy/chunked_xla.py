"""Chunked linear cross-entropy in plain XLA: any backend, O(chunk) memory.

Tokens are processed `token_chunk` at a time; when even a small token chunk's logits would
not fit the memory budget (huge vocabularies), each token chunk also walks the vocabulary in
`vocab_chunk` columns with an online log-sum-exp, and recomputes the logits for the
gradient (two passes). Logits are formed in float32; G is cast to the compute dtype for the
two gradient matmuls (tensor cores), which accumulate in float32; dW and db accumulate
across chunks in float32.

Memory: about min(`memory_budget_bytes`, max(1/20 of the full float32 logits, 256 tokens'
logits)) for the chunk's logits and G, plus a float32 dW accumulator (D·V·4 bytes) during
the gradient pass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from memeff_jax.ops import _vma
from memeff_jax.ops.linear_cross_entropy import _chunked
from memeff_jax.ops.linear_cross_entropy import _common
from memeff_jax.ops.linear_cross_entropy._common import LossOptions, Stats
from memeff_jax.ops.linear_cross_entropy._vocab_parallel import VocabShards

# The chunk's temporaries per logit at most, as the compiled program holds them: float32
# logits and G, with G in x's dtype beside them or a logit softcap's factor (a tested bound).
_BYTES_PER_LOGIT = 12
_MIN_TOKEN_CHUNK = 16
# The chunks' temporaries aim at no more than this share of the full float32 logits (N·V·4
# bytes) they replace, but hold at least _GEMM_ROWS tokens (and _MIN_BUDGET bytes): fewer
# rows run the chunk's three matmuls at a fraction of their rate (CPU, N = 2,048, D = 1,024,
# V = 32,768, float32: 2.28 s at the share's 34-token chunks, 1.23 s at 256, 1.13 s for the
# unchunked reference).
_LOGITS_SHARE = 1 / 20
_GEMM_ROWS = 256
_MIN_BUDGET = 2 * 2**20


@dataclasses.dataclass(frozen=True)
class ChunkedXla:
  """Pure-XLA chunked implementation.

  Attributes:
    memory_budget_bytes: the most bytes of chunk temporaries (logits and G) to aim for. A
      call aims at no more than 1/20 of its full float32 logits (N·V·4 bytes) either,
      unless that is under 256 tokens' worth (or 2 MiB): chunks of fewer rows cost time
      and save little beside the float32 dW accumulator (D·V·4 bytes). Decides the token
      chunk (and, if even 16 tokens do not fit, the vocabulary chunk).
  """

  memory_budget_bytes: int = 256 * 2**20
  name: str = "chunked_xla"

  def plan(self, n_tokens: int, vocab: int, chunk_size) -> tuple[int, int]:
    """(token_chunk, vocab_chunk) for a call; `chunk_size` overrides the budget."""
    if chunk_size is not None:
      if isinstance(chunk_size, int):
        return min(chunk_size, n_tokens), vocab
      tokens, cols = chunk_size
      return min(tokens, n_tokens), min(cols, vocab)
    per_token = vocab * _BYTES_PER_LOGIT
    budget = min(self.memory_budget_bytes, max(int(n_tokens * vocab * 4 * _LOGITS_SHARE),
                                               _GEMM_ROWS * per_token, _MIN_BUDGET))
    tokens = budget // per_token
    if tokens >= _MIN_TOKEN_CHUNK:
      if tokens >= 128:
        tokens = tokens // 128 * 128
      return _chunked.balanced_chunk(n_tokens, tokens), vocab
    tokens = min(_MIN_TOKEN_CHUNK, n_tokens)
    cols = max(128, budget // (tokens * _BYTES_PER_LOGIT) // 128 * 128)
    return tokens, min(cols, vocab)

  def __call__(self, x, weight, bias, labels, valid, weights=None, *, opts: LossOptions,
               chunk_size=None, vocab: VocabShards | None = None):
    local = opts if vocab is None else vocab.options(opts, weight)
    tokens, cols = self.plan(x.shape[0], local.vocab_size, chunk_size)
    backend = XlaChunkBackend(opts=local, vocab_chunk=cols)
    return _chunked.chunked_loss(_chunked.Static(backend, opts, tokens, vocab),
                                 x, weight, bias, labels, valid, weights)


@dataclasses.dataclass(frozen=True)
class XlaChunkBackend:
  """Per-chunk work of ChunkedXla (see _chunked for the protocol)."""

  implementation = "chunked_xla"  # its name in errors (a class attribute, not a field)

  opts: LossOptions
  vocab_chunk: int

  def dw_dtype(self, w):
    del w
    return jnp.float32

  @property
  def _columns(self):
    """block_stats' options here: the blocks tile the vocabulary exactly (no padding
    columns), Σ ẑ is wanted only under label smoothing and Σ p ẑ only for the entropy."""
    return {"padded": False, "logit_sum": bool(self.opts.label_smoothing),
            "weighted_sum": self.opts.entropy}

  def _capped_logits(self, x_c, w, bias, start, size):
    layout = self.opts.weight_layout
    w_blk = w if size == self.opts.vocab_size else _common.vocab_slice(w, start, size, layout)
    z = _common.logits_dot(x_c, w_blk, layout, jnp.float32)
    if bias is not None:
      z = z + jax.lax.dynamic_slice_in_dim(bias, start, size).astype(jnp.float32)[None, :]
    return _common.cap_logits(z, self.opts.logit_softcap)

  def _block_stats(self, x_c, w, bias, labels_c, start, size):
    zc = self._capped_logits(x_c, w, bias, start, size)
    cols = start + jnp.arange(size, dtype=jnp.int32)
    m, s, _, t, u = _common.block_stats(zc, cols, None, self.opts.vocab_size,
                                        **self._columns)
    return m, s, _label_logits(zc, labels_c, start), t, u

  def stats(self, x_c, w, bias, labels_c) -> Stats:
    vocab = self.opts.vocab_size
    if self.vocab_chunk >= vocab:
      acc = self._block_stats(x_c, w, bias, labels_c, 0, vocab)
    else:
      rows = x_c.shape[0]
      init = _vma.varying_like((jnp.full((rows,), -jnp.inf, jnp.float32),) + tuple(
          jnp.zeros((rows,), jnp.float32) for _ in range(4)), x_c, w, bias, labels_c)
      acc = _chunked.blocked_loop(
          vocab, self.vocab_chunk,
          lambda start, size, acc: _common.combine_stats(
              acc, self._block_stats(x_c, w, bias, labels_c, start, size)),
          init)
    return _common.stats_of(acc, self.opts)

  def grads(self, x_c, w, bias, labels_c, a_c, e_c, lse_c, dw_acc, db_acc, need,
            vocab: VocabShards | None = None, needed=None, entropy=None):
    del needed  # every row's statistics are exact here
    need_dx, need_dw, need_db = need
    shards = vocab
    opts, layout, vocab = self.opts, self.opts.weight_layout, self.opts.vocab_size
    single = self.vocab_chunk >= vocab
    # One vocabulary block, statistics wanted: form the logits once for both uses.
    # Otherwise (vocabulary blocks, or lse given by the forward pass) each block recomputes.
    reuse = single and lse_c is None
    probs = None
    if reuse:
      # On CPU the exponentials once, for Σ and for G: XLA's CPU backend computes them again
      # in each fusion that reads them. Elsewhere G recomputes them, as the GPU form was
      # measured (a [C, V] buffer of them would add a write and a read where bandwidth bounds).
      zc = self._capped_logits(x_c, w, bias, 0, vocab)
      m = jnp.max(zc, axis=1)
      exps = jnp.exp(zc - m[:, None])
      s = jnp.sum(exps, axis=1)
      t = jnp.sum(zc, axis=1) if opts.label_smoothing else jnp.zeros_like(m)
      mu = jnp.sum(exps * _common.floored(zc), axis=1) / s if opts.entropy else None
      stats = Stats(m + jnp.log(s), _label_logits(zc, labels_c, 0), t, mu)
      # Vocab parallel, G comes from the merged statistics, not this slice's.
      if shards is None and jax.default_backend() == "cpu":
        probs = exps * (1.0 / s)[:, None]
    elif lse_c is None:
      stats = self.stats(x_c, w, bias, labels_c)
    else:  # the backward pass: statistics are known and not returned
      stats = Stats(lse_c, jnp.zeros_like(lse_c), jnp.zeros_like(lse_c))
    if shards is not None and lse_c is None:  # G from the whole vocabulary's statistics
      stats = shards.merge(stats)
    if lse_c is None:  # a token_loss's coefficients (and its share of the entropy's)
      a_c, own_entropy = _common.resolve_stats(a_c, stats, opts)
      entropy = own_entropy or entropy
    dx_c = jnp.zeros(x_c.shape, jnp.float32) if need_dx else None

    def block(start, size, carry):
      dx_c, dw_acc, db_acc = carry
      zc_blk = zc if reuse else self._capped_logits(x_c, w, bias, start, size)
      w_blk = w if single else _common.vocab_slice(w, start, size, layout)
      cols = start + jnp.arange(size, dtype=jnp.int32)
      g = _common.block_grad(zc_blk, cols, labels_c, stats.lse, a_c, e_c, opts, padded=False,
                             probs=probs, entropy=entropy)
      g_lo = g.astype(x_c.dtype)  # tensor-core operand; products accumulate in float32
      if need_dx:
        dx_c = dx_c + _common.dx_dot(g_lo, w_blk, layout, jnp.float32)
      if need_dw:
        axis = 1 if layout == "dv" else 0
        blk = _common.dw_dot(x_c, g_lo, layout, jnp.float32)
        if single:
          dw_acc = dw_acc + blk
        else:
          cur = jax.lax.dynamic_slice_in_dim(dw_acc, start, size, axis=axis)
          dw_acc = jax.lax.dynamic_update_slice_in_dim(dw_acc, cur + blk, start, axis=axis)
      if need_db:
        cur = jax.lax.dynamic_slice_in_dim(db_acc, start, size)
        db_acc = jax.lax.dynamic_update_slice_in_dim(db_acc, cur + jnp.sum(g, axis=0), start, 0)
      return dx_c, dw_acc, db_acc

    carry = _vma.varying_like((dx_c, dw_acc, db_acc), x_c, w, bias, labels_c, a_c, e_c, lse_c)
    dx_c, dw_acc, db_acc = _chunked.blocked_loop(vocab, vocab if single else self.vocab_chunk,
                                                 block, carry)
    return stats, dx_c, dw_acc, db_acc


def _label_logits(zc, labels, start):
  """Each row's capped logit at its label where the label is among zc's columns (vocabulary
  ids start, start + 1, ...), else 0: a gather, where a compare over the block made XLA's
  CPU backend write a [C, Vb] select out for the reduction."""
  inside = (labels >= start) & (labels < start + zc.shape[1])
  col = jnp.where(inside, labels - start, 0)
  return jnp.where(inside, jnp.take_along_axis(zc, col[:, None], axis=1)[:, 0], 0.0)
