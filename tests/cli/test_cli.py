"""The command-line entry points."""

from memeff_jax import cli


def test_compare_loss_runs_and_agrees(capsys):
  assert cli.main(["compare-loss", "--tokens", "256", "--hidden", "32", "--vocab", "1000",
                   "--reps", "1"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("memeff-jax compare-loss on ")
  assert "memeff_jax.linear_cross_entropy" in out
  assert "less temporary memory" in out


def test_train_runs(capsys):
  assert cli.main(["train", "--config", "tiny", "--steps", "2", "--seq-len", "64"]) == 0
  assert "memeff layers: loss" in capsys.readouterr().out


def test_report_runs(capsys):
  """The step's memory report, every policy's row against the budget, and the pick."""
  assert cli.main(["report", "--config", "tiny", "--seq-len", "64", "--batch", "1",
                   "--budget-gib", "4"]) == 0
  out = capsys.readouterr().out
  assert "temporaries" in out and "remat policies" in out and "everything" in out
  assert "fits 4.000 GiB" in out and "within 4.0 GiB, the least recomputation: 'everything'" in out


def test_policy_table_without_a_budget_has_no_fits_column():
  from memeff_jax import remat  # pylint: disable=import-outside-toplevel
  cands = [remat.Candidate("nothing", 2**30, 1e9, xla_flops=1e9),
           remat.Candidate("everything", error="XlaRuntimeError: out of memory")]
  text = remat.table(cands)
  assert "fits" not in text and "cannot compile: XlaRuntimeError" in text
  assert text.splitlines()[1].split()[:3] == ["nothing", "1.000", "GiB"]
  assert remat.table(cands, 2**31).splitlines()[1].endswith("yes")


def test_every_option_has_help():
  """Each subcommand and option says what it is (and the defaults, where there are any)."""
  import argparse  # pylint: disable=import-outside-toplevel
  top = cli.parser()
  assert top.description and "memory" in top.description
  commands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))  # pylint: disable=protected-access
  assert {c.dest for c in commands._choices_actions} == set(commands.choices)  # pylint: disable=protected-access
  assert all(c.help for c in commands._choices_actions)  # pylint: disable=protected-access
  for name, sub in commands.choices.items():
    for action in sub._actions:  # pylint: disable=protected-access
      if action.dest == "help":
        continue
      assert action.help, f"{name} {action.option_strings or action.dest} has no help"
      if action.default not in (None, argparse.SUPPRESS) and action.option_strings:
        assert "default" in action.help, f"{name} {action.option_strings} hides its default"


def test_progress_writes_lines_into_a_file(tmp_path):
  from memeff_jax.models import run  # pylint: disable=import-outside-toplevel
  with open(tmp_path / "log", "w") as f:
    for i in range(1, 21):
      run.progress("memeff", i, 20, 1.0, stream=f)
  lines = (tmp_path / "log").read_text().splitlines()
  assert len(lines) == 10 and "\r" not in "".join(lines) and lines[-1].endswith("20/20 loss 1.0000")
