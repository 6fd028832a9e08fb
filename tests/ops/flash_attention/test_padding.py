"""pallas_mosaic_gpu's padded calls (_padding): lengths and head dims its kernels do not take.

On CPU the padding runs around chunked_xla in place of the kernels (the same function of
the padded call); the GPU suite runs it around the kernels (test_pallas_mosaic_gpu.py).
"""

import dataclasses
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memeff_jax.kernels import hopper
from memeff_jax.ops.flash_attention import _common
from memeff_jax.ops.flash_attention import _mosaic
from memeff_jax.ops.flash_attention import _padding
from memeff_jax.ops.flash_attention import ChunkedXla
from memeff_jax.ops.flash_attention import flash_attention
from memeff_jax.ops.flash_attention import masks
from memeff_jax.ops.flash_attention import mosaic_gpu_backward
from memeff_jax.ops.flash_attention import pallas_mosaic_gpu as pm
from memeff_jax.ops.flash_attention import pallas_triton
from memeff_jax.ops.flash_attention import PallasMosaicGpu
from memeff_jax.ops.flash_attention import PallasTriton
from memeff_jax.ops.flash_attention import reference
from memeff_jax.ops.flash_attention.masks import MaskSpec
from memeff_jax.ops.flash_attention.pallas_triton import BlockConfig
from tests.ops.flash_attention.test_flash_attention import _FlashAttentionTest

_INNER = ChunkedXla(block_q=32, block_k=16)


class _Static(NamedTuple):
  opts: _common.AttentionOptions
  padding: _padding.Padding


def _forward(st, q, k, v, q_seg, kv_seg):
  padded = st.padding.options(st.opts)
  return _padding.forward(st.padding, lambda *args: _INNER(*args, opts=padded),
                          q, k, v, q_seg, kv_seg)


def _backward(st, res, cts):
  padded = st.padding.options(st.opts)
  inner = lambda res, cts: (*_INNER.backward(*res, *cts, opts=padded), None, None)
  return _padding.backward(st.padding, inner, res, cts)


_padded = _common.attention_vjp(_forward, _backward, "padded_chunked_xla")


class PaddedChunkedXla:
  """chunked_xla behind the padding pallas_mosaic_gpu plans for the call (its own custom_vjp,
  so that gradients take _padding.backward as the kernels' do)."""

  name = "padded_chunked_xla"

  def __call__(self, q, k, v, q_seg, kv_seg, *, opts):
    pad = PallasMosaicGpu().padding(q.shape, k.shape, opts.mask)
    if pad is None:  # a head dim of 32 or less: no padding
      return _INNER(q, k, v, q_seg, kv_seg, opts=opts)
    return _padded(self, _Static(opts, pad), q, k, v, q_seg, kv_seg)


class TestPaddingOnChunkedXla(_FlashAttentionTest):
  """T = 100 and S = 153 (padded to 128 and 256), D = 72 (to 80): causal and the (5, 3)
  window hide the padded keys by themselves, the rest by the key bound (MaskSpec.keys)."""

  impl = PaddedChunkedXla()
  shape = dict(b=2, t=100, s=153, hq=4, hkv=1, d=72)
  dtypes = (jnp.float32,)  # padding and slicing do not depend on it (TestChunkedXla: both)


class TestPaddingOnChunkedXlaMoreQueriesThanKeys(_FlashAttentionTest):
  """T = 200 > S = 130, D = 144 (padded to 160): causal rows past S would see the padded keys
  but for the key bound. The masks only (softcap and scale act as in the class above)."""

  impl = PaddedChunkedXla()
  shape = dict(b=2, t=200, s=130, hq=4, hkv=2, d=144)
  dtypes = (jnp.float32,)
  features = ("plain", "causal", "window", "causal_window", "segments", "everything")


@pytest.mark.parametrize("t, s, d, causal, want", [
    (1000, 1000, 96, True, _padding.Padding(1024, 1024, 96, None)),  # causal hides them
    (1000, 1000, 96, False, _padding.Padding(1024, 1024, 96, 1000)),
    (1024, 1024, 72, True, _padding.Padding(1024, 1024, 80, None)),  # the head dim alone
    (1024, 1024, 80, True, None),  # 32-byte swizzles
    (1024, 1024, 112, True, None),  # a multiple of 16 up to 128
    (1024, 1024, 120, True, _padding.Padding(1024, 1024, 128, None)),
    (300, 200, 128, True, _padding.Padding(384, 256, 128, 200)),  # rows 200.. see past S
    (200, 300, 64, True, _padding.Padding(256, 384, 64, None)),
    (256, 384, 160, False, None),  # a multiple of 32 above 128
    (256, 384, 144, False, _padding.Padding(256, 384, 160, None)),  # the head dim alone
    (200, 320, 224, True, _padding.Padding(256, 384, 224, None)),  # S: the backward's 128
    (256, 384, 128, False, None),  # the kernels take it as it is
    (256, 320, 256, False, None),  # 64-key blocks at D = 256, forward and backward
    (1024, 1024, 40, False, _padding.Padding(1024, 1024, 48, None)),  # pallas_triton: 64
    (1000, 1000, 33, True, _padding.Padding(1024, 1024, 48, None)),
    (1000, 1000, 56, True, _padding.Padding(1024, 1024, 64, None)),
    (1000, 1000, 32, True, None),  # pallas_triton computes at 32
    (1000, 1000, 320, True, None),  # over 256: no kernel takes it
])
def test_plan(t, s, d, causal, want):
  mask = MaskSpec.make(causal, None, False)
  assert PallasMosaicGpu().padding((1, t, 4, d), (1, s, 4, d), mask) == want


def test_plan_window_and_segment_ids():
  """A right window hides the padded keys where the last real query's reach ends before S,
  with segment ids or without; elsewhere the key bound does."""
  plan = lambda mask: PallasMosaicGpu().padding((1, 1000, 4, 128), (1, 1000, 4, 128), mask)
  assert plan(MaskSpec(left=100, right=0)).keys is None
  assert plan(MaskSpec(left=100, right=30)).keys == 1000  # 999 + 30 reaches key 1000
  assert plan(MaskSpec(left=None, right=0, segments=True)).keys is None
  assert plan(MaskSpec(segments=True)).keys == 1000
  short_window = PallasMosaicGpu().padding((1, 900, 4, 128), (1, 1000, 4, 128),
                                           MaskSpec(left=None, right=100))
  assert short_window.keys is None  # 899 + 100 < 1000
  opts = _common.AttentionOptions(mask=MaskSpec(right=100), scale=0.1)
  assert short_window.options(opts) == opts


@pytest.mark.parametrize("t, s, d, in_place, pays", [
    (1000, 1000, 96, False, True),  # 1.05× the work
    (3000, 3000, 160, False, True),
    (300, 200, 160, False, True),  # 1.64×, under pallas_triton's 4.07× at D = 192
    (1000, 1000, 64, False, True),  # 1.049×, under 1.05×
    (600, 600, 64, False, False),  # 640 × 640: 1.14×
    (600, 600, 64, True, True),  # under 1.58× in place
    (520, 520, 64, True, True),  # 1.51×
    (176, 176, 128, True, True),  # 256 × 256: 2.12×, under 2.37×
    (136, 136, 128, True, False),  # 3.54×
    (136, 136, 64, True, False),
    (257, 257, 64, False, False),  # 384 × 384: 2.23×
    (257, 257, 128, False, False),
    (1000, 700, 128, False, True),  # 1,024 × 768: 1.12×
    (3000, 3000, 192, False, True),
])
def test_padding_pays_where_the_work_stays_under_tritons_slowdown(t, s, d, in_place, pays):
  pad = PallasMosaicGpu().padding((1, t, 4, d), (1, s, 4, d), MaskSpec.make(True, None, False))
  pad = pad._replace(in_place=in_place)
  assert pad.pays(t, s) == pays, (pad, pad.work(t, s))


def _as_on_hopper(monkeypatch):
  """Dispatch as on a Hopper GPU, so that calls lower for CUDA on this host."""
  monkeypatch.setattr(pm, "hopper_available", lambda: None)
  monkeypatch.setattr(hopper, "on_nvidia_gpu", lambda: True)


def _lowered(t, implementation, d=64):
  """A bf16 [2, t, 4, d] self-attention's fwd+bwd lowered for CUDA, as text."""
  x = jax.ShapeDtypeStruct((2, t, 4, d), jnp.bfloat16)
  loss = lambda q, k, v: jnp.sum(flash_attention(
      q, k, v, implementation=implementation).astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(
      lowering_platforms=("cuda",)).as_text()


def _kernels(text):
  """"mosaic" or "triton" per custom call of lowered text (names vary by jax release)."""
  return {"mosaic" if "mosaic_gpu" in name else "triton" if "triton" in name else name
          for name in re.findall(r"custom_call @(\S+)\(", text)}


def test_default_order_leaves_costly_padding_to_triton(monkeypatch):
  """implementation=None lowers T = 257 (384 padded, 2.23× the work) and T = 700 (768 on
  copies, 1.20×) to pallas_triton's kernels, T = 1,000 and 600 (640 in place, 1.14×) to the
  Mosaic ones, and D = 40 (64 on copies, where pallas_triton computes too) to the Mosaic ones,
  D = 32 not; asked for by name, the Mosaic kernels run T = 257 padded all the same."""
  _as_on_hopper(monkeypatch)
  assert _kernels(_lowered(257, None)) == {"triton"}
  assert _kernels(_lowered(1000, None)) == {"mosaic"}
  assert _kernels(_lowered(600, None)) == {"mosaic"}
  assert _kernels(_lowered(700, None)) == {"triton"}
  assert _kernels(_lowered(1024, None, d=40)) == {"mosaic"}
  assert _kernels(_lowered(1024, None, d=32)) == {"triton"}
  assert "tensor<2x384x4x64xbf16>" in _lowered(257, "pallas_mosaic_gpu")
  with pytest.raises(NotImplementedError, match=r"T=257, S=257 would run padded to 384, 384"):
    flash_attention(*(jnp.zeros((2, 257, 4, 64), jnp.bfloat16),) * 3,
                    implementation=pm.PallasMosaicGpu(pad="where_faster"))


def test_without_pallas_triton_the_default_order_pads(monkeypatch):
  """Where JAX has no Pallas Triton, implementation=None runs the Mosaic kernels padded
  however much the padding costs (T = 257 at 384, T = 700 on copies), and D = 32, which
  they do not serve, on chunked_xla (no kernel)."""
  _as_on_hopper(monkeypatch)
  monkeypatch.setattr(pallas_triton, "plgpu", None)
  assert _kernels(_lowered(257, None)) == {"mosaic"}
  assert _kernels(_lowered(700, None)) == {"mosaic"}
  assert _kernels(_lowered(1024, None, d=32)) == set()


def test_pad_takes_two_settings():
  with pytest.raises(ValueError, match="pad must be 'always' or 'where_faster', got 'never'"):
    PallasMosaicGpu(pad="never")


def test_padded_ids_take_each_rows_last_id():
  """Segment ids are padded with each row's last id; q, k and v in place are not copied."""
  q_seg = jnp.asarray([[3, 3, 7, 7, 9], [0, 1, 1, 2, 2]], jnp.int32)
  kv_seg = q_seg[:, ::-1]
  x = jnp.zeros((2, 5, 1, 64))
  pad = _padding.Padding(8, 7, 64, 5, in_place=True)
  pq_, pk_, pv_, pq, pk = pad.inputs(x, x, x, q_seg, kv_seg)
  assert pq_ is x and pk_ is x and pv_ is x
  np.testing.assert_array_equal(pq, [[3, 3, 7, 7, 9, 9, 9, 9], [0, 1, 1, 2, 2, 2, 2, 2]])
  np.testing.assert_array_equal(pk, [[9, 7, 7, 3, 3, 3, 3], [2, 2, 1, 1, 0, 0, 0]])
  assert pad.inputs(x, x, x, None, None)[3:] == (None, None)


def test_padded_calls_take_the_mosaic_kernels(monkeypatch):
  """On a Hopper GPU (faked here: the program is lowered for CUDA, not run) T = 1,000 and
  D = 88 run the Mosaic forward and backward on padded copies, not pallas_triton's kernels;
  the static keeps the call's options, its kernels describe the padded call."""
  monkeypatch.setattr(pm, "hopper_available", lambda: None)
  monkeypatch.setattr(hopper, "on_nvidia_gpu", lambda: True)
  q = jax.ShapeDtypeStruct((1, 1000, 4, 88), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 1000, 2, 88), jnp.bfloat16)
  for causal in (True, False):
    opts = _common.AttentionOptions(mask=MaskSpec.make(causal, None, False), scale=88**-0.5)
    st = PallasMosaicGpu()._static(q, k, opts)  # pylint: disable=protected-access
    keys = None if causal else 1000  # causal hides the padded keys by itself
    assert st.opts == opts and st.padding == _padding.Padding(1024, 1024, 96, keys)
    assert st.backward is not None and st.triton is None
    assert st.padded().opts.mask == dataclasses.replace(opts.mask, keys=keys)

    def loss(q, k, v, causal=causal):
      out = flash_attention(q, k, v, causal=causal, implementation="pallas_mosaic_gpu")
      return jnp.sum(out.astype(jnp.float32))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k).lower(
        lowering_platforms=("cuda",)).as_text()
    # The forward and the ordered one-pass backward, on the padded copies; no Triton kernel.
    assert text.count("custom_call @mosaic_gpu") == 2 and "triton" not in text
    assert "tensor<1x1024x4x96xbf16>" in text


# Each head dim, and each mask with both backward kinds (deterministic: the dq kernel apart).
@pytest.mark.parametrize("d, causal, segments, deterministic", [
    (48, False, False, False), (64, True, False, True), (80, True, True, False),
    (96, False, False, True), (128, True, False, False), (192, True, True, True),
    (256, False, False, False), (128, True, True, True)])
def test_lengths_of_whole_tma_tiles_run_in_place(monkeypatch, d, causal, segments,
                                                 deterministic):
  """T = 1,000 and S = 1,544 (whole 8-row tiles) at a head dim the kernels take run in
  place: the kernels take the padded lengths and read and write the call's own arrays past
  their ends, so the program lowered for CUDA (not run) holds no padded copy of q, k, v or
  dO, only of the segment ids and the kernels' row statistics; S = 1,537 (no whole tiles)
  and a Triton backward take copies."""
  monkeypatch.setattr(pm, "hopper_available", lambda: None)
  monkeypatch.setattr(hopper, "on_nvidia_gpu", lambda: True)
  opts = _common.AttentionOptions(mask=MaskSpec.make(causal, None, segments), scale=0.1,
                                  deterministic=deterministic)
  q = jax.ShapeDtypeStruct((1, 1000, 4, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 1544, 2, d), jnp.bfloat16)
  st = PallasMosaicGpu()._static(q, k, opts)  # pylint: disable=protected-access
  assert st.padding.in_place and st.padded().lengths == (st.padding.t, st.padding.s)
  ids = (jax.ShapeDtypeStruct((1, 1000), jnp.int32), jax.ShapeDtypeStruct((1, 1544), jnp.int32))

  def loss(q, k, v, q_ids, kv_ids):
    out = flash_attention(q, k, v, causal=causal, deterministic=deterministic,
                          q_segment_ids=q_ids if segments else None,
                          kv_segment_ids=kv_ids if segments else None,
                          implementation="pallas_mosaic_gpu")
    return jnp.sum(out.astype(jnp.float32))

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k, *ids).lower(
      lowering_platforms=("cuda",)).as_text()
  calls = re.findall(r"custom_call @(\S+)\(", text)
  assert calls and all("mosaic_gpu" in c for c in calls), calls
  lengths = {int(n) for n in re.findall(rf"tensor<1x(\d+)x\dx{d}xbf16>", text)}
  assert lengths == {1000, 1544}, lengths
  # Copies where TMA cannot take the rows in place, or a Triton kernel reads them.
  odd = jax.ShapeDtypeStruct((1, 1537, 2, d), jnp.bfloat16)
  # pylint: disable=protected-access
  assert not PallasMosaicGpu()._static(q, odd, opts).padding.in_place
  triton = PallasMosaicGpu(backward_config=pm.pallas_triton.default_config(d))
  assert not triton._static(q, k, opts).padding.in_place


# Six rows hold every pair of (causal, deterministic, (hkv, segments)); each half of them
# every value. Each head dim takes a half, in turn: every value at each head dim, every pair
# over two of them.
_PAIRS = [(False, False, 2, False), (True, True, 2, False), (True, False, 4, False),
          (False, True, 4, False), (False, True, 2, True), (True, False, 2, True)]


@pytest.mark.parametrize("causal, deterministic, hkv, segments, d, runs_at", [
    (*_PAIRS[j], d, runs_at)
    for i, (d, runs_at) in enumerate([(96, 96), (80, 80), (192, 192), (144, 160), (40, 48)])
    for j in range(i % 2, 6, 2)])
def test_head_dims_lower_to_the_mosaic_kernels(monkeypatch, causal, deterministic, hkv,
                                               segments, d, runs_at):
  """D = 96 (64-byte swizzles; dq_split's 48-column halves 32-byte ones), D = 80 (32-byte
  swizzles, no dq_split) and D = 192 (the column-split backward, 96 columns a warpgroup; with
  segment ids without split scores), and D = 144 and 40 padded to 160 and 48, run the Mosaic
  forward and backward: the program lowers for CUDA (not run) with no Triton kernel and no
  copy wider than the head dim it runs at."""
  monkeypatch.setattr(pm, "hopper_available", lambda: None)
  monkeypatch.setattr(hopper, "on_nvidia_gpu", lambda: True)
  ids = jax.ShapeDtypeStruct((1, 512), jnp.int32)
  q = jax.ShapeDtypeStruct((1, 512, 4, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 512, hkv, d), jnp.bfloat16)
  loss = lambda q, k, v, ids: jnp.sum(flash_attention(
      q, k, v, causal=causal, deterministic=deterministic,
      q_segment_ids=ids if segments else None).astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k, ids).lower(
      lowering_platforms=("cuda",)).as_text()
  calls = re.findall(r"custom_call @(\S+)\(", text)
  # Two kernels, or three where the deterministic backward runs dq apart.
  assert len(calls) in (2, 3) and all("mosaic_gpu" in c for c in calls), calls
  widths = {int(w) for w in re.findall(r"tensor<1x512x\dx(\d+)xbf16>", text)}
  assert widths == {d, runs_at}, widths


@pytest.mark.parametrize("mask", [MaskSpec(keys=300), MaskSpec(right=0, keys=200),
                                  MaskSpec(left=70, right=30, keys=230),
                                  MaskSpec(keys=256), MaskSpec(keys=40)])
def test_key_bound_block_ranges(mask):
  """The block ranges the kernels walk under a key bound (the forward's and dq kernel's key
  blocks per query block, the backward's query blocks per key CTA, masks.kv_block_range):
  every block with a visible pair is walked, none wholly past the bound, and a block left
  unmasked sees every pair."""
  t, s, bq, bkv, cta_keys = 384, 384, 64, 128, 128
  seen = np.asarray(masks.visible(mask, jnp.arange(t), jnp.arange(s)))
  for qi in range(t // (2 * bq)):
    per_block, cta_lo, cta_hi = _mosaic.query_cta_key_blocks(mask, None, 0, qi, bq, bkv,
                                                             s // bkv)
    for w, bounds in enumerate(per_block):
      lo, hi, full_lo, full_hi = (int(x) for x in bounds)
      rows = seen[(2 * qi + w) * bq:(2 * qi + w + 1) * bq].reshape(bq, s // bkv, bkv)
      any_seen, all_seen = rows.any((0, 2)), rows.all((0, 2))
      assert any_seen[:lo].sum() == any_seen[hi:].sum() == 0, (qi, w, bounds)
      assert all_seen[full_lo:full_hi].all() and hi <= -(-mask.keys // bkv)
      assert int(cta_lo) <= lo and hi <= int(cta_hi)
      kv_lo, kv_hi = masks.kv_block_range(mask, (2 * qi + w) * bq, bq, s, bkv)
      assert any_seen[:int(kv_lo)].sum() == any_seen[int(kv_hi):].sum() == 0
      assert int(kv_hi) <= -(-mask.keys // bkv)
  for kvi in range(s // cta_keys):
    first, last, full_lo, full_hi = (int(x) for x in mosaic_gpu_backward._query_blocks(
        mask, jnp.int32(kvi * cta_keys), cta_keys, t // bq, bq))
    cols = seen[:, kvi * cta_keys:(kvi + 1) * cta_keys].reshape(t // bq, bq, cta_keys)
    any_seen, all_seen = cols.any((1, 2)), cols.all((1, 2))
    assert any_seen[:first].sum() == any_seen[last:].sum() == 0
    assert all_seen[full_lo:full_hi].all(), (kvi, full_lo, full_hi)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("hkv", [8, 2])
@pytest.mark.parametrize("deterministic", [True, False])
def test_padded_keys_leave_the_unpadded_calls_kernels(monkeypatch, d, hkv, deterministic):
  """A call without a mask whose padded keys the key bound hides runs the forward, backward
  and dq configs of the call of its padded lengths (segment ids would have taken shared
  memory and, at D = 128, the deterministic backward's second dQ slot)."""
  monkeypatch.setattr(pm, "hopper_available", lambda: None)
  monkeypatch.setattr(hopper, "on_nvidia_gpu", lambda: True)
  opts = _common.AttentionOptions(mask=MaskSpec(), scale=0.1, deterministic=deterministic)
  static = lambda t: PallasMosaicGpu()._static(  # pylint: disable=protected-access
      jax.ShapeDtypeStruct((2, t, 8, d), jnp.bfloat16),
      jax.ShapeDtypeStruct((2, t, hkv, d), jnp.bfloat16), opts)
  padded, whole = static(1000), static(1024)
  assert padded.padding.keys == 1000 and not padded.padded().opts.mask.segments
  assert (padded.config, padded.backward, padded.dq) == (whole.config, whole.backward, whole.dq)


@pytest.mark.parametrize("impl", [ChunkedXla(block_q=16, block_k=16), PallasTriton(
    interpret=True, config=BlockConfig(block_q=16, block_k=16, bwd_block_q=16, bwd_block_k=16))])
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, (9, 30))])
def test_key_bound_equals_cutting_the_keys(impl, causal, window):
  """Under a key bound (where a padded call's backward runs on pallas_triton, its kernels take
  the bound) every implementation computes the call on the keys before it: the same output,
  log-sum-exp and dq, dk and dv there, and zero dk and dv past it."""
  keys, kq, kk, kv, kd = 37, *jax.random.split(jax.random.key(5), 4)
  q = jax.random.normal(kq, (2, 48, 4, 32))
  k, v = (jax.random.normal(key, (2, 64, 2, 32)) for key in (kk, kv))
  d_out = jax.random.normal(kd, q.shape)
  mask = MaskSpec.make(causal, window, False)
  bounded = _common.AttentionOptions(mask=dataclasses.replace(mask, keys=keys), scale=0.3)
  out, lse = impl(q, k, v, None, None, opts=bounded)
  dq, dk, dv = impl.backward(q, k, v, None, None, out, lse, d_out, jnp.zeros_like(lse),
                             opts=bounded)[:3]
  cut = lambda x: x[:, :keys]
  whole = _common.AttentionOptions(mask=mask, scale=0.3)
  ref = ChunkedXla(block_q=16, block_k=16)
  want_out, want_lse = reference.reference_attention(q, cut(k), cut(v), None, None, whole)
  want = ref.backward(q, cut(k), cut(v), None, None, want_out, want_lse, d_out,
                      jnp.zeros_like(want_lse), opts=whole)[:3]
  np.testing.assert_allclose(out, want_out, atol=2e-5)
  np.testing.assert_allclose(lse, want_lse, atol=2e-5)
  for got, exp in zip((dq, cut(dk), cut(dv)), want):
    np.testing.assert_allclose(got, exp, atol=5e-5)
  assert not np.any(dk[:, keys:]) and not np.any(dv[:, keys:])
