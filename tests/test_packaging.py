"""A regular install carries what the library reads: the wheel, installed into a fresh
environment without the source tree, runs the demo and finds its tuning tables."""

import pathlib
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """(python, memeff-jax script, a working directory outside the source tree)."""
  tmp = tmp_path_factory.mktemp("install")
  # Built from a copy: pip builds in the source tree's build/, and under xdist each worker
  # that runs a test of this module builds the wheel at the same time.
  src = tmp / "src"
  shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
      ".git", "build", "*.egg-info", "__pycache__", ".whl", ".before", "results"))
  subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp),
                  str(src)], check=True)
  wheel, = tmp.glob("memeff_jax-*.whl")
  env = tmp / "env"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
  python = env / "bin" / "python"
  # The dependencies (jax, flax, ...) from this interpreter's site-packages, read as plain
  # paths: their .pth files, among them an editable install of this project, are not run.
  site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                         "['purelib'])"], check=True, capture_output=True, text=True)
  deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
  (pathlib.Path(site.stdout.strip()) / "deps.pth").write_text("\n".join(sorted(deps)) + "\n")
  subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                  "--no-deps", str(wheel)], check=True)
  work = tmp / "work"
  work.mkdir()
  return python, env / "bin" / "memeff-jax", work


def test_installed_package_has_its_tuning_tables(installed):
  python, _, work = installed
  code = ("import memeff_jax, pathlib; from memeff_jax import _tuning; "
          "assert 'site-packages' in memeff_jax.__file__, memeff_jax.__file__; "
          "t = _tuning.lookup('flash_attention', 'pallas_mosaic_gpu_backward', "
          "device_kind='H100'); "
          "assert t['d128_ordered']['dq_rotate']; "
          "g = _tuning.lookup('linear_cross_entropy', 'mosaic_gemm', device_kind='H200'); "
          "assert g['logits']['tile_n'] == 192; print('tables ok')")
  out = subprocess.run([str(python), "-c", code], cwd=work, check=True, capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
  assert "tables ok" in out.stdout


def test_installed_demo_runs(installed):
  _, script, work = installed
  out = subprocess.run([str(script), "demo", "--steps", "2", "--plot", str(work / "demo.png")],
                       cwd=work, capture_output=True, text=True, timeout=600,
                       env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stdout + out.stderr
  assert "losses agree step by step" in out.stdout
