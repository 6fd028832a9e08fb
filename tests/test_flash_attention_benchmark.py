"""benchmarks/flash_attention.py's peers: cuDNN on packed documents (its packed layout), cuDNN
made deterministic, torch's scaled_dot_product_attention; the grid table that compares memeff
with them; memeff:tuned, the default dispatch with a tuned setting changed; --shapes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import flash_attention as bench
import memeff_jax
from memeff_jax.ops import flash_attention as fa
from memeff_jax.ops.flash_attention import pallas_mosaic_gpu as pm
from memeff_jax.ops.flash_attention._common import AttentionOptions
from memeff_jax.ops.flash_attention.masks import MaskSpec


def test_packed_layout_of_contiguous_documents():
  seg = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2],
                   [5, 5, 5, 5, 7, 7, 7, 7]])
  lengths, offsets = bench.cudnn_packed_layout(seg)
  np.testing.assert_array_equal(lengths, [[3, 2, 3], [4, 4, -1]])
  np.testing.assert_array_equal(offsets, [[0, 3, 5, -1], [0, 4, -1, -1]])


def test_an_id_in_two_runs_has_no_packed_layout():
  """Segment ids see the two runs of id 0 as one document; the packed layout cannot."""
  assert bench.cudnn_packed_layout(jnp.array([[0, 0, 1, 1, 0, 0]])) is None
  assert bench.cudnn_packed_fn(True, jnp.array([[0, 0, 1, 1, 0, 0]]), None) is None


def test_documents_as_rows_only_where_every_row_cuts_evenly():
  assert bench.documents_as_rows(bench.document_ids(2, 48, 4)) == 4
  assert bench.documents_as_rows(jnp.array([[0, 0, 1, 1], [5, 5, 6, 6]])) == 2
  assert bench.documents_as_rows(jnp.array([[0, 0, 1, 1], [5, 6, 6, 6]])) is None
  assert bench.documents_as_rows(bench.document_ids(2, 48, 4, seed=0)) is None
  assert bench.attention_fn("rows:xla", True, bench.document_ids(2, 48, 4, seed=0)) is None
  assert bench.attention_fn("rows:xla", True, None) is None


@pytest.mark.parametrize("causal", [False, True])
def test_documents_as_rows_compute_what_segment_ids_do(causal):
  """rows:PROVIDER on equal documents: memeff's attention with those segment ids, forward
  and gradients (xla on the CPU)."""
  b, t, h, d, docs = 2, 48, 2, 16, 4
  seg = bench.document_ids(b, t, docs)
  keys = jax.random.split(jax.random.key(3), 4)
  q, k, v, ct = (jax.random.normal(kk, (b, t, h, d)) for kk in keys)
  peer = bench.attention_fn("rows:xla", causal, seg)
  ours = lambda q, k, v: memeff_jax.flash_attention(
      q, k, v, causal=causal, q_segment_ids=seg, kv_segment_ids=seg,
      implementation="reference")

  def out_and_grads(f):
    out, pull = jax.vjp(f, q, k, v)
    return (out, *pull(ct))

  for got, want in zip(out_and_grads(peer), out_and_grads(ours)):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_packed_documents_match_segment_ids(causal):
  """The peer computes what memeff computes with segment ids, forward and gradients."""
  b, t, h, d = 2, 1024, 4, 128
  seg = jnp.array([[0] * 300 + [1] * 500 + [2] * 224, [3] * 1024])
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, ct = (jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
                 for kk in keys)
  peer = bench.cudnn_packed_fn(causal, seg, None)
  ours = lambda q, k, v: memeff_jax.flash_attention(
      q, k, v, causal=causal, q_segment_ids=seg, kv_segment_ids=seg,
      implementation="reference")

  def out_and_grads(f):
    out, pull = jax.vjp(lambda *a: f(*a).astype(jnp.float32), q, k, v)
    return (out, *pull(ct.astype(jnp.float32)))

  for got, want in zip(jax.jit(lambda: out_and_grads(peer))(),
                       jax.jit(lambda: out_and_grads(ours))()):
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)


def test_grid_keeps_the_packed_row_per_visible_pair_and_adds_cudnn_packed():
  """The packed row's ratio (in the mean) stays against cuDNN's unpacked row; cuDNN on the
  same documents gets a line of its own, outside the mean, and a second mean with it."""
  from benchmarks import make_results  # pylint: disable=import-outside-toplevel
  base = dict(set="grid", device="GPU", jax="0", timestamp="t", b=4, t=4096, h=32, hkv=32,
              d=128, causal=True, window=None, rounds=3)
  rate = {("memeff", None): 400.0, ("cudnn", None): 500.0, ("memeff", 8): 200.0,
          ("cudnn", 8): 160.0}
  rows = [dict(base, provider=p, docs=docs, fwd_bwd_tflops=v, fwd_tflops=v)
          for (p, docs), v in rate.items()]
  text = "\n".join(make_results.grid_section(rows))
  assert "| causal, 8 docs (vs unpacked) | 200 | 500 | 0.400× | 0.400× |" in text
  assert "| causal, 8 docs (vs cuDNN packed) | 200 | 160 | 1.250× | 1.250× |" in text
  assert f"{(0.8 * 0.4) ** 0.5:.3f}× cuDNN over 2 rows" in text
  assert f"on the same documents (the faster way): {(0.8 * 1.25) ** 0.5:.3f}×" in text
  # cuDNN on the documents as rows: a line of its own; the second mean takes the faster peer
  as_rows = [dict(base, provider="rows:cudnn", docs=8, fwd_bwd_tflops=250.0, fwd_tflops=250.0)]
  text = "\n".join(make_results.grid_section(rows + as_rows))
  assert "| causal, 8 docs (vs cuDNN, documents as rows) | 200 | 250 | 0.800× | 0.800× |" in text
  assert f"{(0.8 * 0.4) ** 0.5:.3f}× cuDNN over 2 rows" in text
  assert f"(the faster way): {(0.8 * 0.8) ** 0.5:.3f}×" in text
  no_packed_peer = "\n".join(make_results.grid_section(
      [r for r in rows if (r["provider"], r["docs"]) != ("cudnn", 8)]))
  assert "same documents" not in no_packed_peer
  # a later run of the unpacked row alone: shown, and the packed row keeps its own run's
  later = [dict(r, timestamp="u", fwd_bwd_tflops=440.0, fwd_tflops=440.0)
           for r in rows if r["docs"] is None]
  text = "\n".join(make_results.grid_section(rows + later))
  assert "| causal | 440 | 440 | 1.000× | 1.000× |" in text
  assert "| causal, 8 docs (vs unpacked) | 200 | 500 | 0.400× | 0.400× |" in text
  assert f"{0.4 ** 0.5:.3f}× cuDNN over 2 rows" in text


def test_grid_compares_with_deterministic_cudnn_where_it_ran():
  """A last column and a mean of their own against cudnn:deterministic, the packed row
  against its unpacked row as in the cuDNN columns; none where it did not run."""
  from benchmarks import make_results  # pylint: disable=import-outside-toplevel
  base = dict(set="grid", device="GPU", jax="0", timestamp="t", b=4, t=4096, h=32, hkv=32,
              d=128, causal=True, window=None, rounds=3)
  rate = {("memeff", None): 400.0, ("cudnn", None): 500.0, ("cudnn:deterministic", None): 320.0,
          ("memeff", 8): 200.0, ("cudnn", 8): 160.0, ("cudnn:deterministic", 8): 100.0}
  rows = [dict(base, provider=p, docs=docs, fwd_bwd_tflops=v, fwd_tflops=v)
          for (p, docs), v in rate.items()]
  text = "\n".join(make_results.grid_section(rows))
  assert "| × cuDNN fwd | × deterministic cuDNN fwd+bwd |" in text
  assert "| causal | 400 | 500 | 0.800× | 0.800× | 1.250× |" in text
  assert "| causal, 8 docs (vs unpacked) | 200 | 500 | 0.400× | 0.400× | 0.625× |" in text
  assert "| causal, 8 docs (vs cuDNN packed) | 200 | 160 | 1.250× | 1.250× | 2.000× |" in text
  assert f"default): {(1.25 * 0.625) ** 0.5:.3f}× over 2 rows" in text
  plain = "\n".join(make_results.grid_section(
      [r for r in rows if r["provider"] != "cudnn:deterministic"]))
  assert "deterministic" not in plain
  assert "| causal | 400 | 500 | 0.800× | 0.800× |\n" in plain


def test_a_peer_on_the_documents_as_rows_is_a_jax_peer():
  """The per-shape table's best JAX peer counts rows:PEER (cuDNN on the documents as rows
  where that beats its packed layout), not memeff on those rows."""
  from benchmarks import make_results  # pylint: disable=import-outside-toplevel
  base = dict(causal=True, fwd_ms=1.0, fwd_tflops=1.0, fwd_bwd_ms=1.0)
  rows = [dict(base, provider=p, fwd_bwd_tflops=v) for p, v in (
      ("memeff", 260.0), ("cudnn", 193.0), ("rows:cudnn", 200.0), ("rows:memeff", 286.0))]
  text = make_results.fa_table(rows)
  assert "| memeff | True | 1.00 | 1 | 1.00 | 260 | 1.300× |" in text
  assert "| rows:memeff | True | 1.00 | 1 | 1.00 | 286 | 1.430× |" in text


@pytest.mark.gpu
def test_deterministic_cudnn_gives_the_same_gradients_every_call():
  """cudnn:deterministic's programs (COMPILER_OPTIONS) make cuDNN's backward repeatable."""
  b, t, h, d = 2, 2048, 8, 128
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, ct = (jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
                 for kk in keys)
  provider = "cudnn:deterministic"
  f = bench.attention_fn(provider, True, None)
  step = jax.jit(lambda q, k, v, ct: jax.vjp(f, q, k, v)[1](ct),
                 compiler_options=bench.COMPILER_OPTIONS[provider])
  first = step(q, k, v, ct)
  for _ in range(3):
    for got, want in zip(step(q, k, v, ct), first):
      np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                    np.asarray(want).view(np.uint16))


def _reference_out_and_grads(q, k, v, ct, causal):
  out, pull = jax.vjp(lambda *a: memeff_jax.flash_attention(
      *a, causal=causal, implementation="reference"), q, k, v)
  return (out, *pull(ct))


def _torch_out_and_grads(provider, q, k, v, ct, causal, device):
  _, fwd_bwd, leaves = bench.torch_case(provider, q, k, v, ct, causal, device=device)
  out = fwd_bwd().transpose(1, 2)  # back to [B, T, H, D]
  return [x.detach().float().cpu().numpy() for x in (out, *(l.grad for l in leaves))]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [4, 2])
def test_torch_peer_computes_memeffs_attention(causal, hkv):
  """torch_case's layout (memeff's [B, T, H, D] viewed as torch's [B, H, T, D]), its shared
  K/V heads and its gradients, on torch's math backend on the CPU."""
  torch = pytest.importorskip("torch")
  del torch
  b, t, h, d = 2, 40, 4, 16
  keys = jax.random.split(jax.random.key(2), 4)
  q, ct = (jax.random.normal(kk, (b, t, h, d)) for kk in keys[::3])
  k, v = (jax.random.normal(kk, (b, t, hkv, d)) for kk in keys[1:3])
  got = _torch_out_and_grads("torch:math", q, k, v, ct, causal, "cpu")
  for g, want in zip(got, _reference_out_and_grads(q, k, v, ct, causal)):
    np.testing.assert_allclose(g, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", ["torch:cudnn", "torch:flash"])
def test_torch_gpu_peers_compute_memeffs_attention(provider):
  pytest.importorskip("torch")
  b, t, h, d = 2, 1024, 4, 128
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, ct = (jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
                 for kk in keys)
  got = _torch_out_and_grads(provider, q, k, v, ct, True, "cuda")
  want = jax.jit(lambda *a: _reference_out_and_grads(
      *(x.astype(jnp.float32) for x in a), True))(q, k, v, ct)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=3e-2, rtol=3e-2)


def test_documents_of_random_lengths():
  """doc_seed: each row cut into `docs` documents at its own random points, the same ones
  on every call; cuDNN's packed layout takes them, and the mask sees fewer pairs than equal
  documents would leave unless the cuts happen to fall evenly."""
  seg = np.asarray(bench.document_ids(3, 1000, 8, seed=0))
  assert seg.shape == (3, 1000) and seg.dtype == np.int32
  for row in seg:
    assert row[0] == 0 and row[-1] == 7 and np.all(np.diff(row) >= 0)
    assert set(np.unique(row)) == set(range(8))
  assert len({tuple(row) for row in seg}) == 3  # rows differ
  np.testing.assert_array_equal(seg, bench.document_ids(3, 1000, 8, seed=0))
  assert not np.array_equal(seg, bench.document_ids(3, 1000, 8, seed=1))
  lengths, offsets = bench.cudnn_packed_layout(jnp.asarray(seg))
  np.testing.assert_array_equal(np.asarray(lengths).sum(1), [1000] * 3)
  np.testing.assert_array_equal(np.asarray(offsets)[:, 0], [0] * 3)
  equal = np.asarray(bench.document_ids(3, 1000, 8))
  np.testing.assert_array_equal(equal[0], np.arange(1000) * 8 // 1000)


def test_random_documents_have_a_heading_of_their_own():
  from benchmarks import make_results  # pylint: disable=import-outside-toplevel
  base = dict(set="packed", device="GPU", jax="0", timestamp="t", b=4, t=4096, s=4096, h=32,
              hkv=32, d=128, docs=8, dtype="bfloat16", causal=True, window=None,
              provider="memeff", fwd_ms=1.0, fwd_tflops=1.0, fwd_bwd_ms=1.0,
              fwd_bwd_tflops=1.0)
  runs = make_results.fa_runs([base, dict(base, doc_seed=0)])
  headings = [make_results.fa_heading(key, rows) for key, rows in runs]
  assert len(headings) == 2
  assert any("8 documents per row, bfloat16" in h for h in headings)
  assert any("8 documents per row of random lengths (seed 0), bfloat16" in h for h in headings)


def test_a_run_measured_again_by_a_later_run_of_any_set_leaves_the_results():
  from benchmarks import make_results  # pylint: disable=import-outside-toplevel
  base = dict(set="d-sweep", device="GPU", jax="0", timestamp="1", b=4, t=4096, s=4096, h=32,
              hkv=32, d=128, docs=None, dtype="bfloat16", causal=True, window=None,
              provider="memeff", fwd_ms=1.0, fwd_tflops=1.0, fwd_bwd_ms=1.0,
              fwd_bwd_tflops=1.0)
  old = [base, dict(base, causal=False), dict(base, provider="tokamax:mosaic")]
  causal_later = dict(base, set="headline", timestamp="2")
  sets = lambda rows: sorted(key[0] for key, _ in make_results.fa_runs(rows))
  # The later run measured the causal mask only: the older one still holds the other mask.
  assert sets(old + [causal_later]) == ["d-sweep", "headline"]
  # Both masks measured again, with fewer providers: the older run leaves.
  assert sets(old + [causal_later, dict(causal_later, causal=False)]) == ["headline"]
  # Another GPU's or another shape's runs are their own cases.
  assert sets(old + [dict(causal_later, causal=False, device="GPU2"), causal_later]) == [
      "d-sweep", "headline", "headline"]
  assert sets(old + [dict(causal_later, d=64), dict(causal_later, d=64, causal=False)]) == [
      "d-sweep", "headline"]


def test_tuned_provider_replaces_fields_of_the_configs_the_dispatch_picks(as_on_hopper):
  """memeff:tuned:... runs the default dispatch (as on a Hopper GPU here) with the named
  fields of its forward and backward configs replaced, only while its call is traced."""
  tuned, deterministic = bench.parse_memeff("memeff:tuned:bwd_dq_heavy_first=1:persistent=1")
  assert tuned == bench.Tuned({"persistent": 1}, {"dq_heavy_first": 1}) and deterministic
  q = jax.ShapeDtypeStruct((1, 8192, 32, 128), jnp.bfloat16)  # the grid forward, not persistent
  opts = AttentionOptions(mask=MaskSpec.make(True, None, False), scale=0.125)
  static = lambda: pm.PallasMosaicGpu()._static(q, q, opts)  # pylint: disable=protected-access
  default = static()
  assert not default.backward.dq_heavy_first and not default.config.persistent
  with bench.tuned_fields(tuned):
    changed = static()
  assert changed.backward == dataclasses.replace(default.backward, dq_heavy_first=True)
  assert changed.config == dataclasses.replace(default.config, persistent=True)
  assert static() == default  # restored
  assert not fa.MosaicBackwardConfig.for_deterministic(128, True).dq_heavy_first


def test_tuned_provider_refuses_a_config_its_kernel_cannot_run(as_on_hopper):
  """A tuned setting the Mosaic kernels cannot run is an error naming it, not a row timing
  the kernel the dispatch would fall back to."""
  opts = AttentionOptions(mask=MaskSpec.make(True, None, False), scale=0.0625)
  static = lambda q: pm.PallasMosaicGpu()._static(q, q, opts)  # pylint: disable=protected-access
  d256 = jax.ShapeDtypeStruct((4, 4096, 16, 256), jnp.bfloat16)
  with bench.tuned_fields(bench.parse_memeff("memeff:tuned:bwd_pingpong=1")[0]):
    with pytest.raises(ValueError, match=r"\{'pingpong': 1\}.*scores_split needs"):
      static(d256)
  d128 = jax.ShapeDtypeStruct((1, 8192, 32, 128), jnp.bfloat16)  # the grid forward
  with bench.tuned_fields(bench.parse_memeff("memeff:tuned:dynamic=1")[0]):
    with pytest.raises(ValueError, match=r"\{'dynamic': 1\}.*dynamic needs persistent"):
      static(d128)
  assert static(d256).backward.scores_split  # restored: the default runs


def test_tuned_provider_computes_the_default_attention():
  """On the CPU (no Mosaic kernel: the fields change nothing) the tuned provider's call is
  memeff's."""
  ks = jax.random.split(jax.random.key(3), 3)
  q, k, v = (jax.random.normal(key, (1, 256, 2, 64), jnp.float32) for key in ks)
  want = bench.attention_fn("memeff", True, None)(q, k, v)
  got = bench.attention_fn("memeff:tuned:bwd_dq_heavy_first=1", True, None)(q, k, v)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_shapes_are_a_slice_or_indices():
  """--shapes picks the set's shapes by a Python slice or by indices (rows apart, one run)."""
  grid = list(range(9))
  assert grid[bench.selected_shapes("0:2")] == [0, 1]
  assert grid[bench.selected_shapes("5:")] == [5, 6, 7, 8]
  assert grid[bench.selected_shapes(":")] == grid
  assert bench.selected_shapes("0,5,6") == [0, 5, 6]
  assert bench.selected_shapes("3") == [3]
