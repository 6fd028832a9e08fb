"""The command-line entry points."""

from memeff_jax import cli


def test_compare_loss_runs_and_agrees(capsys):
  assert cli.main(["compare-loss", "--tokens", "256", "--hidden", "32", "--vocab", "1000",
                   "--reps", "1"]) == 0
  out = capsys.readouterr().out
  assert "memeff_jax.linear_cross_entropy" in out
  assert "less temporary memory" in out


def test_train_runs(capsys):
  assert cli.main(["train", "--config", "tiny", "--steps", "2", "--seq-len", "64"]) == 0
  assert "memeff layers: loss" in capsys.readouterr().out


def test_report_runs(capsys):
  assert cli.main(["report", "--config", "tiny", "--seq-len", "64", "--batch", "1"]) == 0
  out = capsys.readouterr().out
  assert "temporaries" in out and "remat policies" in out and "everything" in out
