"""Bad input gets a clear error naming the argument and what was expected."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memeff_jax
from memeff_jax.ops.linear_cross_entropy import Int64Labels
from memeff_jax.ops.linear_cross_entropy import PallasMosaicGpu

X = jnp.ones((2, 5, 8))
W = jnp.ones((8, 11))
Y = jnp.zeros((2, 5), jnp.int32)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(x=jnp.ones((2, 5, 7))), ValueError, r"x.shape=\(2, 5, 7\) has D=7"),
    (dict(weight=jnp.ones((8, 11, 1))), ValueError, r"weight must be 2-D"),
    (dict(weight=jnp.ones((11, 8))), ValueError, r"weight.shape=\(11, 8\)"),
    (dict(labels=jnp.zeros((2, 4), jnp.int32)), ValueError, r"labels.shape=\(2, 4\) must equal"),
    (dict(labels=jnp.zeros((2, 5))), TypeError, r"labels must be integers.*float32"),
    (dict(x=jnp.ones((2, 5, 8), jnp.int32)), TypeError, r"x must be float32.*int32"),
    (dict(bias=jnp.ones((10,))), ValueError, r"bias.shape=\(10,\) must be \(V,\)=\(11,\)"),
    (dict(where=jnp.ones((2, 5))), TypeError, r"where must be a boolean mask"),
    (dict(where=jnp.ones((5,), bool)), ValueError, r"where.shape=\(5,\) must equal"),
    (dict(token_weights=jnp.ones((2, 5), jnp.int32)), TypeError,
     r"token_weights must be floating point, got token_weights.dtype=int32"),
    (dict(token_weights=jnp.ones((10,))), ValueError,
     r"token_weights.shape=\(10,\) must equal labels.shape=\(2, 5\)"),
    (dict(token_loss_args=(jnp.ones((2, 5)),)), ValueError,
     r"token_loss_args \(1 arrays\) given without a token_loss"),
    (dict(token_loss="ppo"), TypeError, r"token_loss must be a callable"),
    (dict(token_loss=lambda lp: -lp, token_loss_args=jnp.ones((2, 5))), TypeError,
     r"token_loss_args must be a tuple of arrays, got ArrayImpl"),
    (dict(token_loss=lambda lp, a: a * lp, token_loss_args=(jnp.ones((2, 4)),)), ValueError,
     r"token_loss_args\[0\].shape=\(2, 4\) must equal labels.shape=\(2, 5\)"),
    (dict(token_loss=lambda lp, a: a * lp, token_loss_args=(jnp.ones((2, 5), jnp.int32),)),
     TypeError, r"token_loss_args\[0\] must be floating point, got dtype int32"),
    (dict(token_loss=lambda lp, a: a * lp), TypeError,
     r"token_loss must take the log-probability and 0 more float32 scalars"),
    (dict(token_loss=lambda lp: jnp.stack([lp, lp])), TypeError,
     r"token_loss must return one real scalar per token"),
    (dict(token_loss=lambda lp: -lp, z_loss=1e-4), ValueError,
     r"token_loss replaces the cross-entropy, so it takes no label_smoothing or z_loss"),
    (dict(reduction="avg"), ValueError, r"reduction must be one of"),
    (dict(weight_layout="kn"), ValueError, r"weight_layout must be 'dv'"),
    (dict(implementation="cudnn"), ValueError, r"unknown implementation='cudnn'"),
    (dict(label_smoothing=-0.1), ValueError, r"label_smoothing must be in \[0, 1\]"),
    (dict(z_loss=-1.0), ValueError, r"z_loss must be finite and ≥ 0"),
    (dict(z_loss=float("inf")), ValueError, r"z_loss must be finite and ≥ 0"),
    (dict(z_loss=float("nan")), ValueError, r"z_loss must be finite and ≥ 0"),
    (dict(label_smoothing=float("nan")), ValueError, r"label_smoothing must be in \[0, 1\]"),
    (dict(label_smoothing="0.1"), TypeError, r"label_smoothing must be a Python real"),
    (dict(logit_softcap=0.0), ValueError, r"logit_softcap must be None or > 0"),
    (dict(logit_softcap=float("nan")), ValueError, r"logit_softcap must be None or > 0"),
    (dict(chunk_size=0), ValueError, r"chunk_size must be positive"),
    (dict(chunk_size=True), TypeError, r"chunk_size must be a Python int, got True"),
    (dict(chunk_size=2.5), TypeError, r"chunk_size must be a Python int, got 2.5"),
    (dict(chunk_size=(4, 8, 2)), ValueError, r"chunk_size must be a positive int or a"),
    (dict(ignore_index=None), TypeError, r"ignore_index must be a Python int, got None"),
    (dict(return_aux="yes"), TypeError, r"return_aux must be a Python bool"),
    (dict(entropy=1), TypeError, r"entropy must be a Python bool"),
    (dict(entropy=True), ValueError,
     r"entropy=True returns the entropy in Aux \(pass return_aux=True too\) or hands it "
     r"to a token_loss"),
    (dict(token_loss=lambda lp: -lp, entropy=True), TypeError,
     r"token_loss must take the log-probability, the entropy \(entropy=True\) and 0 more"),
    (dict(implementation=123), TypeError, r"implementation must be None, a name"),
    (dict(labels=Int64Labels(jnp.zeros((2, 5, 2)))), TypeError,
     r"Int64Labels.words must be \[..., 2\] int32 or uint32.*float32"),
    (dict(labels=Int64Labels(jnp.zeros((2, 5, 3), jnp.int32))), TypeError,
     r"Int64Labels.words must be .*shape \(2, 5, 3\)"),
    (dict(labels=Int64Labels(jnp.zeros((2, 4, 2), jnp.int32))), ValueError,
     r"labels.shape=\(2, 4\) must equal"),
    (dict(labels=Int64Labels(jnp.zeros((2, 5, 2), jnp.int32)), ignore_index=2**63), ValueError,
     r"ignore_index=9223372036854775808 is outside the int64 range"),
])
def test_bad_input(kwargs, error, match):
  args = dict(x=X, weight=W, labels=Y)
  args.update(kwargs)
  with pytest.raises(error, match=match):
    memeff_jax.linear_cross_entropy(args.pop("x"), args.pop("weight"), args.pop("labels"),
                                    **args)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU message")
def test_explicit_gpu_implementation_on_cpu_says_why():
  with pytest.raises(NotImplementedError,
                     match=r"pallas_mosaic_gpu: pallas_mosaic_gpu needs a GPU"):
    memeff_jax.linear_cross_entropy(X, W, Y, implementation="pallas_mosaic_gpu")


def test_fallback_order_skips_what_cannot_serve():
  loss = memeff_jax.linear_cross_entropy(X, W, Y,
                                         implementation=("pallas_mosaic_gpu", "chunked_xla"))
  ref = memeff_jax.linear_cross_entropy(X, W, Y, implementation="reference")
  assert jnp.allclose(loss, ref)


def test_bad_kernel_option():
  with pytest.raises(ValueError, match="dw_accumulation must be"):
    PallasMosaicGpu(dw_accumulation="bf16")


def test_bad_mosaic_gemms_option():
  with pytest.raises(ValueError, match=r"mosaic_gemms must be a tuple of names from"):
    PallasMosaicGpu(mosaic_gemms="dw")
  with pytest.raises(ValueError, match=r"mosaic_gemms must be a tuple.*'dW'"):
    PallasMosaicGpu(mosaic_gemms=("dW",))
  with pytest.raises(ValueError, match="excludes dw_accumulation='float32'"):
    PallasMosaicGpu(mosaic_gemms=("dw",), dw_accumulation="float32")
  with pytest.raises(ValueError, match=r"'tma_add'.*needs 'dw' in mosaic_gemms, got \('dx',\)"):
    PallasMosaicGpu(mosaic_gemms=("dx",), dw_accumulation="tma_add")


def test_mosaic_gemms_in_interpret_mode_say_why():
  impl = PallasMosaicGpu(interpret=True, mosaic_gemms=("dw",))
  with pytest.raises(NotImplementedError, match="interpret mode runs no Mosaic GPU kernel"):
    memeff_jax.linear_cross_entropy(X, W, Y, implementation=impl)


def _per_token(labels, **kw):
  x = jax.random.normal(jax.random.key(0), (labels.shape[0], 8))
  w = jax.random.normal(jax.random.key(1), (8, 11))
  return np.asarray(memeff_jax.linear_cross_entropy(x, w, labels, reduction="none", **kw))


def test_wide_labels_are_not_narrowed_into_real_classes():
  """A uint32 label ≥ 2³¹ gives NaN (not the class it wraps to), and an ignore_index no
  int32 label can equal ignores nothing (label 0 stays a class)."""
  got = _per_token(jnp.array([0, 3, 2**31 + 3, 2**32 - 100], jnp.uint32))
  want = _per_token(jnp.array([0, 3, 0, 0], jnp.int32))
  np.testing.assert_array_equal(got[:2], want[:2])
  assert np.all(np.isnan(got[2:]))
  np.testing.assert_array_equal(_per_token(jnp.arange(4), ignore_index=2**32),
                                _per_token(jnp.arange(4)))
  assert np.all(_per_token(jnp.arange(4), ignore_index=np.int64(2)) == np.where(
      np.arange(4) == 2, 0.0, _per_token(jnp.arange(4))))


def test_int64_labels_with_x64():
  with jax.enable_x64(True):
    labels = jnp.array([1, 2**32 + 3, 2**32 - 100, 5], jnp.int64)
    x = jax.random.normal(jax.random.key(0), (4, 8), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (8, 11), jnp.float32)
    got = np.asarray(memeff_jax.linear_cross_entropy(x, w, labels, reduction="none",
                                                     ignore_index=2**32 - 100))
  assert np.isfinite(got[0]) and np.isnan(got[1]) and got[2] == 0.0 and np.isfinite(got[3])


def test_static_options_accept_numpy_and_concrete_jax_scalars():
  ref = memeff_jax.linear_cross_entropy(X, W, Y, label_smoothing=0.1, chunk_size=4)
  got = memeff_jax.linear_cross_entropy(X, W, Y, label_smoothing=jnp.float32(0.1),
                                        chunk_size=np.int64(4))
  np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_traced_option_is_refused_by_name():
  with pytest.raises(TypeError, match=r"z_loss must be a Python real, not a traced value"):
    jax.jit(lambda z: memeff_jax.linear_cross_entropy(X, W, Y, z_loss=z))(1e-4)


def test_no_z_loss_adds_nothing_where_lse_squared_overflows():
  """Logits near 1e20: lse² overflows float32, so 0·lse² would be NaN."""
  x = jnp.full((4, 2), 1e10)
  w = jnp.array([[1e10, -1e10, 0.0], [0.0, 0.0, 1.0]])
  labels = jnp.array([0, 1, 2, 0])
  for impl in ("chunked_xla", "reference"):
    loss, grads = jax.value_and_grad(lambda x, w: memeff_jax.linear_cross_entropy(
        x, w, labels, implementation=impl), argnums=(0, 1))(x, w)
    assert np.isfinite(loss) and all(np.all(np.isfinite(g)) for g in grads), impl


def test_infinite_softcap_is_no_cap():
  np.testing.assert_array_equal(
      memeff_jax.linear_cross_entropy(X, W, Y, logit_softcap=float("inf")),
      memeff_jax.linear_cross_entropy(X, W, Y))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_zero_size_inputs(reduction):
  """No tokens: loss 0 (every token left out) or an empty vector. D = 0: logits of zeros."""
  x = jax.random.normal(jax.random.key(0), (3, 0, 8))
  w = jax.random.normal(jax.random.key(1), (8, 11))
  f = lambda x, w, y: memeff_jax.linear_cross_entropy(x, w, y, reduction=reduction)
  loss, grads = jax.value_and_grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1))(
      x, w, jnp.zeros((3, 0), jnp.int32))
  assert loss == 0.0 and not np.any(grads[1]) and grads[0].shape == x.shape
  x0, w0, y = jnp.ones((5, 0)), jnp.ones((0, 11)), jnp.arange(5)
  per_token = np.log(11.0) * np.ones(5)
  want = {"mean": per_token.mean(), "sum": per_token.sum(), "none": per_token}[reduction]
  np.testing.assert_allclose(f(x0, w0, y), want, rtol=1e-6)
  for layout, weight in (("dv", w0), ("vd", w0.T)):
    grads = jax.grad(lambda x, w: jnp.sum(memeff_jax.linear_cross_entropy(
        x, w, y, weight_layout=layout)), argnums=(0, 1))(x0, weight)
    assert grads[0].shape == (5, 0) and grads[1].shape == weight.shape


def test_second_order_gradients_say_so():
  grad = lambda impl: jax.grad(lambda x: memeff_jax.linear_cross_entropy(
      x, W, Y, implementation=impl))
  with pytest.raises(NotImplementedError, match=r"higher-order gradients are not supported by "
                     r"chunked_xla; use implementation='reference'"):
    jax.grad(lambda x: jnp.sum(grad("chunked_xla")(x)))(X)
  jax.grad(lambda x: jnp.sum(grad("reference")(x)))(X)


def test_interpret_mode_kernel_runs_under_x64():
  x = jax.random.normal(jax.random.key(0), (8, 16))
  w = jax.random.normal(jax.random.key(1), (16, 100))
  f = lambda impl: jax.value_and_grad(lambda x, w: memeff_jax.linear_cross_entropy(
      x, w, jnp.arange(8), implementation=impl), argnums=(0, 1))(x, w)
  with jax.enable_x64(True):
    got = jax.jit(f, static_argnums=0)(PallasMosaicGpu(interpret=True))
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(f("reference"))):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
