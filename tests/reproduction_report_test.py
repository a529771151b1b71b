"""Tests of the reproduction report (nsrnn_jax/reproduction_report.py)."""

import json
import os
import shutil
import subprocess

import pytest

from nsrnn_jax import paper_figures
from nsrnn_jax import reproduction_report
from nsrnn_jax import run_records
# tests/fake_records.py (tests/ is on sys.path under pytest).
from fake_records import fake_record

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_report_says_which_stack_table_the_ns_runs_used():
  old = fake_record("dyck", "ns", 0.005, 0, 0.01, 0.01)   # before the field
  new = [dict(fake_record("dyck", "ns", 0.005, r, 0.01, 0.01),
              config={"stack_table": "shares"}) for r in (1, 2)]
  text = reproduction_report.render_report([old] + new)
  assert ("NS-RNN runs: 1 on the 'scaled' table, 2 on the 'shares' table"
          in text)
  lstm_only = reproduction_report.render_report(
      [fake_record("dyck", "lstm", 0.005, 0, 0.01, 0.01)])
  assert "NS-RNN runs:" not in lstm_only


def test_report_says_on_how_many_test_strings_the_ns_stack_is_exact():
  def measured(task, restart, fractions, margins, kind="product"):
    rec = fake_record(task, "ns", 0.005, restart, 0.01, 0.01)
    test = {"lengths": [40, 41], "num_strings": [100, 300],
            "ce_diff": [0.0, 0.0], "stack_exact_fraction": fractions,
            "stack_margin": margins}
    return dict(rec, test=dict(test, stack_margin_kind=kind) if kind
                else test)
  records = [fake_record("dyck", "ns", 0.005, 0, 0.01, 0.01),  # before
             measured("dyck", 1, [1.0, 0.5], [-30.0, -50.5]),
             measured("dyck", 2, [1.0, 1.0], [-20.0, -25.0]),
             measured("marked_reversal", 1, [0.25, 0.0], [-45.0, -60.0])]
  line = next(l for l in reproduction_report.render_report(
      records).splitlines() if l.startswith("Records: "))
  # Dyck: (100 + 150 + 100 + 300) of 800; marked: 25 of 400.
  assert ("`config.valid_stack_margin`): Marked reversal 6% of 400 (1 run, "
          "smallest -60.0 nats); Dyck 81% of 800 (2 runs, smallest -50.5 "
          "nats). The margin") in line, line
  # A record from before the product margin names no kind.
  records[2] = measured("dyck", 2, [1.0, 1.0], [-20.0, -25.0], kind=None)
  line = next(l for l in reproduction_report.render_report(
      records).splitlines() if l.startswith("Records: "))
  assert ("-50.5 nats) (1 of these records measured the factor margin of "
          "before 2026-12-06, never above the product margin: a lower "
          "bound). The margin") in line, line
  assert "again in float64 with the same parameters (records from " \
      "2026-12-07 on, `test.unproven_max_error`): none yet;" in line, line
  # Records that scored their unproven strings again in float64: per task
  # the strings and the largest error over its runs.
  for i, (strings, error) in ((1, (350, 2.5e-5)), (3, (120, 7.0e-4))):
    records[i]["test"].update(unproven_strings=strings,
                              unproven_max_error=error)
  records[2] = measured("dyck", 2, [1.0, 1.0], [-20.0, -25.0])
  records[2]["test"].update(unproven_strings=0, unproven_max_error=0.0)
  line = next(l for l in reproduction_report.render_report(
      records).splitlines() if l.startswith("Records: "))
  assert ("`test.unproven_max_error`): Marked reversal 120 strings (1 run), "
          "ln p within 7.0e-04 nats of float64; Dyck 350 strings (2 runs), "
          "ln p within 2.5e-05 nats of float64;") in line, line
  # Runs whose margin proved every test string: nothing rescored.
  line = next(l for l in reproduction_report.render_report(
      records[2:3]).splitlines() if l.startswith("Records: "))
  assert "`test.unproven_max_error`): Dyck 0 strings (1 run);" in line, line
  line = next(l for l in reproduction_report.render_report(
      records[:1]).splitlines() if l.startswith("Records: "))
  assert "proven exact" not in line


def test_report_says_which_code_made_the_records():
  def made_by(commit, modified, restart):
    return dict(fake_record("dyck", "lstm", 0.005, restart, 0.01, 0.01),
                code={"commit": commit, "modified": modified})
  records = [fake_record("dyck", "lstm", 0.005, 0, 0.01, 0.01),  # before
             made_by("a" * 40, False, 1), made_by("a" * 40, True, 2),
             made_by("b" * 40, False, 3),
             made_by(None, None, 4)]         # not made in a git checkout
  line = next(l for l in reproduction_report.render_report(
      records).splitlines() if l.startswith("Records: "))
  assert line.endswith(
      "(cpu, 2 cores). Code: 3 records name the commit that made them "
      "(`code`), 2 commit(s), 1 of them with uncommitted changes; 2 name "
      "none (made before the field, or outside a git checkout)."), line
  line = next(l for l in reproduction_report.render_report(
      records[:1]).splitlines() if l.startswith("Records: "))
  assert line.endswith("(cpu, 2 cores)."), line


def _three_lstm_settings():
  """Dyck LSTM records: lr 0.01 and 0.005 with 3 restarts, 0.001 with 1."""
  recs = [fake_record("dyck", "lstm", 0.01, r, best, 0.1)
          for r, best in enumerate([0.02, 0.04, 0.03])]       # mean 0.03
  recs += [fake_record("dyck", "lstm", 0.005, r, best, 0.2)
           for r, best in enumerate([0.01, 0.05, 0.02])]      # mean 0.0267
  # Lowest mean, but from fewer restarts: not eligible under "mean".
  return recs + [fake_record("dyck", "lstm", 0.001, 0, 0.001, 0.3)]


def test_selection_lowest_mean_best_epoch_among_most_restarts():
  recs = _three_lstm_settings()
  cell = reproduction_report.summarize_cells(recs)[("dyck", "lstm")]
  assert cell.selected.name == "lr_0.005"
  assert len(cell.runs) == 3 and len(cell.settings) == 3
  mean, std = cell.last_valid()
  assert mean == pytest.approx(0.2) and std == pytest.approx(0.0)


def test_report_gaps_add_up_to_the_whole_paper():
  # 7 Dyck LSTM runs of 600 s each: every LSTM cell is timed by them (the
  # same model on any task), the other models are unknown.
  recs = [fake_record("dyck", "lstm", 0.005, r, 0.01, 0.01) for r in range(5)]
  recs += [fake_record("dyck", "lstm", 0.01, r, 0.01, 0.01) for r in (0, 1)]
  text = reproduction_report.render_report(recs)
  section = text.split("## What has not run yet")[1].split("\n## ")[0]
  rows = [l for l in section.splitlines() if l.startswith("| ")]
  assert "| Dyck | LSTM | 7 | 20 | 13 | 2.2 h |" in rows
  assert "| Marked reversal | LSTM | 0 | 20 | 20 | 3.3 h |" in rows
  # 93 missing LSTM runs x 600 s = 15.5 h; 5 x (60 + 60 + 20) of the rest.
  assert rows[-1] == "| **All** | | 7 | 800 | 793 | 15.5 h + 700 runs of unknown cost |"
  assert "--task=all" in section


def test_report_lists_every_grid_point_with_what_the_selection_compared():
  recs = _three_lstm_settings()
  text = reproduction_report.render_report(recs)
  section = text.split("## Every grid point")[1].split("\n## ")[0]
  rows = [l for l in section.splitlines() if l.startswith("| Dyck")]
  # std (ddof=0) of 0.02, 0.04, 0.03 is 0.00816; of 0.01, 0.05, 0.02 0.01700.
  assert rows == [
      "| Dyck | LSTM | lr_0.001 | 1 | 0.0010 ± 0.0000 | 0.0010 (restart 0) "
      "| fewer restarts |",
      "| Dyck | LSTM | lr_0.005 | 3 | 0.0267 ± 0.0170 | 0.0100 (restart 0) "
      "| selected |",
      "| Dyck | LSTM | lr_0.01 | 3 | 0.0300 ± 0.0082 | 0.0200 (restart 0) |  |",
  ]
  # Under best_run the single best run's setting is the selected one.
  text = reproduction_report.render_report(recs, selection="best_run")
  assert ("| Dyck | LSTM | lr_0.001 | 1 | 0.0010 ± 0.0000 | 0.0010 (restart 0)"
          " | selected |") in text
  assert "fewer restarts |" not in text


def test_best_run_selection_picks_the_single_best_run():
  recs = [fake_record("dyck", "ns", 0.01, r, best, 0.1 + r)
          for r, best in enumerate([0.02, 0.04, 0.03])]
  recs += [fake_record("dyck", "ns", 0.005, r, best, 0.5 + r)
           for r, best in enumerate([0.01, 0.001, 0.02])]
  cell = reproduction_report.summarize_cells(
      recs, selection="best_run")[("dyck", "ns")]
  assert cell.selected.name == "lr_0.005/restart_1"
  assert cell.last_valid() == (1.5, 0.0)
  mean_cell = reproduction_report.summarize_cells(recs)[("dyck", "ns")]
  assert mean_cell.selected.name == "lr_0.005"
  with pytest.raises(ValueError, match="selection"):
    reproduction_report.summarize_cells(recs, selection="median")


def test_report_values_claims_and_gaps():
  recs = []
  for r in range(3):
    recs.append(fake_record("marked_reversal", "ns", 0.005, r, 0.002,
                            0.003 + 0.001 * (r - 1),
                            test_in=-0.005 + 0.001 * (r - 1), test_out=0.05))
    for model, t_in in (("lstm", 0.05), ("gref", 0.02)):
      recs.append(fake_record("marked_reversal", model, 0.005, r, 0.05, 0.09,
                              test_in=t_in, test_out=0.2))
    recs.append(fake_record("marked_reversal", "jm", 0.005, r, 0.05, 0.09,
                            stack_size=20, test_in=0.03, test_out=0.2))
  text = reproduction_report.render_report(recs)
  assert text == reproduction_report.render_report(list(reversed(recs)))
  # NS-RNN: last-epoch 0.0030 +- 0.0008 is within the paper's 0.0038 +- 0.0022.
  assert ("| Marked reversal | Ours | lr_0.005 | 3 | 1 | "
          "0.0030 ± 0.0008 | 0.0038 ± 0.0022 | ✓ |") in text
  # LSTM 0.09 lies within 0.0871 +- 0.0148; Gref 0.09 not within 0.035 +- 0.0355.
  assert "| Marked reversal | LSTM | lr_0.005 | 3 | 1 | 0.0900" in text
  assert "0.0350 ± 0.0355 | ✗ |" in text
  # Test bins: mean ± std over restarts (std of -0.006, -0.005, -0.004).
  assert ("| Marked reversal | Ours | -0.0050 ± 0.0008 | 0.0500 ± 0.0000 | "
          "-0.0055 | 0.0796 |") in text
  # The verdict, and the numbers it compared.
  assert ("| Marked reversal | the NS-RNN has the lowest test difference on "
          "lengths 40-80 | agrees | Ours -0.0050 ± 0.0008, JM 0.0300 ± "
          "0.0000, Gref 0.0200 ± 0.0000, LSTM 0.0500 ± 0.0000 | 3 of 3 | "
          "Ours 0/4, JM 0/12, Gref 0/12, LSTM 0/4 |") in text
  assert ("| Dyck | all stack models end near 0 (last validation difference "
          "within ±0.005) | not decidable yet (cells missing) | Ours —, JM —, "
          "Gref — | — | Ours 0/4, JM 0/12, Gref 0/12 |") in text
  assert "| Dyck | all stack models end near 0" in text
  assert "not decidable yet" in text
  # Gaps: 3 of 20 NS-RNN runs done; 17 x 600 s = 2.8 h.
  assert "| Marked reversal | Ours | 3 | 20 | 17 | 2.8 h |" in text
  assert "| Dyck | Ours | 0 | 20 | 20 | 3.3 h |" in text  # Rate of any task.
  assert "| Dyck | JM | 0 | 60 | 60 | 10.0 h |" in text


def test_claims_say_whether_their_grids_are_complete():
  # Every setting of the paper's grid for the three stack models on Dyck,
  # all restarts finished: the claim's grid is complete.
  recs = []
  for lr in run_records.LEARNING_RATES:
    for r in range(run_records.NUM_RESTARTS):
      recs.append(fake_record("dyck", "ns", lr, r, 0.001, 0.001,
                              test_in=0.0, test_out=0.03))
      for model in ("jm", "gref"):
        for m in run_records.STACK_SIZES:
          recs.append(fake_record("dyck", model, lr, r, 0.002, 0.002,
                                  stack_size=m, test_in=0.0, test_out=0.02))
  claim = ("| Dyck | all stack models end near 0 (last validation "
           "difference within ±0.005) | agrees | Ours 0.0010 ± 0.0000, JM "
           "0.0020 ± 0.0000, Gref 0.0020 ± 0.0000 | ")
  assert claim + "5 of 5 | complete |" in reproduction_report.render_report(
      recs)
  # One restart missing makes its setting unfinished (it no longer counts),
  # and the selection falls back on the finished settings.
  missing = [x for x in recs if not (x["model"] == "gref" and x["restart"] == 4
                                     and x["setting"] == "m_40-lr_0.001")]
  cells = reproduction_report.summarize_cells(missing)
  assert reproduction_report.grid_progress(cells[("dyck", "gref")]) == (11, 12)
  assert reproduction_report.grid_progress(cells[("dyck", "ns")]) == (4, 4)
  assert reproduction_report.grid_progress(cells[("dyck", "lstm")]) == (0, 4)
  assert (claim + "5 of 5 | Ours 4/4, JM 12/12, Gref 11/12 |"
          in reproduction_report.render_report(missing))


def test_claims_are_read_restart_by_restart_on_shared_restarts():
  # Restart r: the NS-RNN's 40-80 test difference against the others'. It is
  # the lowest in restarts 0 and 2 (0.10 < 0.15), not in 1 (0.20): 2 of 3,
  # though its mean (0.1333) is the lowest.
  ns = {0: 0.10, 1: 0.20, 2: 0.10}
  recs = []
  for r in range(3):
    # (Restart 1 has the NS-RNN's best validation difference.)
    recs.append(fake_record("unmarked_reversal", "ns", 0.005, r,
                            0.05 if r == 1 else 0.1, 0.1,
                            test_in=ns[r], test_out=0.3))
    recs.append(fake_record("unmarked_reversal", "jm", 0.005, r, 0.1, 0.1,
                            stack_size=20, test_in=0.15, test_out=0.3))
    for model in ("gref", "lstm"):
      recs.append(fake_record("unmarked_reversal", model, 0.005, r, 0.1, 0.1,
                              stack_size=20 if model == "gref" else None,
                              test_in=0.3, test_out=0.3))
  claim = ("unmarked_reversal", "lowest", ("ns", "jm", "gref", "lstm"), 0)
  cells = reproduction_report.summarize_cells(recs)
  assert reproduction_report.claim_verdict(cells, *claim)
  assert reproduction_report.paired_agreement(cells, *claim) == (2, 3)
  assert "| agrees | Ours 0.1333 ± 0.0471, JM 0.1500 ± 0.0000" in (
      reproduction_report.render_report(recs))
  assert "0.3000 ± 0.0000 | 2 of 3 | " in reproduction_report.render_report(
      recs)
  # Only the restarts every compared model finished count: without JM's
  # restart 0, restarts 1 and 2 remain, and the claim holds in 2 only.
  fewer = [x for x in recs if not (x["model"] == "jm" and x["restart"] == 0)]
  cells = reproduction_report.summarize_cells(fewer)
  assert reproduction_report.paired_agreement(cells, *claim) == (1, 2)
  # The best-run selection keeps one run per model: the NS-RNN's restart 1,
  # the others' restart 0 (ties go to the lowest restart): nothing to pair.
  cells = reproduction_report.summarize_cells(recs, selection="best_run")
  assert [cells[("unmarked_reversal", m)].runs[0]["restart"]
          for m in ("ns", "jm")] == [1, 0]
  assert reproduction_report.paired_agreement(cells, *claim) is None


def test_committed_report_is_generated_from_committed_records(tmp_path):
  results = os.path.join(REPO, "results")
  records = run_records.load_records(results)
  with open(os.path.join(REPO, "docs", "reproduction.md")) as f:
    committed = f.read()
  paper = paper_figures.load(
      os.path.join(results, reproduction_report.PAPER_FIGURES_FILE))
  rendered = reproduction_report.render_report(records, paper_data=paper)
  assert committed == rendered, (
      "docs/reproduction.md is stale: run python -m nsrnn_jax.reproduce "
      "--report")
  # The plotted numbers too (PNG bytes depend on the matplotlib version).
  report = tmp_path / "docs" / "reproduction.md"
  reproduction_report.write_report(results, str(report))
  for task in run_records.TASKS:
    generated = tmp_path / "docs" / "figures" / task / "series.json"
    committed_series = os.path.join(REPO, "docs", "figures", task,
                                    "series.json")
    assert generated.exists() == os.path.exists(committed_series), task
    if generated.exists():
      with open(committed_series) as f:
        assert json.load(f) == json.loads(generated.read_text())


def test_report_names_records_git_does_not_track(tmp_path):
  if shutil.which("git") is None:
    pytest.skip("git not installed")
  env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t",
             GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
  run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, env=env,
                                  check=True, capture_output=True)
  run("init", "-q")
  results = tmp_path / "results"
  for name in ("committed", "modified", "new"):
    (results / "dyck" / "ns" / name).mkdir(parents=True)
    (results / "dyck" / "ns" / name / "restart_0.json").write_text("{}")
  run("add", "results/dyck/ns/committed", "results/dyck/ns/modified")
  run("commit", "-q", "-m", "records")
  (results / "dyck" / "ns" / "modified" / "restart_0.json").write_text("[]")
  (results / "notes.txt").write_text("not a record")
  assert reproduction_report.uncommitted_records(str(results)) == [
      str(results / "dyck/ns/modified/restart_0.json"),
      str(results / "dyck/ns/new/restart_0.json")]
  run("add", "-A")
  run("commit", "-q", "-m", "all")
  assert reproduction_report.uncommitted_records(str(results)) == []
  # No such directory: nothing to say.
  missing = str(tmp_path / "missing")
  assert reproduction_report.uncommitted_records(missing) == []
