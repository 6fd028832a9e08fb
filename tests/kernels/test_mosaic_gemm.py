"""kernels.mosaic_gemm: the Hopper GEMM with an in-place C accumulate (kernel tests need a GPU)."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memeff_jax.kernels import hopper
from memeff_jax.kernels import mosaic_gemm as mg

M, N, K = 256, 512, 256


def _operands(trans_a, trans_b, seed=0, m=M, k=K, n=N):
  key = jax.random.split(jax.random.key(seed), 3)
  a = jax.random.normal(key[0], (k, m) if trans_a else (m, k), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(key[1], (n, k) if trans_b else (k, n), jnp.float32).astype(jnp.bfloat16)
  c = jax.random.normal(key[2], (m, n), jnp.float32).astype(jnp.bfloat16)
  ref = (a.T if trans_a else a).astype(jnp.float32) @ (b.T if trans_b else b).astype(jnp.float32)
  return a, b, c, ref


@pytest.mark.parametrize("shape", [(8, 8), (5, 7), (32, 171), (19, 393), (1, 6)])
def test_snake_walks_as_planar_snake(shape):
  """hopper.snake (integer ops alone, for the one-warp memory loop) visits the tiles in
  plgpu.planar_snake's order, ragged last bands included."""
  plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
  index = jnp.arange(shape[0] * shape[1], dtype=jnp.int32)
  for minor, band in itertools.product((0, 1), (1, 2, 3, 8, 16)):
    want = jax.vmap(lambda i: jnp.stack(plgpu.planar_snake(i, shape, minor, band)))(index)
    got = jax.vmap(lambda i: jnp.stack(hopper.snake(i, shape, minor, band)))(index)
    np.testing.assert_array_equal(got, want, err_msg=f"minor={minor}, band={band}")


def test_row_swizzle_is_the_widest_that_divides_a_row():
  got = {w: hopper.row_swizzle(w) for w in (16, 48, 64, 80, 96, 128, 160, 192)}
  assert got == {16: 32, 48: 32, 64: 128, 80: 32, 96: 64, 128: 128, 160: 64, 192: 128}
  assert hopper.row_swizzle(24, jnp.float32) == 32
  with pytest.raises(ValueError, match=r"a row of 40 bfloat16 \(80 bytes\) is no multiple"):
    hopper.row_swizzle(40)


def test_errors_name_the_shapes():
  a = jnp.zeros((M, K), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"contracting sizes differ.*\[256, 256\].*\[128, 512\]"):
    mg.gemm(a, jnp.zeros((128, N), jnp.bfloat16))
  with pytest.raises(TypeError, match="16-bit"):
    mg.gemm(a.astype(jnp.float32), jnp.zeros((K, N), jnp.float32))
  with pytest.raises(ValueError, match="N=320 is not a multiple of the tile 128"):
    mg.gemm(a, jnp.zeros((K, 320), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"c must be \[256, 512\]"):
    mg.gemm_into(jax.new_ref(jnp.zeros((M, M), jnp.bfloat16)), a, jnp.zeros((K, N), jnp.bfloat16))
  assert mg.shape_error(4096, 128256, 512, mg.GemmConfig()) is None
  with pytest.raises(ValueError, match="schedule must be"):
    mg.GemmConfig(schedule="stream-k")
  with pytest.raises(ValueError, match="cluster must be"):
    mg.GemmConfig(cluster="k")
  with pytest.raises(ValueError, match="even num_sms"):
    mg.GemmConfig(cluster="m", num_sms=131)
  with pytest.raises(ValueError, match="M=128 is not a multiple of the tile 256"):
    mg.gemm(jnp.zeros((128, K), jnp.bfloat16), jnp.zeros((K, N), jnp.bfloat16),
            config=mg.GemmConfig(cluster="m"))
  with pytest.raises(ValueError, match="wg_split must be 'm' or 'n'"):
    mg.GemmConfig(wg_split="k")
  for schedule in ("ring", "pingpong"):  # one slot would deadlock the walk
    with pytest.raises(ValueError, match=f"'{schedule}' schedule needs max_concurrent_steps "
                                         ">= 2, got 1"):
      mg.GemmConfig(schedule=schedule, max_concurrent_steps=1)
  with pytest.raises(ValueError, match="'cooperative' schedule needs max_concurrent_steps >= 1"):
    mg.GemmConfig(max_concurrent_steps=0)
  with pytest.raises(ValueError, match="in 'pingpong' each owns whole tiles"):
    mg.GemmConfig(schedule="pingpong", wg_split="m")
  with pytest.raises(ValueError, match="an option of the 'pingpong' and 'ring' schedules"):
    mg.GemmConfig(epilogue_rows=64)
  with pytest.raises(ValueError, match="epilogue_rows must be a multiple of 64 dividing"):
    mg.GemmConfig(schedule="ring", epilogue_rows=96)
  with pytest.raises(ValueError, match="epilogue_rows=64 serves GEMMs that read no C"):
    mg.gemm_into(jax.new_ref(jnp.zeros((M, N), jnp.bfloat16)), a, jnp.zeros((K, N), jnp.bfloat16),
                 config=mg.GemmConfig(schedule="ring", epilogue_rows=64))
  deep = mg.GemmConfig(tile_n=128, schedule="ring", max_concurrent_steps=5)  # 5 × 48 KiB
  with pytest.raises(ValueError, match=r"the tiles take 311,296 bytes of shared memory \(5 A/B"):
    mg.gemm(a, jnp.zeros((K, N), jnp.bfloat16), config=deep)
  with pytest.raises(ValueError, match=r"262,144 bytes of shared memory.*float32 out"):
    mg.gemm(a, jnp.zeros((K, N), jnp.bfloat16), out_dtype=jnp.float32,
            config=mg.GemmConfig(tile_n=128, schedule="ring", epilogue_rows=64))
  with pytest.raises(ValueError, match="bytes of shared memory"):
    mg.gemm_into(jax.new_ref(jnp.zeros((M, N), jnp.bfloat16)), a, jnp.zeros((K, N), jnp.bfloat16),
                 config=deep)
  assert mg.smem_bytes(mg.GemmConfig(), jnp.bfloat16, jnp.bfloat16) is None  # cooperative
  with pytest.raises(ValueError, match="add must be 'epilogue' or 'tma', got 'l2'"):
    mg.gemm_into(jax.new_ref(jnp.zeros((M, N), jnp.bfloat16)), a, jnp.zeros((K, N), jnp.bfloat16),
                 add="l2")


@pytest.mark.parametrize("schedule", ["pingpong", "ring"])
@pytest.mark.parametrize("cluster", [None, "m", "n"])
def test_ring_kernel_lowers_for_cuda(schedule, cluster):
  """The ring kernel's schedules lower to a Mosaic GPU module on a CPU host (runs need a
  GPU)."""
  cfg = mg.GemmConfig(tile_n=128 if schedule == "pingpong" else 64, max_concurrent_steps=3,
                      schedule=schedule, num_sms=132, cluster=cluster)
  for ta, tb in ((True, False), (False, True), (False, False)):
    a = jax.ShapeDtypeStruct((K, M) if ta else (M, K), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((N, K) if tb else (K, N), jnp.bfloat16)
    f = lambda a, b, ta=ta, tb=tb: mg.gemm(a, b, trans_a=ta, trans_b=tb, config=cfg)
    text = jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("trans_a,trans_b,split", [
    (ta, tb, s) for ta, tb in itertools.product([False, True], repeat=2)
    for s in ("n", "m", "pingpong", "n/cluster-n", "n/cluster-m", "pingpong/cluster-m",
              "pingpong/cluster-n", "ring-n", "ring-m", "ring-n/cluster-m", "ring-m/cluster-n",
              "ring-m/cluster-m", "ringE-n", "ringE-n/cluster-m")])
def test_matches_float32_reference(trans_a, trans_b, split):
  """split "pingpong": 128 × 128 tiles, one per warpgroup, 4 tiles per CTA on 2 CTAs (each
  warpgroup runs two), K in 4 steps through a ring of 3 slots (the slots' phases wrap
  across tiles). "/cluster-m|n": CTAs in pairs sharing B's (A's) blocks by multicast; the
  ping-pong pair walks 4 tiles of 256 × 128 (128 × 256). "ring-n|m": the cooperative split
  through the ring kernel, 4 CTA tiles per CTA on 2 CTAs, K in 4 steps through 3 slots;
  "ringE": the epilogue through 64-row pieces. ring-m/cluster-m's pair tile is 512 rows:
  M = 512 there."""
  split, _, cluster = split.partition("/cluster-")
  a, b, c, ref = _operands(trans_a, trans_b, m=512 if split == "ring-m" and cluster == "m" else M)
  if split == "pingpong":
    cfg = mg.GemmConfig(tile_n=128, max_concurrent_steps=3, schedule="pingpong", num_sms=2,
                        cluster=cluster or None)
  elif split.startswith("ring"):
    cfg = mg.GemmConfig(wg_split=split[-1], max_concurrent_steps=3, schedule="ring", num_sms=2,
                        cluster=cluster or None,
                        epilogue_rows=64 if split.startswith("ringE") else None)
  else:
    cfg = mg.GemmConfig(wg_split=split, cluster=cluster or None)
  out = jax.jit(lambda a, b: mg.gemm(a, b, trans_a=trans_a, trans_b=trans_b, config=cfg))(a, b)
  np.testing.assert_allclose(out.astype(np.float32), ref.astype(jnp.bfloat16).astype(np.float32),
                             rtol=1e-2, atol=0.5)
  if cfg.schedule != "cooperative":  # enabled: the same product (a disabled one is undefined)
    on = jax.jit(lambda a, b, on: mg.gemm(a, b, trans_a=trans_a, trans_b=trans_b, config=cfg,
                                          enabled=on))(a, b, jnp.bool_(True))
    np.testing.assert_array_equal(on, out)

  if cfg.epilogue_rows:
    return

  def into(c, a, b):
    r = jax.new_ref(c)
    mg.gemm_into(r, a, b, trans_a=trans_a, trans_b=trans_b, config=cfg)
    return r[...]

  out = jax.jit(into, donate_argnums=0)(jnp.copy(c), a, b)
  want = (c.astype(jnp.float32) + ref).astype(jnp.bfloat16).astype(np.float32)
  np.testing.assert_allclose(out.astype(np.float32), want, rtol=1e-2, atol=0.5)


RAGGED_CONFIGS = {  # N = 448 or 512 against CTA tiles of 128, 144, 256 and 384 columns
    "pingpong-128": (448, mg.GemmConfig(tile_n=128, max_concurrent_steps=3, schedule="pingpong",
                                        num_sms=2)),
    "pingpong-144": (512, mg.GemmConfig(tile_n=144, max_concurrent_steps=3, schedule="pingpong",
                                        num_sms=2)),
    "ringE-n-256": (448, mg.GemmConfig(tile_n=128, max_concurrent_steps=3, schedule="ring",
                                       num_sms=2, epilogue_rows=64)),
    "ring-n-96/cluster-n": (512, mg.GemmConfig(tile_n=96, max_concurrent_steps=3,
                                               schedule="ring", num_sms=2, cluster="n")),
    # narrowed_to_fill_waves' tiles (a transposed B, so warpgroup halves of 16 columns)
    "ringE-n-224": (512, mg.GemmConfig(tile_n=112, max_concurrent_steps=3, schedule="ring",
                                       num_sms=2, epilogue_rows=64)),
    "ringE-n-160": (448, mg.GemmConfig(tile_n=80, max_concurrent_steps=3, schedule="ring",
                                       num_sms=2, epilogue_rows=64)),
    "ringE-m-144": (512, mg.GemmConfig(tile_m=64, tile_n=144, wg_split="m",
                                       max_concurrent_steps=3, schedule="ring", num_sms=2,
                                       epilogue_rows=64)),
}


def _ragged_case(name, trans_a, seed=5):
  n, cfg = RAGGED_CONFIGS[name]
  k = jax.random.split(jax.random.key(seed), 2)
  a = jax.random.normal(k[0], (K, M) if trans_a else (M, K), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(k[1], (n, K), jnp.float32).astype(jnp.bfloat16)  # trans_b: [N, K]
  ref = (a.T if trans_a else a).astype(jnp.float32) @ b.T.astype(jnp.float32)
  return a, b, cfg, ref


def test_ragged_n_is_allowed_only_where_tma_clips_it():
  assert mg.shape_error(512, 128256, 4096, RAGGED_CONFIGS["pingpong-144"][1]) is None
  assert "N=448 is not a multiple" in mg.shape_error(256, 448, 256, mg.GemmConfig(tile_n=128))
  a, b, cfg, _ = _ragged_case("pingpong-144", False)
  f = lambda a, b: mg.gemm(a, b, trans_b=True, config=cfg)
  text = jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_tiles_narrowed_to_fill_the_waves():
  """narrowed_to_fill_waves: the CTA width with the fewest waves × width on 132 SMs, the
  widest of equals, its warpgroup halves whole swizzle groups; other tiles as they were."""
  ring = mg.GemmConfig(tile_n=128, schedule="ring", epilogue_rows=64, minor="m", band=8)

  def tiles(m, n, config=ring, trans_b=True):
    c = mg.narrowed_to_fill_waves(config, m, n, trans_b=trans_b, sms=132)
    assert dataclasses.replace(c, tile_m=config.tile_m, tile_n=config.tile_n,
                               wg_split=config.wg_split) == config  # the rest as it was
    return c.wg_split, c.tile_m, c.tile_n

  assert tiles(1024, 4096) == ("n", 128, 128)  # 128 tiles: one wave already
  assert tiles(1024, 3584) == ("n", 128, 112)  # 112 → 128 tiles, one wave 224 wide
  assert tiles(1024, 5120) == ("n", 128, 80)  # 160 → 256 tiles, two waves 160 wide
  assert tiles(1024, 2304) == ("m", 64, 144)  # 72 → 128: 144 columns split along M
  assert tiles(2432, 768) == ("m", 64, 144)  # 57 → 114
  assert tiles(512, 4096) == ("m", 64, 144)  # 64 → 116: no narrower than 144 columns
  assert tiles(4096, 4096) == ("n", 128, 128)  # 4 waves of 256 columns: no narrower is shorter
  # B not transposed: halves of 64 columns, so 192 (2 waves, longer than 256's one) at most
  assert tiles(1024, 3584, trans_b=False) == ("n", 128, 128)
  ping = mg.GemmConfig(tile_n=256, schedule="pingpong", max_concurrent_steps=3)
  assert tiles(1024, 3584, ping) == ("n", 128, 224)  # ping-pong: a warpgroup's whole tile
  for kept in (mg.GemmConfig(tile_n=128), dataclasses.replace(ring, cluster="m"),
               dataclasses.replace(ring, tile_n=128, tail_n=64)):
    assert mg.narrowed_to_fill_waves(kept, 1024, 3584, trans_b=True, sms=132) == kept
  for name in ("ringE-n-224", "ringE-n-160", "ringE-m-144"):  # they lower (runs: the GPU test)
    a, b, cfg, _ = _ragged_case(name, False)
    f = lambda a, b, cfg=cfg: mg.gemm(a, b, trans_b=True, config=cfg)
    assert "mosaic_gpu" in jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(RAGGED_CONFIGS))
@pytest.mark.parametrize("trans_a", [False, True])
def test_ragged_n_matches_reference(name, trans_a):
  """N not a multiple of the tile: the last column of tiles reads TMA's zeros past the end
  of B and stores only its columns inside the output."""
  a, b, cfg, ref = _ragged_case(name, trans_a)
  out = jax.jit(lambda a, b: mg.gemm(a, b, trans_a=trans_a, trans_b=True, config=cfg))(a, b)
  np.testing.assert_allclose(out.astype(np.float32), ref.astype(jnp.bfloat16).astype(np.float32),
                             rtol=1e-2, atol=0.5)


@pytest.mark.parametrize("schedule", ["cooperative", "pingpong", "ring"])
def test_row_windows_lower_for_cuda(schedule):
  """Rows windows (a traced block index) lower on a CPU host for every schedule, in arrays
  whose rows their size does not divide too."""
  cfg = mg.GemmConfig(tile_n=128, max_concurrent_steps=3, schedule=schedule, num_sms=132,
                      wg_split="m" if schedule != "pingpong" else "n")
  for ta, extra in ((False, 0), (True, 0), (False, 128), (True, 64)):
    a = jax.ShapeDtypeStruct((4 * K + extra, M) if ta else (4 * M + extra, K), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((4 * K + extra, N), jnp.bfloat16)
    f = lambda a, b, i, ta=ta: mg.gemm(mg.Rows(a, i, K if ta else M), mg.Rows(b, i, K),
                                       trans_a=ta, config=cfg)
    text = jax.jit(f).trace(a, b, jax.ShapeDtypeStruct((), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_row_windows_must_fit_the_array():
  b = jnp.zeros((K, N), jnp.bfloat16)
  for rows in (128, 700):  # shorter than the window; no whole number of TMA's 8-row tiles
    with pytest.raises(ValueError, match=rf"a: Rows of size 256 must be rows of .*\({rows}, "):
      mg.gemm(mg.Rows(jnp.zeros((rows, K), jnp.bfloat16), 0, M), b)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["cooperative", "pingpong", "ring"])
def test_row_windows_read_and_write_in_place(schedule):
  """Block i of A's rows (and of B's, as K) times B, written into block i of a larger C
  without reading it (accumulate=False): equals the sliced product, the rest of C intact;
  and accumulated into it (accumulate=True)."""
  cfg = (mg.GemmConfig(tile_n=128, max_concurrent_steps=3, schedule=schedule, num_sms=2)
         if schedule == "pingpong" else
         mg.GemmConfig(wg_split="m", max_concurrent_steps=3, schedule=schedule, num_sms=2))
  ks = jax.random.split(jax.random.key(5), 3)
  for ta in (False, True):
    a = jax.random.normal(ks[0], (3 * K, M) if ta else (3 * M, K), jnp.float32).astype(
        jnp.bfloat16)
    b = jax.random.normal(ks[1], (3 * K, N), jnp.float32).astype(jnp.bfloat16)
    c = jax.random.normal(ks[2], (3 * M, N), jnp.float32).astype(jnp.bfloat16)
    i = 1
    a_i = a[i * K:(i + 1) * K] if ta else a[i * M:(i + 1) * M]
    prod = ((a_i.T if ta else a_i).astype(jnp.float32)
            @ b[i * K:(i + 1) * K].astype(jnp.float32))

    def run(c, a, b, i, accumulate, ta=ta):
      r = jax.new_ref(c)
      mg.gemm_into(mg.Rows(r, i, M), mg.Rows(a, i, K if ta else M), mg.Rows(b, i, K),
                   trans_a=ta, accumulate=accumulate, config=cfg)
      return r[...]

    for accumulate in (False, True):
      out = jax.jit(run, static_argnums=4)(c, a, b, jnp.int32(i), accumulate)
      want = prod + (c[i * M:(i + 1) * M].astype(jnp.float32) if accumulate else 0)
      np.testing.assert_allclose(out[i * M:(i + 1) * M].astype(np.float32),
                                 want.astype(jnp.bfloat16).astype(np.float32), rtol=1e-2,
                                 atol=0.5)
      np.testing.assert_array_equal(np.delete(np.asarray(out), np.s_[i * M:(i + 1) * M], 0),
                                    np.delete(np.asarray(c), np.s_[i * M:(i + 1) * M], 0))
    out = jax.jit(lambda a, b, i, ta=ta: mg.gemm(mg.Rows(a, i, K if ta else M), b[:K],
                                                 trans_a=ta, config=cfg))(a, b, jnp.int32(i))
    np.testing.assert_allclose(
        out.astype(np.float32),
        ((a_i.T if ta else a_i).astype(jnp.float32) @ b[:K].astype(jnp.float32)).astype(
            jnp.bfloat16).astype(np.float32), rtol=1e-2, atol=0.5)


TMA_ADD_CONFIGS = {
    "cooperative": mg.GemmConfig(max_concurrent_steps=3),
    "pingpong/cluster-m": mg.GemmConfig(tile_n=128, max_concurrent_steps=3, schedule="pingpong",
                                        num_sms=2, cluster="m"),
    "ringE-n": mg.GemmConfig(max_concurrent_steps=3, schedule="ring", num_sms=2, epilogue_rows=64),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(TMA_ADD_CONFIGS))
@pytest.mark.parametrize("trans_a,trans_b", [(True, False), (False, True)])
def test_tma_add_matches_reference(name, trans_a, trans_b):
  """C += op(A) op(B) with the product rounded to bf16 and added to C by TMA reduce stores:
  C + bf16(product), rounded, but for the product's own rounding, which may fall on the
  other side where the kernel's float32 sum (in its own order) differs from XLA's in the
  last bit: then one bf16 ulp of the product or of the result apart (H200: 3 and 7 of
  131,072 elements)."""
  a, b, c, ref = _operands(trans_a, trans_b, seed=3, m=512 if "cluster" in name else M)

  def into(c, a, b):
    r = jax.new_ref(c)
    mg.gemm_into(r, a, b, trans_a=trans_a, trans_b=trans_b, add="tma",
                 config=TMA_ADD_CONFIGS[name])
    return r[...]

  out = np.asarray(jax.jit(into, donate_argnums=0)(jnp.copy(c), a, b).astype(np.float32))
  prod = ref.astype(jnp.bfloat16).astype(jnp.float32)
  twice = np.asarray((c.astype(jnp.float32) + prod).astype(jnp.bfloat16).astype(np.float32))
  off = np.abs(out - twice) > 2.0**-7 * (np.abs(twice) + np.abs(np.asarray(prod)))
  assert not off.any(), f"{off.sum()} elements beyond one ulp, e.g. {np.argwhere(off)[:3]}"
  assert (out != twice).mean() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("cluster", [None, "m", "n"])
@pytest.mark.parametrize("trans_a,trans_b", [(True, False), (False, True)])
@pytest.mark.parametrize("slots,num_sms,k", [(2, 3, 512), (2, 3, 320), (4, 2, 512),
                                             (4, 2, 768)])
def test_pingpong_on_own_slots_matches_reference(slots, num_sms, k, trans_a, trans_b,
                                                  cluster):
  """Ping-pong: each warpgroup waits on and releases its own tiles' slots only, through
  its own `ready` barriers, whether a tile fills each slot an even number of times (K =
  512: 8 steps of 64) or not (K = 320 on 2 slots: 5 steps; K = 768 on 4: 12, GPT-2's D).
  2 slots: 3 CTAs over 12 tiles of 128 × 128; 4 slots: 2 CTAs over 8 tiles of 128 × 192
  (some CTAs run an odd number, so the warpgroups own different numbers of tiles; pairs
  along M or N when clustered); stored, added by TMA and (128 wide) added in the
  epilogue."""
  a, b, c, ref = _operands(trans_a, trans_b, seed=7, m=512, k=k, n=384)
  wide = slots == 4  # 192 wide: the epilogue through 64-row pieces, so no C tile fits
  cfg = mg.GemmConfig(tile_n=192 if wide else 128, max_concurrent_steps=slots,
                      schedule="pingpong", num_sms=2 if cluster else num_sms, cluster=cluster,
                      epilogue_rows=64 if wide else None)
  out = jax.jit(lambda a, b: mg.gemm(a, b, trans_a=trans_a, trans_b=trans_b, config=cfg))(a, b)
  np.testing.assert_allclose(out.astype(np.float32), ref.astype(jnp.bfloat16).astype(np.float32),
                             rtol=1e-2, atol=0.5)
  if cfg.schedule != "cooperative":  # enabled: the same product (a disabled one is undefined)
    on = jax.jit(lambda a, b, on: mg.gemm(a, b, trans_a=trans_a, trans_b=trans_b, config=cfg,
                                          enabled=on))(a, b, jnp.bool_(True))
    np.testing.assert_array_equal(on, out)
  want = (c.astype(jnp.float32) + ref).astype(jnp.bfloat16).astype(np.float32)
  for add in ("tma",) if wide else ("epilogue", "tma"):
    def into(c, a, b, add=add):
      r = jax.new_ref(c)
      mg.gemm_into(r, a, b, trans_a=trans_a, trans_b=trans_b, config=cfg, add=add)
      return r[...]
    out = jax.jit(into, donate_argnums=0)(jnp.copy(c), a, b)
    np.testing.assert_allclose(out.astype(np.float32), want, rtol=1e-2, atol=0.5)


@pytest.mark.gpu
def test_accumulates_in_place():
  a, b, c, _ = _operands(True, False)

  def into(c, a, b):
    r = jax.new_ref(c)
    mg.gemm_into(r, a, b, trans_a=True)
    return r[...]

  m = jax.jit(into, donate_argnums=0).lower(c, a, b).compile().memory_analysis()
  assert m.temp_size_in_bytes < c.nbytes // 4
  assert m.alias_size_in_bytes >= c.nbytes


ROW_SCALE_CONFIGS = {
    "ring-m, 64-row epilogue": mg.GemmConfig(wg_split="m", tile_n=128, schedule="ring",
                                              max_concurrent_steps=3, num_sms=3,
                                              epilogue_rows=64),
    "ring-n": mg.GemmConfig(tile_n=128, schedule="ring", max_concurrent_steps=3, num_sms=2),
    "pingpong/cluster-m": mg.GemmConfig(tile_n=128, max_concurrent_steps=3, schedule="pingpong",
                                        num_sms=2, cluster="m"),
}


def test_row_scale_is_checked_and_lowers_for_cuda():
  a = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((K, N), jnp.bfloat16)
  cfg = ROW_SCALE_CONFIGS["ring-n"]
  s = jax.ShapeDtypeStruct((M,), jnp.float32)
  text = jax.jit(lambda a, b, s: mg.gemm(a, b, config=cfg, row_scale=s)).trace(a, b, s).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  za, zb = jnp.zeros((M, K), jnp.bfloat16), jnp.zeros((K, N), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"row_scale must be \[256\].*got \(512,\)"):
    mg.gemm(za, zb, config=cfg, row_scale=jnp.ones((512,)))
  with pytest.raises(TypeError, match="row_scale must be floating point, got int32"):
    mg.gemm(za, zb, config=cfg, row_scale=jnp.ones((M,), jnp.int32))
  with pytest.raises(ValueError, match="row_scale needs the 'pingpong' or 'ring' schedule"):
    mg.gemm(za, zb, row_scale=jnp.ones((M,)))
  with pytest.raises(ValueError, match="row_scale and row_stats do not combine"):
    mg.gemm(za, zb, config=cfg, row_scale=jnp.ones((M,)), row_stats=N)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(ROW_SCALE_CONFIGS))
@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (True, False)])
def test_row_scale_scales_the_float32_product(name, trans_a, trans_b):
  """diag(s) op(A) op(B), rounded once: as gemm returns it, written into a window of C
  (accumulate=False), and added to C in the epilogue and by TMA (the scaled product
  rounded first there)."""
  cfg = ROW_SCALE_CONFIGS[name]
  m = 512 if "cluster" in name else M
  a, b, c, ref = _operands(trans_a, trans_b, seed=11, m=m)
  s = jnp.exp(jax.random.normal(jax.random.key(12), (m,), jnp.float32) * 3)  # 1e-4..1e4
  want = s[:, None] * ref
  bf = lambda v: np.asarray(jnp.asarray(v).astype(jnp.bfloat16).astype(jnp.float32))
  # A bf16 ulp of the result, plus one of a typical entry of its row (|ref| ~ 16): where
  # the float32 sums of kernel and XLA differ in their last bits and cancel.
  typical = np.asarray(s)[:, None] * 16.0

  def check(got, expect, ulps, what):
    off = np.abs(got - expect) > ulps * 2.0**-7 * (np.abs(expect) + typical)
    assert not off.any(), f"{what}: {off.sum()} elements off, e.g. {np.argwhere(off)[:3]}"

  out = jax.jit(lambda a, b, s: mg.gemm(a, b, trans_a=trans_a, trans_b=trans_b, config=cfg,
                                        row_scale=s))(a, b, s)
  check(np.asarray(out.astype(jnp.float32)), bf(want), 1, "gemm")

  def into(c, a, b, s, accumulate, add):
    r = jax.new_ref(c)
    mg.gemm_into(r, a, b, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate, add=add,
                 config=cfg if add == "tma" or not accumulate
                 else dataclasses.replace(cfg, epilogue_rows=None), row_scale=s)
    return r[...]

  into = jax.jit(into, static_argnums=(4, 5))
  cf = c.astype(jnp.float32)
  for accumulate, add, expect, ulps in ((False, "epilogue", bf(want), 1),
                                        (True, "epilogue", bf(cf + want), 1),
                                        (True, "tma", bf(cf + bf(want)), 2)):
    got = np.asarray(into(c, a, b, s, accumulate, add).astype(jnp.float32))
    check(got, expect, ulps, f"gemm_into accumulate={accumulate} add={add}")


ROW_STATS_CONFIGS = {  # (M, N, columns counted, config): CTA tiles of 128 × 256 and 256 × 128
    "ring-n": (256, 1024, 1024, mg.GemmConfig(tile_n=128, schedule="ring",
                                              max_concurrent_steps=3, num_sms=6)),
    "ringE-n, ragged, 1,000 columns": (
        256, 1088, 1000, mg.GemmConfig(tile_n=128, schedule="ring", num_sms=8, epilogue_rows=64)),
    "ring-m, 64-row warpgroup tiles": (
        256, 768, 700, mg.GemmConfig(tile_m=64, tile_n=256, wg_split="m", schedule="ring",
                                     max_concurrent_steps=3, num_sms=4)),
    "pingpong, ragged, 1,000 columns": (
        256, 1088, 1000, mg.GemmConfig(tile_n=128, schedule="pingpong", max_concurrent_steps=4,
                                       num_sms=6, epilogue_rows=64)),
    "pingpong on own slots, 192 wide, ragged": (  # K's 4 steps: twice the 2 slots
        256, 1088, 1000, mg.GemmConfig(tile_n=192, schedule="pingpong", max_concurrent_steps=2,
                                       num_sms=5, epilogue_rows=64)),
    "ring-m, idle CTAs": (256, 512, 512, mg.GemmConfig(wg_split="m", tile_n=128,
                                                       schedule="ring", max_concurrent_steps=3,
                                                       num_sms=7)),
}


def _row_stats_case(name, seed=7, configs=None):
  m, n, cols, cfg = (configs or ROW_STATS_CONFIGS)[name]
  k = jax.random.split(jax.random.key(seed), 2)
  a = jax.random.normal(k[0], (m, K), jnp.float32).astype(jnp.bfloat16)
  b = (3 * jax.random.normal(k[1], (n, K), jnp.float32)).astype(jnp.bfloat16)  # [N, K]
  return a, b, cols, cfg


def test_row_stats_lower_for_cuda_and_check_their_arguments():
  a, b, cols, cfg = _row_stats_case("ringE-n, ragged, 1,000 columns")
  f = lambda a, b: mg.gemm(a, b, trans_b=True, config=cfg, row_stats=cols)
  out, parts = jax.eval_shape(f, a, b)
  assert out.shape == (256, 1088) and parts.shape == (2 * 4, 256)  # 8 CTAs on 2 row blocks
  assert mg.row_stats_rows(256, cfg) == 8
  text = jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  with pytest.raises(ValueError, match="'ring' or 'pingpong' schedule, without clusters"):
    mg.gemm(a, b[:1024], trans_b=True, config=mg.GemmConfig(tile_n=128), row_stats=cols)
  ping = ROW_STATS_CONFIGS["pingpong, ragged, 1,000 columns"][3]
  assert mg.row_stats_rows(256, ping) == 6  # 3 CTAs per row block, each warpgroup its own
  f = lambda a, b: mg.gemm(a, b, trans_b=True, config=ping, row_stats=cols)
  assert "mosaic_gpu" in jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
  with pytest.raises(ValueError, match=r"row_stats must count columns in \[1, 1088\], got 0"):
    mg.gemm(a, b, trans_b=True, config=cfg, row_stats=0)
  f = lambda a, b: mg.gemm(a, b, trans_b=True, config=cfg, row_stats=cols, exp_out=True)
  assert "mosaic_gpu" in jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
  assert jax.eval_shape(f, a, b)[1].shape == (1088 // 128 + 1, 256)  # one per column strip
  with pytest.raises(ValueError, match="exp_out is an option of row_stats"):
    mg.gemm(a, b, trans_b=True, config=cfg, exp_out=True)
  f = lambda a, b: mg.gemm(a, b, trans_b=True, config=cfg, row_stats=cols, exp_out=True,
                           softcap=30.0)
  assert "mosaic_gpu" in jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
  for bad in (dict(softcap=30.0), dict(softcap=0.0, exp_out=True)):
    with pytest.raises(ValueError, match="softcap is a positive cap of exp_out's product"):
      mg.gemm(a, b, trans_b=True, config=cfg, row_stats=cols, **bad)
  with pytest.raises(ValueError, match="exp_out.*neither row_stats_into nor tail_n"):
    mg.gemm(a, b, trans_b=True, config=TAIL_CONFIGS["ring-n"], row_stats=cols, exp_out=True)
  for cap in (None, 30.0):  # the row sums alone: one output, no [M, N] product
    f = lambda a, b, cap=cap: mg.gemm(a, b, trans_b=True, config=cfg, row_stats=cols,
                                      exp_out=True, softcap=cap, store=False)
    assert jax.eval_shape(f, a, b).shape == (1088 // 128 + 1, 256)
    assert "mosaic_gpu" in jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
  for bad in (dict(), dict(row_stats=cols)):
    with pytest.raises(ValueError, match="store=False is an option of exp_out"):
      mg.gemm(a, b, trans_b=True, config=cfg, store=False, **bad)


def test_a_plain_product_may_be_disabled():
  """gemm(enabled=flag) lowers with a traced flag; statistics cannot be switched off."""
  a, b, cols, cfg = _row_stats_case("ringE-n, ragged, 1,000 columns")
  f = lambda a, b, on: mg.gemm(a, b, trans_b=True, config=cfg, enabled=on)
  on = jnp.bool_(True)
  assert jax.eval_shape(f, a, b, on).shape == (256, 1088)
  assert "mosaic_gpu" in jax.jit(f).trace(a, b, on).lower(
      lowering_platforms=("cuda",)).as_text()
  with pytest.raises(ValueError, match="enabled is an option of a plain product"):
    mg.gemm(a, b, trans_b=True, config=cfg, row_stats=cols, exp_out=True, enabled=on)
  with pytest.raises(ValueError, match="enabled needs the 'pingpong' or 'ring' schedule"):
    mg.gemm(a, b[:1024], trans_b=True, config=mg.GemmConfig(tile_n=128), enabled=on)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(ROW_STATS_CONFIGS))
def test_row_stats_match_the_rounded_output(name):
  """logsumexp over the partials is each row's log-sum-exp of the first `cols` columns of
  the bf16 output; a CTA with no tile (or a column range past `cols`) adds -inf."""
  a, b, cols, cfg = _row_stats_case(name)
  out, parts = jax.jit(lambda a, b: mg.gemm(a, b, trans_b=True, config=cfg,
                                            row_stats=cols))(a, b)
  ref = a.astype(jnp.float32) @ b.T.astype(jnp.float32)
  np.testing.assert_allclose(out.astype(np.float32), ref.astype(jnp.bfloat16).astype(np.float32),
                             rtol=1e-2, atol=0.5)
  want = jax.nn.logsumexp(out[:, :cols].astype(jnp.float32), axis=1)
  assert parts.shape == (mg.row_stats_rows(a.shape[0], cfg), a.shape[0])
  assert not np.isnan(np.asarray(parts)).any()
  np.testing.assert_allclose(jax.nn.logsumexp(parts, axis=0), want, rtol=1e-6, atol=1e-4)


# exp_out also runs in CTA pairs: along N, the last pair's second CTA lies wholly past N.
EXP_OUT_CONFIGS = {**ROW_STATS_CONFIGS, "pingpong, pairs along N, ragged, 1,000 columns": (
    256, 1088, 1000, mg.GemmConfig(tile_n=128, schedule="pingpong", max_concurrent_steps=4,
                                   num_sms=6, epilogue_rows=64, cluster="n"))}


def test_exp_out_in_cta_pairs_lowers_for_cuda():
  a, b, cols, cfg = _row_stats_case("pingpong, pairs along N, ragged, 1,000 columns",
                                    configs=EXP_OUT_CONFIGS)
  f = lambda a, b: mg.gemm(a, b, trans_b=True, config=cfg, row_stats=cols, exp_out=True)
  assert jax.eval_shape(f, a, b)[1].shape == (1088 // 128 + 1, 256)
  assert "mosaic_gpu" in jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [None, 8.0])
@pytest.mark.parametrize("name", sorted(EXP_OUT_CONFIGS))
def test_exp_out_matches_reference(name, softcap):
  """exp_out: the output is exp(min(product, 64)) and the per-strip partials are each row's
  sums of its exponentials there, over the first `cols` columns in all; every schedule,
  ragged N, idle CTAs, CTA pairs. With a softcap c the exponentials are of c·tanh(product
  / c) and the output holds them times 1 − tanh²."""
  a, b, cols, cfg = _row_stats_case(name, configs=EXP_OUT_CONFIGS)
  out, parts = jax.jit(lambda a, b: mg.gemm(a, b, trans_b=True, config=cfg, row_stats=cols,
                                            exp_out=True, softcap=softcap))(a, b)
  ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
  slope, atol = 1.0, 1e-30
  if softcap is not None:  # in float64: 1 − t² of a float32 t near ±1 is its rounding
    t = np.tanh(ref / softcap)
    ref, slope = softcap * t, (1.0 - t) * (1.0 + t)
    # The kernel's float32 t is that far from tanh: 1e-7 of slope at e^8's exponentials.
    atol = 1e-6 * np.exp(softcap)
  ref = np.minimum(ref, mg.EXP_CLAMP)
  assert parts.shape == (-(-b.shape[0] // cfg.tile_n), a.shape[0])
  np.testing.assert_allclose(out.astype(np.float32), np.exp(ref) * slope, rtol=1e-2,
                             atol=atol)
  want = jax.nn.logsumexp(ref[:, :cols], axis=1)
  np.testing.assert_allclose(jnp.log(jnp.sum(parts, axis=0)), want, rtol=1e-5, atol=1e-4)
  strips = [jnp.sum(jnp.exp(ref[:, c:min(c + cfg.tile_n, cols)]), axis=1)
            for c in range(0, b.shape[0], cfg.tile_n)]
  np.testing.assert_allclose(parts, jnp.stack(strips), rtol=1e-4, atol=1e-30)
  # Without the stores: the same sums, bit for bit.
  alone = jax.jit(lambda a, b: mg.gemm(a, b, trans_b=True, config=cfg, row_stats=cols,
                                       exp_out=True, softcap=softcap, store=False))(a, b)
  np.testing.assert_array_equal(alone, parts)


TAIL_CONFIGS = {  # M = 256, N = 1,088: whole CTA tiles dealt evenly, the rest in tail tiles
    # 2 row blocks × 3 CTAs: one 128 × 256 tile each, then 320 columns in 128-wide tiles
    "ring-n": mg.GemmConfig(tile_n=128, schedule="ring", max_concurrent_steps=3, num_sms=6,
                            tail_n=64),
    "ringE-n": mg.GemmConfig(tile_n=128, schedule="ring", max_concurrent_steps=3, num_sms=6,
                             epilogue_rows=64, tail_n=64),
    # 1 row block × 4 CTAs: two 256 × 128 tiles each, then one tile 64 wide
    "ring-m": mg.GemmConfig(tile_n=128, wg_split="m", schedule="ring", max_concurrent_steps=3,
                            num_sms=4, tail_n=64),
    # 2 row blocks × 3 CTAs: two 128 × 128 tiles each, then 5 tiles 64 wide (2, 2, 1)
    "pingpong": mg.GemmConfig(tile_n=128, schedule="pingpong", max_concurrent_steps=4,
                              num_sms=6, tail_n=64),
}


def test_tail_tiles_are_checked_and_lower_for_cuda():
  for bad in (dict(tail_n=64), dict(tail_n=64, schedule="ring", cluster="m"),
              dict(tail_n=48, tile_n=192, schedule="ring"), dict(tail_n=64, tile_n=64,
                                                                  schedule="ring")):
    with pytest.raises(ValueError, match="tail_n is a multiple of 32 dividing tile_n"):
      mg.GemmConfig(**bad)
  with pytest.raises(ValueError, match=r"tail_n=32 \(not a multiple of 64\) needs B stored"):
    mg.gemm(jnp.zeros((M, K), jnp.bfloat16), jnp.zeros((K, 1088), jnp.bfloat16),
            config=mg.GemmConfig(tile_n=128, schedule="ring", tail_n=32))
  with pytest.raises(ValueError, match="M has more row blocks than the 6 CTAs"):
    mg.gemm(jnp.zeros((1024, K), jnp.bfloat16), jnp.zeros((K, 1088), jnp.bfloat16),
            config=mg.GemmConfig(tile_m=64, tile_n=128, schedule="ring", num_sms=6, tail_n=64))
  for name, cfg in TAIL_CONFIGS.items():
    for tb, stats in ((True, None), (False, 1000)):
      a = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
      b = jax.ShapeDtypeStruct((1088, K) if tb else (K, 1088), jnp.bfloat16)
      f = lambda a, b, tb=tb, stats=stats, cfg=cfg: mg.gemm(a, b, trans_b=tb, config=cfg,
                                                            row_stats=stats)
      text = jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
      assert "mosaic_gpu" in text, (name, tb)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(TAIL_CONFIGS))
@pytest.mark.parametrize("trans_b", [False, True])
def test_tail_tiles_match_reference(name, trans_b):
  """The product, the product added to C, and row statistics over 1,000 of the 1,088
  columns, with the last columns in tail tiles (the last one ragged in ring-n)."""
  cfg, n, cols = TAIL_CONFIGS[name], 1088, 1000
  k = jax.random.split(jax.random.key(11), 3)
  a = jax.random.normal(k[0], (M, K), jnp.float32).astype(jnp.bfloat16)
  b = (2 * jax.random.normal(k[1], (n, K) if trans_b else (K, n), jnp.float32)
       ).astype(jnp.bfloat16)
  c = jax.random.normal(k[2], (M, n), jnp.float32).astype(jnp.bfloat16)
  ref = a.astype(jnp.float32) @ (b.T if trans_b else b).astype(jnp.float32)
  out, parts = jax.jit(lambda a, b: mg.gemm(a, b, trans_b=trans_b, config=cfg,
                                            row_stats=cols))(a, b)
  np.testing.assert_allclose(out.astype(np.float32), ref.astype(jnp.bfloat16).astype(np.float32),
                             rtol=1e-2, atol=0.5)
  want = jax.nn.logsumexp(out[:, :cols].astype(jnp.float32), axis=1)
  np.testing.assert_allclose(jax.nn.logsumexp(parts, axis=0), want, rtol=1e-6, atol=1e-4)
  if cfg.epilogue_rows:
    return

  def into(c, a, b):
    r = jax.new_ref(c)
    mg.gemm_into(r, a, b, trans_b=trans_b, config=cfg)
    return r[...]

  out = jax.jit(into, donate_argnums=0)(jnp.copy(c), a, b)
  want = (c.astype(jnp.float32) + ref).astype(jnp.bfloat16).astype(np.float32)
  np.testing.assert_allclose(out.astype(np.float32), want, rtol=1e-2, atol=0.5)



def test_stats_window_is_checked():
  cfg = TAIL_CONFIGS["ring-n"]  # 2 row blocks × 3 CTAs × 2 warpgroups: P = 6
  rows = lambda shape, dtype=jnp.bfloat16: mg.Rows(jnp.zeros(shape, dtype), 1, shape[0] // 2)
  assert mg.stats_window_error(rows((512, 512)), 256, cfg) is None  # 3 · 6 · 256 words
  assert "cannot hold the partials' 4608 words" in mg.stats_window_error(rows((32, 128)), 256,
                                                                          cfg)
  assert "multiple or a divisor of M=256" in mg.stats_window_error(rows((512, 384)), 256, cfg)
  assert "Rows of a bfloat16 array" in mg.stats_window_error(rows((512, 512), jnp.float16),
                                                             256, cfg)
  with pytest.raises(ValueError, match="cannot hold"):
    mg.gemm(jnp.zeros((M, K), jnp.bfloat16), jnp.zeros((1088, K), jnp.bfloat16), trans_b=True,
            config=cfg, row_stats=1000, row_stats_into=rows((32, 128)))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ring-n", "pingpong"])
def test_row_stats_into_a_window_as_words(name):
  """row_stats_into stores the partials as bf16 words in rows 256-511 of a [768, 512] array
  (the rest untouched): summed, they are row_stats' float32 partials bit for bit."""
  cfg, cols = TAIL_CONFIGS[name], 1000
  k = jax.random.split(jax.random.key(17), 2)
  a = jax.random.normal(k[0], (M, K), jnp.float32).astype(jnp.bfloat16)
  b = (2 * jax.random.normal(k[1], (1088, K), jnp.float32)).astype(jnp.bfloat16)
  fill = jnp.full((768, 512), 7.0, jnp.bfloat16)

  @jax.jit
  def run(a, b, fill):
    ref = jax.new_ref(fill)
    out, words = mg.gemm(a, b, trans_b=True, config=cfg, row_stats=cols,
                         row_stats_into=mg.Rows(ref, 1, 256))
    return out, words, ref[...]

  out, words, after = run(a, b, fill)
  want_out, want = jax.jit(lambda a, b: mg.gemm(a, b, trans_b=True, config=cfg,
                                                row_stats=cols))(a, b)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
  p = words.count
  got = sum(words.words[words.start + i * p:words.start + (i + 1) * p].astype(jnp.float32)
            for i in range(3))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  used = 3 * p * M // 512  # rows of the window the words fill
  np.testing.assert_array_equal(np.asarray(after[:256], np.float32), 7.0)
  np.testing.assert_array_equal(np.asarray(after[256 + used:], np.float32), 7.0)
