"""Bad input gets a clear error naming the argument and what was expected."""

import jax
import jax.numpy as jnp
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
    (dict(reduction="avg"), ValueError, r"reduction must be one of"),
    (dict(weight_layout="kn"), ValueError, r"weight_layout must be 'dv'"),
    (dict(implementation="cudnn"), ValueError, r"unknown implementation='cudnn'"),
    (dict(label_smoothing=-0.1), ValueError, r"label_smoothing must be in \[0, 1\]"),
    (dict(z_loss=-1.0), ValueError, r"z_loss must be ≥ 0"),
    (dict(logit_softcap=0.0), ValueError, r"logit_softcap must be None or > 0"),
    (dict(chunk_size=0), ValueError, r"chunk_size must be a positive int"),
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
  with pytest.raises(NotImplementedError, match=r"pallas_mosaic_gpu: pallas_mosaic_gpu needs a GPU"):
    memeff_jax.linear_cross_entropy(X, W, Y, implementation="pallas_mosaic_gpu")


def test_fallback_order_skips_what_cannot_serve():
  loss = memeff_jax.linear_cross_entropy(X, W, Y, implementation=("pallas_mosaic_gpu", "chunked_xla"))
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
