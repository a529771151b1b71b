"""benchmarks/rerun_records.py's comparison and README's table of it."""

import sys

import numpy as np
import pytest

from fake_records import fake_record


@pytest.fixture(scope="module")
def rerun(load_benchmark):
  return load_benchmark("rerun_records")


def _record(restart, curve, lr=0.01, loss=45.0):
  rec = fake_record("marked_reversal", "ns", lr, restart, min(curve),
                    curve[-1])
  rec["epochs"] = [{"epoch": i + 1, "valid_ce_diff": v,
                    "train_loss": loss + i} for i, v in enumerate(curve)]
  return rec


def test_first_epoch_below_the_threshold(rerun):
  rec = _record(0, [0.3, 0.2, 0.04, 0.01])
  assert rerun.first_below(rec, 4, 0.05) == 3
  assert rerun.first_below(rec, 2, 0.05) is None      # only within epochs
  assert rerun.first_below(rec, 4, 0.01) is None      # strictly below
  assert rerun.first_below(rec, 9, 0.25) == 2


def test_reruns_are_compared_restart_by_restart(rerun):
  plateau, learns_at_2 = [0.3, 0.25, 0.24], [0.3, 0.01, 0.005]
  rows = [
      # Record stuck, rerun learns: an outcome changed.
      rerun.compare(_record(0, learns_at_2, loss=44.5),
                    _record(0, plateau + [0.01]), 3, 0.05),
      # Both learn, at different epochs: the first epoch changed.
      rerun.compare(_record(1, learns_at_2), _record(1, [0.3, 0.2, 0.01]),
                    3, 0.05),
      # Both stuck.
      rerun.compare(_record(2, plateau), _record(2, plateau), 3, 0.05),
      # A restart with no committed record: counted, not compared.
      rerun.compare(_record(7, learns_at_2), None, 3, 0.05),
      rerun.compare(_record(0, plateau, lr=0.005),
                    _record(0, plateau, lr=0.005), 3, 0.05),
  ]
  assert rows[0]["recorded_first"] is None and rows[0]["rerun_first"] == 2
  assert rows[0]["recorded_curve"] == plateau      # the first 3 epochs only
  assert rows[0]["rerun_epoch1_loss"] == 44.5
  assert rows[0]["recorded_epoch1_loss"] == 45.0
  assert "recorded_first" not in rows[3] and not rows[3]["committed"]
  summary = rerun.summarize(rows)
  assert list(summary) == ["0.01", "0.005"]         # highest rate first
  assert summary["0.01"] == {
      "committed_runs": 3, "recorded_learned": 1,
      "rerun_learned_on_committed": 2, "outcome_changed": 1,
      "first_epoch_changed": 2, "runs": 4, "rerun_learned": 3}
  assert summary["0.005"]["rerun_learned"] == 0


def test_readme_block_reads_the_json(load_benchmark, rerun, monkeypatch):
  report = load_benchmark("report")
  rows = [rerun.compare(_record(0, [0.3, 0.01]), _record(0, [0.3, 0.2]),
                        2, 0.05),
          rerun.compare(_record(1, [0.3, 0.2]), None, 2, 0.05)]
  data = {"task": "marked_reversal", "model": "ns", "epochs": 2,
          "threshold": 0.05, "restarts": 2, "rows": rows,
          "summary": rerun.summarize(rows), "source_revision": "abc1234",
          "device": "cpu: X (2 cores)", "conditions": None}
  monkeypatch.setattr(report, "_load", lambda name: data)
  monkeypatch.setattr(report, "_paper_mean_at", lambda *a: 0.25)
  lines = report.rerun_records_block().splitlines()
  files = report.RERUN_RECORDS_FILES
  # One table: a row per file and learning rate, then a caption per file.
  assert lines[2:2 + len(files)] == [
      f"| `{name}` | 0.01 | 2 | 0/1 | 1/1 | 1 | 1/2 | r0 – → 2 |"
      for name in files]
  assert lines[2 + len(files)] == ""
  assert lines[3 + len(files)].startswith(f"`{files[0]}`: ns on "
                                          "marked_reversal, the first 2")
  paper_line = ("The paper's Figure 3 mean (its 5 selected runs) for ns on "
                "marked_reversal at epoch 2: 0.2500.")
  assert paper_line in lines
  # Then the mean curve per file and rate over its reruns (restarts 0 and
  # 1: [0.3, 0.01] and [0.3, 0.2]) beside the paper's, epoch by epoch.
  assert lines[-2:] == ["| 1 | 0.250 | " + " | ".join(["0.300"] * len(files))
                        + " |",
                        "| 2 | 0.250 | " + " | ".join(["0.105"] * len(files))
                        + " |"]


def test_init_gradients_compare_relative_to_each_array(rerun):
  then = {"param:w": np.array([1.0, 2.0]), "batch0": np.array([[1, 2]]),
          "loss0": np.array(10.0),
          "grad0:w": np.array([1e-3, -2e-3]), "grad0:b": np.array([4.0])}
  now = dict(then, **{"loss0": np.array(10.0 + 1e-5),
                      "grad0:w": np.array([1e-3, -2e-3 + 2e-9])})
  got = rerun.compare_init_gradients(now, then)
  assert got["params_equal"] and got["batches_equal"]
  assert got["loss_max_rel_diff"] == pytest.approx(1e-6)
  # Relative to the largest entry of its own array, not of all gradients.
  assert got["grad_max_rel_diff"] == pytest.approx(1e-6)
  got = rerun.compare_init_gradients(
      dict(then, **{"param:w": np.array([1.0, 2.5])}), then)
  assert not got["params_equal"]


def test_readme_block_names_the_codes(load_benchmark, rerun, monkeypatch):
  report = load_benchmark("report")
  rows = [rerun.compare(_record(0, [0.3, 0.01]), _record(0, [0.3, 0.2]),
                        2, 0.05)]
  data = {"task": "marked_reversal", "model": "ns", "epochs": 2,
          "threshold": 0.05, "restarts": 1, "rows": rows,
          "summary": rerun.summarize(rows), "source_revision": "abc1234",
          "overrides": ["dtype=float64"],
          "device": "cpu", "rerun_code": [{"commit": "f" * 40,
                                           "modified": True}],
          "against": {"revision": "0123456", "record": "results/r.json",
                      "batches": 3, "params_equal": True,
                      "batches_equal": False, "loss_max_rel_diff": 0.0,
                      "grad_max_rel_diff": 2.5e-7, "retrained_epochs": 3,
                      "retrained_equals_record": False}}
  monkeypatch.setattr(report, "_load", lambda name: data)
  monkeypatch.setattr(report, "_paper_mean_at", lambda *a: None)
  text = report.rerun_records_block()
  assert ("rerun with `--set=dtype=float64` by the code at fffffff with "
          "uncommitted changes, cpu;") in text
  assert ("`--against=0123456`: that code retrains the first 3 epochs of "
          "`results/r.json` **not** as recorded; at initialisation, on its "
          "first 3 batches, it and the rerun's code give parameters equal, "
          "batches **differ**, loss max relative difference 0.0e+00, "
          "gradient 2.5e-07.") in text


def test_a_revision_git_does_not_know_is_refused_before_the_reruns(
    rerun, monkeypatch, capsys):
  # Refused at once: the reruns, which take long, would come first.
  monkeypatch.setattr(rerun.subprocess, "run", _no_rerun(rerun.subprocess.run))
  monkeypatch.setattr(sys, "argv", ["rerun_records.py",
                                    "--against=no-such-revision-x"])
  with pytest.raises(SystemExit) as exit_info:
    rerun.main()
  assert exit_info.value.code == 2
  assert capsys.readouterr().err == (
      "error: --against 'no-such-revision-x': no such git revision\n")
  if rerun.machine.source_revision() is not None:   # a git checkout
    assert rerun.machine.is_revision("HEAD")


def _no_rerun(run):
  """subprocess.run that lets git through and fails on anything else."""

  def checked(argv, *args, **kwargs):
    assert argv[0] == "git", argv
    return run(argv, *args, **kwargs)

  return checked
