"""flash_attention against the float32 reference, for every implementation.

One parameterized base takes the implementation; subclasses run chunked_xla, the Pallas
Triton kernels in the interpreter (CPU), and both on the GPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memeff_jax.ops.flash_attention import ChunkedXla
from memeff_jax.ops.flash_attention import flash_attention
from memeff_jax.ops.flash_attention import PallasTriton
from memeff_jax.ops.flash_attention.pallas_triton import BlockConfig

jax.config.update("jax_default_matmul_precision", "highest")

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2, jnp.float16: 5e-3}

FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(sliding_window=(5, 3)),  # smaller than any block
    "causal_window": dict(causal=True, sliding_window=9),
    "segments": dict(segments=True),
    "softcap": dict(logit_softcap=2.5),
    "scale": dict(scale=0.3),
    "everything": dict(causal=True, sliding_window=(40, 7), segments=True, logit_softcap=3.0),
}


def make_problem(key, b, t, s, hq, hkv, d, dtype, segments=False):
  kq, kk, kv, ks1, ks2, kg = jax.random.split(key, 6)
  q = jax.random.normal(kq, (b, t, hq, d), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (b, s, hkv, d), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (b, s, hkv, d), jnp.float32).astype(dtype)
  seg = None
  if segments:  # several packed documents per row: sorted ids, some rows start mid-id
    seg = (jnp.sort(jax.random.randint(ks1, (b, t), 0, 4), axis=1),
           jnp.sort(jax.random.randint(ks2, (b, s), 0, 4), axis=1))
  return q, k, v, seg, jax.random.normal(kg, (b, t, hq, d), jnp.float32)


def rel_err(got, ref):
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)


def run(impl, q, k, v, seg, ct, options):
  """(out, lse, (dq, dk, dv)) of flash_attention with `options`: one jitted program per
  implementation, options and shapes (compiled once, not op by op)."""
  return _value_and_grads(impl, tuple(sorted(options.items())))(q, k, v, seg, ct)


@functools.lru_cache(maxsize=None)
def _value_and_grads(impl, options):
  options = dict(options)
  options.pop("segments", None)

  def f(q, k, v, seg, ct):
    seg_ids = {} if seg is None else dict(q_segment_ids=seg[0], kv_segment_ids=seg[1])
    out, lse = flash_attention(q, k, v, return_lse=True, implementation=impl, **options,
                               **seg_ids)
    lse_ct = jnp.where(jnp.isfinite(lse), lse, 0.0) * 0.25
    return jnp.sum(out.astype(jnp.float32) * ct) + jnp.sum(lse_ct), (out, lse)

  @jax.jit
  def value_and_grads(q, k, v, seg, ct):
    (_, (out, lse)), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(
        q, k, v, seg, ct)
    return out, lse, grads

  return value_and_grads


class _FlashAttentionTest:
  impl = None
  extra = {}  # options every call of the suite adds (e.g. deterministic=False)
  dtypes = (jnp.float32, jnp.bfloat16)
  # Odd shapes: T ≠ S, neither a block multiple; D = 96 (padded to 128 in tiles); GQA 4:1.
  shape = dict(b=2, t=100, s=153, hq=4, hkv=1, d=96)
  features = tuple(FEATURES)  # those test_matches_reference runs

  @pytest.mark.parametrize("name", sorted(FEATURES))
  def test_matches_reference(self, name):
    if name not in self.features:
      pytest.skip(f"{type(self).__name__} runs {self.features} (see its docstring)")
    options = FEATURES[name]
    for i, dtype in enumerate(self.dtypes):
      q, k, v, seg, ct = make_problem(jax.random.key(i), **self.shape, dtype=dtype,
                                      segments=options.get("segments", False))
      out, lse, grads = run(self.impl, q, k, v, seg, ct, {**self.extra, **options})
      up = lambda x: x.astype(jnp.float32)
      r_out, r_lse, r_grads = run("reference", up(q), up(k), up(v), seg, ct, options)
      tol = TOL[dtype]
      assert out.dtype == dtype and lse.dtype == jnp.float32
      assert lse.shape == (self.shape["b"], self.shape["t"], self.shape["hq"])
      assert rel_err(out, r_out) < tol, (dtype, rel_err(out, r_out))
      np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(r_lse))
      fin = np.isfinite(np.asarray(r_lse))
      assert rel_err(np.asarray(lse)[fin], np.asarray(r_lse)[fin]) < 1e-4
      for g, rg, arg in zip(grads, r_grads, "qkv"):
        assert g.dtype == dtype
        assert np.all(np.isfinite(np.asarray(g, np.float32))), arg
        assert rel_err(g, rg) < tol, (dtype, arg, rel_err(g, rg))

  def test_rows_that_see_no_key_give_zero_and_finite_gradients(self):
    """A window past the start and a segment with no key: output 0, lse -inf, no NaN."""
    b, t, s, h, d = 1, 40, 40, 2, 32
    q, k, v, _, ct = make_problem(jax.random.key(3), b, t, s, h, h, d, jnp.float32)
    q_seg = jnp.where(jnp.arange(t) < 30, 0, 7)[None]  # id 7 has no key
    kv_seg = jnp.zeros((1, s), jnp.int32)
    opts = dict(sliding_window=(0, 0))  # causal with window 0 → sees itself only
    out, lse, grads = run(self.impl, q, k, v, (q_seg, kv_seg), ct, {**self.extra, **opts})
    assert np.all(np.asarray(out)[0, 30:] == 0.0)
    assert np.all(np.isneginf(np.asarray(lse)[0, 30:]))
    for g in grads:
      assert np.all(np.isfinite(np.asarray(g)))
    r_out, _, r_grads = run("reference", q, k, v, (q_seg, kv_seg), ct, opts)
    assert rel_err(out, r_out) < 2e-5
    for g, rg in zip(grads, r_grads):
      assert rel_err(g, rg) < 2e-5

  def test_matches_jax_nn(self):
    q, k, v, _, _ = make_problem(jax.random.key(4), 2, 64, 64, 4, 2, 64, jnp.float32)
    for causal in (False, True):
      got = flash_attention(q, k, v, causal=causal, implementation=self.impl, **self.extra)
      want = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
      assert rel_err(got, want) < 2e-5

  @pytest.mark.parametrize("causal", [False, True])
  def test_sequence_lengths_match_jax_nn(self, causal):
    """query_seq_lengths and key_value_seq_lengths as jax.nn.dot_product_attention's, on the
    queries that are not padding, the outputs and gradients (T ≠ S, GQA, a row without
    queries, one with 5 keys), in the suite's first dtype and head dim against float32; a
    padding query gives 0. (Not the scalar the gradients are of: a sum of outputs times
    cotangents of either sign, whose cancellation leaves it 3% off in bfloat16 at D = 40
    and 80 where every output is within 0.2%.)"""
    b, t, s, dtype = 3, 40, 56, self.dtypes[0]
    q, k, v, _, ct = make_problem(jax.random.key(12), b, t, s, 4, 2, self.shape["d"], dtype)
    lengths = dict(query_seq_lengths=jnp.array([40, 17, 0]),
                   key_value_seq_lengths=jnp.array([56, 30, 5]))
    valid = (jnp.arange(t)[None] < lengths["query_seq_lengths"][:, None])[..., None, None]
    ours = lambda q, k, v: flash_attention(q, k, v, causal=causal, implementation=self.impl,
                                           **lengths, **self.extra)
    theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                          **lengths)
    outputs = lambda f, *a: jnp.where(valid, f(*a).astype(jnp.float32), 0.0)
    grads = lambda f: jax.jit(jax.grad(lambda q, k, v: jnp.sum(outputs(f, q, k, v) * ct),
                                       argnums=(0, 1, 2)))
    up = lambda x: x.astype(jnp.float32)
    got = (outputs(ours, q, k, v), grads(ours)(q, k, v))
    want = (outputs(theirs, up(q), up(k), up(v)), grads(theirs)(up(q), up(k), up(v)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert rel_err(g, w) < TOL[dtype]
    assert np.all(np.asarray(jnp.where(valid, 0.0, ours(q, k, v))) == 0.0)


class TestChunkedXla(_FlashAttentionTest):
  impl = ChunkedXla(block_q=32, block_k=16)


class TestPallasTritonInterpret(_FlashAttentionTest):
  impl = PallasTriton(interpret=True, config=BlockConfig(
      block_q=32, block_k=16, bwd_block_q=16, bwd_block_k=32))
  dtypes = (jnp.float32, jnp.bfloat16)


@pytest.mark.gpu
class TestChunkedXlaGpu(_FlashAttentionTest):
  impl = "chunked_xla"
  shape = dict(b=2, t=1000, s=1537, hq=8, hkv=2, d=96)


@pytest.mark.gpu
class TestPallasTritonGpu(_FlashAttentionTest):
  impl = "pallas_triton"
  dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)
  shape = dict(b=2, t=1000, s=1537, hq=8, hkv=2, d=96)

  @pytest.mark.parametrize("d", [32, 64, 128, 192, 256])
  def test_head_dims(self, d):
    q, k, v, _, ct = make_problem(jax.random.key(d), 1, 300, 300, 4, 2, d, jnp.bfloat16)
    out, _, grads = run(self.impl, q, k, v, None, ct, dict(causal=True))
    up = lambda x: x.astype(jnp.float32)
    r_out, _, r_grads = run("reference", up(q), up(k), up(v), None, ct, dict(causal=True))
    assert rel_err(out, r_out) < 3e-2
    for g, rg in zip(grads, r_grads):
      assert rel_err(g, rg) < 3e-2


def test_sequence_lengths_beside_segment_ids():
  """Lengths on packed documents whose ids include T + S and T + S + 1 (the ids the padding
  takes) and a negative one: the dense mask of both, through the mask path, forward and
  gradients, the backward from saved residuals too."""
  from memeff_jax.ops.flash_attention import flash_attention_backward  # pylint: disable=import-outside-toplevel
  b, t = 2, 24
  q, k, v, _, ct = make_problem(jax.random.key(13), b, t, t, 2, 2, 16, jnp.float32)
  seg = jnp.array([[-5] * 6 + [48] * 8 + [49] * 10, [48] * 12 + [49] * 12])
  q_len, kv_len = jnp.array([20, 9]), jnp.array([24, 14])
  rows = jnp.arange(t)[None]
  dense = ((seg[:, :, None] == seg[:, None, :]) & (rows < q_len[:, None])[:, :, None]
           & (rows < kv_len[:, None])[:, None, :])
  opts = dict(causal=True, implementation="chunked_xla")
  ours = lambda q, k, v: flash_attention(q, k, v, q_segment_ids=seg, query_seq_lengths=q_len,
                                         key_value_seq_lengths=kv_len, **opts)
  masked = lambda q, k, v: flash_attention(q, k, v, mask=dense[:, None], **opts)
  grads = lambda f: jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v) * ct),
                                               argnums=(0, 1, 2)))(q, k, v)
  for g, w in zip(jax.tree.leaves(grads(ours)), jax.tree.leaves(grads(masked))):
    assert rel_err(g, w) < 1e-6
  out, lse = flash_attention(q, k, v, q_segment_ids=seg, query_seq_lengths=q_len,
                             key_value_seq_lengths=kv_len, return_lse=True, **opts)
  back = flash_attention_backward(q, k, v, out, lse, ct, q_segment_ids=seg,
                                  query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                                  **opts)
  for g, w in zip(back, grads(masked)[1]):
    assert rel_err(g, w) < 1e-6


@pytest.mark.parametrize("impl", ["reference", "chunked_xla",
                                  PallasTriton(interpret=True, config=BlockConfig(
                                      block_q=32, block_k=16, bwd_block_q=16, bwd_block_k=32))])
def test_backward_from_saved_residuals_equals_vjp(impl):
  """flash_attention_backward (the PyTorch bridge's path) equals jax.vjp of the forward."""
  from memeff_jax.ops.flash_attention import flash_attention_backward  # pylint: disable=import-outside-toplevel
  q, k, v, seg, ct = make_problem(jax.random.key(11), 1, 50, 70, 4, 2, 32, jnp.float32,
                                  segments=True)
  opts = dict(causal=True, sliding_window=(20, 0), logit_softcap=3.0,
              q_segment_ids=seg[0], kv_segment_ids=seg[1])
  f = lambda q, k, v: flash_attention(q, k, v, return_lse=True, implementation=impl, **opts)

  @jax.jit
  def both(q, k, v):
    (out, lse), vjp = jax.vjp(f, q, k, v)
    d_lse = jnp.where(jnp.isfinite(lse), 0.5, 0.0)
    return (flash_attention_backward(q, k, v, out, lse, ct, d_lse, implementation=impl, **opts),
            vjp((ct, d_lse)))

  got, want = both(q, k, v)
  for g, w in zip(got, want):
    assert rel_err(g, w) < 1e-5
