"""The suite's own options: `--shard K/N` splits the collected tests into N disjoint parts
that together are the whole suite."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _collected(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
       "tests/ops/flash_attention/test_padding.py", *args],
      cwd=ROOT, capture_output=True, text=True, check=False)


def _ids(result: subprocess.CompletedProcess) -> list[str]:
  assert result.returncode == 0, result.stdout + result.stderr
  return [line for line in result.stdout.splitlines() if "::" in line]


def test_shards_partition_the_suite():
  whole = _ids(_collected())
  parts = [_ids(_collected("--shard", f"{k}/3")) for k in (1, 2, 3)]
  assert len(whole) >= 6
  assert sorted(sum(parts, [])) == sorted(whole)
  assert all(abs(len(p) - len(whole) / 3) < 1 for p in parts), [len(p) for p in parts]
  assert parts[1] == whole[1::3]  # interleaved, in collection order


def test_shard_after_keyword_selection():
  selected = _ids(_collected("-k", "not in_place"))
  assert 0 < len(selected) < len(_ids(_collected()))
  assert _ids(_collected("-k", "not in_place", "--shard", "2/2")) == selected[1::2]


def test_bad_shard_is_a_usage_error():
  result = _collected("--shard", "3/2")
  assert result.returncode != 0
  assert "--shard '3/2': expected K/N with 1 <= K <= N" in result.stderr
