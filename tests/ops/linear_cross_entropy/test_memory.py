"""Memory is a tested property: compiled temporaries, read from XLA's memory analysis."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import memeff_jax
from memeff_jax import memory
from memeff_jax.kernels import hopper
from memeff_jax.ops.linear_cross_entropy.chunked_xla import ChunkedXla
from memeff_jax.ops.linear_cross_entropy.pallas_mosaic_gpu import GEMMS, PallasMosaicGpu


def _temp_bytes(loss, *shapes):
  compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*shapes).compile()
  analysis = compiled.memory_analysis()
  if analysis is None:
    pytest.skip("this backend gives no memory analysis")
  return analysis.temp_size_in_bytes


def _shapes(n, d, v, dtype):
  return (jax.ShapeDtypeStruct((n, d), dtype), jax.ShapeDtypeStruct((d, v), dtype),
          jax.ShapeDtypeStruct((n,), jnp.int32))


def test_chunked_xla_holds_under_ten_percent_of_the_logits():
  """16,384 tokens × vocab 50,257 in float32: 3.07 GiB of logits, default chunking."""
  n, d, v = 16384, 64, 50257
  x, w, y = _shapes(n, d, v, jnp.float32)
  logits_bytes = n * v * 4
  assert logits_bytes >= 2**30

  def ours(x, w, y):
    return memeff_jax.linear_cross_entropy(x, w, y, implementation="chunked_xla")

  def naive(x, w, y):
    return optax.softmax_cross_entropy_with_integer_labels(x @ w, y).mean()

  temp = _temp_bytes(ours, x, w, y)
  assert temp < 0.10 * logits_bytes, f"{temp / 2**30:.3f} GiB of temporaries"
  # The measurement can fail: the materializing loss holds at least the logits.
  assert _temp_bytes(naive, x, w, y) >= logits_bytes


@pytest.mark.parametrize("n, v", [(2048, 16384), (8192, 32768), (1024, 128256), (4096, 50257),
                                  (32768, 16384)])
def test_chunks_are_sized_from_the_logits_they_replace(n, v):
  """The default chunk holds 1/20 of the problem's own float32 logits, or 256 tokens' where
  that is more (within memory_budget_bytes), not a fixed token count: the temporaries are
  within the chunk's 12 bytes per logit (float32 logits and G, and G in x's dtype or a
  softcap's factor; test_chunk_temporaries_per_option), its largest buffer
  one float32 [chunk, V], and from 15,360 tokens on they are under a tenth of the logits."""
  x, w, y = _shapes(n, 64, v, jnp.float32)
  logits_bytes = n * v * 4
  tokens, cols = ChunkedXla().plan(n, v, None)
  assert tokens * cols * 12 <= min(256 * 2**20, max(logits_bytes / 20, 256 * v * 12))
  step = jax.value_and_grad(lambda x, w, y: memeff_jax.linear_cross_entropy(
      x, w, y, implementation="chunked_xla"), argnums=(0, 1))
  report = memory.analyze(step, x, w, y)
  if report.temp_bytes is None:
    pytest.skip("this backend gives no memory analysis")
  assert report.temp_bytes < 1.05 * tokens * cols * 12, f"{report.temp_bytes / 2**20:.1f} MiB"
  if n >= 15360:
    assert report.temp_bytes < 0.10 * logits_bytes
  # Every buffer but those of dW's [D, V] shape (the gradient's own size) is chunk-sized.
  chunked = [b for b in report.buffers if tuple(b.shape) != (64, v)]
  assert max(b.nbytes for b in chunked) <= tokens * cols * 4


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunk_temporaries_per_option(dtype):
  """Every option stays within the plan's 12 bytes per chunk logit; without a softcap the
  chunk holds 8 (float32 logits and G): no masked copy of the logits, whose blocks never
  hold padding columns, and no Σẑ pass without label smoothing."""
  n, d, v = 4096, 64, 50257
  x, w, y = _shapes(n, d, v, dtype)
  tokens, cols = ChunkedXla().plan(n, v, None)
  per_logit = {}
  for name, options in [("plain", {}), ("label_smoothing", {"label_smoothing": 0.1}),
                        ("z_loss", {"z_loss": 1e-4}), ("logit_softcap", {"logit_softcap": 30.0})]:
    temp = _temp_bytes(lambda x, w, y: memeff_jax.linear_cross_entropy(
        x, w, y, implementation="chunked_xla", **options), x, w, y)
    per_logit[name] = (temp - d * v * 4) / (tokens * cols)  # less the float32 dW
  # (+ 1%: the [N] statistics and the like)
  assert max(per_logit.values()) <= 12 * 1.01, per_logit
  assert max(per_logit[k] for k in ("plain", "label_smoothing", "z_loss")) <= 8 * 1.01, per_logit


def test_entropy_keeps_the_chunks_memory():
  """The entropy (return_aux, entropy=True): logged, the temporaries of the aux outputs
  without it plus [N]-sized statistics; differentiated too (its backward recomputes the
  chunks), within the plan's 12 bytes per chunk logit."""
  n, d, v = 4096, 64, 50257
  shapes = _shapes(n, d, v, jnp.float32)
  tokens, cols = ChunkedXla().plan(n, v, None)

  def temp(entropy, differentiated):
    def loss(x, w, y):
      out, aux = memeff_jax.linear_cross_entropy(x, w, y, implementation="chunked_xla",
                                                 return_aux=True, entropy=entropy)
      return out + (jnp.sum(aux.entropy) if differentiated else 0.0)
    return _temp_bytes(loss, *shapes) - d * v * 4  # less the float32 dW

  assert temp(True, False) <= temp(False, False) + 4 * n * 4
  assert temp(True, True) <= 12 * 1.01 * tokens * cols


def _clipped_ratio(log_p, advantages, old_log_p):
  ratio = jnp.exp(log_p - old_log_p)
  return -jnp.minimum(ratio * advantages, jnp.clip(ratio, 0.8, 1.2) * advantages)


def test_token_loss_keeps_the_chunks_memory():
  """A token_loss with two arguments: the cross-entropy's temporaries plus [N]-sized ones
  (its arguments stacked, their gradients, the log-probabilities), mean or per token."""
  n, d, v = 4096, 64, 50257
  shapes = _shapes(n, d, v, jnp.float32)
  args = (jax.ShapeDtypeStruct((n,), jnp.float32),) * 2

  def temp(reduction, token_loss):
    def loss(x, w, y, a, o):
      out = memeff_jax.linear_cross_entropy(
          x, w, y, implementation="chunked_xla", reduction=reduction,
          token_loss=_clipped_ratio if token_loss else None,
          token_loss_args=(a, o) if token_loss else ())
      return jnp.sum(out)
    return _temp_bytes(loss, *shapes, *args)

  for reduction in ("mean", "none"):
    assert temp(reduction, True) <= temp(reduction, False) + 12 * n * 4, reduction


def test_mean_loss_without_aux_holds_no_per_token_statistics():
  """Without return_aux a mean loss is summed inside the chunk loop: no [N] float32 log-sum-
  exp, label logit, Σẑ or gradient coefficients. A small head at 65,536 and 131,072 tokens
  in chunks of 1,024: its temporaries grow by less than one float32 per added token, where
  with the aux outputs (computed, not differentiated) they grow by at least two."""
  n, d, v = 2**16, 16, 256

  def loss(aux):
    def f(x, w, y):
      out = memeff_jax.linear_cross_entropy(x, w, y, implementation="chunked_xla",
                                            chunk_size=1024, return_aux=aux)
      return out[0] if aux else out
    return f

  def growth(aux):
    small, large = (_temp_bytes(loss(aux), *_shapes(m, d, v, jnp.float32)) for m in (n, 2 * n))
    return large - small

  reduced, with_stats = growth(False), growth(True)
  assert reduced < n * 4, reduced
  assert with_stats >= 2 * n * 4, with_stats  # the measurement sees [N] buffers


@pytest.mark.gpu
def test_pallas_gpu_temporaries_at_llama3_8b_shape():
  """The default implementation at N=16384, D=4096, V=128256 in bf16 (4 GiB of logits). On
  Hopper it puts all three GEMMs on kernels.mosaic_gemm (PallasMosaicGpu.auto_gemms): issue 2's
  0.25 GiB."""
  n, d, v = 16384, 4096, 128256
  x, w, y = _shapes(n, d, v, jnp.bfloat16)
  temp = _temp_bytes(lambda x, w, y: memeff_jax.linear_cross_entropy(x, w, y), x, w, y)
  assert temp < 0.10 * n * v * 2, f"{temp / 2**30:.3f} GiB of temporaries"
  if hopper.unavailable() is None:
    assert temp < 2**28, f"{temp / 2**30:.4f} GiB of temporaries"


@pytest.mark.gpu
@pytest.mark.parametrize("layout,chunk,dw_accumulation", [("dv", 1024, "weight"),
                                                          ("vd", 512, "weight"),
                                                          ("vd", 512, "tma_add")])
def test_mosaic_gemms_hold_only_the_chunk_logits(layout, chunk, dw_accumulation):
  """All three GEMMs on kernels.mosaic_gemm read x's chunk and write dx's where they lie
  (mosaic_gemm.Rows): the temporaries are the chunk's [C, V] logits and O(N) statistics,
  with no [C, D] copy and no cuBLAS workspace. Llama-3-8B shapes, bf16."""
  n, d, v = 16384, 4096, 128256
  x, w, y = _shapes(n, d, v, jnp.bfloat16)
  if layout == "vd":
    w = jax.ShapeDtypeStruct((v, d), jnp.bfloat16)
  impl = PallasMosaicGpu(mosaic_gemms=GEMMS, dw_accumulation=dw_accumulation, exp_logits=False)
  temp = _temp_bytes(lambda x, w, y: memeff_jax.linear_cross_entropy(
      x, w, y, weight_layout=layout, implementation=impl, chunk_size=chunk), x, w, y)
  logits = chunk * v * 2
  assert logits <= temp < logits + 2**20, f"{(temp - logits) / 2**20:.2f} MiB over the logits"


@pytest.mark.gpu
def test_exp_logits_with_mosaic_gemms_fits_a_quarter_gib():
  """exp_logits (the default) with all three GEMMs on kernels.mosaic_gemm: x's scaled rows wait
  in dx's rows for the dW GEMM, and the dx GEMM writes dx's rows in place, where they are
  scaled. Next to the chunk's [C, V] exponentials there are only their rows' per-strip
  sums ([V/128, C] float32, 3.9 MiB). Llama-3-8B, "dv", 1,024-token chunks: 0.2485 GiB."""
  n, d, v = 16384, 4096, 128256
  x, w, y = _shapes(n, d, v, jnp.bfloat16)
  impl = PallasMosaicGpu(mosaic_gemms=GEMMS, dw_accumulation="tma_add")
  temp = _temp_bytes(lambda x, w, y: memeff_jax.linear_cross_entropy(
      x, w, y, implementation=impl, chunk_size=1024), x, w, y)
  logits, strips = 1024 * v * 2, (v // 128) * 1024 * 4
  assert logits <= temp < logits + strips + 2**18, f"{(temp - logits) / 2**20:.2f} MiB over E"
  assert temp < 2**28, f"{temp / 2**30:.4f} GiB"


@pytest.mark.gpu
@pytest.mark.parametrize("n", [65536, 131072])
def test_long_calls_hold_a_float32_total_at_most(n):
  """Past 32 chunks the default adds up each group of 32 chunks' dW in bf16 and the groups'
  sums in a float32 total (_chunked._grouped). Beside the chunk's exponentials it holds
  that total at most (D·V·4 bytes): the group's bf16 sum is dW's output buffer. Llama-3-8B,
  2 and 4 groups (H100: 1.226 and 2.204 GiB)."""
  if (why := hopper.unavailable()) is not None:
    pytest.skip(why)
  d, v = 4096, 128256
  x, w, y = _shapes(n, d, v, jnp.bfloat16)
  temp = _temp_bytes(lambda x, w, y: memeff_jax.linear_cross_entropy(x, w, y), x, w, y)
  logits, strips = 1024 * v * 2, (v // 128) * 1024 * 4
  assert temp < logits + strips + d * v * 4 + 2**24, f"{temp / 2**30:.3f} GiB"


@pytest.mark.gpu
def test_grouped_chunks_copy_no_dx(monkeypatch):
  """x's scaled rows wait in dx's rows for the dW GEMM, which the dx GEMM then overwrites in
  place: only a data dependence orders the two (PallasMosaicGpu's _apply). Without it XLA's
  schedule decides, and in groups of 16 chunks at Llama-3-8B's head it put dx first and
  copied all of dx twice a chunk (H100: 1.21x the floor). The compiled program holds no
  copy of an array of dx's shape."""
  if (why := hopper.unavailable()) is not None:
    pytest.skip(why)
  monkeypatch.setattr(PallasMosaicGpu, "_rounding_limit", lambda self, itemsize: 16)
  n, d, v = 65536, 4096, 128256
  x, w, y = _shapes(n, d, v, jnp.bfloat16)
  step = jax.jit(jax.value_and_grad(lambda x, w, y: memeff_jax.linear_cross_entropy(x, w, y),
                                    argnums=(0, 1)))
  text = step.lower(x, w, y).compile().as_text()
  assert " while(" in text  # the chunk loop is there
  copies = re.findall(r"= (\w+\[[\d,]+\])\{[\d,]*\} copy\(", text)
  assert f"bf16[{n},{d}]" not in copies, copies


@pytest.mark.parametrize("layout", ["dv", "vd"])
def test_smoothing_apart_adds_its_share_in_place(layout):
  """Label smoothing on the exponential path (interpret mode: the exp GEMM's XLA equivalent)
  adds its uniform share of G to dx and dW after the chunks, in their buffers: against the
  same call without smoothing the temporaries grow by a few vectors ([D] column sums and
  Σ a x, [N] weights), not by a second dW (4 MiB here) or dx (1 MiB)."""
  n, d, v = 2048, 256, 8192
  x, w, y = _shapes(n, d, v, jnp.bfloat16)
  if layout == "vd":
    w = jax.ShapeDtypeStruct((v, d), jnp.bfloat16)
  impl = PallasMosaicGpu(interpret=True, exp_logits=True)
  temp = {eps: _temp_bytes(lambda x, w, y, eps=eps: memeff_jax.linear_cross_entropy(
      x, w, y, weight_layout=layout, label_smoothing=eps, implementation=impl,
      chunk_size=512), x, w, y) for eps in (0.0, 0.1)}
  assert temp[0.1] - temp[0.0] < 2**18, {k: t / 2**20 for k, t in temp.items()}
