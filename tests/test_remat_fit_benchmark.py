"""benchmarks/remat_fit.py end to end on CPU, with the fresh-process train run faked."""

import json

from benchmarks import remat_fit
from benchmarks import train_step


def test_each_budget_row_names_the_pick_and_its_measured_peak(monkeypatch, tmp_path, capsys):
  runs = []

  def fake(config, kernels, batch, steps, seq_len, remat_policy=None, **kw):
    runs.append(remat_policy)
    return {"peak_bytes": 2**30}

  monkeypatch.setattr(train_step, "measure", fake)
  out = tmp_path / "remat_fit.jsonl"
  remat_fit.main(["--config", "tiny", "--batch", "1", "--seq-len", "256",
                  "--policies", "nothing,everything", "--budgets-gib", "0.000001,100",
                  "--out", str(out)])
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["budget_bytes"] for r in rows] == [1073, 100 * 2**30]
  assert "error" in rows[0] and "chosen" not in rows[0]  # nothing fits a kilobyte
  assert rows[1]["chosen"] == "everything"  # the fewest FLOPs where both fit
  assert rows[1]["measured_peak_bytes"] == 2**30
  assert rows[1]["predicted_peak_bytes"] == next(
      c["peak_bytes"] for c in rows[1]["candidates"] if c["name"] == "everything")
  assert runs == ["everything"]
  assert "everything" in capsys.readouterr().out  # the policy table is printed
