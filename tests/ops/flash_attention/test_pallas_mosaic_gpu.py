"""The Mosaic GPU (Hopper) forward: what it serves, that it builds, and its numbers on the GPU."""

import collections
import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memeff_jax import _tuning
from memeff_jax.kernels import hopper
from memeff_jax.ops.flash_attention import _common
from memeff_jax.ops.flash_attention import _mosaic
from memeff_jax.ops.flash_attention import _padding
from memeff_jax.ops.flash_attention import flash_attention
from memeff_jax.ops.flash_attention import MosaicConfig
from memeff_jax.ops.flash_attention import PallasMosaicGpu
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb
from memeff_jax.ops.flash_attention import mosaic_gpu_dq as mdq
from memeff_jax.ops.flash_attention import MosaicDqConfig
from memeff_jax.ops.flash_attention import pallas_mosaic_gpu as pm
from memeff_jax.ops.flash_attention import pallas_triton
from memeff_jax.ops.flash_attention._common import AttentionOptions
from memeff_jax.ops.flash_attention._common import Residuals
from memeff_jax.ops.flash_attention import masks
from memeff_jax.ops.flash_attention.masks import MaskSpec
from tests.ops.flash_attention.test_flash_attention import _FlashAttentionTest
from tests.ops.flash_attention.test_flash_attention import make_problem
from tests.ops.flash_attention.test_flash_attention import rel_err
from tests.ops.flash_attention.test_flash_attention import run

BF16 = jnp.bfloat16
_MOSAIC_CALL = re.compile(r"custom_call @mosaic_gpu")


def _opts(causal=False, window=None, segments=False, softcap=None, scale=0.125):
  return AttentionOptions(mask=MaskSpec.make(causal, window, segments), scale=scale,
                          logit_softcap=softcap)


@pytest.mark.parametrize("q_shape, k_shape, dtype, opts, config, match", [
    ((1, 256, 4, 128), (1, 256, 4, 128), jnp.float32, _opts(), MosaicConfig(),
     "bfloat16 or float16"),
    ((1, 256, 4, 72), (1, 256, 4, 72), BF16, _opts(), MosaicConfig(), "D=72"),
    ((1, 200, 4, 128), (1, 256, 4, 128), BF16, _opts(), MosaicConfig(), "T=200"),
    ((1, 256, 4, 128), (1, 300, 4, 128), BF16, _opts(), MosaicConfig(), "S=300"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(scale=-1.0), MosaicConfig(), "scale > 0"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(), MosaicConfig(overlap=True),
     "overlap and pingpong"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(), MosaicConfig(num_sms=8),
     "num_sms=8 needs persistent"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(), MosaicConfig(persistent=True, num_sms=0),
     "num_sms=0 needs persistent and at least one CTA"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(), MosaicConfig(dynamic=True),
     "dynamic needs persistent"),
    # One K/V slot (the walk would deadlock): too wide a block, one stage asked for, or the
    # persistent output's buffer taking the second at D = 256.
    ((1, 4224, 4, 128), (1, 4224, 4, 128), BF16, _opts(), MosaicConfig(block_kv=192),
     r"two K/V stages to walk S=4224 in blocks of 192 .* leave room for 1"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(causal=True), MosaicConfig(stages=1),
     r"stages=1, block_kv=128 at D=128 leave room for 1"),
    ((1, 256, 4, 256), (1, 256, 4, 256), BF16, _opts(),
     MosaicConfig(block_kv=64, persistent=True), "with the persistent output buffer"),
    ((1, 512, 4, 256), (1, 512, 4, 256), BF16, _opts(), MosaicConfig(block_kv=512),
     "block_kv=512 at D=256 leaves no room"),
])
def test_support_error_names_what_is_not_served(q_shape, k_shape, dtype, opts, config, match):
  assert re.search(match, pm.support_error(q_shape, k_shape, dtype, opts, config))


def test_support_error_admits_the_served_calls():
  for causal in (False, True):
    for d in _padding.HEAD_DIMS:
      for softcap in (None, 20.0):
        for window, segments in ((None, False), ((100, 3), False), (None, True), (64, True)):
          opts = _opts(causal, window, segments, softcap)
          assert pm.support_error((2, 384, 8, d), (2, 512, 2, d), BF16, opts,
                                  MosaicConfig.for_head_dim(d)) is None
  # One K/V slot serves the overlap (K and V in rings of their own) and a one-block walk.
  wide = MosaicConfig(block_kv=192, overlap=True, pingpong=False)
  assert pm.support_error((1, 4224, 4, 128), (1, 4224, 4, 128), BF16, _opts(), wide) is None
  assert pm.support_error((1, 256, 4, 128), (1, 128, 4, 128), BF16, _opts(),
                          MosaicConfig(stages=1)) is None


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU message")
def test_explicit_mosaic_on_cpu_says_why():
  q = jnp.ones((1, 128, 2, 64), BF16)
  with pytest.raises(NotImplementedError, match="pallas_mosaic_gpu: needs an NVIDIA Hopper"):
    flash_attention(q, q, q, implementation="pallas_mosaic_gpu")


@pytest.mark.parametrize("d, opts, s, overlap, persistent", [
    (128, _opts(), 256, True, True), (128, _opts(causal=True), 8192, True, False),
    (128, _opts(causal=True), 6144, True, "dynamic"),
    (128, _opts(causal=True), 4096, True, "dynamic"),
    (128, _opts(causal=True), 2048, False, "dynamic"),
    (128, _opts(causal=True), 256, False, "dynamic"),
    (256, _opts(), 256, True, False), (256, _opts(causal=True), 256, True, False),
    (64, _opts(), 256, False, True), (64, _opts(causal=True), 4096, False, True),
    (192, _opts(), 256, True, False), (192, _opts(causal=True), 256, True, False),
    (96, _opts(), 256, False, True), (96, _opts(causal=True), 1024, False, True),
    (96, _opts(causal=True), 4096, False, False),
    (128, _opts(window=(100, 7)), 256, False, "dynamic"),
    (128, _opts(causal=True, window=1024), 16384, False, "dynamic"),
    (128, _opts(window=4096), 16384, False, False),
    (128, _opts(causal=True, segments=True), 8192, False, "dynamic"),
    (128, _opts(segments=True), 256, False, False),
    (128, _opts(window=(100, 0), segments=True), 256, False, False),
    (64, _opts(causal=True, segments=True), 256, False, False)])
def test_forward_overlaps_where_it_measured_faster(as_on_hopper, d, opts, s, overlap, persistent):
  """The default forward: intra-warpgroup overlap at D = 128, 192 and 256 with no mask or a
  causal one, ping-pong elsewhere (masked blocks run without the overlap); persistent at
  D = 64, 96 and 128 without a mask, at D = 64 causal, and causal at D = 96 and 128 up to
  SHORT_CAUSAL_KEYS keys (with ping-pong); tiles taken at run time ("dynamic") for those at
  D = 128, for causal calls with segment ids there, at any length, and for causal calls and
  windows there whose band spans at most SHORT_WALK_KEYS keys; three K/V stages at
  D = 96 and 192 without a mask; lazy rescales above D = 128; an explicit config wins."""
  q = jax.ShapeDtypeStruct((1024, s, 4, d), BF16)  # enough work on each SM to run persistent
  st = PallasMosaicGpu()._static(q, q, opts)  # pylint: disable=protected-access
  assert (st.config.overlap, st.config.pingpong) == (overlap, not overlap)
  assert st.config.persistent == bool(persistent)
  assert st.config.dynamic == (persistent == "dynamic")
  wide = d == 64 and opts.mask.is_dense  # see the next test
  block_kv = pm.WIDE_KEY_BLOCK if wide else MosaicConfig.for_head_dim(d).block_kv
  assert st.config.block_kv == block_kv
  assert st.config.stages == (3 if d in (96, 192) and opts.mask.is_dense else 2)
  assert st.config.lazy_rescale == (d > 128)
  # 64-key blocks: two K/V stages fit at every head dim (MosaicConfig()'s 128 leave one at
  # D = 256, which support_error refuses there).
  config = MosaicConfig(block_kv=64)
  explicit = PallasMosaicGpu(config=config)._static(q, q, opts)  # pylint: disable=protected-access
  assert explicit.config == config


@pytest.mark.parametrize("causal, window, s, span", [
    (True, None, 4096, 4096), (False, (100, 7), 256, 108), (True, 1024, 16384, 1025),
    (False, 4096, 4096, 4096), (False, (100, None), 4096, 4096)])
def test_mask_span_counts_the_keys_a_query_can_see(causal, window, s, span):
  assert MaskSpec.make(causal, window, False).span(s) == span


@pytest.mark.parametrize("d, opts, s, heads", [
    (128, _opts(causal=True), 4096, 9),  # 288 tiles of 128 rows (≥ 264), 4,609 blocks
    (128, _opts(causal=True, window=1024), 16384, 4),  # 512 tiles, 3,972 blocks (≥ 3,168)
    (128, _opts(causal=True), 1024, 99),  # 792 tiles, 3,171 blocks
    (96, _opts(causal=True), 2048, 25)])  # 400 tiles, 3,202 blocks
def test_forward_keeps_the_grid_where_each_sm_has_little_work(as_on_hopper, monkeypatch, d,
                                                              opts, s, heads):
  """The short causal calls and (at D = 128) short walks run persistent only where each of
  the 132 SMs takes at least 2 query tiles and 24 key blocks of visible pairs: `heads` query
  heads of s queries is the fewest that do."""
  monkeypatch.setattr(hopper, "sm_count", lambda: 132)
  assert (pm.PERSISTENT_MIN_TILES_PER_SM, pm.PERSISTENT_MIN_BLOCKS_PER_SM) == (2, 24)
  for heads, persistent in ((heads, True), (heads - 1, False)):
    q = jax.ShapeDtypeStruct((1, s, heads, d), BF16)
    st = PallasMosaicGpu()._static(q, q, opts)  # pylint: disable=protected-access
    assert st.config.persistent == persistent
    assert st.config.dynamic == (persistent and d == 128)


@pytest.mark.parametrize("d, opts, s, block_kv, stages", [
    (64, _opts(), 4096, 256, 2), (48, _opts(), 4096, 256, 2), (48, _opts(), 384, 128, 4),
    (64, _opts(), 384, 128, 2), (64, _opts(causal=True), 4096, 128, 2),
    (48, _opts(window=(100, 100)), 4096, 128, 2), (64, _opts(segments=True), 4096, 128, 2),
    (96, _opts(), 4096, 128, 3), (128, _opts(), 4096, 128, 2)])
def test_forward_takes_wide_key_blocks_at_small_head_dims(as_on_hopper, d, opts, s, block_kv,
                                                          stages):
  """256-key blocks in two stages at D = 48 and 64 without a mask where 256 divides S; 128
  elsewhere (D = 48 without a mask then in four stages)."""
  q = jax.ShapeDtypeStruct((1, s, 4, d), BF16)
  st = PallasMosaicGpu()._static(q, q, opts)  # pylint: disable=protected-access
  assert (st.config.block_kv, st.config.stages) == (block_kv, stages)


@pytest.mark.parametrize("s, padded, block_kv", [(257, 384, 128), (1000, 1024, 256)])
def test_padding_plans_at_128_key_blocks(as_on_hopper, s, padded, block_kv):
  """A padded call without a mask at D = 64: S pads to a multiple of 128 keys (257 to 384,
  not 512), and the call takes 256-key blocks only where they divide the padded S (1,024:
  the last block cut by the key bound)."""
  q = jax.ShapeDtypeStruct((2, s, 4, 64), BF16)
  st = PallasMosaicGpu()._static(q, q, _opts())  # pylint: disable=protected-access
  assert (st.padding.s, st.config.block_kv) == (padded, block_kv)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [4, 1])
def test_deterministic_calls_pair_dkv_with_a_dq_kernel(as_on_hopper, causal, hkv):
  """The Mosaic backward sums dq in arrival order: only deterministic=False may run it whole.
  Deterministic calls run it with dq_ordered where the table has an `_ordered` section
  (D = 128; causal GQA with one CTA per query head), else get dK, dV from it
  (with_dq=False) and dq from mosaic_gpu_dq's kernel (pallas_triton's on request, or where
  that does not serve the call)."""
  q = jax.ShapeDtypeStruct((1, 256, 4, 128), BF16)
  k = jax.ShapeDtypeStruct((1, 256, hkv, 128), BF16)
  det = _opts(causal)
  fast = dataclasses.replace(det, deterministic=False)
  assert det.deterministic  # the default
  st = PallasMosaicGpu()._static(q, k, det)  # pylint: disable=protected-access
  assert st.backward.with_dq and st.backward.dq_ordered and st.dq is None  # d128[...]_ordered
  assert st.backward.gqa_per_query_head == (causal and hkv == 1)
  assert st.triton is None
  st = PallasMosaicGpu()._static(q, k, fast)  # pylint: disable=protected-access
  assert st.backward.with_dq and st.triton is None and st.dq is None
  explicit = PallasMosaicGpu(backward_config=mb.MosaicBackwardConfig())
  assert explicit._static(q, k, fast).backward == mb.MosaicBackwardConfig()  # pylint: disable=protected-access
  with pytest.raises(NotImplementedError, match="deterministic=False"):
    explicit._static(q, k, det)  # pylint: disable=protected-access
  dkv_only = mb.MosaicBackwardConfig(dq_split=False, pingpong=True, with_dq=False)
  res = Residuals(q, k, k, None, None, q, jax.ShapeDtypeStruct((1, 4, 256), jnp.float32))
  pairs = det.mask.visible_pairs(256, 256)
  from memeff_jax.remat import flops  # pylint: disable=import-outside-toplevel
  triton_dq = pallas_triton.default_config(128)
  for dq_config, dq_name in ((None, "flash_attention_dq_mosaic"),
                             (MosaicDqConfig(block_kv=64, pingpong=True),
                              "flash_attention_dq_mosaic"),
                             (triton_dq, '"flash_attention_dq"')):
    impl = PallasMosaicGpu(backward_config=dkv_only, dq_config=dq_config)
    st = impl._static(q, k, det)  # pylint: disable=protected-access
    assert st.backward == dkv_only
    assert (st.triton is not None) == (dq_config is triton_dq)
    # The pair lowers for CUDA: the Mosaic dK/dV kernel and the dq kernel.
    bwd = lambda res, d_out, d_lse, st=st: pm._backward(st, res, (d_out, d_lse))[:3]  # pylint: disable=protected-access
    text = jax.jit(bwd).trace(res, q, res.lse).lower(lowering_platforms=("cuda",)).as_text()
    assert "flash_attention_bwd_mosaic" in text and dq_name in text
    # remat.fit counts 4 matmuls for the dK/dV kernel and 3 for the dq kernel.
    assert flops.jaxpr_flops(jax.make_jaxpr(bwd)(res, q, res.lse)) == 2 * 7 * 4 * pairs * 128
  # A dq kernel asked for runs beside the dK/dV kernel, deterministic or not; where none
  # would run (pallas_triton's backward), it is an error, not ignored.
  st = PallasMosaicGpu(dq_config=MosaicDqConfig())._static(q, k, fast)  # pylint: disable=protected-access
  assert not st.backward.with_dq and st.dq == MosaicDqConfig()
  with pytest.raises(NotImplementedError, match="dq_config"):
    PallasMosaicGpu(backward_config=triton_dq, dq_config=MosaicDqConfig())._static(q, k, det)  # pylint: disable=protected-access
  with pytest.raises(NotImplementedError, match="block_kv 64 or 128"):
    PallasMosaicGpu(dq_config=MosaicDqConfig(block_kv=32))._static(q, k, det)  # pylint: disable=protected-access
  # D = 256: the column-split kernel whole with split scores, dq in rank order (GQA: one CTA
  # per query head, as the table asks causal and the few key blocks ask both; causal, the
  # longest walk launched first only without GQA); an explicit dK/dV-only form with two
  # Q/dO stages gets a dq kernel of 64-key blocks.
  q256 = jax.ShapeDtypeStruct((1, 256, 4, 256), BF16)
  k256 = jax.ShapeDtypeStruct((1, 256, hkv, 256), BF16)
  st = PallasMosaicGpu()._static(q256, k256, det)  # pylint: disable=protected-access
  assert st.backward == mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1,
                                                scores_split=True, dq_ordered=True,
                                                dq_rotate=not causal,
                                                dq_heavy_first=causal and hkv == 4,
                                                group_splits=4 if hkv == 1 else 1,
                                                dq_paired=causal and hkv == 1,
                                                dq_rounded=True)  # 4 adders
  assert st.dq is None and st.triton is None
  dkv256 = mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=2, with_dq=False)
  st = PallasMosaicGpu(backward_config=dkv256)._static(q256, k256, det)  # pylint: disable=protected-access
  assert st.backward == dkv256
  assert st.dq == MosaicDqConfig(block_kv=64, stages=2, v_stages=1) and st.triton is None
  # D = 192, not padded: causal, its own ordered section (column_split, a second Q/dO
  # stage); else the dK/dV-only kernel at full width, 32 query rows a step, beside the dq
  # kernel.
  q192 = jax.ShapeDtypeStruct((1, 256, 4, 192), BF16)
  st = PallasMosaicGpu()._static(q192, q192, det)  # pylint: disable=protected-access
  assert st.padding is None and st.triton is None
  if causal:
    assert st.backward.column_split and st.backward.dq_ordered and st.backward.stages == 2
  else:
    assert st.backward == mb.MosaicBackwardConfig(dq_split=False, block_q=32, with_dq=False)
    assert st.dq == MosaicDqConfig(block_kv=64, stages=2, v_stages=1)
  triton = PallasMosaicGpu(backward_config=triton_dq)
  for opts in (det, fast):  # a Triton backward asked for is deterministic either way
    assert triton._static(q, k, opts).triton is not None  # pylint: disable=protected-access


_DQ_CASES = [
    (False, None, False, 128, 256, 512, 4, None),
    (True, None, False, 128, 512, 384, 2, 30.0),
    (True, None, False, 64, 256, 256, 1, None),
    (False, (100, 7), False, 128, 512, 384, 2, None),
    (True, 300, True, 128, 512, 512, 4, 20.0),
    (False, None, True, 64, 256, 384, 1, None),
    (True, (100, 7), True, 256, 256, 384, 2, 30.0),
    (True, None, False, 112, 256, 256, 2, None),
    (False, (100, 7), True, 160, 256, 192, 1, 30.0)]
_DQ_CONFIGS = [MosaicDqConfig(block_kv=64, pingpong=True), MosaicDqConfig(block_kv=64, stages=1),
               MosaicDqConfig(block_kv=64, stages=1, v_stages=2),
               MosaicDqConfig(block_kv=64, stages=2, v_stages=1)]


# Every case on its head dim's config; each other config on every fourth case (the two V
# slots on D = 256's, which refuses them).
@pytest.mark.parametrize("causal, window, segments, d, t, s, hkv, softcap, config",
                         [(*case, None) for case in _DQ_CASES]
                         + [(*case, _DQ_CONFIGS[i % 4]) for i, case in enumerate(_DQ_CASES)])
def test_dq_kernel_lowers_for_cuda(causal, window, segments, d, t, s, hkv, softcap, config):
  config = config or MosaicDqConfig.for_head_dim(d)
  opts = _opts(causal, window, segments, softcap)
  q = jax.ShapeDtypeStruct((2, t, 4, d), BF16)
  k = jax.ShapeDtypeStruct((2, s, hkv, d), BF16)
  if (why := mdq.support_error(q.shape, k.shape, BF16, config, segments)) is not None:
    assert d == 256 and config.v_stages == 2 and "does not fit" in why
    return  # two V slots beside Q, dO and the ids at D = 256: refused, not compiled
  stats = jax.ShapeDtypeStruct((2, 4, 2, t), jnp.float32)

  def dq(q, k, v, d_out, stats, q_seg, kv_seg):
    res = Residuals(q, k, v, q_seg, kv_seg, None, None)
    return mdq.dq(opts, config, res, d_out, stats)

  text = jax.jit(dq).trace(q, k, k, q, stats, *_segment_structs(segments, t, s)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert _MOSAIC_CALL.search(text) and "flash_attention_dq_mosaic" in text


# Each head dim under each mask; each mask with both backward kinds.
@pytest.mark.parametrize("d, hkv, causal, segments, deterministic", [
    (d, hkv, causal, segments, (i + j) % 2 == 0)
    for i, (d, hkv) in enumerate([(112, 2), (160, 2), (160, 4), (224, 1)])
    for j, (causal, segments) in enumerate([(False, False), (True, False), (True, True)])])
def test_head_dims_between_the_tuned_ones_run_as_they_are(as_on_hopper, d, hkv, causal,
                                                          segments, deterministic):
  """D = 112, 160 and 224 run unpadded on the forward settings of the next tuned head dim
  (128, 192, 256). Their backwards: at D = 224 the column-split kernel of D = 256's
  settings; at 160 the dK/dV-only kernel at full width (two Q/dO stages) beside the dq
  kernel; at 112 the dK/dV-only kernel too, on 96-query steps, there being no ordered
  kernel (dq_split's 56-column halves fill no 32-byte swizzle group). Every kernel a call
  runs lowers for CUDA."""
  opts = dataclasses.replace(_opts(causal, None, segments), deterministic=deterministic)
  t = 384
  q = jax.ShapeDtypeStruct((2, t, 4, d), BF16)
  k = jax.ShapeDtypeStruct((2, t, hkv, d), BF16)
  st = PallasMosaicGpu()._static(q, k, opts)  # pylint: disable=protected-access
  assert st.padding is None and st.triton is None
  tuned = _padding.settings_dim(d)
  want = MosaicConfig.for_call(tuned, opts.mask, t)
  assert st.config == dataclasses.replace(want, block_kv=MosaicConfig.for_head_dim(d).block_kv)
  if d > 160:
    assert st.backward.column_split and st.dq is None and st.backward.stages == 1
  else:  # either way: the pair measured faster than the whole kernel in arrival order
    assert not st.backward.with_dq and not st.backward.column_split
    assert st.dq == MosaicDqConfig.for_head_dim(d)
    assert st.backward.stages == 2
    assert st.backward.block_q == (96 if d == 112 else 64)  # d112_dkv: 96 rows a step
  text = _forward_lowered_for_cuda(opts, st.config, t, t, hkv, d, segments)
  text += _backward_lowered_for_cuda(opts, st.backward, t, t, hkv, d, segments)
  assert len(_MOSAIC_CALL.findall(text)) >= 2


@pytest.mark.parametrize("q_shape, k_shape, dtype, config, match", [
    ((1, 256, 4, 72), (1, 256, 4, 72), BF16, MosaicDqConfig(), "D=72"),
    ((1, 256, 4, 256), (1, 256, 4, 256), BF16, MosaicDqConfig(), "block_kv 64 above D=128"),
    ((1, 256, 4, 160), (1, 256, 4, 160), BF16, MosaicDqConfig(), "block_kv 64 above D=128"),
    ((1, 256, 4, 144), (1, 256, 4, 144), BF16, MosaicDqConfig(block_kv=64), "D=144"),
    ((1, 256, 4, 128), (1, 256, 4, 128), jnp.float32, MosaicDqConfig(), "bfloat16 or float16"),
    ((1, 192, 4, 128), (1, 256, 4, 128), BF16, MosaicDqConfig(), "T=192"),
    ((1, 256, 4, 128), (1, 192, 4, 128), BF16, MosaicDqConfig(), "S=192"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, MosaicDqConfig(block_kv=96), "block_kv"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, MosaicDqConfig(stages=0), "one stage"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, MosaicDqConfig(v_stages=0), "one stage"),
    ((1, 256, 4, 256), (1, 256, 4, 256), BF16, MosaicDqConfig(block_kv=64, v_stages=3),
     "does not fit"),
])
def test_dq_support_error_names_what_is_not_served(q_shape, k_shape, dtype, config, match):
  assert re.search(match, mdq.support_error(q_shape, k_shape, dtype, config))


def test_deterministic_must_be_a_bool():
  q = jnp.ones((1, 64, 2, 32))
  with pytest.raises(TypeError, match="deterministic must be a Python bool"):
    flash_attention(q, q, q, deterministic="yes")


def _segment_structs(segments, t, s):
  if not segments:
    return None, None
  return jax.ShapeDtypeStruct((2, t), jnp.int32), jax.ShapeDtypeStruct((2, s), jnp.int32)


def _lower_with(monkeypatch, semantics: str) -> None:
  """Mosaic GPU kernels lowered with `semantics` ("Lane", this jax's default, or
  "Warpgroup", the GPU image's jax 0.11's)."""
  monkeypatch.setattr(pm.plgpu, "CompilerParams", functools.partial(
      pm.plgpu.CompilerParams, lowering_semantics=getattr(pm.plgpu.LoweringSemantics, semantics)))


def _alternating_lowerings(cases):
  """`cases` each with one lowering ("Lane" or "Warpgroup") appended, alternately: each case
  lowers once, and each lowering sees half of a list that spreads its options over both."""
  return [(*case, ("Lane", "Warpgroup")[i % 2]) for i, case in enumerate(cases)]


def _forward_lowered_for_cuda(opts, config, t, s, hkv, d, segments) -> str:
  """The StableHLO of the Mosaic forward at B = 2, Hq = 4, lowered for CUDA."""
  st = pm._Static(opts, config, None, None)  # pylint: disable=protected-access
  q = jax.ShapeDtypeStruct((2, t, 4, d), BF16)
  k = jax.ShapeDtypeStruct((2, s, hkv, d), BF16)
  fwd = functools.partial(pm._forward, st)  # pylint: disable=protected-access
  return jax.jit(fwd).trace(q, k, k, *_segment_structs(segments, t, s)).lower(
      lowering_platforms=("cuda",)).as_text()


def _backward_lowered_for_cuda(opts, config, t, s, hkv, d, segments) -> str:
  """The StableHLO of mosaic_gpu_backward.backward at B = 2, Hq = 4, lowered for CUDA."""
  q = jax.ShapeDtypeStruct((2, t, 4, d), BF16)
  k = jax.ShapeDtypeStruct((2, s, hkv, d), BF16)
  lse = jax.ShapeDtypeStruct((2, 4, t), jnp.float32)

  def bwd(q, k, v, out, lse, d_out, d_lse, q_seg, kv_seg):
    res = Residuals(q, k, v, q_seg, kv_seg, out, lse)
    return mb.backward(opts, config, res, (d_out, d_lse))[:3]

  return jax.jit(bwd).trace(q, k, k, q, lse, q, lse, *_segment_structs(segments, t, s)).lower(
      lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "causal, window, segments, pingpong, d, t, s, hkv, softcap, overlap, semantics",
    _alternating_lowerings([(*case, overlap) for i, case in enumerate([
        (False, None, False, True, 128, 256, 512, 4, None),
        (True, None, False, True, 128, 512, 384, 2, 30.0),
        (True, None, False, False, 64, 256, 256, 1, None),
        (True, None, False, True, 256, 256, 256, 2, None),
        (False, (100, 7), False, True, 128, 512, 384, 2, None),
        (True, 300, True, True, 128, 512, 512, 4, 20.0),
        (False, None, True, False, 64, 256, 384, 1, None)])
                            for overlap in ((False, True) if i % 2 == 0 else (True, False))]))
def test_kernel_lowers_for_cuda(monkeypatch, causal, window, segments, pingpong, d, t, s, hkv,
                                softcap, overlap, semantics):
  """Builds the Mosaic GPU kernel (no GPU needed): catches API drift between jax releases.
  Each case with and without overlap, one under each lowering (the GPU image's jax 0.11
  lowers with warpgroup semantics, this jax with lane semantics). Above D = 128 the lazy
  rescale's branch is taken per warp, by a ballot."""
  _lower_with(monkeypatch, semantics)
  config = dataclasses.replace(MosaicConfig.for_head_dim(d), pingpong=pingpong and not overlap,
                               overlap=overlap)
  opts = _opts(causal, window, segments, softcap)
  text = _forward_lowered_for_cuda(opts, config, t, s, hkv, d, segments)
  assert _MOSAIC_CALL.search(text)
  assert ("vote.sync.ballot" in text) == config.lazy_rescale == (d > 128)


@pytest.mark.parametrize(
    "causal, window, segments, d, overlap, num_sms, t, s, hkv, dynamic, semantics",
    _alternating_lowerings([
    (False, None, False, 128, True, None, 256, 512, 4, False),
    (True, None, False, 128, True, 5, 512, 384, 2, False),
    (True, None, False, 64, False, 3, 256, 256, 1, False),
    (False, (100, 7), False, 128, False, 7, 512, 384, 2, False),
    (True, 300, True, 128, True, 4, 512, 512, 4, False),
    # D = 256: the persistent output's buffer leaves one K/V slot, which only the overlap's
    # separate rings can walk (support_error refuses ping-pong there)
    (False, None, True, 256, True, 2, 256, 384, 1, False),
    (True, None, True, 128, False, 5, 512, 512, 4, True),
    (True, None, False, 128, True, 3, 512, 384, 2, True),
    (True, None, False, 128, False, 4, 512, 640, 2, True)]))  # Q loaded in the last step
def test_persistent_forward_lowers_for_cuda(monkeypatch, causal, window, segments, d, overlap,
                                            num_sms, t, s, hkv, dynamic, semantics):
  """MosaicConfig(persistent=True): a CTA per SM looping over the query tiles its schedule
  deals it, each case under one of the two lowerings."""
  _lower_with(monkeypatch, semantics)
  config = dataclasses.replace(MosaicConfig.for_head_dim(d), pingpong=not overlap,
                               overlap=overlap, persistent=True, num_sms=num_sms,
                               dynamic=dynamic)
  opts = _opts(causal, window, segments)
  assert pm.support_error((2, t, 4, d), (2, s, hkv, d), BF16, opts, config) is None
  assert _MOSAIC_CALL.search(_forward_lowered_for_cuda(opts, config, t, s, hkv, d, segments))


@pytest.mark.parametrize("causal, d, group", [(True, 128, 8), (True, 256, 1), (False, 128, 1)])
def test_forward_interleaves_heads_under_a_causal_mask_but_at_d256(monkeypatch, causal, d,
                                                                   group):
  """The forward's launch order: B·H = 8 heads of 2 query CTAs each interleaved 8 at a time
  (the fewest filling 132 SMs, at most all) under a causal mask, head by head without one
  and at D = 256 (measured slower there)."""
  groups = []
  at = _mosaic.query_cta_at
  monkeypatch.setattr(_mosaic, "query_cta_at",
                      lambda *args: groups.append(args[3]) or at(*args))
  config = MosaicConfig.for_head_dim(d)
  _forward_lowered_for_cuda(_opts(causal, None, False), config, 256, 256, 4, d, False)
  assert groups and set(groups) == {group}


@pytest.mark.parametrize("persistent, dynamic, semantics", _alternating_lowerings(
    [(False, False), (True, False), (True, True)]))
def test_forward_lowers_with_a_last_head_group_short(monkeypatch, persistent, dynamic,
                                                     semantics):
  """Heads interleaved 3 at a time over B·H = 8 heads: the last group has 2, which the
  launch order computes in the kernel (_mosaic.query_cta_at)."""
  _lower_with(monkeypatch, semantics)
  monkeypatch.setattr(_mosaic, "interleaved_heads", lambda *args: 3)
  config = dataclasses.replace(MosaicConfig.for_head_dim(128), persistent=persistent,
                               dynamic=dynamic, num_sms=5 if persistent else None)
  opts = _opts(True, None, False)
  assert _MOSAIC_CALL.search(_forward_lowered_for_cuda(opts, config, 512, 512, 4, 128, False))


_BACKWARD_CASES = [
    (False, None, False, 128, True, False, 2, 256, 384, 2),
    (True, None, False, 128, True, False, 2, 384, 256, 4),
    (True, None, False, 128, False, True, 2, 256, 512, 1),
    (False, None, False, 64, False, False, 3, 192, 256, 4),
    (False, (100, 7), False, 128, False, True, 2, 384, 256, 2),
    (True, 200, True, 128, True, False, 2, 256, 384, 4),
    (False, None, True, 64, False, False, 2, 192, 256, 1),
    (True, None, False, 256, False, False, 1, 256, 320, 2),
    (False, (100, 7), True, 256, False, True, 1, 192, 256, 1),
    (True, None, False, 64, True, False, 2, 256, 256, 2),
    (False, (100, 7), True, 64, True, False, 3, 192, 256, 1)]


# Each case with and without gqa_per_query_head (which excludes dq_split), a softcap on one.
@pytest.mark.parametrize(
    "causal, window, segments, d, dq_split, pingpong, stages, t, s, hkv, softcap, per_query_head",
    [(*case, 30.0 if (i + per_query_head) % 2 else None, per_query_head)
     for i, case in enumerate(_BACKWARD_CASES) for per_query_head in (False, True)
     if not (per_query_head and case[4])])
def test_backward_kernel_lowers_for_cuda(causal, window, segments, d, dq_split, pingpong, stages,
                                         t, s, hkv, softcap, per_query_head):
  config = mb.MosaicBackwardConfig(dq_split=dq_split, pingpong=pingpong, stages=stages,
                                   gqa_per_query_head=per_query_head, column_split=d == 256)
  opts = _opts(causal, window, segments, softcap)
  assert _MOSAIC_CALL.search(_backward_lowered_for_cuda(opts, config, t, s, hkv, d, segments))


@pytest.mark.parametrize("q_shape, k_shape, dtype, opts, config, match", [
    ((1, 256, 4, 72), (1, 256, 4, 72), BF16, _opts(), mb.MosaicBackwardConfig(), "D=72"),
    ((1, 256, 4, 80), (1, 256, 4, 80), BF16, _opts(), mb.MosaicBackwardConfig(),
     "dq_split needs D a multiple of 32"),
    ((1, 256, 4, 256), (1, 256, 4, 256), BF16, _opts(), mb.MosaicBackwardConfig(), "D=256"),
    ((1, 256, 4, 192), (1, 256, 4, 192), BF16, _opts(), mb.MosaicBackwardConfig(),
     "D=192 needs column_split"),
    ((1, 256, 4, 160), (1, 256, 4, 160), BF16, _opts(), mb.MosaicBackwardConfig(),
     "D=160 needs column_split"),
    ((1, 256, 4, 192), (1, 256, 4, 192), BF16, _opts(),
     mb.MosaicBackwardConfig(dq_split=False, with_dq=False), "D=192 with block_q ≤ 32"),
    ((1, 256, 4, 224), (1, 256, 4, 224), BF16, _opts(),
     mb.MosaicBackwardConfig(dq_split=False, with_dq=False, block_q=32),
     "D=224 needs column_split"),
    ((1, 256, 4, 176), (1, 256, 4, 176), BF16, _opts(),
     mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1), "D=176"),
    ((1, 256, 4, 112), (1, 256, 4, 112), BF16, _opts(), mb.MosaicBackwardConfig(),
     "dq_split needs D a multiple of 32"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(),
     mb.MosaicBackwardConfig(dq_split=False, column_split=True),
     "column_split serves D over 128, got D=128"),
    ((1, 256, 4, 256), (1, 256, 4, 256), BF16, _opts(),
     mb.MosaicBackwardConfig(column_split=True, stages=1), "exclude"),
    ((1, 256, 4, 256), (1, 256, 4, 256), BF16, _opts(),
     mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=2), "shared memory"),
    ((1, 96, 4, 128), (1, 256, 4, 128), BF16, _opts(), mb.MosaicBackwardConfig(), "T=96"),
    ((1, 256, 4, 128), (1, 192, 4, 128), BF16, _opts(), mb.MosaicBackwardConfig(), "S=192"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(),
     mb.MosaicBackwardConfig(stages=3, dq_split=False), "shared memory"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(), mb.MosaicBackwardConfig(pingpong=True),
     "exclude"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(), mb.MosaicBackwardConfig(stages=0),
     "one stage"),
    ((1, 256, 4, 128), (1, 256, 2, 128), BF16, _opts(),
     mb.MosaicBackwardConfig(gqa_per_query_head=True), "exclude"),
    ((1, 256, 4, 128), (1, 256, 2, 128), BF16, _opts(),
     mb.MosaicBackwardConfig(group_splits=0), "group_splits must be at least 1"),
    ((1, 256, 4, 128), (1, 256, 2, 128), BF16, _opts(),
     mb.MosaicBackwardConfig(dq_ordered=True, gqa_per_query_head=True, group_splits=2),
     "group_splits and gqa_per_query_head exclude"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(),
     mb.MosaicBackwardConfig(dq_split=False, block_q=80), "block_q=80 needs with_dq=False"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(),
     mb.MosaicBackwardConfig(dq_split=False, block_q=72, with_dq=False), "64, 80, 96 or 128"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(),
     mb.MosaicBackwardConfig(block_q=128), "block_q=128 needs D ≤ 64"),
    ((1, 256, 4, 96), (1, 256, 4, 96), BF16, _opts(),
     mb.MosaicBackwardConfig(dq_split=False, with_dq=False, block_q=128), "80 without dq"),
    ((1, 256, 4, 64), (1, 256, 4, 64), BF16, _opts(),
     mb.MosaicBackwardConfig(dq_split=False, dq_ordered=True), "dq_ordered needs"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(),
     mb.MosaicBackwardConfig(dq_split=False, with_dq=False, dq_ordered=True), "dq_ordered needs"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(),
     mb.MosaicBackwardConfig(dq_rotate=True), "belong to dq_ordered"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(),
     mb.MosaicBackwardConfig(dq_buffers=2), "belong to dq_ordered"),
    ((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(),
     mb.MosaicBackwardConfig(dq_ordered=True, dq_buffers=3), "dq_buffers must be 1 or 2"),
    ((1, 256, 4, 256), (1, 256, 4, 256), BF16, _opts(),
     mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1, dq_ordered=True,
                             dq_buffers=2),
     "shared memory"),
])
def test_backward_support_error_names_what_is_not_served(q_shape, k_shape, dtype, opts, config,
                                                         match):
  assert re.search(match, mb.support_error(q_shape, k_shape, dtype, opts, config))


@pytest.mark.parametrize("causal, window, segments, softcap, pingpong, block_q, t, s, hkv, d", [
    (False, None, False, None, True, 80, 256, 384, 2, 128),  # 256 = 3·80 + 16: ragged last step
    (True, None, False, 30.0, False, 80, 384, 256, 4, 128),
    (False, (100, 7), True, None, True, 80, 192, 256, 1, 128),
    (True, 200, True, None, False, 96, 256, 384, 2, 128),
    (False, None, False, None, False, 96, 384, 256, 1, 128),
    (True, None, False, None, False, 96, 256, 384, 1, 64),  # d64_causal_dkv
    (True, None, True, None, False, 96, 384, 256, 2, 64),
    (True, None, False, None, False, 128, 320, 256, 2, 80),  # d80_dkv
    (False, (100, 7), True, None, False, 128, 256, 384, 1, 48)])  # d48_dkv
def test_wide_step_dkv_kernel_lowers_for_cuda(causal, window, segments, softcap, pingpong, block_q,
                                              t, s, hkv, d):
  """The dK/dV-only kernel with block_q query rows per step, T not a multiple of it."""
  config = mb.MosaicBackwardConfig(dq_split=False, pingpong=pingpong, block_q=block_q,
                                   with_dq=False)
  assert mb.support_error((2, t, 4, d), (2, s, hkv, d), BF16, _opts(causal), config) is None
  opts = _opts(causal, window, segments, softcap)
  assert _MOSAIC_CALL.search(_backward_lowered_for_cuda(opts, config, t, s, hkv, d, segments))


@pytest.mark.parametrize("causal, window, segments, softcap, stages, t, s, hkv, d", [
    (False, None, False, None, 2, 256, 384, 2, 160),
    (True, None, True, 30.0, 2, 384, 256, 4, 160),
    (False, (100, 7), True, None, 3, 192, 256, 1, 160),
    (True, 200, False, None, 3, 256, 512, 4, 160),
    (False, None, True, None, 2, 256, 384, 2, 192),
    (True, (100, 7), False, 30.0, 2, 384, 256, 1, 192),
    (True, None, True, None, 3, 192, 256, 4, 192)])
def test_full_width_dkv_kernel_lowers_for_cuda(causal, window, segments, softcap, stages, t, s,
                                               hkv, d):
  """D = 160 and 192 without dq: each warpgroup's 64 keys keep dK and dV at full width, at
  D = 192 beside score tiles of 32 query rows."""
  config = mb.MosaicBackwardConfig(dq_split=False, stages=stages, with_dq=False,
                                   block_q=mb.FULL_WIDTH_BLOCK_Q[d])
  assert mb.support_error((2, t, 4, d), (2, s, hkv, d), BF16, _opts(causal), config) is None
  opts = _opts(causal, window, segments, softcap)
  assert _MOSAIC_CALL.search(_backward_lowered_for_cuda(opts, config, t, s, hkv, d, segments))


@pytest.mark.parametrize("causal, window, segments, d, t, s, hkv, buffers", [
    (False, None, False, 128, 256, 384, 2, 1),
    (True, None, False, 128, 384, 256, 4, 1),
    (False, (100, 7), True, 128, 256, 512, 1, 1),
    (True, 200, True, 256, 256, 384, 2, 1),
    (False, None, False, 128, 256, 384, 2, 2),
    (True, None, True, 128, 384, 256, 4, 1),
    (False, (100, 7), False, 128, 256, 512, 1, 2),
    (True, None, False, 256, 256, 384, 2, 1),
    (True, None, False, 64, 256, 256, 2, 2),
    (False, (100, 7), True, 64, 256, 384, 1, 1),
    (True, None, False, 64, 320, 256, 2, -2),  # 128-query steps, the last one ragged
    (False, None, False, 64, 256, 384, 1, -1),
    (False, (100, 7), True, 64, 192, 384, 4, -1)])
def test_ordered_backward_lowers_for_cuda(causal, window, segments, d, t, s, hkv, buffers):
  """dq_ordered: the reductions wait on counters in global memory and release them, sent
  by a warp of their own, from one or two dQ tile slots (negative: on 128-query steps);
  without segment ids the program computes no rank table per call."""
  config = mb.MosaicBackwardConfig(dq_split=d != 256, column_split=d == 256,
                                   stages=2 - (d == 256), dq_ordered=True,
                                   dq_buffers=abs(buffers), block_q=128 if buffers < 0 else 64)
  opts = _opts(causal, window, segments)
  assert mb.support_error((2, t, 4, d), (2, s, hkv, d), BF16, opts, config) is None
  text = _backward_lowered_for_cuda(opts, config, t, s, hkv, d, segments)
  assert _MOSAIC_CALL.search(text)
  assert "red.release.gpu" in text and "ld.relaxed.gpu" in text  # signal, and wait
  if not segments:  # the rank table is a constant of the program, not computed per call
    assert "stablehlo.iota" not in text and "reduce_window" not in text


@pytest.mark.parametrize("d", [128, 96])
@pytest.mark.parametrize("hkv", [4, 1])
@pytest.mark.parametrize("segments", [False, True])
def test_long_walk_sections_lower_for_cuda(hkv, segments, d):
  """The `_long` sections of causal calls (staggered warpgroups; at D = 128 one dQ slot and
  no stagger beside segment ids), lowered at a short length: the sections
  change the step, not the walk. D = 96 runs D = 128's sections."""
  config = mb.MosaicBackwardConfig.for_deterministic(d, True, hkv == 1,
                                                     t=mb.long_walk_queries(d))
  config = mb.fit_shared_memory(config, d, BF16, segments)
  # the second dQ slot, which the stagger needs, fits beside segment ids only below D = 128
  assert config.dq_stagger == (not segments or d < 128)
  opts = _opts(True, None, segments)
  assert mb.support_error((2, 512, 4, d), (2, 512, hkv, d), BF16, opts, config) is None
  text = _backward_lowered_for_cuda(opts, config, 512, 512, hkv, d, segments)
  assert _MOSAIC_CALL.search(text) and "red.release.gpu" in text


def test_split_group_fills_the_gpu_where_key_blocks_are_few():
  """Splits per key head where one CTA per key block and key head leaves SMs idle: under a
  causal band enough for UNEVEN_SPLIT_WAVES waves, else the fewest that take the fewest
  waves × heads per CTA; the table's own splits are a least, and at most the group."""
  dkv = mb.MosaicBackwardConfig(dq_split=False, with_dq=False)
  split = lambda config, b, hq, hkv, s, uneven: mb.split_group(config, b, hq, hkv, s, uneven,
                                                              sms=132).group_splits
  # B4 T2048 H71/1 (64 key blocks of 128): 17 splits of 4 or 5 heads make 1,088 CTAs.
  assert split(dkv, 4, 71, 1, 2048, True) == -(-mb.UNEVEN_SPLIT_WAVES * 132 // 64) == 17
  # Non-causal H32/1: 2 splits are one wave of 128 CTAs, 16 heads each (3 would be 2 waves).
  assert split(dkv, 2, 32, 1, 4096, False) == 2
  assert split(dkv, 4, 32, 8, 4096, True) == 1  # 1,024 CTAs: as it is
  assert split(dkv, 1, 4, 4, 256, True) == 1  # no group to split
  assert split(dkv, 1, 2, 1, 256, True) == 2  # at most one CTA per query head
  per_head = dataclasses.replace(dkv, gqa_per_query_head=True, with_dq=True)
  assert mb.split_group(per_head, 1, 71, 1, 256, True) == per_head  # float32 adds
  table = mb.MosaicBackwardConfig.for_deterministic(256, True, True, t=8192, s=8192)
  assert table.group_splits == 8 and not table.gqa_per_query_head
  assert split(table, 2, 8, 4, 8192, True) == 2  # B2 H8/4: 1,024 CTAs, the table's 8 cut to 2


@pytest.mark.parametrize("t", [1024, mb.LONG_WALK_QUERIES])
@pytest.mark.parametrize("hq, hkv", [(32, 8), (8, 2), (32, 4), (48, 1)])
def test_large_groups_store_shares_of_dk_dv_as_partials(t, hq, hkv):
  """Causal GQA's ordered kernel, one CTA per query head, adds each head's share of dK and
  dV into the outputs in order up to ORDERED_SHARES_MAX_GROUP heads per key head; larger
  groups store them as partials, one split per query head."""
  config = mb.MosaicBackwardConfig.for_deterministic(128, True, True, t=t, s=t)
  assert config.gqa_per_query_head and config.dq_ordered
  split = mb.split_group(config, 1, hq, hkv, t, True, sms=132)
  group = hq // hkv
  if group <= mb.ORDERED_SHARES_MAX_GROUP:
    assert split == config
  else:
    assert split == dataclasses.replace(config, gqa_per_query_head=False, group_splits=group)
    assert mb.support_error((1, t, hq, 128), (1, t, hkv, 128), BF16, _opts(True, None, False),
                            split) is None


@pytest.mark.parametrize("config, causal, segments, d, hkv", [
    (mb.MosaicBackwardConfig(dq_split=False, with_dq=False, block_q=96), True, False, 64, 1),
    (mb.MosaicBackwardConfig(dq_split=False, with_dq=False), False, True, 128, 2),
    (mb.MosaicBackwardConfig(dq_ordered=True, dq_buffers=2, dq_rotate=True), False, False, 128,
     1),
    (mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1, scores_split=True,
                             dq_ordered=True, dq_heavy_first=True), True, False, 256, 1)])
@pytest.mark.parametrize("splits", [2, 3])
def test_group_splits_lower_for_cuda(config, causal, segments, d, hkv, splits):
  """group_splits: the kernel stores [splits, B, S, Hkv, D] partials of dK and dV (shares of
  1 and 2 query heads where 3 splits cut a group of 4), which the backward sums to dK, dV."""
  if splits > 4 // hkv:
    pytest.skip("more splits than query heads per key head")
  opts = _opts(causal, None, segments)
  config = dataclasses.replace(config, group_splits=splits)
  assert mb.support_error((2, 384, 4, d), (2, 512, hkv, d), BF16, opts, config) is None
  text = _backward_lowered_for_cuda(opts, config, 384, 512, hkv, d, segments)
  call = next(line for line in text.splitlines() if _MOSAIC_CALL.search(line))
  assert call.split("->")[-1].count(f"tensor<{splits}x2x512x{hkv}x{d}xbf16>") == 2


@pytest.mark.parametrize("causal, window, segments, t, s, hkv, d, semantics",
                         _alternating_lowerings([
    (True, None, False, 512, 512, 1, 128),
    (True, None, False, 512, 512, 2, 128),
    (True, None, False, 512, 384, 2, 128),
    (False, (100, 7), True, 384, 512, 1, 128),
    (True, 200, True, 512, 512, 2, 128),      # segment ids: one dQ slot
    (True, None, False, 512, 512, 2, 64),     # three Q/dO stages, 64-byte swizzles
    (True, None, False, 512, 512, 2, 256),    # column split, split scores
    (True, 200, True, 384, 512, 1, 256)]))    # ... whole scores beside segment ids
def test_ordered_query_head_ctas_lower_for_cuda(monkeypatch, causal, window, segments, t, s,
                                                hkv, d, semantics):
  """gqa_per_query_head with dq_ordered: one CTA per query head adds that head's share of
  dK and dV into the [B, S, Hkv, D] outputs in the group's order (counters waited on and
  released); at every head dim the one-pass kernel serves."""
  _lower_with(monkeypatch, semantics)
  opts = _opts(causal, window, segments)
  if d == 256:
    config = mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1,
                                     scores_split=True, dq_heavy_first=True)
  else:
    config = mb.MosaicBackwardConfig(dq_buffers=2, stages=3 if d == 64 else 2)
  config = mb.fit_shared_memory(dataclasses.replace(config, dq_ordered=True,
                                                    gqa_per_query_head=True), d, BF16, segments)
  assert mb.support_error((2, t, 4, d), (2, s, hkv, d), BF16, opts, config) is None
  text = _backward_lowered_for_cuda(opts, config, t, s, hkv, d, segments)
  call = next(line for line in text.splitlines() if _MOSAIC_CALL.search(line))
  results = call.split("->")[-1]
  assert results.count(f"tensor<2x{s}x{hkv}x{d}xbf16>") == 2  # dK and dV, added into
  assert f"x{hkv}x{d}xf32>" not in results  # no float32 accumulators
  assert "red.release.gpu" in text


@pytest.mark.parametrize("causal, window, segments, softcap, ordered, t, s, hkv, semantics",
                         _alternating_lowerings([
    (True, None, False, None, True, 512, 512, 4),
    (False, None, False, 20.0, True, 256, 384, 2),
    (True, 200, False, None, True, 384, 256, 1),
    (False, (100, 7), False, None, False, 256, 512, 2),
    (True, None, False, 30.0, False, 512, 384, 4)]))
def test_split_scores_lower_for_cuda(monkeypatch, causal, window, segments, softcap, ordered, t,
                                     s, hkv, semantics):
  """scores_split (D = 256): each warpgroup computes Sᵀ and dPᵀ for half of the step's
  queries and writes its halves of Pᵀ and dSᵀ as columns of shared slots (64-byte swizzles),
  where dV, dK and dQ read them."""
  _lower_with(monkeypatch, semantics)
  config = mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1,
                                   scores_split=True, dq_ordered=ordered,
                                   dq_heavy_first=ordered and causal)
  opts = dataclasses.replace(_opts(causal, window, segments), logit_softcap=softcap)
  assert mb.support_error((2, t, 4, 256), (2, s, hkv, 256), BF16, opts, config) is None
  text = _backward_lowered_for_cuda(opts, config, t, s, hkv, 256, segments)
  assert _MOSAIC_CALL.search(text)


def test_split_scores_support_errors():
  why = lambda **kw: mb.support_error((1, 256, 4, 256), (1, 256, 4, 256), BF16, _opts(),
                                      mb.MosaicBackwardConfig(**kw))
  d256 = dict(dq_split=False, column_split=True, stages=1, scores_split=True)
  assert why(**d256) is None
  assert "scores_split needs" in why(**{**d256, "pingpong": True})
  assert "scores_split needs" in mb.support_error(  # D = 128's dq_split kernel
      (1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(), mb.MosaicBackwardConfig(scores_split=True))
  assert "scores_split needs" in why(**{**d256, "with_dq": False})
  config = mb.MosaicBackwardConfig(**d256)  # beside segment ids, the kernel without it
  assert "segment ids" in mb.support_error((1, 256, 4, 256), (1, 256, 4, 256), BF16,
                                           _opts(segments=True), config)
  assert mb.fit_shared_memory(config, 256, BF16, segments=True) == dataclasses.replace(
      config, scores_split=False)
  assert mb.fit_shared_memory(config, 256, BF16, segments=False) == config


@pytest.mark.parametrize("buffers", [2, 1])
@pytest.mark.parametrize("hkv", [4, 1])
def test_rotated_backward_lowers_for_cuda(buffers, hkv):
  """dq_rotate: the rotated walks (no mask; GQA's CTA loops over its query heads)."""
  config = mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, dq_buffers=buffers,
                                   dq_rotate=True)
  opts = _opts()
  assert mb.support_error((2, 512, 4, 128), (2, 384, hkv, 128), BF16, opts, config) is None
  assert mb._rotates(config, opts.mask, 3)  # pylint: disable=protected-access
  text = _backward_lowered_for_cuda(opts, config, 512, 384, hkv, 128, False)
  assert _MOSAIC_CALL.search(text) and "red.release.gpu" in text


@pytest.mark.parametrize("causal, window, segments, rotate", [
    (True, None, True, False),
    (False, (100, 7), False, False),
    (True, 200, True, False),
    (False, None, False, True)])
def test_warps_lower_under_warpgroup_semantics(monkeypatch, causal, window, segments, rotate):
  """The memory warpgroup's per-warp code (loads, dq sends) under the warpgroup lowering
  that the GPU image's jax (0.11) runs: its warps have no lowering for selects, clamps,
  negations or boolean nots, which the lane lowering (this jax's default) accepts."""
  _lower_with(monkeypatch, "Warpgroup")
  config = mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, dq_buffers=1 + (not segments),
                                   dq_rotate=rotate)
  opts = _opts(causal, window, segments)
  assert mb.support_error((2, 512, 4, 128), (2, 384, 2, 128), BF16, opts, config) is None
  assert _MOSAIC_CALL.search(_backward_lowered_for_cuda(opts, config, 512, 384, 2, 128, segments))


@pytest.mark.parametrize("causal, window, segments, ordered, rotate, softcap, d, semantics",
                         _alternating_lowerings([
    (False, None, False, True, True, None, 128),
    (True, None, False, True, False, 30.0, 128),
    (False, (100, 7), True, True, False, None, 128),
    (False, None, False, False, False, None, 128),
    (True, 200, True, False, False, None, 128),
    (False, None, False, True, True, None, 64),
    (True, None, False, False, False, None, 64)]))
def test_staggered_backward_lowers_for_cuda(monkeypatch, causal, window, segments, ordered,
                                            rotate, softcap, d, semantics):
  """dq_stagger: warpgroup 0 issues the last step's dQ with its step's dV and dK (and the
  key block's last at its end), in arrival order and ordered."""
  _lower_with(monkeypatch, semantics)
  config = mb.MosaicBackwardConfig(dq_split=True, dq_ordered=ordered,
                                   dq_buffers=1 + (ordered and not segments), dq_rotate=rotate,
                                   dq_stagger=True)
  opts = dataclasses.replace(_opts(causal, window, segments), logit_softcap=softcap)
  assert mb.support_error((2, 512, 4, d), (2, 384, 2, d), BF16, opts, config) is None
  text = _backward_lowered_for_cuda(opts, config, 512, 384, 2, d, segments)
  assert _MOSAIC_CALL.search(text)


def test_stagger_support_errors():
  why = lambda **kw: mb.support_error((1, 256, 4, 128), (1, 256, 4, 128), BF16, _opts(),
                                      mb.MosaicBackwardConfig(dq_split=True, **kw))
  assert why(dq_stagger=True) is None
  assert why(dq_stagger=True, dq_ordered=True, dq_buffers=2) is None
  assert "dq_stagger needs" in mb.support_error(
      (1, 256, 4, 64), (1, 256, 4, 64), BF16, _opts(),
      mb.MosaicBackwardConfig(dq_split=False, dq_stagger=True))


_HAND_OFFS = [
    dict(dq_ordered=True, dq_buffers=2, dq_rotate=True, dq_stagger=True),
    dict(dq_ordered=True, dq_buffers=2),
    dict(dq_stagger=True),
    dict()]


@pytest.mark.parametrize("fields, semantics", _alternating_lowerings([(f,) for f in _HAND_OFFS]),
                         ids=["stagger", "ordered", "arrival_stagger", "dq_split"])
def test_hand_offs_fence_per_thread(monkeypatch, fields, semantics):
  """The dSᵀ and dQ hand-offs of dq_split fence per thread (the kernel carries the inline
  fence), two under each lowering; a kernel without hand-offs carries none."""
  _lower_with(monkeypatch, semantics)
  opts = _opts(causal="dq_rotate" not in fields)
  config = mb.MosaicBackwardConfig(dq_split=True, **fields)
  assert mb.support_error((2, 512, 4, 128), (2, 512, 4, 128), BF16, opts, config) is None
  text = _backward_lowered_for_cuda(opts, config, 512, 512, 4, 128, False)
  assert _MOSAIC_CALL.search(text) and "fence.proxy.async.shared::cta;" in text
  no_handoff = mb.MosaicBackwardConfig(dq_split=False, with_dq=False)
  text = _backward_lowered_for_cuda(opts, no_handoff, 512, 512, 4, 64, False)
  assert _MOSAIC_CALL.search(text) and "fence.proxy.async.shared::cta;" not in text


def test_ctas_end_once_their_stores_have_read_shared_memory(monkeypatch):
  """The forward, the dq kernel and the backward in arrival order wait on their TMA stores
  only until those have read shared memory (the kernel's end makes the writes visible):
  a wait for the landing would hold the SM from its next CTA. Only dq_ordered's
  reductions, which the next key block's must follow, wait for theirs to land."""
  monkeypatch.setattr(pm, "hopper_available", lambda: None)  # choose as on an H100
  waits = []
  real = mb.plgpu.wait_smem_to_gmem
  monkeypatch.setattr(mb.plgpu, "wait_smem_to_gmem", lambda n, wait_read_only=False: (
      waits.append(wait_read_only), real(n, wait_read_only=wait_read_only))[1])
  opts = _opts(True)
  q = jax.ShapeDtypeStruct((1, 256, 4, 128), BF16)
  k = jax.ShapeDtypeStruct((1, 256, 2, 128), BF16)
  lower = lambda f, *args: jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  st = pm._Static(opts, MosaicConfig.for_head_dim(128), None, None)  # pylint: disable=protected-access
  lower(functools.partial(pm._forward, st), q, k, k, None, None)  # pylint: disable=protected-access
  res = Residuals(q, k, k, None, None, q, jax.ShapeDtypeStruct((1, 4, 256), jnp.float32))
  for config in (mb.MosaicBackwardConfig(dq_split=True),
                 mb.MosaicBackwardConfig(dq_split=False, pingpong=True, with_dq=False)):
    lower(lambda res, d_out, d_lse, c=config: mb.backward(opts, c, res, (d_out, d_lse))[:3],
          res, q, res.lse)
  det = dataclasses.replace(opts, deterministic=True)
  pair = PallasMosaicGpu(backward_config=mb.MosaicBackwardConfig(
      dq_split=False, pingpong=True, with_dq=False), dq_config=MosaicDqConfig())
  st = pair._static(q, k, det)  # pylint: disable=protected-access
  lower(lambda res, d_out, d_lse: pm._backward(st, res, (d_out, d_lse))[:3], res, q, res.lse)  # pylint: disable=protected-access
  assert waits and all(waits), waits
  waits.clear()
  ordered = mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True)
  lower(lambda res, d_out, d_lse: mb.backward(opts, ordered, res, (d_out, d_lse))[:3],
        res, q, res.lse)
  assert waits.count(False) == 1, waits  # the reductions' landing, before the counter


@pytest.mark.parametrize("steps, ctas", [([5] * 12, 5), ([64 - 2 * j for j in range(32)] * 8, 13),
                                         ([3, 0, 9, 1, 1, 7, 2], 3), ([4, 4], 2)])
def test_persistent_schedule_deals_each_block_once_in_launch_order(steps, ctas):
  """Every work item goes to one CTA; each CTA's items come in launch order (an item only
  waits on earlier ones); no CTA's estimate ends a block later than another CTA could have
  started it (greedy list scheduling)."""
  overhead = 4
  table, counts = (np.asarray(x) for x in hopper.greedy_schedule(steps, ctas, overhead))
  assert table.shape[0] == ctas and counts.sum() == len(steps)
  dealt = [list(table[c, :counts[c]]) for c in range(ctas)]
  assert sorted(i for x in dealt for i in x) == list(range(len(steps)))
  assert all(x == sorted(x) for x in dealt)
  cost = lambda x: sum(steps[i] + overhead for i in x)
  ends = [cost(x) for x in dealt]
  assert max(ends) - min(ends) <= max(steps) + overhead


@pytest.mark.parametrize("heads, n_ctas, group", [(128, 32, 8), (512, 8, 32), (32, 128, 2),
                                                   (30, 24, 8), (3, 8, 3), (7, 300, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_forward_launch_order_takes_each_tile_once_heaviest_first(heads, n_ctas, group, causal):
  """interleaved_heads takes the fewest heads (a power of two, at most all) whose CTAs fill
  132 SMs, under a causal mask only; query_cta_at then lists every (head, query CTA) once,
  each group's heads together, their CTAs heaviest (last query rows) first."""
  mask = MaskSpec.make(causal, None, False)
  got = _mosaic.interleaved_heads(mask, heads, n_ctas, 132)
  assert got == (group if causal else 1)
  head, qi = (np.asarray(x) for x in _mosaic.query_cta_at(
      mask, heads, n_ctas, got, jnp.arange(heads * n_ctas, dtype=jnp.int32)))
  assert sorted(zip(head.tolist(), qi.tolist())) == [
      (h, i) for h in range(heads) for i in range(n_ctas)]
  first = head // got * got
  assert np.all(np.diff(first) >= 0)  # group after group
  for g in np.unique(first):  # heaviest first within a group, its heads in turn
    rows = qi[first == g]
    assert np.all(np.diff(rows) <= 0) if causal else np.array_equal(
        rows, np.tile(np.arange(n_ctas), len(rows) // n_ctas))


@pytest.mark.parametrize("order", ["sorted", "random"])
@pytest.mark.parametrize("block, other_block", [(64, 128), (128, 64)])
def test_segment_block_ranges_against_every_pair(order, block, other_block):
  """Per block, [lo, hi) holds every block of the other axis sharing an id with it, and
  [full_lo, full_hi) ⊆ [lo, hi) only blocks whose every pair shares one (no mask); with
  packed documents (sorted ids) both are exact."""
  n, m = 1024, 768
  key = jax.random.key(11)
  # ids in runs of 64 tokens, so that some blocks hold one id even out of order
  ids, other = (jnp.repeat(jax.random.randint(k, (3, size // 64), 0, 3), 64, axis=1)
                for k, size in zip(jax.random.split(key), (n, m)))
  if order == "sorted":
    ids, other = jnp.sort(ids, -1), jnp.sort(other, -1)
    other = other.at[1].set(ids[1, :m])  # a row of equal documents on both axes
  ids = ids.at[2, -128:].set(5)  # a document the other axis lacks: blocks that meet none
  ranges = np.asarray(_mosaic.segment_block_ranges(ids, other, block, other_block))
  assert ranges.shape == (3, n // block, 4)
  mine = np.asarray(ids).reshape(3, n // block, 1, block, 1)
  theirs = np.asarray(other).reshape(3, 1, m // other_block, 1, other_block)
  pairs = mine == theirs
  meets, whole = pairs.any((-2, -1)), pairs.all((-2, -1))
  assert whole.any() and (~whole & meets).any()
  blocks = m // other_block
  assert (~meets.any(-1)).any()
  for b in range(3):
    for i in range(n // block):
      lo, hi, full_lo, full_hi = (int(x) for x in _mosaic.segment_bounds(
          (0, blocks, 0, blocks), ranges[b, i]))
      met, full = np.flatnonzero(meets[b, i]), np.flatnonzero(whole[b, i])
      assert lo <= full_lo <= full_hi <= hi
      assert all(lo <= j < hi for j in met)
      assert all(whole[b, i, j] for j in range(full_lo, full_hi))
      if order == "sorted":
        assert (lo, hi) == ((met[0], met[-1] + 1) if met.size else (blocks, blocks))
        assert list(range(full_lo, full_hi)) == list(full)


@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (False, (300, 7)),
                                            (True, 300)])
def test_kernels_leave_unmasked_only_blocks_seen_whole(causal, window):
  """With segment ids, the blocks the kernels visit (the forward's and dq kernel's key
  blocks per query block, the backward's query blocks per key block) hold every visible
  pair, and those they run unmasked are visible whole: the band's bounds met with
  segment_block_ranges'."""
  t, bq, bkv, cta_keys = 1024, 64, 128, 128
  mask = MaskSpec.make(causal, window, True)
  lengths = [[300, 600, 124], [1024], [64, 448, 512]]  # documents per row
  ids = jnp.asarray([np.repeat(np.arange(len(x)), x) for x in lengths], jnp.int32)
  pos = jnp.arange(t)
  seen = np.asarray(jax.vmap(lambda i: masks.visible(mask, pos, pos, i, i))(ids))  # [B, T, S]
  fwd = pm._mosaic.segment_block_ranges(ids, ids, bq, bkv)  # pylint: disable=protected-access
  bwd = pm._mosaic.segment_block_ranges(ids, ids, cta_keys, bq)  # pylint: disable=protected-access
  whole_blocks = 0
  for b in range(len(lengths)):
    tiles = lambda r, c: seen[b, r * bq:(r + 1) * bq, c * bkv:(c + 1) * bkv]
    for qi in range(t // (2 * bq)):
      per_block, _, _ = pm._mosaic.query_cta_key_blocks(mask, fwd, b, qi, bq, bkv, t // bkv)  # pylint: disable=protected-access
      for w, (lo, hi, full_lo, full_hi) in enumerate(per_block):
        for j in range(t // bkv):
          tile = tiles(2 * qi + w, j)
          assert not tile.any() or lo <= j < hi
          assert tile.all() or not full_lo <= j < full_hi
          whole_blocks += int(full_lo <= j < full_hi)
    for kvi in range(t // cta_keys):
      first, last, full_lo, full_hi = mb._query_blocks(  # pylint: disable=protected-access
          mask, kvi * cta_keys, cta_keys, t // bq, bq, [bwd[b, kvi, i] for i in range(4)])
      for qb in range(t // bq):
        tile = seen[b, qb * bq:(qb + 1) * bq, kvi * cta_keys:(kvi + 1) * cta_keys]
        assert not tile.any() or first <= qb < last
        assert tile.all() or not full_lo <= qb < full_hi
  assert whole_blocks > 0


@pytest.mark.parametrize("causal, window, segments, t, s, cta_keys", [
    (False, None, None, 256, 384, 128),
    (True, None, None, 384, 256, 128),
    (True, None, None, 256, 512, 64),
    (False, (100, 7), None, 512, 384, 128),
    (False, (2, 2), None, 512, 384, 128),  # the last query block sees no key: no adder
    (True, 200, "sorted", 512, 512, 128),
    (False, None, "random", 256, 384, 64)])
def test_reduction_ranks_order_each_query_blocks_adders(causal, window, segments, t, s, cta_keys):
  """Per query block, the key blocks that add into its dq (those _query_blocks visits) hold
  ranks 0, 1, ... in descending key block: each waits only on ones launched before it; and
  the block's count of adders (none: dq_ordered's output there is never written)."""
  bq, batch = mb.BLOCK_Q, 2
  n_q, n_kv = t // bq, s // cta_keys
  mask = MaskSpec.make(causal, window, segments is not None)
  ranges = None
  if segments:
    key = jax.random.key(5)
    q_seg, kv_seg = (jax.random.randint(k, (batch, n), 0, 4)
                     for k, n in zip(jax.random.split(key), (t, s)))
    if segments == "sorted":
      q_seg, kv_seg = jnp.sort(q_seg, -1), jnp.sort(kv_seg, -1)
    ranges = pm._mosaic.segment_block_ranges(kv_seg, q_seg, cta_keys, bq)  # pylint: disable=protected-access
  ranks, adders = map(np.asarray, mb._reduction_ranks(mask, batch, n_kv, cta_keys, n_q, bq,  # pylint: disable=protected-access
                                                      ranges))
  assert ranks.shape == (batch, n_kv, n_q) and adders.shape == (batch, n_q)
  for b in range(batch):
    visits = []
    for j in range(n_kv):
      seg = None if ranges is None else tuple(ranges[b, j])
      first, last, _, _ = mb._query_blocks(mask, j * cta_keys, cta_keys, n_q, bq, seg)  # pylint: disable=protected-access
      visits.append(range(int(first), int(last)))
    for qb in range(n_q):
      adding = [j for j in range(n_kv) if qb in visits[j]]
      assert [ranks[b, j, qb] for j in adding[::-1]] == list(range(len(adding)))
      assert adders[b, qb] == len(adding)
  assert ranks.min() >= 0


@pytest.mark.parametrize("causal, window, segments, t, s, rotate", [
    (True, None, False, 512, 512, False),
    (False, (2, 2), False, 512, 384, False),  # the last query block has no adder
    (False, None, False, 512, 512, True),
    (True, None, True, 512, 512, False)])
def test_dq_order_is_computed_while_tracing(causal, window, segments, t, s, rotate):
  """dq_ordered's rank table and the rows of dq it writes: without segment ids constants of
  the program (no kernels in each call), equal to _reduction_ranks'; `written` is None only
  where every query block has an adder. With segment ids they are computed in the call."""
  bq, cta_keys, batch = mb.BLOCK_Q, 128, 2
  n_q, n_kv = t // bq, s // cta_keys
  mask = MaskSpec.make(causal, window, segments)
  seen = {}

  @jax.jit
  def trace(seg):
    ranges = pm._mosaic.segment_block_ranges(seg, seg, cta_keys, bq) if segments else None  # pylint: disable=protected-access
    seen["order"] = mb._dq_order(mask, batch, n_kv, cta_keys, n_q, bq, t, ranges,  # pylint: disable=protected-access
                                 rotate=rotate)
    return seg

  trace(jnp.zeros((batch, t), jnp.int32))
  ranks, adders_got, written = seen["order"]
  assert isinstance(ranks, jax.core.Tracer) == isinstance(adders_got, jax.core.Tracer) == segments
  if segments:
    return
  assert not isinstance(written, jax.core.Tracer)
  want, adders = map(np.asarray, mb._reduction_ranks(mask, batch, n_kv, cta_keys, n_q, bq,  # pylint: disable=protected-access
                                                     rotate=rotate))
  np.testing.assert_array_equal(np.asarray(ranks), want)
  np.testing.assert_array_equal(adders_got, adders)
  if (adders > 0).all():
    assert written is None
  else:
    np.testing.assert_array_equal(np.asarray(written)[..., 0, 0],
                                  np.repeat(adders > 0, bq, axis=1)[:, :t])


def _run_ordered_schedule(ranks, walks, heads: int, sms: int, seed: int,
                          heavy_first: bool = False):
  """dq_ordered's protocol, played out: `heads` key heads of CTAs launched in grid order
  (last key block first; first key block first with `heavy_first`) onto `sms` SMs; a CTA
  adds into its walk's next query block once that block's counter equals its rank there,
  then counts it up. Resident CTAs move in a random order. Returns each (head, query
  block)'s adders in the order they added, or None if no CTA can move (deadlock)."""
  rng = np.random.default_rng(seed)
  n_kv = len(walks)
  order = list(range(n_kv) if heavy_first else reversed(range(n_kv)))
  queue = [(hd, j) for hd in range(heads) for j in order]
  resident, done = {}, {}
  counters = collections.Counter()
  while queue or resident:
    while queue and len(resident) < sms:
      resident[queue.pop(0)] = 0
    moved = False
    for cta in rng.permutation(len(resident)):
      hd, j = cta = list(resident)[cta]
      qb = walks[j][resident[cta]]
      if counters[hd, qb] == ranks[j, qb]:
        counters[hd, qb] += 1
        done.setdefault((hd, qb), []).append(j)
        resident[cta] += 1
        moved = True
        if resident[cta] == len(walks[j]):
          del resident[cta]
        break
    if not moved:
      return None
  return done


@pytest.mark.parametrize("t, s", [(4096, 4096), (512, 1024), (256, 768), (1024, 512)])
def test_rotated_walks_add_in_rank_order_without_deadlock(t, s):
  """dq_rotate (no mask): key block j walks the query blocks from _rotation(j) on; per query
  block the ranks order its adders by visit step, then launch order, and the protocol
  finishes whenever a key head's CTAs fit on the SMs at once (ROTATE_MAX_KV), however the
  CTAs interleave; with fewer SMs it can deadlock, which is why the bound exists."""
  cta_keys, bq = 2 * mb.BLOCK_KV, mb.BLOCK_Q
  n_kv, n_q = s // cta_keys, t // bq
  mask = MaskSpec.make(False, None, False)
  ranks, adders = map(np.asarray, mb._reduction_ranks(mask, 2, n_kv, cta_keys, n_q, bq,  # pylint: disable=protected-access
                                                      rotate=True))
  assert ranks.shape == (2, n_kv, n_q) and (adders == n_kv).all()
  ranks = ranks[1]
  starts = np.asarray(mb._rotation(jnp.arange(n_kv, dtype=jnp.int32), n_kv, n_q))  # pylint: disable=protected-access
  walks = [[(int(r) + i) % n_q for i in range(n_q)] for r in starts]
  for qb in range(n_q):  # by visit step, then launch order (last key block first)
    turns = sorted(range(n_kv), key=lambda j, qb=qb: (walks[j].index(qb), n_kv - 1 - j))
    assert [ranks[j, qb] for j in turns] == list(range(n_kv))
  if n_kv <= 8:  # the schedule plays out at small heads only (CPU time)
    for seed in range(3):
      done = _run_ordered_schedule(ranks, walks, heads=3, sms=n_kv + 1, seed=seed)
      assert done is not None and len(done) == 3 * n_q
      assert all(len(order) == n_kv for order in done.values())
    # Fewer SMs than a head's CTAs: the first launched wait on ones that never start.
    assert _run_ordered_schedule(ranks, walks, heads=1, sms=n_kv // 2, seed=0) is None
    # Turns against the walks (latest visitor first) deadlock even with the SMs to spare.
    assert _run_ordered_schedule(n_kv - 1 - ranks, walks, heads=3, sms=n_kv + 1, seed=0) is None


@pytest.mark.parametrize("causal, window", [(True, None), (False, (300, 0))])
def test_heavy_first_walks_add_in_rank_order_without_deadlock(causal, window):
  """dq_heavy_first: the masked walks launch first key block first while the adders keep
  their order (descending key block), so a CTA waits on ones launched after it: the
  protocol finishes whenever a key head's CTAs fit on the SMs at once (the bound it shares
  with dq_rotate), and can deadlock with fewer."""
  cta_keys, bq, n_kv = 2 * mb.BLOCK_KV, mb.BLOCK_Q, 6
  n_q = n_kv * cta_keys // bq
  mask = MaskSpec.make(causal, window, False)
  config = mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, dq_heavy_first=True)
  assert mb._heavy_first(config, mask, n_kv)  # pylint: disable=protected-access
  assert not mb._heavy_first(config, mask, mb.ROTATE_MAX_KV + 1)  # pylint: disable=protected-access
  assert not mb._heavy_first(dataclasses.replace(config, dq_heavy_first=False), mask, n_kv)  # pylint: disable=protected-access
  ranks = np.asarray(mb._reduction_ranks(mask, 1, n_kv, cta_keys, n_q, bq)[0])[0]  # pylint: disable=protected-access
  walks = []
  for j in range(n_kv):
    first, last, _, _ = mb._query_blocks(mask, j * cta_keys, cta_keys, n_q, bq)  # pylint: disable=protected-access
    walks.append(list(range(int(first), int(last))))
  for seed in range(3):
    done = _run_ordered_schedule(ranks, walks, heads=3, sms=n_kv, seed=seed, heavy_first=True)
    assert done is not None and len(done) == 3 * n_q
    for (_, qb), adders in done.items():  # descending key block, as ranked
      assert adders == sorted(adders, reverse=True), qb
  assert _run_ordered_schedule(ranks, walks, heads=3, sms=2, seed=0, heavy_first=True) is None


@pytest.mark.parametrize("batch, hq, hkv, n_kv, cta_keys, bq, sms", [
    (1, 8, 1, 8, 64, 64, 8),     # MQA: 4 pairs a head, 2 splits of 4 heads
    (2, 8, 4, 6, 64, 64, 24),    # one split per key head's 2 query heads
    (1, 4, 4, 4, 128, 64, 9),    # no GQA, 128 keys per CTA
    (1, 4, 2, 6, 128, 128, 12),  # 128-query steps (D = 64)
    (1, 6, 2, 4, 64, 64, 5)])    # 3 query heads per key head, one split
def test_paired_schedule_covers_the_walks_and_adds_without_deadlock(batch, hq, hkv, n_kv,
                                                                    cta_keys, bq, sms):
  """dq_paired: the most splits whose pairs fit on the SMs; the CTAs' items visit each
  (head, query block, key block) of the causal band exactly once, in pairs of equal work
  (key blocks n − 1 − j, then j from the last query block down); the ranks order each query
  block's adders, and the protocol finishes with every CTA resident, however the CTAs
  interleave."""
  mask = MaskSpec.make(True, None, False)
  n_q = n_kv * cta_keys // bq
  config = mb.MosaicBackwardConfig(dq_split=cta_keys == 128, column_split=cta_keys == 64,
                                   dq_ordered=True, dq_paired=True, group_splits=hq // hkv)
  splits = mb._paired_splits(config, mask, batch, hq, hkv, n_q * bq, n_kv * cta_keys, sms)  # pylint: disable=protected-access
  group = hq // hkv
  assert splits == max(n for n in range(1, group + 1)
                       if group % n == 0 and batch * hkv * n * n_kv // 2 <= sms)
  deal, ctas, ranks = mb._paired_schedule(mask, batch, hq, hkv, splits, n_kv, n_q, cta_keys,  # pylint: disable=protected-access
                                          bq)
  assert ctas == batch * hkv * splits * n_kv // 2 <= sms
  assert ranks.shape == (batch, hq, n_kv, n_q)
  walks, pair_steps = [], set()
  for c in range(ctas):
    items = [deal.item(c, r) for r in range(2)]
    steps = []
    for r, (b, kv_head, kvi, head0, heads, part) in enumerate(items):
      assert head0 // group == kv_head and 0 <= part < splits
      first, last, _, _ = (int(x) for x in mb._query_blocks(mask, kvi * cta_keys, cta_keys,  # pylint: disable=protected-access
                                                            n_q, bq))
      blocks = range(first, last)[::-1] if r else range(first, last)  # the second descending
      steps += [(b, head, kvi, qb) for head in range(head0, head0 + heads) for qb in blocks]
    assert items[0][2] == n_kv - 1 - items[1][2]  # key blocks n − 1 − j, then j
    pair_steps.add(len(steps))
    walks.append(steps)
  assert len(pair_steps) == 1  # every CTA the same work
  want = {(b, head, kvi, qb) for b in range(batch) for head in range(hq) for kvi in range(n_kv)
          for qb in range(kvi * cta_keys // bq, n_q)}
  visits = [v for steps in walks for v in steps]
  assert len(visits) == len(set(visits)) and set(visits) == want
  for b in range(batch):
    for head in range(hq):
      for qb in range(n_q):
        adders = [kvi for kvi in range(n_kv) if (b, head, kvi, qb) in want]
        assert sorted(ranks[b, head, kvi, qb] for kvi in adders) == list(range(len(adders)))
  rng = np.random.default_rng(0)
  at, counters = [0] * len(walks), collections.Counter()
  while any(i < len(steps) for i, steps in zip(at, walks)):
    movable = [c for c, steps in enumerate(walks) if at[c] < len(steps)
               and counters[steps[at[c]][:2] + steps[at[c]][3:]] == ranks[steps[at[c]]]]
    assert movable, "deadlock"
    c = movable[rng.integers(len(movable))]
    counters[walks[c][at[c]][:2] + walks[c][at[c]][3:]] += 1
    at[c] += 1


def test_paired_backward_applies_where_the_pairs_fit_on_the_sms():
  """dq_paired at Gemma-2B's MQA (B1 T8k H8/1, D = 256, 128 key blocks; 8 group splits,
  1,024 grid CTAs for 132 SMs): 2 splits, 128 CTAs of a pair each. Every other call keeps
  the grid of key blocks: more pairs than SMs, a grid of one wave, other masks, T ≠ S, an
  odd number of key blocks."""
  config = mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1,
                                   scores_split=True, dq_ordered=True, dq_paired=True,
                                   group_splits=8)
  causal = MaskSpec.make(True, None, False)
  splits = lambda mask, t, s, b=1, hkv=1, on=config: mb._paired_splits(  # pylint: disable=protected-access
      on, mask, b, 8, hkv, t, s, 132)
  assert splits(causal, 8192, 8192) == 2
  assert splits(causal, 8192, 8192, b=2) == 1
  assert splits(causal, 8192, 8192, b=2, hkv=4) is None  # Gemma-2-2B: 512 pairs
  assert splits(causal, 1024, 1024) is None  # 16 key blocks: the grid's 128 CTAs, one wave
  assert splits(causal, 1024, 1024, hkv=4) is None  # 2 splits of a key head's 2 query heads
  assert splits(causal, 8192, 8192 - 128) is None  # T ≠ S
  assert splits(causal, 64 * 7, 64 * 7) is None  # 7 key blocks
  assert splits(MaskSpec.make(False, None, False), 8192, 8192) is None
  assert splits(MaskSpec.make(True, 1024, False), 8192, 8192) is None
  assert splits(MaskSpec.make(True, None, True), 8192, 8192) is None
  assert splits(causal, 8192, 8192, on=dataclasses.replace(config, dq_paired=False)) is None
  assert "dq_paired belongs to dq_ordered" in mb.support_error(
      (1, 256, 8, 256), (1, 256, 1, 256), BF16, _opts(True, None, False),
      dataclasses.replace(config, dq_ordered=False))
  assert "dq_paired excludes" in mb.support_error(
      (1, 256, 8, 128), (1, 256, 1, 128), BF16, _opts(True, None, False),
      mb.MosaicBackwardConfig(dq_ordered=True, dq_paired=True, dq_stagger=True))
  assert "dq_paired excludes" in mb.support_error(
      (1, 256, 8, 128), (1, 256, 1, 128), BF16, _opts(True, None, False),
      mb.MosaicBackwardConfig(dq_ordered=True, dq_paired=True, dq_rounded_per_block=True))


@pytest.mark.parametrize("d, t, hkv, sms, semantics", _alternating_lowerings([
    (256, 512, 1, 12), (256, 768, 2, 30), (128, 512, 4, 20), (128, 1024, 1, 12)]))
def test_paired_backward_lowers_for_cuda(monkeypatch, d, t, hkv, sms, semantics):
  """dq_paired: a CTA per pair of key blocks (its second K and V loaded once the first key
  block's dK and dV have left their shared memory), under both lowerings; the dK and dV
  partials are those of the pairs' splits."""
  _lower_with(monkeypatch, semantics)
  monkeypatch.setattr(mb.hopper, "sm_count", lambda: sms)
  if d == 256:
    config = mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1,
                                     scores_split=True, dq_ordered=True, dq_paired=True,
                                     group_splits=4 // hkv)
  else:
    config = mb.MosaicBackwardConfig(dq_ordered=True, dq_buffers=2, early_softmax=True,
                                     dq_paired=True)
  opts = _opts(True, None, False)
  assert mb.support_error((2, t, 4, d), (2, t, hkv, d), BF16, opts, config) is None
  splits = mb._paired_splits(config, opts.mask, 2, 4, hkv, t, t, sms)  # pylint: disable=protected-access
  assert splits is not None
  text = _backward_lowered_for_cuda(opts, config, t, t, hkv, d, False)
  call = next(line for line in text.splitlines() if _MOSAIC_CALL.search(line))
  parts = f"{splits}x" if splits > 1 else ""
  assert call.split("->")[-1].count(f"tensor<{parts}2x{t}x{hkv}x{d}xbf16>") == 2


def test_tuned_backward_configs_serve_their_calls():
  """The tuning table's sections name real fields and choices the kernel accepts, and none
  that its calls would ignore: dq_rotate applies only without a mask, so no causal section
  sets it."""
  table = _tuning.lookup("flash_attention", "pallas_mosaic_gpu_backward")
  assert not [name for name, fields in table.items()
              if "causal" in name and fields.get("dq_rotate")]
  for d in (64, 96, 128, 192, 256):
    for causal in (False, True):
      config = mb.MosaicBackwardConfig.tuned(d, causal)
      assert mb.support_error((2, 256, 8, d), (2, 256, 2, d), BF16, _opts(causal), config) is None
  assert mb.MosaicBackwardConfig.tuned(128, False) == mb.MosaicBackwardConfig(dq_split=True)
  assert mb.MosaicBackwardConfig.tuned(128, True, gqa=True) == mb.MosaicBackwardConfig.tuned(
      128, True)  # no _gqa section: the head dim's own
  for d in (64, 128, 256):  # the dK/dV-only kernel of deterministic calls
    for causal in (False, True):
      for gqa in (False, True):
        config = mb.MosaicBackwardConfig.tuned(d, causal, gqa, with_dq=False)
        assert not config.with_dq
        assert mb.support_error((2, 256, 8, d), (2, 256, 2, d), BF16, _opts(causal),
                                config) is None
  assert mb.MosaicBackwardConfig.tuned(256, True, with_dq=False).stages == 2  # d256_dkv
  assert mb.MosaicBackwardConfig.tuned(128, False, with_dq=False).block_q == 80  # d128_dkv
  assert mb.MosaicBackwardConfig.tuned(128, False, gqa=True, with_dq=False).block_q == 80
  assert mb.MosaicBackwardConfig.tuned(128, True, with_dq=False).block_q == 64  # d128_causal_dkv
  assert mb.MosaicBackwardConfig.tuned(64, True, with_dq=False).block_q == 96  # d64_causal_dkv
  for d in (48, 80):  # d48_dkv, d80_dkv, with either mask
    assert {mb.MosaicBackwardConfig.tuned(d, causal, with_dq=False).block_q
            for causal in (False, True)} == {128}
  assert mb.MosaicBackwardConfig.tuned(64, False, with_dq=False).block_q == 64
  assert mb.MosaicBackwardConfig.tuned(128, True, gqa=True, with_dq=False).pingpong  # _gqa_dkv
  # d128[_causal][_gqa]_ordered: the whole kernel, dq in rank order
  # (causal GQA: one CTA per query head, as without GQA)
  for causal, gqa in ((False, False), (True, False), (False, True), (True, True)):
    ordered = mb.MosaicBackwardConfig.for_deterministic(128, causal, gqa)
    assert ordered == mb.MosaicBackwardConfig(  # causal: one dQ slot, Δ by XLA's pass
        dq_split=True, dq_ordered=True, dq_buffers=1 + (not causal), dq_rotate=not causal,
        dq_stagger=not causal, gqa_per_query_head=causal and gqa, early_softmax=causal)
    assert mb.support_error((2, 256, 8, 128), (2, 256, 2, 128), BF16, _opts(causal),
                            ordered) is None
  # d128_causal[_gqa]_ordered_long: from LONG_WALK_QUERIES queries, the staggered
  # warpgroups on a second dQ slot in place of early_softmax
  for gqa in (False, True):
    base = mb.MosaicBackwardConfig.for_deterministic(128, True, gqa)
    assert mb.MosaicBackwardConfig.for_deterministic(128, True, gqa, t=1024) == base
    long = mb.MosaicBackwardConfig.for_deterministic(128, True, gqa, t=mb.LONG_WALK_QUERIES)
    assert long == dataclasses.replace(base, dq_buffers=2, early_softmax=False,
                                       dq_stagger=True)
    assert mb.support_error((1, 8192, 8, 128), (1, 8192, 2, 128), BF16, _opts(True),
                            long) is None
    assert mb.fit_shared_memory(long, 128, BF16, segments=False) == long
    # beside segment ids one dQ slot fits, which does not stagger: the shorter calls' kernel
    assert mb.fit_shared_memory(base, 128, BF16, segments=True) == base
    assert (mb.fit_shared_memory(long, 128, BF16, segments=True)
            == dataclasses.replace(base, early_softmax=False))
    assert (mb.MosaicBackwardConfig.for_deterministic(128, False, gqa, t=8192)
            == mb.MosaicBackwardConfig.for_deterministic(128, False, gqa))  # causal only
    # a causal window's kernel is the long walks' at any span: staggered
    window = mb.MosaicBackwardConfig.for_deterministic(128, True, gqa, t=1152, s=4096,
                                                       seen=1025)
    assert dataclasses.replace(window, dq_rounded=False) == long
  # D = 96 runs these sections, its `_long` variant from twice as many queries, and without a
  # mask under GQA unstaggered (d96_gqa_ordered)
  det, n = mb.MosaicBackwardConfig.for_deterministic, mb.LONG_WALK_QUERIES
  assert mb.long_walk_queries(96) == 2 * n == 2 * mb.long_walk_queries(128)
  assert det(96, True, t=n) == det(128, True, t=n // 2) != det(128, True, t=n)
  assert det(96, True, t=2 * n) == det(128, True, t=n)
  assert det(96, False, True) == dataclasses.replace(det(128, False, True), dq_stagger=False)
  assert det(96, False) == det(128, False)
  # d256[_causal]_ordered: the column-split kernel with split scores, dq in rank order (rotated
  # without a mask, causal with the longest walk launched first); in arrival order the same
  # kernel (d256, d256_causal)
  for causal in (False, True):
    assert mb.MosaicBackwardConfig.for_deterministic(256, causal) == mb.MosaicBackwardConfig(
        dq_split=False, column_split=True, stages=1, scores_split=True, dq_ordered=True,
        dq_rotate=not causal, dq_heavy_first=causal)
    assert mb.MosaicBackwardConfig.tuned(256, causal) == mb.MosaicBackwardConfig(
        dq_split=False, column_split=True, stages=1, scores_split=True)
  # d224_causal_ordered: D = 256's causal kernel with the last key block first; D = 224's
  # other calls take D = 256's sections
  assert det(224, True) == dataclasses.replace(det(256, True), dq_heavy_first=False)
  assert det(224, False) == det(256, False) and det(224, True, True) == det(256, True, True)
  # d64[_causal][_gqa]_ordered: the D = 128 kernel's dq_split on 128-query steps, two Q/dO
  # stages, rotated from one dQ slot without a mask, two causal (one CTA per query head under
  # GQA)
  for causal, gqa in ((False, False), (True, False), (False, True), (True, True)):
    assert mb.MosaicBackwardConfig.for_deterministic(64, causal, gqa) == mb.MosaicBackwardConfig(
        dq_split=True, dq_ordered=True, block_q=128, stages=2, dq_buffers=1 + causal,
        dq_rotate=not causal, gqa_per_query_head=causal and gqa)
  # d256_causal_gqa_ordered: the same with one CTA per query head, the last key block first;
  # one CTA per pair of key blocks where the pairs fit on the SMs
  assert mb.MosaicBackwardConfig.for_deterministic(256, True, True) == mb.MosaicBackwardConfig(
      dq_split=False, column_split=True, stages=1, scores_split=True, dq_ordered=True,
      group_splits=8, dq_paired=True)  # one CTA per query head, up to 8, by partials
  # d192_causal_ordered: D = 256's causal kernel with two Q/dO stages, the last key block first
  assert mb.MosaicBackwardConfig.for_deterministic(192, True) == mb.MosaicBackwardConfig(
      dq_split=False, column_split=True, stages=2, scores_split=True, dq_ordered=True)
  # d256_gqa_ordered: non-causal GQA at D = 256 as without GQA (one CTA per key head)
  assert (mb.MosaicBackwardConfig.for_deterministic(256, False, True)
          == mb.MosaicBackwardConfig.for_deterministic(256, False))


def test_nondeterministic_calls_take_arrival_order_where_it_measured_faster(as_on_hopper):
  """deterministic=False: dq's reductions in arrival order where the table names that kernel
  (the default table nowhere), else the ordered kernel deterministic calls run (D = 64, 96,
  128, 224, 256; D = 192 causal without GQA), else the whole kernel in arrival order (D =
  48, 80: no ordered kernel) rather than the dK/dV kernel beside a dq kernel, which D = 112,
  160 and 192 keep."""
  cfg = mb.MosaicBackwardConfig
  cases = [(c, g) for c in (False, True) for g in (False, True)]
  for d, (causal, gqa) in itertools.product((64, 96, 128, 224, 256), cases):
    for t in (1024, mb.LONG_WALK_QUERIES):
      ordered = cfg.for_nondeterministic(d, causal, gqa, t=t, s=t)
      assert ordered.dq_ordered and ordered.column_split == (d > 128)
      assert ordered == cfg.for_deterministic(d, causal, gqa, t=t, s=t)
  assert cfg.for_nondeterministic(192, True).dq_ordered
  for d, (causal, gqa) in itertools.product((48, 80), cases):
    arrival = cfg.for_nondeterministic(d, causal, gqa)
    assert arrival.with_dq and not arrival.dq_ordered
    assert not cfg.for_deterministic(d, causal, gqa).with_dq
  for d, (causal, gqa) in itertools.product((112, 160, 192), cases):
    if (d, causal, gqa) == (192, True, False):
      continue  # d192_causal_ordered
    pair = cfg.for_deterministic(d, causal, gqa)
    assert not pair.with_dq and cfg.for_nondeterministic(d, causal, gqa) == pair
  # through the dispatcher, with its group splits
  fast = dataclasses.replace(_opts(True), deterministic=False)
  backward = lambda d, hkv, opts: PallasMosaicGpu()._static(  # pylint: disable=protected-access
      jax.ShapeDtypeStruct((2, 1024, 8, d), BF16), jax.ShapeDtypeStruct((2, 1024, hkv, d), BF16),
      opts).backward
  for d, hkv in ((64, 2), (128, 2), (256, 8), (256, 1)):
    assert backward(d, hkv, fast) == backward(d, hkv, _opts(True))
  assert backward(256, 1, fast).group_splits == 8  # causal MQA: a CTA per query head


def test_an_arrival_order_section_serves_nondeterministic_calls(as_on_hopper, tuning_tables):
  """A `d<D>[_causal][_gqa]` section makes deterministic=False calls add dq in arrival order;
  deterministic calls keep their ordered section; a call the section does not name (here
  causal) keeps the ordered kernel."""
  tuning_tables(flash_attention="[pallas_mosaic_gpu_backward.default.d256]\n"
                                "dq_split = false\ncolumn_split = true\nstages = 1\n"
                                "[pallas_mosaic_gpu_backward.default.d256_ordered]\n"
                                "dq_split = false\ncolumn_split = true\nstages = 1\n")
  cfg = mb.MosaicBackwardConfig
  arrival = cfg(dq_split=False, column_split=True, stages=1)
  assert cfg.for_nondeterministic(256, False) == arrival
  assert cfg.for_nondeterministic(224, False) == arrival  # D = 224 takes D = 256's sections
  assert cfg.for_deterministic(256, False).dq_ordered
  assert cfg.for_nondeterministic(256, True) == cfg.for_deterministic(256, True)


def test_deterministic_calls_take_an_ordered_section(as_on_hopper, tuning_tables):
  """A `_ordered` section makes deterministic calls run the whole kernel with dq_ordered; an
  explicit dq_ordered config runs whole for them too."""
  tuning_tables(flash_attention="[pallas_mosaic_gpu_backward.default.d128_ordered]\n"
                                "dq_split = true\n")
  ordered = mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True)
  assert mb.MosaicBackwardConfig.for_deterministic(128, False) == ordered
  assert not mb.MosaicBackwardConfig.for_deterministic(128, True).with_dq  # no d128_causal_
  assert not mb.MosaicBackwardConfig.for_deterministic(64, False).with_dq
  q = jax.ShapeDtypeStruct((1, 256, 4, 128), BF16)
  st = PallasMosaicGpu()._static(q, q, _opts())  # pylint: disable=protected-access
  # two key blocks add into each query block: dq in the input dtype (dq_rounded)
  assert st.backward == dataclasses.replace(ordered, dq_rounded=True)
  assert st.dq is None and st.triton is None
  explicit = PallasMosaicGpu(backward_config=dataclasses.replace(ordered, dq_rotate=True))
  assert explicit._static(q, q, _opts()).backward.dq_ordered  # pylint: disable=protected-access


@pytest.mark.parametrize("t, window, d, section", [
    (8192, 4096, 128, "d128_causal_gqa_ordered_long"),  # at any span: Δ does not fuse
    (16384, 8192, 128, "d128_causal_gqa_ordered_long"),
    (16384, None, 128, "d128_causal_gqa_ordered_long"),
    (4096, 1024, 128, "d128_causal_gqa_ordered_long"),
    (8192, 4096, 256, "d256_gqa_ordered"),  # D = 256 keeps the sections without a mask
])
def test_causal_windows_at_d128_take_the_causal_sections(as_on_hopper, tuned_as, t, window, d,
                                                         section):
  """Deterministic calls under a causal window run the causal sections' `_long` variants at
  D = 128 (under GQA a CTA per query head) at any span: their Δ does not fuse."""
  tuned_as("NVIDIA H200")  # an H100 has `_longest` sections
  opts = AttentionOptions(mask=MaskSpec.make(True, window, False), scale=0.1,
                          deterministic=True)
  # pylint: disable=protected-access
  st = PallasMosaicGpu()._static(jax.ShapeDtypeStruct((1, t, 32, d), BF16),
                                 jax.ShapeDtypeStruct((1, t, 8, d), BF16), opts)
  want = {**_tuning.lookup("flash_attention", "pallas_mosaic_gpu_backward")[section],
          "dq_ordered": True}
  assert dataclasses.replace(st.backward, dq_rounded=False) == mb.MosaicBackwardConfig(**want)


def test_longest_walks_take_the_h100_sections(tuned_as):
  """On an H100, causal calls from LONGEST_WALK_QUERIES queries without segment ids run a
  third Q/dO stage on one dQ slot, unstaggered (the `_longest` sections); an H200, D = 96
  below twice that, and calls with segment ids keep the `_long` sections."""
  det, n = mb.MosaicBackwardConfig.for_deterministic, mb.LONGEST_WALK_QUERIES
  for gqa in (False, True):
    tuned_as("NVIDIA H200")
    on_h200 = [det(d, True, gqa, t=t, s=t, segments=seg)
               for d, t, seg in ((128, n, False), (128, n, True), (96, n, False))]
    assert on_h200[0] == det(128, True, gqa, t=n // 2, s=n // 2) and on_h200[0].dq_stagger
    tuned_as("NVIDIA H100 80GB HBM3")
    longest = det(128, True, gqa, t=n, s=n)
    assert longest == dataclasses.replace(on_h200[0], stages=3, dq_buffers=1, dq_stagger=False)
    assert det(128, True, gqa, t=n // 2, s=n // 2) == on_h200[0]
    assert det(128, True, gqa, t=n, s=n, segments=True) == on_h200[1]
    assert det(96, True, gqa, t=n, s=n) == on_h200[2]
    assert det(96, True, gqa, t=2 * n, s=2 * n) == longest
    assert mb.fit_shared_memory(longest, 128, BF16, segments=False) == longest
    assert mb.support_error((1, n, 8, 128), (1, n, 2 if gqa else 8, 128), BF16, _opts(True),
                            longest) is None


@pytest.mark.parametrize("d, causal, gqa, s, rounded", [
    (128, True, False, 256, True), (128, False, True, 2048, True),
    (128, True, True, 2176, False),  # 17 key blocks of 128
    (256, True, False, 1024, True), (256, False, False, 2048, False),  # 64-key blocks
    (64, False, False, 1024, True), (96, True, True, 2048, True),
    (128, True, False, 0, False)])  # S not known
def test_short_calls_add_dq_in_the_input_dtype(d, causal, gqa, s, rounded):
  """for_deterministic rounds dq per adder (dq_rounded) where at most ROUNDED_DQ_MAX_ADDERS
  key blocks add into a query block, and keeps the float32 sum elsewhere."""
  config = mb.MosaicBackwardConfig.for_deterministic(d, causal, gqa, t=1024, s=s)
  assert config.dq_ordered and config.dq_rounded == rounded
  if s:
    assert (s // config.cta_keys() <= mb.ROUNDED_DQ_MAX_ADDERS) == rounded
  assert mb.support_error((1, 1024, 4, d), (1, max(s, 256), 2 if gqa else 4, d), BF16,
                          _opts(causal), mb.fit_shared_memory(config, d, BF16, False)) is None
  shape = (1, 256, 4, 128)  # in arrival order an adder cannot know it is the first
  assert "belong to dq_ordered" in mb.support_error(
      shape, shape, BF16, _opts(causal), mb.MosaicBackwardConfig(dq_rounded=True))


@pytest.mark.parametrize("window", [(0, 0), (63, 0), (64, 5), (100, 7), (300, 100),
                                    (1024, 0), (2048, 0)])
def test_block_adders_bound_the_windows_adders(window):
  """block_adders bounds the key blocks that add into each query block under a window (the
  most any block has, by _reduction_ranks), at most one over where the queries reach past
  the window, and at a full band is S's key blocks."""
  mask = MaskSpec.make(False, window, False)
  for t, s, block_q, cta_keys in itertools.product([512, 3072], [1024, 3072], [64, 128],
                                                   [64, 128]):
    n_kv, n_q = s // cta_keys, t // block_q
    _, adders = mb._reduction_ranks(mask, 1, n_kv, cta_keys, n_q, block_q)  # pylint: disable=protected-access
    bound = mb.block_adders(s, mask.span(s), cta_keys, block_q)
    case = (t, s, block_q, cta_keys)
    assert int(adders.max()) <= bound, case
    if sum(window) + 2 * block_q + cta_keys <= min(t, s):
      assert bound <= int(adders.max()) + 1, case
    assert mb.block_adders(s, 0, cta_keys, block_q) == s // cta_keys


@pytest.mark.parametrize("d, causal, seen, segments, rounded, per_block", [
    (128, True, 1025, False, True, False),    # a window of 1,024: at most 10 key blocks
    (128, True, 2049, False, False, False),   # 2,048: 18
    (128, False, 4096, True, False, True),    # segment ids: chosen per query block
    (64, True, 0, True, False, True),
    (128, True, 1025, True, True, False),     # a window bounds them beside segment ids too
    (256, False, 0, True, False, True)])
def test_rounding_follows_the_adders_a_call_can_have(d, causal, seen, segments, rounded,
                                                     per_block):
  """for_deterministic adds dq rounded where no query block can have more than
  ROUNDED_DQ_MAX_ADDERS adders (a window's span, not all S = 4,096 keys, bounds them), and
  with segment ids chooses per query block where more could."""
  config = mb.MosaicBackwardConfig.for_deterministic(d, causal, t=4096, s=4096,
                                                     segments=segments, seen=seen)
  assert (config.dq_rounded, config.dq_rounded_per_block) == (rounded, per_block)
  opts = _opts(causal, seen - 1 if seen else None, segments)
  shape = (1, 4096, 4, d)
  config = mb.fit_shared_memory(config, d, BF16, segments)
  assert mb.support_error(shape, shape, BF16, opts, config) is None
  both = dataclasses.replace(config, dq_rounded=True, dq_rounded_per_block=True)
  assert "exclude each other" in mb.support_error(shape, shape, BF16, opts, both)


@pytest.mark.parametrize("causal, d, t, s, hkv, semantics", [
    (True, 128, 2304, 2304, 4, "Lane"), (False, 64, 2304, 2432, 1, "Warpgroup"),
    (True, 96, 2304, 2304, 2, "Warpgroup"), (True, 256, 2304, 2304, 2, "Lane")])
def test_rounded_per_block_dq_lowers_for_cuda(monkeypatch, causal, d, t, s, hkv, semantics):
  """dq_rounded_per_block (segment ids, more than ROUNDED_DQ_MAX_ADDERS key blocks): the
  kernel returns dq in the input dtype and the float32 sums beside it, and _finish_dq's
  kernel takes both into dq."""
  _lower_with(monkeypatch, semantics)
  config = mb.MosaicBackwardConfig.for_deterministic(d, causal, hkv < 4, t=t, s=s,
                                                     segments=True)
  config = mb.fit_shared_memory(config, d, BF16, True)
  assert config.dq_rounded_per_block and not config.dq_rounded
  opts = _opts(causal, None, True)
  assert mb.support_error((2, t, 4, d), (2, s, hkv, d), BF16, opts, config) is None
  text = _backward_lowered_for_cuda(opts, config, t, s, hkv, d, True)
  kernel, finish = [line.split("->")[-1] for line in text.splitlines()
                    if _MOSAIC_CALL.search(line)]
  assert f"tensor<2x{t}x4x{d}xbf16>, tensor<2x{t}x4x{d}xf32>" in kernel
  assert finish.strip().startswith(f"tensor<2x{t}x4x{d}xbf16>")


@pytest.mark.parametrize("causal, window, segments, d, t, s, hkv", [
    (True, None, False, 128, 512, 512, 4),
    (True, None, False, 128, 512, 512, 1),      # one CTA per query head
    (False, None, False, 128, 256, 384, 2),     # rotated walks
    (True, 200, True, 128, 384, 512, 2),        # beside segment ids
    (True, None, False, 64, 512, 512, 4),
    (False, (100, 7), False, 96, 256, 384, 1),  # 48-column tiles: 32-byte swizzle
    (True, None, False, 256, 256, 256, 2)])     # column split, 128-column tiles
def test_rounded_dq_lowers_for_cuda(causal, window, segments, d, t, s, hkv):
  """dq_rounded: the kernel returns dq in the input dtype, stored and added by TMA from
  tiles in that dtype, with no float32 dq and no pass after it (T ≠ S leaves no query
  block without an adder here)."""
  config = mb.MosaicBackwardConfig.for_deterministic(d, causal, hkv < 4, t=t, s=s)
  config = mb.fit_shared_memory(config, d, BF16, segments)
  assert config.dq_rounded
  opts = _opts(causal, window, segments)
  assert mb.support_error((2, t, 4, d), (2, s, hkv, d), BF16, opts, config) is None
  text = _backward_lowered_for_cuda(opts, config, t, s, hkv, d, segments)
  call = next(line for line in text.splitlines() if _MOSAIC_CALL.search(line))
  assert f"tensor<2x{t}x4x{d}xbf16>" in call.split("->")[-1]  # dq itself
  assert f"x{d}xf32>" not in call.split("->")[-1]  # no float32 dq
  assert "red.release.gpu" in text


def test_two_dq_slots_give_way_to_segment_ids(monkeypatch):
  """At D = 128, dq_buffers=2 fits in shared memory without segment ids, not beside them
  (a GPU run found 232,624 bytes needed of 232,448): such calls get one dQ slot."""
  monkeypatch.setattr(pm, "hopper_available", lambda: None)
  two = mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, dq_buffers=2)
  shape = (1, 256, 4, 128)
  assert mb.support_error(shape, shape, BF16, _opts(), two) is None
  segments = _opts(segments=True)
  why = mb.support_error(shape, shape, BF16, segments, two)
  assert "with segment ids" in why and "shared memory" in why
  assert mb.fit_shared_memory(two, 128, BF16, segments=False) == two
  one = mb.fit_shared_memory(two, 128, BF16, segments=True)
  assert one == dataclasses.replace(two, dq_buffers=1)
  assert mb.support_error(shape, shape, BF16, segments, one) is None
  q = jax.ShapeDtypeStruct(shape, BF16)
  st = PallasMosaicGpu(backward_config=two)._static(q, q, segments)  # pylint: disable=protected-access
  assert st.backward == one
  assert PallasMosaicGpu(backward_config=two)._static(q, q, _opts()).backward == two  # pylint: disable=protected-access
  staggered = dataclasses.replace(two, dq_stagger=True)
  assert mb.fit_shared_memory(staggered, 128, BF16, segments=True) == one  # no stagger on one slot


def test_causal_documents_take_the_causal_sections_from_long_walks(as_on_hopper):
  """Causal calls with segment ids: below CAUSAL_DOCUMENTS_QUERIES queries the deterministic
  sections without a mask (under GQA one CTA per key head, which short documents favour),
  from there the causal `_long` section (one CTA per query head); windows keep the sections
  without a mask, and without GQA both choices give the same kernel: one dQ slot beside the
  ids, so Pᵀ early. deterministic=False runs the same ordered kernels (at D = 128)."""
  docs, window = _opts(True, None, True), _opts(True, 1024, True)
  long, short = mb.CAUSAL_DOCUMENTS_QUERIES, mb.CAUSAL_DOCUMENTS_QUERIES // 2
  backward = lambda t, hkv, opts: PallasMosaicGpu()._static(  # pylint: disable=protected-access
      jax.ShapeDtypeStruct((1, t, 8, 128), BF16), jax.ShapeDtypeStruct((1, t, hkv, 128), BF16),
      opts).backward
  assert not backward(short, 2, docs).gqa_per_query_head
  assert backward(long, 2, docs) == mb.MosaicBackwardConfig(  # one dQ slot: no stagger
      dq_split=True, gqa_per_query_head=True, dq_ordered=True, dq_rounded_per_block=True,
      early_softmax=True)
  assert not backward(long, 2, window).gqa_per_query_head
  # MHA: the causal section's kernel, dq_rotate (only without a mask) aside
  assert not mb._rotates(backward(short, 8, docs), docs.mask, short // 128)  # pylint: disable=protected-access
  assert (dataclasses.replace(backward(short, 8, docs), dq_rotate=False)
          == backward(long, 8, docs)
          == mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, dq_rounded_per_block=True,
                                     early_softmax=True))
  for d in (64, 256):  # other head dims: the sections without a mask at any length
    assert (mb.MosaicBackwardConfig.for_deterministic(d, True, True, t=long, segments=True)
            == mb.MosaicBackwardConfig.for_deterministic(d, False, True, t=long))
  # deterministic=False: the same ordered kernels (D = 128 has no arrival-order section)
  fast = lambda opts: dataclasses.replace(opts, deterministic=False)
  for t, hkv in ((short, 2), (long, 2), (short, 8)):
    assert backward(t, hkv, fast(docs)) == backward(t, hkv, docs)
    assert backward(t, hkv, fast(window)) == backward(t, hkv, window)


def test_remat_counts_the_kernel_cost():
  """remat.fit ranks policies by the FLOPs they recompute: the kernel must report its own."""
  from memeff_jax.remat import flops  # pylint: disable=import-outside-toplevel
  opts = _opts(causal=True)
  st = pm._Static(opts, MosaicConfig(), None, None)  # pylint: disable=protected-access
  q = jax.ShapeDtypeStruct((2, 256, 4, 64), BF16)
  fwd = functools.partial(pm._forward, st, q_seg=None, kv_seg=None)  # pylint: disable=protected-access
  pairs = 256 * 257 // 2
  assert flops.jaxpr_flops(jax.make_jaxpr(fwd)(q, q, q)) == 2 * 2 * 2 * 4 * pairs * 64


def _hopper():
  return jax.default_backend() == "gpu" and pm.hopper_available() is None


def _assert_grads_match_reference(impl, key, shape, opts, **extra):
  """bf16 gradients of `impl` (called with opts and `extra`) within 3e-2 of the float32
  reference's (called with opts) on make_problem(key, *shape)."""
  q, k, v, _, ct = make_problem(key, *shape, BF16)
  _, _, grads = run(impl, q, k, v, None, ct, {**opts, **extra})
  up = lambda x: x.astype(jnp.float32)
  _, _, r_grads = run("reference", up(q), up(k), up(v), None, ct, opts)
  for name, g, rg in zip("qkv", grads, r_grads):
    assert g.dtype == BF16
    assert rel_err(g, rg) < 3e-2, name


def _assert_reproducible_grads(impl, q, k, v, seg, ct, opts, calls: int = 3):
  """`impl`'s bf16 gradients are the same bits on `calls` more calls, and within 3e-2 of the
  float32 reference's. Both run through `run`, with the same output and LSE cotangents.
  Returns both: (impl's gradients, the reference's)."""
  step = jax.jit(lambda q, k, v: run(impl, q, k, v, seg, ct, opts)[2])
  first = step(q, k, v)
  for _ in range(calls):
    for g, h in zip(first, step(q, k, v)):
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(h, np.float32))
  up = lambda x: x.astype(jnp.float32)
  _, _, r_grads = run("reference", up(q), up(k), up(v), seg, ct, opts)
  for name, g, rg in zip("qkv", first, r_grads):
    assert rel_err(g, rg) < 3e-2, name
  return first, r_grads


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpu:

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  @pytest.mark.parametrize("causal", [False, True])
  @pytest.mark.parametrize("pingpong", [True, False])
  @pytest.mark.parametrize("b, t, s, hq, hkv, d", [
      (2, 256, 384, 8, 2, 128),   # T < S, GQA 4:1
      (1, 384, 256, 4, 4, 64),    # T > S
      (1, 512, 512, 4, 1, 128)])  # MQA
  def test_matches_reference(self, dtype, causal, pingpong, b, t, s, hq, hkv, d):
    impl = PallasMosaicGpu(config=MosaicConfig(pingpong=pingpong))
    q, k, v, _, ct = make_problem(jax.random.key(t + s + d), b, t, s, hq, hkv, d, dtype)
    opts = dict(causal=causal)
    out, lse, grads = run(impl, q, k, v, None, ct, opts)
    up = lambda x: x.astype(jnp.float32)
    r_out, r_lse, r_grads = run("reference", up(q), up(k), up(v), None, ct, opts)
    tol = {jnp.bfloat16: 3e-2, jnp.float16: 5e-3}[dtype]
    assert out.dtype == dtype
    assert rel_err(out, r_out) < tol
    assert rel_err(lse, r_lse) < 1e-4
    for g, rg in zip(grads, r_grads):
      assert rel_err(g, rg) < tol

  @pytest.mark.parametrize("d, block_kv, causal, pingpong", [
      (256, 64, False, True), (256, 64, True, True), (192, 64, True, True),
      (128, 64, True, True), (128, 64, True, False)])
  def test_wide_heads_and_key_blocks_smaller_than_two_query_blocks(self, d, block_kv, causal,
                                                                   pingpong):
    """block_kv < 2·block_q: under causal the first query block needs one key block fewer
    than the second, which it releases without computing."""
    impl = PallasMosaicGpu(config=MosaicConfig(block_kv=block_kv, pingpong=pingpong))
    q, k, v, _, ct = make_problem(jax.random.key(d + block_kv), 1, 384, 512, 4, 2, d, BF16)
    out, lse, grads = run(impl, q, k, v, None, ct, dict(causal=causal))
    up = lambda x: x.astype(jnp.float32)
    r_out, r_lse, r_grads = run("reference", up(q), up(k), up(v), None, ct, dict(causal=causal))
    assert rel_err(out, r_out) < 3e-2
    assert rel_err(lse, r_lse) < 1e-4
    for g, rg in zip(grads, r_grads):
      assert rel_err(g, rg) < 3e-2

  @pytest.mark.parametrize("opts", [
      dict(causal=False), dict(causal=True), dict(causal=True, logit_softcap=30.0),
      dict(sliding_window=(100, 30)),  # skips at both ends of a CTA
      dict(sliding_window=5),  # narrower than a block: rows of the first block see none
      dict(causal=True, segments=True), dict(sliding_window=(100, 30), segments=True)])
  @pytest.mark.parametrize("d", [64, 128, 256])
  @pytest.mark.parametrize("persistent", [False, True])
  def test_overlapped_forward_matches_reference(self, opts, d, persistent):
    """MosaicConfig(overlap=True): PV of the previous block in flight during the softmax
    (and with persistent five CTAs looping over the query tiles)."""
    config = dataclasses.replace(MosaicConfig.for_head_dim(d), pingpong=False, overlap=True,
                                 persistent=persistent, num_sms=5 if persistent else None)
    impl = PallasMosaicGpu(config=config)
    q, k, v, seg, ct = make_problem(jax.random.key(d + 3), 2, 384, 512, 8, 2, d, BF16,
                                    segments=opts.get("segments", False))
    out, lse, grads = run(impl, q, k, v, seg, ct, opts)
    up = lambda x: x.astype(jnp.float32)
    r_out, r_lse, r_grads = run("reference", up(q), up(k), up(v), seg, ct, opts)
    assert rel_err(out, r_out) < 3e-2
    finite = jnp.isfinite(r_lse)
    assert bool(jnp.all(finite == jnp.isfinite(lse)))
    assert rel_err(jnp.where(finite, lse, 0.0), jnp.where(finite, r_lse, 0.0)) < 1e-4
    for g, rg in zip(grads, r_grads):
      assert rel_err(g, rg) < 3e-2

  @pytest.mark.parametrize("opts", [
      dict(causal=False), dict(causal=True), dict(causal=True, logit_softcap=30.0),
      dict(sliding_window=(100, 30)), dict(causal=True, segments=True)])
  @pytest.mark.parametrize("d", [128, 256])
  @pytest.mark.parametrize("overlap", [False, True])
  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  def test_lazy_rescale_follows_rising_maxima(self, opts, d, overlap, dtype):
    """lazy_rescale on keys whose scores rise along the walk, so that rows keep their
    maximum for some blocks (p up to 2^8) and move it past the threshold at others: the
    reference's output and log-sum-exp, and within rounding of the eager rescale."""
    config = dataclasses.replace(MosaicConfig.for_head_dim(d), pingpong=not overlap,
                                 overlap=overlap)
    q, k, v, seg, ct = make_problem(jax.random.key(d + 5), 2, 256, 640, 8, 2, d, dtype,
                                    segments=opts.get("segments", False))
    # q's rows lean on (1, …, 1), so the scores climb about 23 log2 units over the keys
    rise = jnp.linspace(0.0, 16.0 / d ** 0.5, k.shape[1])[None, :, None, None]
    q, k = (q.astype(jnp.float32) + 1.0).astype(dtype), (k + rise).astype(dtype)
    outs = [run(PallasMosaicGpu(config=dataclasses.replace(config, lazy_rescale=lazy)),
                q, k, v, seg, ct, opts) for lazy in (True, False)]
    up = lambda x: x.astype(jnp.float32)
    r_out, r_lse, r_grads = run("reference", up(q), up(k), up(v), seg, ct, opts)
    (out, lse, grads), (eager_out, eager_lse, _) = outs
    assert rel_err(out, r_out) < 3e-2
    assert rel_err(out, eager_out) < 1e-2
    finite = jnp.isfinite(r_lse)
    assert bool(jnp.all(finite == jnp.isfinite(lse)))
    assert rel_err(jnp.where(finite, lse, 0.0), jnp.where(finite, r_lse, 0.0)) < 1e-4
    assert rel_err(jnp.where(finite, lse, 0.0), jnp.where(finite, eager_lse, 0.0)) < 1e-5
    for g, rg in zip(grads, r_grads):
      assert rel_err(g, rg) < 3e-2

  @pytest.mark.parametrize("opts", [
      dict(causal=False), dict(causal=True), dict(causal=True, logit_softcap=30.0),
      dict(sliding_window=(100, 30)), dict(causal=True, segments=True)])
  @pytest.mark.parametrize("overlap", [False, True])
  @pytest.mark.parametrize("num_sms", [3, None])
  @pytest.mark.parametrize("dynamic", [False, True])
  def test_persistent_forward_gives_the_grids_bits(self, opts, overlap, num_sms, dynamic):
    """A persistent CTA's tile runs the grid CTA's arithmetic: the same output and
    log-sum-exp, bit for bit (3 CTAs: each loops over many tiles), whether its tiles are
    dealt before the launch or taken at run time."""
    config = dataclasses.replace(MosaicConfig(), pingpong=not overlap, overlap=overlap)
    q, k, v, seg, _ = make_problem(jax.random.key(11), 2, 512, 640, 8, 2, 128, BF16,
                                   segments=opts.get("segments", False))
    kw = {key: val for key, val in opts.items() if key != "segments"}
    if seg is not None:
      kw.update(q_segment_ids=seg[0], kv_segment_ids=seg[1])
    outs = [flash_attention(q, k, v, implementation=PallasMosaicGpu(config=c), return_lse=True,
                            **kw)
            for c in (config, dataclasses.replace(config, persistent=True, num_sms=num_sms,
                                                  dynamic=dynamic))]
    for grid, persistent in zip(*outs):
      np.testing.assert_array_equal(np.asarray(persistent, np.float32),
                                    np.asarray(grid, np.float32))

  @pytest.mark.parametrize("backward", [
      mb.MosaicBackwardConfig(dq_split=True), mb.MosaicBackwardConfig(dq_split=False),
      mb.MosaicBackwardConfig(dq_split=True, stages=3),
      mb.MosaicBackwardConfig(dq_split=False, stages=1),
      mb.MosaicBackwardConfig(dq_split=False, pingpong=True),
      mb.MosaicBackwardConfig(dq_split=False, gqa_per_query_head=True),
      mb.MosaicBackwardConfig(dq_split=False, pingpong=True, gqa_per_query_head=True),
      mb.MosaicBackwardConfig(dq_split=True, dq_stagger=True)])
  @pytest.mark.parametrize("causal", [False, True])
  @pytest.mark.parametrize("b, t, s, hq, hkv", [
      (2, 256, 384, 8, 2),    # T < S: under causal the last key blocks see no query
      (1, 384, 256, 4, 4),    # T > S
      (1, 256, 256, 4, 1)])   # MQA: one key head collects four query heads
  def test_mosaic_backward_matches_reference(self, backward, causal, b, t, s, hq, hkv):
    _assert_grads_match_reference(PallasMosaicGpu(backward_config=backward),
                                  jax.random.key(t + 3 * s + hq), (b, t, s, hq, hkv, 128),
                                  dict(causal=causal), deterministic=False)

  @pytest.mark.parametrize("dq_config", [
      MosaicDqConfig(), MosaicDqConfig(pingpong=True), MosaicDqConfig(block_kv=64),
      MosaicDqConfig(block_kv=64, pingpong=True), MosaicDqConfig(stages=1),
      # Rings of different depths: each refills in its own turn (a K block two steps
      # ahead of its V block, or the reverse).
      MosaicDqConfig(block_kv=64, stages=2, v_stages=1),
      MosaicDqConfig(block_kv=64, stages=1, v_stages=2)])
  @pytest.mark.parametrize("opts", [
      dict(causal=False), dict(causal=True),
      dict(sliding_window=(100, 30))])  # wider than a block: skips at both ends of a CTA
  @pytest.mark.parametrize("b, t, s, hq, hkv, d", [
      (2, 256, 384, 8, 2, 128),   # T < S, GQA 4:1
      (1, 384, 256, 4, 4, 64),    # T > S: under causal the last query rows see every key
      (1, 256, 512, 4, 1, 128)])  # MQA
  def test_mosaic_dq_kernel_matches_reference(self, dq_config, opts, b, t, s, hq, hkv, d):
    """The deterministic backward: the dK/dV-only Mosaic kernel beside mosaic_gpu_dq's."""
    _assert_grads_match_reference(PallasMosaicGpu(dq_config=dq_config),
                                  jax.random.key(t + 5 * s + d), (b, t, s, hq, hkv, d), opts)

  @pytest.mark.parametrize("block_q, pingpong", [(80, True), (80, False), (96, False)])
  @pytest.mark.parametrize("opts, segments", [
      (dict(causal=False), False), (dict(causal=True), False),
      (dict(sliding_window=(100, 30)), False), (dict(causal=True, logit_softcap=3.0), False),
      (dict(causal=True), True)])
  @pytest.mark.parametrize("b, t, s, hq, hkv", [
      (2, 256, 384, 8, 2),    # T = 3·80 + 16 (2·96 + 64): the last step reaches past T
      (1, 384, 256, 4, 1)])   # T > S, MQA
  def test_wide_step_dkv_kernel_matches_reference(self, block_q, pingpong, opts, segments, b, t,
                                                  s, hq, hkv):
    """The deterministic pair with block_q query rows per step of the dK/dV kernel."""
    backward = mb.MosaicBackwardConfig(dq_split=False, pingpong=pingpong, block_q=block_q,
                                       with_dq=False)
    impl = PallasMosaicGpu(backward_config=backward)
    q, k, v, seg, ct = make_problem(jax.random.key(t + s + block_q), b, t, s, hq, hkv, 128, BF16,
                                    segments=segments)
    _, _, grads = run(impl, q, k, v, seg, ct, opts)
    up = lambda x: x.astype(jnp.float32)
    _, _, r_grads = run("reference", up(q), up(k), up(v), seg, ct, opts)
    for name, g, rg in zip("qkv", grads, r_grads):
      assert rel_err(g, rg) < 3e-2, name

  @pytest.mark.parametrize("dq_config", [MosaicDqConfig(block_kv=64, stages=1),
                                         MosaicDqConfig(block_kv=64, stages=2, v_stages=1)])
  @pytest.mark.parametrize("opts", [dict(causal=False), dict(causal=True),
                                    dict(sliding_window=(100, 30))])
  def test_mosaic_dq_kernel_d256(self, dq_config, opts):
    """D = 256: one K/V slot each, and the default's two K slots beside one V slot."""
    _assert_grads_match_reference(PallasMosaicGpu(dq_config=dq_config), jax.random.key(256),
                                  (1, 256, 384, 4, 2, 256), opts)

  @pytest.mark.parametrize("backward", [
      mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1),
      mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1, pingpong=True),
      mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1,
                              gqa_per_query_head=True),
      mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1, scores_split=True)])
  @pytest.mark.parametrize("causal", [False, True])
  @pytest.mark.parametrize("b, t, s, hq, hkv", [(2, 256, 320, 8, 2), (1, 384, 192, 4, 4)])
  def test_mosaic_backward_d256_column_split(self, backward, causal, b, t, s, hq, hkv):
    """D = 256: each compute warpgroup owns half of the columns of dK, dV and dQ."""
    impl = PallasMosaicGpu(config=MosaicConfig(block_kv=64), backward_config=backward)
    _assert_grads_match_reference(impl, jax.random.key(t + s + hq), (b, t, s, hq, hkv, 256),
                                  dict(causal=causal), deterministic=False)

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  def test_mosaic_backward_d64_and_lse_cotangent(self, dtype):
    """D = 64 (no dq_split), and a cotangent on the log-sum-exp as well as the output."""
    q, k, v, _, ct = make_problem(jax.random.key(11), 2, 256, 256, 4, 2, 64, dtype)
    g_lse = jax.random.normal(jax.random.key(12), (2, 256, 4), jnp.float32)  # lse is [B, T, H]

    def loss(impl, q, k, v):
      out, lse = flash_attention(q, k, v, causal=True, return_lse=True, implementation=impl,
                                 deterministic=False)
      return jnp.sum(out.astype(jnp.float32) * ct) + jnp.sum(lse * g_lse)

    impl = PallasMosaicGpu(backward_config=mb.MosaicBackwardConfig(dq_split=False))
    got = jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2))(q, k, v)
    up = lambda x: x.astype(jnp.float32)
    want = jax.grad(functools.partial(loss, "reference"), argnums=(0, 1, 2))(up(q), up(k), up(v))
    tol = {jnp.bfloat16: 3e-2, jnp.float16: 5e-3}[dtype]
    for g, w in zip(got, want):
      assert rel_err(g, w) < tol

  @pytest.mark.parametrize("causal", [False, True])
  @pytest.mark.parametrize("d", [64, 128, 256])
  def test_softcap_matches_reference(self, causal, d):
    """Gemma-style logit softcap, small enough (cap 2) that the tanh saturates for many scores."""
    q, k, v, _, ct = make_problem(jax.random.key(d + causal), 1, 256, 384, 4, 2, d, BF16)
    opts = dict(causal=causal, logit_softcap=2.0)
    up = lambda x: x.astype(jnp.float32)
    r_out, r_lse, r_grads = run("reference", up(q), up(k), up(v), None, ct, opts)
    for deterministic in (True, False):
      out, lse, grads = run(PallasMosaicGpu(), q, k, v, None, ct,
                            dict(opts, deterministic=deterministic))
      assert rel_err(out, r_out) < 3e-2
      assert rel_err(lse, r_lse) < 1e-3
      for g, rg in zip(grads, r_grads):
        assert rel_err(g, rg) < 3e-2

  def test_triton_backward_on_request(self):
    """A pallas_triton BlockConfig runs the Triton dq and dk/dv kernels instead."""
    impl = PallasMosaicGpu(backward_config=pallas_triton.default_config(128))
    q, k, v, _, ct = make_problem(jax.random.key(3), 1, 256, 256, 4, 2, 128, BF16)
    f = lambda q, k, v: flash_attention(q, k, v, causal=True, implementation=impl)
    text = jax.jit(jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
                   ).lower(q, k, v).as_text()
    assert "flash_attention_dq" in text and "flash_attention_bwd_mosaic" not in text
    _, _, grads = run(impl, q, k, v, None, ct, dict(causal=True))
    up = lambda x: x.astype(jnp.float32)
    _, _, r_grads = run("reference", up(q), up(k), up(v), None, ct, dict(causal=True))
    for g, rg in zip(grads, r_grads):
      assert rel_err(g, rg) < 3e-2

  @pytest.mark.parametrize("causal", [False, True])
  def test_default_backward_is_bitwise_reproducible(self, causal):
    """deterministic=True (the default): repeated backward passes give identical bits. Many
    key blocks per query row, so that a reduction in arrival order would show."""
    q, k, v, _, ct = make_problem(jax.random.key(21), 2, 1024, 2048, 8, 2, 128, BF16)
    f = lambda q, k, v: flash_attention(q, k, v, causal=causal)
    step = jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1](ct.astype(BF16)))
    first = step(q, k, v)
    for _ in range(3):
      for g, h in zip(first, step(q, k, v)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(h, np.float32))

  @pytest.mark.parametrize("backward", [
      mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True),
      mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, dq_buffers=2),
      mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, dq_buffers=2, dq_rotate=True),
      mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1, dq_ordered=True,
                              dq_rotate=True),
      mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, dq_buffers=2, dq_heavy_first=True),
      mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1, dq_ordered=True,
                              dq_heavy_first=True),
      mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, dq_buffers=2,
                              gqa_per_query_head=True),
      mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1, dq_ordered=True,
                              dq_rotate=True, scores_split=True),
      mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1, dq_ordered=True,
                              dq_heavy_first=True, scores_split=True),
      mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1, dq_ordered=True,
                              dq_heavy_first=True, scores_split=True, gqa_per_query_head=True),
      mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, dq_buffers=2, dq_rotate=True,
                              dq_rounded=True),
      mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1, dq_ordered=True,
                              dq_heavy_first=True, scores_split=True, dq_rounded=True),
      mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, stages=3),
      mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, stages=3,
                              gqa_per_query_head=True)],
      ids=["one_slot", "two_slots", "rotate", "d256", "heavy_first", "d256_heavy_first",
           "per_query_head", "d256_split_scores", "d256_heavy_first_split_scores",
           "d256_per_query_head", "rounded", "d256_rounded", "three_stages",
           "three_stages_per_query_head"])
  @pytest.mark.parametrize("opts", [dict(causal=False), dict(causal=True),
                                    dict(sliding_window=(300, 100))])
  def test_ordered_backward_is_bitwise_reproducible(self, backward, opts):
    """dq_ordered: the one-pass kernel (deterministic by default) gives identical bits on
    every call, and the reference's gradients. 16 key blocks per query row (32 at D = 256),
    GQA 4:1."""
    d = 256 if backward.column_split else 128
    q, k, v, _, ct = make_problem(jax.random.key(22), 2, 1024, 2048, 8, 2, d, BF16)
    _assert_reproducible_grads(PallasMosaicGpu(backward_config=backward), q, k, v, None, ct,
                               opts)

  def test_long_causal_documents_under_gqa_take_a_cta_per_query_head(self, monkeypatch):
    """The default backward of deterministic causal GQA calls with segment ids from
    CAUSAL_DOCUMENTS_QUERIES on (lowered here to the test's length): one CTA per query head in
    rank order beside the ids, the same bits every call, and the reference's gradients."""
    monkeypatch.setattr(mb, "CAUSAL_DOCUMENTS_QUERIES", 768)
    q, k, v, seg, ct = make_problem(jax.random.key(27), 2, 768, 768, 8, 2, 128, BF16,
                                    segments=True)
    st = PallasMosaicGpu()._static(q, k, _opts(True, None, True))  # pylint: disable=protected-access
    assert st.backward.gqa_per_query_head and st.backward.dq_ordered
    _assert_reproducible_grads("pallas_mosaic_gpu", q, k, v, seg, ct,
                               dict(causal=True, segments=True))

  @pytest.mark.parametrize("hkv", [4, 1])
  def test_rounded_dq_matches_and_keeps_the_float32_sums_error(self, hkv):
    """Short deterministic calls add dq in the input dtype (dq_rounded): the same bits every
    call, and at ROUNDED_DQ_MAX_ADDERS key blocks an error against the float32 reference
    within 1.4× the float32 sum's."""
    t = mb.ROUNDED_DQ_MAX_ADDERS * 2 * mb.BLOCK_KV
    q, k, v, _, ct = make_problem(jax.random.key(26), 1, t, t, 4, hkv, 128, BF16)
    st = PallasMosaicGpu()._static(q, k, _opts(causal=True))  # pylint: disable=protected-access
    assert st.backward.dq_rounded
    f32_sum = PallasMosaicGpu(backward_config=dataclasses.replace(st.backward, dq_rounded=False))
    step = lambda impl: jax.jit(lambda q, k, v: run(impl, q, k, v, None, ct,
                                                    dict(causal=True))[2])
    rounded = step(PallasMosaicGpu())
    first = rounded(q, k, v)
    for g, h in zip(first, rounded(q, k, v)):
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(h, np.float32))
    summed = step(f32_sum)(q, k, v)
    up = lambda x: x.astype(jnp.float32)
    _, _, r_grads = run("reference", up(q), up(k), up(v), None, ct, dict(causal=True))
    for g, rg in zip(first, r_grads):
      assert rel_err(g, rg) < 3e-2
    for g, h in zip(first[1:], summed[1:]):  # dK, dV: the same kernel's bits
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(h, np.float32))
    assert rel_err(first[0], r_grads[0]) < 1.4 * rel_err(summed[0], r_grads[0])

  @pytest.mark.parametrize("hkv, d", [(4, 128), (2, 64), (1, 96), (4, 96)])
  def test_rounded_per_block_takes_each_blocks_own_sum(self, hkv, d):
    """dq_rounded_per_block, the default beside segment ids past ROUNDED_DQ_MAX_ADDERS key
    blocks: the same bits every call, near the float32 reference; and from the same
    residuals and row statistics, a query block with at most that many adders has
    dq_rounded's bits, one with more the float32 sums', one that no key is visible to zeros,
    and dK and dV are the float32 kernel's. D = 96 without GQA runs dq_stagger, whose
    warpgroup 0 stores each step's dQ a step late."""
    t = 4096
    rows = [np.repeat([0, 1, 3], [384, 3584, 128]), np.repeat([0, 1], [2000, 2096])]
    q_ids = np.stack(rows).astype(np.int32)
    kv_ids = q_ids.copy()
    kv_ids[0, -128:] = 2  # the last 128 queries of row 0 see no key
    seg = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
    q, k, v, _, ct = make_problem(jax.random.key(29), 2, t, t, 4, hkv, d, BF16)
    opts = _opts(True, None, True, scale=d ** -0.5)
    backward = PallasMosaicGpu()._static(q, k, opts).backward  # pylint: disable=protected-access
    assert backward.dq_rounded_per_block
    grads, r_grads = _assert_reproducible_grads("pallas_mosaic_gpu", q, k, v, seg, ct,
                                                dict(causal=True, segments=True))
    out, lse, _ = run("pallas_mosaic_gpu", q, k, v, seg, ct, dict(causal=True, segments=True))
    res = Residuals(q, k, v, *seg, out, jnp.swapaxes(lse, 1, 2))  # [B, Hq, T]
    d_out, d_lse = ct.astype(BF16), jnp.zeros_like(res.lse)
    stats = mb.row_stats(opts, res, _common.softmax_delta(out, d_out, d_lse))
    grads_of = lambda **kw: [np.asarray(g, np.float32) for g in jax.jit(
        lambda res, stats: mb.backward(opts, dataclasses.replace(backward, **kw), res,
                                       (d_out, d_lse), stats=stats)[:3])(res, stats)]
    per_block = grads_of()
    rounded = grads_of(dq_rounded_per_block=False, dq_rounded=True)
    summed = grads_of(dq_rounded_per_block=False)
    for g, h in zip(per_block[1:], summed[1:]):
      np.testing.assert_array_equal(g, h)
    # Per query block, the key blocks of 128 with a key visible to one of its queries.
    bq = backward.block_q
    idx = np.arange(t)
    seen = (idx[None, None] <= idx[None, :, None]) & (q_ids[:, :, None] == kv_ids[:, None])
    adders = seen.reshape(2, t // bq, bq, t // 128, 128).any(axis=(2, 4)).sum(axis=-1)
    few = lambda n: 0 < n <= mb.ROUNDED_DQ_MAX_ADDERS
    for bb, qb in np.ndindex(adders.shape):
      block, n = (bb, slice(qb * bq, (qb + 1) * bq)), adders[bb, qb]
      want = (rounded if few(n) else summed)[0][block] * (n > 0)
      np.testing.assert_array_equal(per_block[0][block], want, err_msg=f"{block}: {n} adders")
    assert {0, 1, mb.ROUNDED_DQ_MAX_ADDERS + 1} <= set(adders.flat)
    assert rel_err(grads[0], r_grads[0]) <= 1.4 * rel_err(summed[0], r_grads[0])

  def test_large_groups_keep_dk_dv_near_the_float32_sums_error(self):
    """Causal MQA with 16 query heads per key head (past ORDERED_SHARES_MAX_GROUP): each
    query head's CTA stores its dK and dV shares as partials, summed in float32. The same
    bits every call, and errors against the float32 reference within 1.25× those of float32
    adds (in arrival order; 1.16× for dV on an H200), which the shares' bf16 adds in
    order exceed (2.0×)."""
    q, k, v, _, ct = make_problem(jax.random.key(28), 1, 1024, 1024, 16, 1, 128, BF16)
    opts = dict(causal=True)
    st = PallasMosaicGpu()._static(q, k, _opts(causal=True))  # pylint: disable=protected-access
    assert st.backward.group_splits == 16 and not st.backward.gqa_per_query_head
    in_order = PallasMosaicGpu(backward_config=dataclasses.replace(
        st.backward, gqa_per_query_head=True, group_splits=1))
    first, r_grads = _assert_reproducible_grads(PallasMosaicGpu(), q, k, v, None, ct, opts,
                                                calls=1)
    errs = lambda grads: [rel_err(g, r) for g, r in zip(grads[1:], r_grads[1:])]
    other = lambda impl, **kw: errs(run(impl, q, k, v, None, ct, {**opts, **kw})[2])
    partials, ordered = errs(first), other(in_order)
    float32 = other(PallasMosaicGpu(backward_config=mb.MosaicBackwardConfig(
        dq_split=False, pingpong=True, gqa_per_query_head=True)), deterministic=False)
    for name, p, o, f in zip("kv", partials, ordered, float32):
      assert p < 1.25 * f < o, (name, p, o, f)

  @pytest.mark.parametrize("hkv, d", [(4, 128), (1, 128), (4, 96)])
  def test_long_causal_calls_stagger(self, hkv, d):
    """From long_walk_queries(d) queries a deterministic causal call runs the `_long` section
    (staggered warpgroups; D = 96 takes D = 128's): the reference's gradients,
    the same bits every call."""
    t = mb.long_walk_queries(d)
    q, k, v, _, ct = make_problem(jax.random.key(25), 1, t, t, 4, hkv, d, BF16)
    opts = _opts(causal=True)
    st = PallasMosaicGpu()._static(q, k, opts)  # pylint: disable=protected-access
    assert st.backward.dq_stagger and st.backward.dq_ordered
    _assert_reproducible_grads(PallasMosaicGpu(), q, k, v, None, ct, dict(causal=True),
                               calls=1)

  @pytest.mark.parametrize("backward", [
      mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, dq_buffers=2, dq_rotate=True),
      mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, dq_buffers=1)],
      ids=["rotate", "one_slot"])
  @pytest.mark.parametrize("opts", [dict(causal=False), dict(causal=True),
                                    dict(sliding_window=(300, 100))])
  def test_staggered_dq_gives_the_same_bits(self, backward, opts):
    """dq_stagger: the same WGMMAs on the same operands, warpgroup 0's dQ half a step later:
    bit for bit the ordered kernel's gradients, on every call. GQA 4:1, 16 key blocks."""
    q, k, v, _, ct = make_problem(jax.random.key(25), 2, 1024, 2048, 8, 2, 128, BF16)
    step = lambda c: jax.jit(lambda q, k, v: run(PallasMosaicGpu(backward_config=c), q, k, v,
                                                 None, ct, opts)[2])
    staggered = step(dataclasses.replace(backward, dq_stagger=True))
    want = step(backward)(q, k, v)
    for _ in range(3):
      for g, h in zip(staggered(q, k, v), want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(h, np.float32))

  @pytest.mark.parametrize("opts", [dict(causal=False), dict(causal=True, logit_softcap=20.0)])
  def test_staggered_arrival_order_matches_the_reference(self, opts):
    """dq_stagger in arrival order (deterministic=False's kernel): the reference's gradients."""
    q, k, v, _, ct = make_problem(jax.random.key(26), 2, 1024, 1024, 4, 4, 128, BF16)
    config = mb.MosaicBackwardConfig(dq_split=True, dq_stagger=True)
    _, _, grads = run(PallasMosaicGpu(backward_config=config), q, k, v, None, ct,
                      {**opts, "deterministic": False})
    up = lambda x: x.astype(jnp.float32)
    _, _, r_grads = run("reference", up(q), up(k), up(v), None, ct, opts)
    for name, g, rg in zip("qkv", grads, r_grads):
      assert rel_err(g, rg) < 3e-2, name

  @pytest.mark.parametrize("backward", [
      mb.MosaicBackwardConfig(dq_split=True),
      mb.MosaicBackwardConfig(dq_split=True, dq_stagger=True),
      mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, dq_buffers=2, dq_rotate=True,
                              dq_stagger=True),
      mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, dq_buffers=2),
      mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True),
      mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, dq_buffers=2, dq_rotate=True,
                              stages=3),
      mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, dq_buffers=2, stages=3),
      mb.MosaicBackwardConfig(dq_split=True, block_q=128),
      mb.MosaicBackwardConfig(dq_split=True, dq_ordered=True, dq_buffers=2, dq_rotate=True,
                              block_q=128, dq_rounded=True)],
      ids=["arrival", "stagger", "ordered_rotate", "ordered_two_slots", "ordered_one_slot",
           "rotate_3_stages", "two_slots_3_stages", "arrival_128_rows", "rounded_128_rows"])
  @pytest.mark.parametrize("opts, hkv", [(dict(causal=False), 4), (dict(causal=True), 4),
                                         (dict(sliding_window=(300, 100)), 4),
                                         (dict(causal=False), 2)])
  def test_d64_dq_split_matches_reference(self, backward, opts, hkv):
    """dq_split at D = 64 (K, V, Q, dO and dSᵀ in 64-byte swizzles, so that dQ reads K's
    columns by 32-wide halves): the reference's gradients; the ordered kernels give the same
    bits on every call."""
    q, k, v, _, ct = make_problem(jax.random.key(27), 2, 1024, 1024, 4, hkv, 64, BF16)
    impl = PallasMosaicGpu(backward_config=backward)
    kw = {**opts, "deterministic": backward.dq_ordered}
    _, _, grads = run(impl, q, k, v, None, ct, kw)
    if backward.dq_ordered:
      for g, h in zip(grads, run(impl, q, k, v, None, ct, kw)[2]):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(h, np.float32))
    up = lambda x: x.astype(jnp.float32)
    _, _, r_grads = run("reference", up(q), up(k), up(v), None, ct, opts)
    for name, g, rg in zip("qkv", grads, r_grads):
      assert rel_err(g, rg) < 3e-2, name

  def test_default_picks_mosaic_where_it_serves(self):
    q = jnp.ones((1, 256, 4, 128), BF16)
    assert _MOSAIC_CALL.search(jax.jit(flash_attention).lower(q, q, q).as_text())
    q96 = jnp.ones((1, 1000, 4, 80), BF16)  # T = 1,000, D = 80: padded (_padding)
    assert _MOSAIC_CALL.search(jax.jit(flash_attention).lower(q96, q96, q96).as_text())
    q32 = jnp.ones((1, 256, 4, 32), BF16)  # D = 32: falls through to pallas_triton
    assert not _MOSAIC_CALL.search(jax.jit(flash_attention).lower(q32, q32, q32).as_text())

  def test_backward_from_saved_residuals_equals_vjp(self):
    from memeff_jax.ops.flash_attention import flash_attention_backward  # pylint: disable=import-outside-toplevel
    q, k, v, _, ct = make_problem(jax.random.key(5), 1, 256, 256, 4, 2, 128, BF16)
    f = lambda q, k, v: flash_attention(q, k, v, causal=True, return_lse=True,
                                        implementation="pallas_mosaic_gpu")
    (out, lse), vjp = jax.vjp(f, q, k, v)
    ct = ct.astype(BF16)
    want = vjp((ct, jnp.full_like(lse, 0.5)))
    got = flash_attention_backward(q, k, v, out, lse, ct, jnp.full_like(lse, 0.5), causal=True,
                                   implementation="pallas_mosaic_gpu")
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("b, t, hq, hkv, d, sms", [
    (1, 1024, 8, 1, 256, 40),  # MQA: 4 splits of 2 query heads, 32 CTAs
    (2, 768, 4, 2, 256, 30),   # one split, 24 CTAs
    (1, 1024, 4, 4, 128, 20),  # dq_split, 128 keys per CTA, no GQA: 16 CTAs
    (2, 512, 8, 2, 128, 9)])   # one split, 8 CTAs
def test_paired_backward_matches_reference(monkeypatch, b, t, hq, hkv, d, sms):
  """dq_paired against the float32 reference, and the same bits when run again (the SMs
  the schedule sees patched down, so that the grid of key blocks would take more than one
  wave)."""
  monkeypatch.setattr(mb.hopper, "sm_count", lambda: sms)
  if d == 256:
    config = mb.MosaicBackwardConfig(dq_split=False, column_split=True, stages=1,
                                     scores_split=True, dq_ordered=True, dq_paired=True,
                                     group_splits=hq // hkv)
  else:
    config = mb.MosaicBackwardConfig(dq_ordered=True, dq_buffers=2, early_softmax=True,
                                     dq_paired=True)
  assert mb._paired_splits(config, MaskSpec.make(True, None, False), b, hq, hkv, t, t, sms)  # pylint: disable=protected-access
  impl = PallasMosaicGpu(backward_config=config)
  q, k, v, _, ct = make_problem(jax.random.key(t + d + hkv), b, t, t, hq, hkv, d, BF16)
  opts = dict(causal=True)
  out, lse, grads = run(impl, q, k, v, None, ct, opts)
  r_out, _, r_grads = run("reference", *(x.astype(jnp.float32) for x in (q, k, v)), None, ct,
                          opts)
  assert rel_err(out, r_out) < 3e-2
  for g, rg in zip(grads, r_grads):
    assert rel_err(g, rg) < 3e-2
  for g, again in zip(grads, run(impl, q, k, v, None, ct, opts)[2]):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(again, np.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuFeatures(_FlashAttentionTest):
  """Every mask and feature of the shared suite through both Mosaic kernels, as calls with
  deterministic=False run them (D = 128, GQA 4:1, T ≠ S: the ordered one-pass kernel, which
  measured faster there than arrival order; TestMosaicGpuSplitDq runs arrival order)."""

  impl = PallasMosaicGpu()
  extra = dict(deterministic=False)
  dtypes = (jnp.bfloat16, jnp.float16)
  shape = dict(b=2, t=512, s=768, hq=8, hkv=2, d=128)
  deterministic_dq = "flash_attention_dq_mosaic"  # the dq kernel of deterministic calls

  def test_rows_that_see_no_key_give_zero_and_finite_gradients(self):
    """A segment id with no key, and queries past the last key's window (T > S)."""
    b, t, s, h, d = 1, 512, 384, 4, self.shape["d"]
    q, k, v, _, ct = make_problem(jax.random.key(3), b, t, s, h, 2, d, BF16)
    q_seg = jnp.where(jnp.arange(t) < 200, 0, 7)[None]  # id 7 has no key
    kv_seg = jnp.zeros((1, s), jnp.int32)
    cases = [(dict(sliding_window=(5, 2)), (q_seg, kv_seg), slice(200, None)),
             (dict(sliding_window=(2, 2)), None, slice(s + 2, None))]
    for opts, seg, empty in cases:
      out, lse, grads = run(self.impl, q, k, v, seg, ct, {**self.extra, **opts})
      r_out, r_lse, r_grads = run("reference", *(x.astype(jnp.float32) for x in (q, k, v)), seg,
                                  ct, opts)
      assert np.all(np.asarray(out, np.float32)[0, empty] == 0.0)
      assert np.all(np.isneginf(np.asarray(lse)[0, empty]))
      np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))
      assert rel_err(out, r_out) < 3e-2
      for g, rg in zip(grads, r_grads):
        assert np.all(np.isfinite(np.asarray(g, np.float32)))
        assert rel_err(g, rg) < 3e-2

  def test_matches_jax_nn(self):
    q, k, v, _, _ = make_problem(jax.random.key(4), 2, 256, 256, 4, 2, self.shape["d"], BF16)
    for causal in (False, True):
      for window in (None, (70, 0), (40, 90)):
        got = flash_attention(q, k, v, causal=causal, sliding_window=window,
                              implementation=self.impl, **self.extra)
        want = jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=window)
        assert rel_err(got, want) < 1e-2

  @pytest.mark.parametrize("causal", [False, True])
  def test_unsorted_segment_ids(self, causal):
    """Ids in no order: the block ranges are then a superset, and the mask does the rest."""
    b, t, s, d = 2, 256, 384, self.shape["d"]
    q, k, v, _, ct = make_problem(jax.random.key(8), b, t, s, 4, 2, d, BF16)
    seg = (jax.random.randint(jax.random.key(9), (b, t), 0, 3),
           jax.random.randint(jax.random.key(10), (b, s), 0, 3))
    opts = dict(causal=causal)
    out, lse, grads = run(self.impl, q, k, v, seg, ct, {**self.extra, **opts})
    r_out, r_lse, r_grads = run("reference", *(x.astype(jnp.float32) for x in (q, k, v)), seg, ct,
                                opts)
    assert rel_err(out, r_out) < 3e-2
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(r_lse))
    for g, rg in zip(grads, r_grads):
      assert rel_err(g, rg) < 3e-2

  @pytest.mark.parametrize("causal", [False, True])
  def test_documents_over_several_blocks(self, causal):
    """Documents of 300 to 600 tokens: blocks inside one document run without a mask
    (segment_block_ranges' full ranges), those across a boundary with it."""
    b, t, d = 2, 1024, self.shape["d"]
    q, k, v, _, ct = make_problem(jax.random.key(12), b, t, t, 4, 2, d, BF16)
    pos = jnp.arange(t)
    seg = jnp.stack([(pos >= 300).astype(jnp.int32) + (pos >= 700), pos // 512])
    out, lse, grads = run(self.impl, q, k, v, (seg, seg), ct, {**self.extra, "causal": causal})
    r_out, r_lse, r_grads = run("reference", *(x.astype(jnp.float32) for x in (q, k, v)),
                                (seg, seg), ct, dict(causal=causal))
    assert rel_err(out, r_out) < 3e-2 and rel_err(lse, r_lse) < 1e-2
    for g, rg in zip(grads, r_grads):
      assert rel_err(g, rg) < 3e-2

  def test_packed_documents_take_the_mosaic_kernels(self):
    q = jnp.ones((1, 256, 4, self.shape["d"]), BF16)
    seg = jnp.repeat(jnp.arange(4), 64)[None]
    # The dK/dV kernel beside the dq kernel where the call's config has no dq (this mask is
    # not causal alone): deterministic calls without an `_ordered` section, and at D = 112 to
    # 192 (the pair, faster there than arrival order) calls with deterministic=False too.
    cfg = mb.MosaicBackwardConfig
    pair = lambda pick: not pick(self.shape["d"], False, segments=True).with_dq
    for deterministic in (False, True):
      f = lambda q, d=deterministic: flash_attention(q, q, q, causal=True, sliding_window=100,
                                                     q_segment_ids=seg, deterministic=d)
      text = jax.jit(jax.grad(lambda q, f=f: f(q).astype(jnp.float32).sum())).lower(q).as_text()
      assert "flash_attention_fwd_mosaic" in text and "flash_attention_bwd_mosaic" in text
      assert (self.deterministic_dq in text) == pair(
          cfg.for_deterministic if deterministic else cfg.for_nondeterministic)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuSplitDq(TestMosaicGpuFeatures):
  """The features suite through the one-pass backward whose warpgroups split dQ's columns
  and issue it with dV and dK (dq_split), unstaggered, bf16."""

  impl = PallasMosaicGpu(backward_config=mb.MosaicBackwardConfig(dq_split=True))
  dtypes = (jnp.bfloat16,)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuArrivalPerQueryHead(TestMosaicGpuFeatures):
  """Arrival order with one CTA per query head, dK and dV added by TMA reductions, and the
  compute warpgroups in ping-pong (an explicit config: no default runs it), bf16."""

  impl = PallasMosaicGpu(backward_config=mb.MosaicBackwardConfig(
      dq_split=False, pingpong=True, gqa_per_query_head=True))
  dtypes = (jnp.bfloat16,)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuOrderedDq(TestMosaicGpuFeatures):
  """The features suite through the one-pass backward with its dq reductions in a fixed
  order (dq_ordered), which deterministic calls (the default) may run whole, bf16."""

  impl = PallasMosaicGpu(backward_config=mb.MosaicBackwardConfig(
      dq_split=True, dq_ordered=True))
  extra = {}
  dtypes = (jnp.bfloat16,)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuOrderedDqTwoSlots(TestMosaicGpuOrderedDq):
  """dq_ordered with the dQ tiles sent from two slots, and the walks rotated where there is
  no mask."""

  impl = PallasMosaicGpu(backward_config=mb.MosaicBackwardConfig(
      dq_split=True, dq_ordered=True, dq_buffers=2, dq_rotate=True))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuOrderedDqStagger(TestMosaicGpuOrderedDq):
  """The ordered defaults (two slots, rotated walks) with the compute warpgroups half a step
  apart, taking turns (dq_stagger)."""

  impl = PallasMosaicGpu(backward_config=mb.MosaicBackwardConfig(
      dq_split=True, dq_ordered=True, dq_buffers=2, dq_rotate=True, dq_stagger=True))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuPersistentForward(TestMosaicGpuFeatures):
  """The forward with persistent (seven CTAs looping over the query tiles, ping-pong)."""

  impl = PallasMosaicGpu(config=MosaicConfig(persistent=True, num_sms=7))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuDynamicForward(TestMosaicGpuFeatures):
  """The persistent forward with its tiles taken at run time (seven CTAs)."""

  impl = PallasMosaicGpu(config=MosaicConfig(persistent=True, num_sms=7, dynamic=True))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuFeaturesD64(TestMosaicGpuFeatures):
  """D = 64, MQA: the ordered backward (dQ's 32-column halves, 128-query steps), which
  deterministic=False runs too (test_d64_dq_split_matches_reference: arrival order)."""

  dtypes = (jnp.bfloat16,)
  shape = dict(b=1, t=384, s=512, hq=4, hkv=1, d=64)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuFeaturesD256(TestMosaicGpuFeatures):
  """D = 256: the Mosaic forward with 64-key blocks, the backward with column_split."""

  dtypes = (jnp.bfloat16,)
  shape = dict(b=1, t=256, s=384, hq=4, hkv=2, d=256)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuFeaturesDeterministic(TestMosaicGpuFeatures):
  """The default deterministic backward: at this suite's GQA 4:1 the ordered one-pass
  kernel, one CTA per key head (d128_gqa_ordered), or under a causal mask one per query
  head (d128_causal_gqa_ordered)."""

  extra = {}
  dtypes = (jnp.bfloat16,)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuFeaturesD256Mha(TestMosaicGpuFeaturesD256):
  """D = 256, one query head per key head: dq in arrival order (d256[_causal])."""

  shape = dict(b=1, t=256, s=384, hq=4, hkv=4, d=256)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuFeaturesDeterministicD64(TestMosaicGpuFeaturesD64):
  extra = {}


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuFeaturesDeterministicD256(TestMosaicGpuFeaturesD256):
  extra = {}


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuFeaturesDeterministicD256Mha(TestMosaicGpuFeaturesD256):
  """One query head per key head: the ordered column-split kernel (d256[_causal]_ordered),
  which the GQA suite runs one CTA per key head (d256_gqa_ordered) or causal per query head
  (d256_causal_gqa_ordered)."""

  extra = {}
  shape = dict(b=1, t=256, s=384, hq=4, hkv=4, d=256)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuOrderedDqD256(TestMosaicGpuFeaturesD256):
  """D = 256: the column-split one-pass backward with dq_ordered, deterministic calls."""

  impl = PallasMosaicGpu(backward_config=mb.MosaicBackwardConfig(
      dq_split=False, column_split=True, stages=1, dq_ordered=True))
  extra = {}


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuFeaturesD96(TestMosaicGpuFeatures):
  """D = 96: 64-byte swizzles (dq_split's 48-column halves of K 32-byte ones), dq in arrival
  order (an explicit config: deterministic=False runs D = 128's ordered settings)."""

  impl = PallasMosaicGpu(backward_config=mb.MosaicBackwardConfig(dq_split=True))
  dtypes = (jnp.bfloat16,)
  shape = dict(b=1, t=256, s=384, hq=4, hkv=2, d=96)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuFeaturesDeterministicD96(TestMosaicGpuFeaturesD96):
  """D = 96, deterministic: the ordered kernel with D = 128's settings (no fused Δ)."""

  impl = PallasMosaicGpu()
  extra = {}


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuFeaturesDeterministicD96Mha(TestMosaicGpuFeaturesDeterministicD96):
  shape = dict(b=1, t=256, s=384, hq=4, hkv=4, d=96)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuFeaturesD192(TestMosaicGpuFeatures):
  """D = 192: the forward with 64-key blocks; the backward's dK/dV-only kernel at full width,
  32 query rows a step, beside the dq kernel (without GQA under a causal mask, the ordered
  column-split kernel with 96 columns a warpgroup in 64-byte swizzles)."""

  dtypes = (jnp.bfloat16,)
  shape = dict(b=1, t=256, s=384, hq=4, hkv=2, d=192)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuFeaturesD192Mha(TestMosaicGpuFeaturesD192):
  """D = 192, one query head per key head."""

  shape = dict(b=1, t=256, s=384, hq=4, hkv=4, d=192)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuFeaturesDeterministicD192(TestMosaicGpuFeaturesD192):
  """D = 192, deterministic: the ordered column-split kernel with D = 256's settings (causal:
  two Q/dO stages, d192_causal_ordered)."""

  extra = {}


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuFeaturesDeterministicD192Mha(TestMosaicGpuFeaturesDeterministicD192):
  shape = dict(b=1, t=256, s=384, hq=4, hkv=4, d=192)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuPadded(_FlashAttentionTest):
  """Lengths and a head dim the kernels do not take run on padded copies (_padding): T =
  1,000 and S = 1,537 to 1,024 and 1,664, D = 88 to 96, GQA 4:1, deterministic; every
  feature of the shared suite (segment ids, windows, softcap, an LSE cotangent)."""

  impl = PallasMosaicGpu()
  dtypes = (jnp.bfloat16,)
  shape = dict(b=2, t=1000, s=1537, hq=8, hkv=2, d=88)

  def test_rows_that_see_no_key_give_zero_and_finite_gradients(self):
    """A segment id with no key: output 0, lse -inf, finite gradients, padded or not."""
    b, t, s, h, d = 1, self.shape["t"], self.shape["s"], 4, self.shape["d"]
    q, k, v, _, ct = make_problem(jax.random.key(3), b, t, s, h, 2, d, BF16)
    q_seg = jnp.where(jnp.arange(t) < 300, 0, 7)[None]  # id 7 has no key
    kv_seg = jnp.zeros((1, s), jnp.int32)
    out, lse, grads = run(self.impl, q, k, v, (q_seg, kv_seg), ct, {**self.extra, "causal": True})
    assert np.all(np.asarray(out, np.float32)[0, 300:] == 0.0)
    assert np.all(np.isneginf(np.asarray(lse)[0, 300:]))
    r_out, _, r_grads = run("reference", *(x.astype(jnp.float32) for x in (q, k, v)),
                            (q_seg, kv_seg), ct, dict(causal=True))
    assert rel_err(out, r_out) < 3e-2
    for g, rg in zip(grads, r_grads):
      assert np.all(np.isfinite(np.asarray(g, np.float32)))
      assert rel_err(g, rg) < 3e-2

  def test_matches_jax_nn(self):
    q, k, v, _, _ = make_problem(jax.random.key(4), 2, 200, 200, 4, 2, self.shape["d"], BF16)
    for causal in (False, True):
      got = flash_attention(q, k, v, causal=causal, implementation=self.impl, **self.extra)
      want = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                          is_causal=causal)
      assert rel_err(got, want) < 3e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuInPlace(TestMosaicGpuPadded):
  """T = 1,000 and S = 1,544 at D = 128 run in place (_padding.Padding.in_place): the kernels
  take the padded lengths and read and write the call's own arrays past their ends (rows
  there load as zeros and take no stores); every feature of the shared suite."""

  shape = dict(b=2, t=1000, s=1544, hq=8, hkv=2, d=128)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuInPlaceD192(TestMosaicGpuInPlace):
  """In place at D = 192 (64-key forward blocks, the column-split backward), T > S."""

  shape = dict(b=2, t=520, s=264, hq=4, hkv=2, d=192)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuInPlaceD64(TestMosaicGpuInPlace):
  """In place at D = 64 (its persistent forward, 128-query backward steps), T < S."""

  shape = dict(b=2, t=264, s=520, hq=4, hkv=4, d=64)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuInPlaceD64Gqa(TestMosaicGpuInPlace):
  """In place at D = 64, GQA 2:1, T > S: causal calls run one CTA per query head, their rows
  past S kept from the padded keys by the key bound."""

  shape = dict(b=2, t=520, s=264, hq=4, hkv=2, d=64)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuGroupWalks(TestMosaicGpuPadded):
  """One CTA per key block walking all 4 query heads of its key head (group_splits=1, which
  calls this short would not take), dq ordered; T and S in place."""

  impl = PallasMosaicGpu(backward_config=mb.MosaicBackwardConfig(dq_ordered=True, dq_buffers=2))
  shape = dict(b=2, t=1000, s=1544, hq=8, hkv=2, d=128)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuUnevenGroupSplits(TestMosaicGpuPadded):
  """The dK/dV-only kernel beside the dq kernel, 3 splits of 4 query heads (shares of 1, 1
  and 2), MQA."""

  impl = PallasMosaicGpu(backward_config=mb.MosaicBackwardConfig(
      dq_split=False, with_dq=False, group_splits=3))
  shape = dict(b=2, t=520, s=264, hq=4, hkv=1, d=64)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuD160(TestMosaicGpuPadded):
  """D = 160 as it is (the forward on D = 192's settings, in 32-byte swizzles; the dK/dV-only
  backward at full width beside the dq kernel), T = 300 > S = 200 on padded copies of the
  lengths: causal rows past S would see the padded keys but for the key bound."""

  shape = dict(b=2, t=300, s=200, hq=4, hkv=2, d=160)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuD160Mha(TestMosaicGpuInPlace):
  """D = 160 in place, one query head per key head."""

  shape = dict(b=2, t=264, s=520, hq=4, hkv=4, d=160)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuD160Nondeterministic(TestMosaicGpuD160Mha):
  extra = dict(deterministic=False)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuD224(TestMosaicGpuInPlace):
  """D = 224 as it is (112 columns a warpgroup, 32-byte swizzles; D = 256's settings), MQA,
  T > S."""

  shape = dict(b=2, t=520, s=264, hq=4, hkv=1, d=224)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuD224Mha(TestMosaicGpuInPlace):
  """D = 224, one query head per key head: causal calls launch the last key block first
  (d224_causal_ordered), where D = 256 launches the first first."""

  shape = dict(b=2, t=520, s=520, hq=4, hkv=4, d=224)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuPaddedD144(TestMosaicGpuPadded):
  """D = 144 to 160 on copies, GQA 2:1."""

  shape = dict(b=2, t=512, s=384, hq=4, hkv=2, d=144)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuPaddedD40(TestMosaicGpuPadded):
  """D = 40 to 48 (pallas_triton computes at 64), T = 1,000 < S = 1,100, MQA."""

  shape = dict(b=2, t=1000, s=1100, hq=4, hkv=1, d=40)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuPaddedWideKeys(TestMosaicGpuPadded):
  """D = 56 to 64, S = 1,000 to 1,024: calls without a mask take 256-key blocks, the last
  cut by the key bound (WIDE_KEY_BLOCK); T = 600 < S, GQA 2:1."""

  shape = dict(b=2, t=600, s=1000, hq=4, hkv=2, d=56)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuInPlaceD64Group4(TestMosaicGpuInPlace):
  """In place at D = 64, T = 1,000 at 1,024 (eight 128-query steps), GQA 4:1: causal calls
  run one CTA per query head, adding their shares of dK and dV in the group's order."""

  shape = dict(b=2, t=1000, s=1544, hq=8, hkv=2, d=64)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuD80(TestMosaicGpuInPlace):
  """D = 80 as it is (32-byte swizzles), T > S: deterministic, the dK/dV-only kernel beside
  the dq kernel (no dq_split, so no ordered one-pass kernel)."""

  shape = dict(b=2, t=512, s=384, hq=4, hkv=2, d=80)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuD80Nondeterministic(TestMosaicGpuD80):
  """D = 80, the one-pass kernel adding dq in arrival order."""

  extra = dict(deterministic=False)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuD112(TestMosaicGpuInPlace):
  """D = 112 as it is (32-byte swizzles; D = 128's forward settings), T < S: deterministic,
  the dK/dV-only kernel beside the dq kernel (dq_split's halves would not fill a swizzle
  group, so no ordered one-pass kernel)."""

  shape = dict(b=2, t=384, s=512, hq=4, hkv=2, d=112)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuD112Nondeterministic(TestMosaicGpuD112):
  """D = 112, the one-pass kernel adding dq in arrival order (an explicit config: calls with
  deterministic=False run the pair there, which measured faster)."""

  impl = PallasMosaicGpu(backward_config=mb.MosaicBackwardConfig(dq_split=False))
  extra = dict(deterministic=False)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuD48(TestMosaicGpuInPlace):
  """D = 48 as it is (32-byte swizzles), MQA, T < S."""

  shape = dict(b=2, t=384, s=512, hq=4, hkv=1, d=48)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
class TestMosaicGpuD48Nondeterministic(TestMosaicGpuD48):
  extra = dict(deterministic=False)
