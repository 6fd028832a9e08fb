"""The command-line entry points."""

from memeff_jax import cli


def test_demo_runs_and_agrees(capsys):
  assert cli.main(["demo", "--tokens", "256", "--hidden", "32", "--vocab", "1000",
                   "--reps", "1"]) == 0
  out = capsys.readouterr().out
  assert "memeff_jax.linear_cross_entropy" in out
  assert "less temporary memory" in out
