"""Test setup: `gpu` tests skipped without a GPU; JAX allocating GPU memory on demand, so
that the README's `pytest -n 2` workers (pytest-xdist) can share one GPU; with
MEMEFF_TEST_GPUS=n, xdist worker i sees GPU i mod n only (benchmarks/gpu.sh spreads the
workers over the host's GPUs so); eight CPU devices for meshes; fast-compiling XLA
flags; a compilation cache per run on CPU; tuning tables of a test's own (`tuning_tables`);
`--shard K/N` to run a suite in parts (where one command may run only so long)."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
_WORKER, _GPUS = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("MEMEFF_TEST_GPUS", 0))
if _WORKER and _GPUS > 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
  os.environ["CUDA_VISIBLE_DEVICES"] = str(int(_WORKER.removeprefix("gw")) % _GPUS)
# Eight CPU devices for the multi-device tests (a mesh on one host); one-device tests use the
# first, as before. The suite is compile-bound (small arrays, many programs): without a GPU,
# LLVM at -O0 (30% off the context-parallel tests' time against -O1) and XLA:CPU's elemental
# emitters in place of its fusion emitters (a further 16%); with one, LLVM at -O1, as the GPU
# suite has always run. Set before jax is imported.
_FLAGS = ["--xla_force_host_platform_device_count=8"]
if os.path.exists("/dev/nvidiactl"):
  _FLAGS.append("--xla_backend_optimization_level=1")
else:
  _FLAGS += ["--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"]
for _flag in _FLAGS:
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402  (after the allocator setting)
import pytest


def _has_gpu() -> bool:
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False


@pytest.fixture(scope="package", autouse=True)
def _compilation_cache(tmp_path_factory):
  """On CPU, a compilation cache shared by the run's xdist workers, in the run's temporary
  directory (pytest keeps the last three): many tests compile the same programs (one-device
  references, shared shapes and options), and reusing them takes about a sixth off the
  suite. Results are XLA's either way (the cache's key is the program, its options and the
  jaxlib)."""
  if _has_gpu():
    return
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):  # .../pytest-N/popen-gwK: the run's is the parent
    root = root.parent
  jax.config.update("jax_compilation_cache_dir", str(root / "compilation-cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_addoption(parser):
  parser.addoption(
      "--shard", default=None, metavar="K/N",
      help="run only the K-th (1-based) of N interleaved parts of the collected tests: every "
           "N-th test from the K-th on, so that each part takes a share of every class")


def _shard(value: str) -> tuple[int, int]:
  try:
    k, n = (int(part) for part in value.split("/"))
  except ValueError:
    k = n = 0
  if not 1 <= k <= n:
    raise pytest.UsageError(f"--shard {value!r}: expected K/N with 1 <= K <= N, e.g. 2/3")
  return k, n


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs: even parts
def pytest_collection_modifyitems(config, items):
  if (value := config.getoption("shard")) is not None:
    k, n = _shard(value)
    kept = items[k - 1::n]
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % n != k - 1])
    items[:] = kept
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def tuning_tables(tmp_path, monkeypatch):
  """tuning_tables(op=toml_text, ...): memeff_jax._tuning reads these tables, and only
  these, for the rest of the test."""
  from memeff_jax import _tuning  # pylint: disable=import-outside-toplevel
  (tmp_path / "tuning").mkdir()
  monkeypatch.setenv("MEMEFF_JAX_CONFIG_DIR", str(tmp_path))

  def write(**tables):
    for op, text in tables.items():
      (tmp_path / "tuning" / f"{op}.toml").write_text(text)
    _tuning._table.cache_clear()  # pylint: disable=protected-access

  yield write
  _tuning._table.cache_clear()  # pylint: disable=protected-access


@pytest.fixture
def tuned_as(monkeypatch):
  """tuned_as(kind): the tuning tables read as on a GPU of that device kind, so that tests of
  the tuned settings pass on any machine."""
  from memeff_jax import _tuning  # pylint: disable=import-outside-toplevel
  lookup = _tuning.lookup
  def pin(kind):
    monkeypatch.setattr(_tuning, "lookup",
                        lambda *a, **kw: lookup(*a, **{**kw, "device_kind": kind}))
  return pin


@pytest.fixture
def as_on_hopper(monkeypatch):
  """The Mosaic kernels report themselves available: default choices are made as on a
  Hopper GPU, on any machine."""
  # pylint: disable=import-outside-toplevel
  from memeff_jax.kernels import hopper
  from memeff_jax.ops.flash_attention import pallas_mosaic_gpu
  monkeypatch.setattr(pallas_mosaic_gpu, "hopper_available", lambda: None)
  monkeypatch.setattr(hopper, "on_nvidia_gpu", lambda: True)
