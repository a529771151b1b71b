"""Tests of nsrnn_jax.later_protocol (random learning rates, best run)."""

import json
import math
import os
import socket

import numpy as np
import pytest

from nsrnn_jax import later_protocol
from nsrnn_jax import reproduce
from nsrnn_jax import run_records
from nsrnn_jax import workdir_lock

TINY = ["--set=num_train_batches=6", "--set=num_valid_batches=2",
        "--set=train_min_length=5", "--set=train_max_length=9",
        "--set=test_min_length=5", "--set=test_max_length=11",
        "--set=test_strings_per_length=2", "--set=max_epochs=1",
        "--set=length_buckets=(9, 11)", "--set=hidden_size=4"]


def test_learning_rates_are_log_uniform_on_the_papers_range():
  lo, hi = later_protocol.LEARNING_RATE_RANGE
  assert (lo, hi) == (5e-4, 1e-2)
  rates = later_protocol.learning_rates(4000, seed=3)
  assert all(lo <= r <= hi for r in rates)
  # log-uniform: the logs' mean and variance are those of U[ln lo, ln hi]
  # (within 5 standard errors), and a quarter of the draws falls in each
  # quarter of the log range (a uniform draw would put 82% above 2.5e-3).
  logs = np.log(rates)
  a, b = math.log(lo), math.log(hi)
  width = b - a
  assert abs(logs.mean() - (a + b) / 2) < 5 * width / math.sqrt(12 * 4000)
  assert abs(logs.var() - width ** 2 / 12) < 0.1 * width ** 2 / 12
  counts = np.histogram(logs, bins=4, range=(a, b))[0]
  assert np.all(np.abs(counts - 1000) < 5 * math.sqrt(1000 * 0.75))
  # Run k's rate does not depend on how many runs were asked for.
  assert later_protocol.learning_rates(3, seed=3) == rates[:3]
  assert later_protocol.learning_rates(3, seed=4) != rates[:3]


def _record(model, k, best, lr, test=None, train_max=80):
  return {"task": "marked_copy", "model": model, "restart": k,
          "learning_rate": lr, "best_valid_ce_diff": best,
          "config": {"train_max_length": train_max}, "test": test}


def test_summary_picks_the_best_run_and_the_spread():
  test = {"lengths": [40, 60, 80, 90, 100],
          "ce_diff": [0.1, 0.2, 0.3, 0.5, 0.7]}
  recs = [_record("rns-3-3", 0, 0.30, 0.001),
          _record("rns-3-3", 1, 0.10, 0.004, test),
          _record("rns-3-3", 2, 0.20, 0.009),
          _record("lstm", 1, 0.5, 0.002),      # a tie: the lower run wins
          _record("lstm", 0, 0.5, 0.003)]
  rows = {r["model"]: r for r in later_protocol.summarize(recs)}
  ns = rows["rns-3-3"]
  assert (ns["runs"], ns["best_run"], ns["best_learning_rate"]) == (
      3, 1, 0.004)
  assert ns["best_valid_ce_diff"] == 0.10
  assert ns["mean_best_valid_ce_diff"] == pytest.approx(0.2)
  assert ns["std_best_valid_ce_diff"] == pytest.approx(math.sqrt(2 / 300))
  assert ns["test_ce_diff_bins"] == pytest.approx([0.2, 0.6])
  assert rows["lstm"]["best_run"] == 0
  assert rows["lstm"]["test_ce_diff_bins"] is None
  table = later_protocol.render_table(later_protocol.summarize(recs))
  assert ("| marked_copy | rns-3-3 | 3 | 1 (0.004) | 0.1000 | 0.2000 ± "
          "0.0816 | 0.2000 / 0.6000 |") in table


def test_best_run_curves_follow_the_summarys_best_run():
  epochs = lambda *v: [{"epoch": i + 1, "valid_ce_diff": x}
                       for i, x in enumerate(v)]
  test = {"lengths": [40, 41], "ce_diff": [0.3, None]}
  recs = [dict(_record("lstm", 0, 0.4, 0.001), epochs=epochs(0.9, 0.4)),
          dict(_record("lstm", 1, 0.2, 0.002, test),
               epochs=epochs(0.8, 0.5, 0.2)),
          dict(_record("jm-10", 0, 0.3, 0.001), epochs=epochs(0.3)),
          dict(_record("jm-10", 1, 0.3, 0.002), epochs=epochs(0.7, 0.3))]
  (task, curves), = later_protocol.best_run_curves(recs).items()
  assert task == "marked_copy"
  jm, lstm = curves                     # models in name order
  assert (lstm["model"], lstm["run"], lstm["learning_rate"]) == (
      "lstm", 1, 0.002)
  assert lstm["epochs"] == [1, 2, 3]
  assert lstm["valid_ce_diff"] == [0.8, 0.5, 0.2]
  assert (lstm["lengths"], lstm["test_ce_diff"]) == ([40, 41], [0.3, None])
  assert (jm["run"], jm["valid_ce_diff"], jm["lengths"]) == (0, [0.3], [])
  fig = later_protocol.plot_best_runs(task, curves)
  left, right = fig.axes[:2]
  np.testing.assert_array_equal(left.lines[1].get_ydata(), [0.8, 0.5, 0.2])
  np.testing.assert_array_equal(right.lines[0].get_ydata(), [0.3, np.nan])


def test_runs_resume_and_keep_their_rates(tmp_path, capsys):
  workdir = str(tmp_path / "w")
  args = ["--task=marked_copy", "--models=lstm", f"--workdir={workdir}"]
  assert later_protocol.main(args + ["--runs=2"] + TINY) == 0
  out = capsys.readouterr().out
  assert "[1/2] marked_copy/lstm/run_0 (lr " in out
  assert "[2/2] marked_copy/lstm/run_1 (lr " in out
  rates = later_protocol.learning_rates(3)
  records = os.path.join(workdir, "records", "marked_copy", "lstm")
  for k in range(2):
    with open(os.path.join(records, f"restart_{k}.json")) as f:
      rec = json.load(f)
    assert rec["learning_rate"] == rates[k]
    assert rec["config"]["learning_rate"] == rates[k]
    assert rec["config"]["data_seed"] == reproduce.BASE_SEED + k
    assert rec["config"]["predict_eos"]              # §4.1
    assert not rec["config"]["test_bound_includes_num_lengths"]
    assert rec["setting"] == f"run_{k}" and rec["protocol"] == "custom"
  # More runs: only the new one trains; the first two keep their rates.
  before = os.path.getmtime(os.path.join(records, "restart_0.json"))
  assert later_protocol.main(args + ["--runs=3"] + TINY) == 0
  out = capsys.readouterr().out
  assert "run_2" in out and "run_0" not in out.split("| task")[0]
  assert os.path.getmtime(os.path.join(records, "restart_0.json")) == before
  with open(os.path.join(workdir, "summary.json")) as f:
    (row,) = json.load(f)["rows"]
  assert row["runs"] == 3 and row["model"] == "lstm"
  assert row["best_learning_rate"] in rates
  # --report reads the same records.
  assert later_protocol.main([f"--workdir={workdir}", "--report"]) == 0
  assert "| marked_copy | lstm | 3 |" in capsys.readouterr().out


def test_a_run_another_process_trains_is_left_to_it(tmp_path, capsys):
  # Two commands on one workdir: the run whose directory a live process
  # (here this one) holds is left to it; the next run trains.
  workdir = str(tmp_path / "w")
  args = ["--task=marked_copy", "--models=lstm", f"--workdir={workdir}",
          "--runs=2"] + TINY
  held = os.path.join(workdir, "marked_copy", "lstm", "run_0")
  with workdir_lock.hold(held):
    assert later_protocol.main(args) == 0
  out = capsys.readouterr().out
  rate = later_protocol.learning_rates(2)[0]
  assert (f"[1/2] marked_copy/lstm/run_0 (lr {rate:.6g}): left to process "
          f"{os.getpid()} on {socket.gethostname()}, which trains it") in out
  records = os.path.join(workdir, "records", "marked_copy", "lstm")
  assert sorted(os.listdir(records)) == ["restart_1.json"]
  # Free again: a rerun trains it.
  assert later_protocol.main(args) == 0
  assert sorted(os.listdir(records)) == ["restart_0.json", "restart_1.json"]


@pytest.mark.parametrize("args,message", [
    (["--task=marked_copy", "--models=jm-0"], "unknown model 'jm-0'"),
    (["--task=copy", "--models=lstm"], "unknown task 'copy'"),
    (["--task=marked_copy", "--models=lstm", "--runs=0"],
     "--runs must be a positive integer"),
    (["--task=marked_copy", "--models=lstm,lstm"], "--models repeats lstm"),
    (["--task=marked_copy", "--models=lstm,,jm-3"],
     "--models has an empty item"),
    (["--models=lstm"], "--task and --models are required"),
    (["--task=marked_copy", "--models=lstm", "--set=bogus=1"],
     "--set bogus: unknown config field"),
    (["--task=marked_copy", "--models=lstm", "--set=hidden_size=0"],
     "config.hidden_size must be >= 1"),
    (["--task=marked_copy", "--models=lstm", "--set=hidden_size=abc"],
     "--set hidden_size='abc': the field holds int values"),
    (["--task=dyck", "--models=lstm", "--seed=-1", "--status"],
     "--seed must be an integer >= 0, got -1"),
    (["--task=paper,marked_copy", "--models=lstm"],
     "--task=paper stands alone"),
    (["--task=marked_copy", "--models=paper,lstm"],
     "--models=paper stands alone"),
    (["--task=marked_copy_k3", "--models=paper"],
     "--models=paper: the paper runs no models on 'marked_copy_k3'"),
    (["--task=dyck", "--models=lstm", "--protocol=iclr2024"],
     "--protocol must be one of iclr2023, iclr2022, got 'iclr2024'"),
    (["--task=dyck", "--models=lstm", "--protocol=iclr2022", "--seed=3"],
     "--seed draws the iclr2023 learning rates; iclr2022 runs the grid"),
    (["--task=marked_copy", "--models=paper", "--protocol=iclr2022"],
     "--models=paper: the ICLR 2022 study runs no models on 'marked_copy'"),
])
def test_bad_input_is_one_line_exit_2_and_trains_nothing(tmp_path, capsys,
                                                         args, message):
  workdir = tmp_path / "w"
  assert later_protocol.main(args + [f"--workdir={workdir}"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: ")
  assert message in err
  assert not workdir.exists()


def test_a_file_as_workdir_is_refused_for_status_too(tmp_path, capsys):
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  for mode in ([], ["--status"]):
    assert later_protocol.main(["--task=dyck", "--models=lstm",
                                f"--workdir={a_file}"] + mode) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --workdir {a_file} is a file, not a directory "
                   "of runs\n")


def test_the_papers_tasks_and_models(tmp_path, capsys, monkeypatch):
  # --task=paper --models=paper plans every (task, model) of the paper's
  # study: 7 non-CF tasks x 5 models, 3 capacity families x 6 sizes x 7
  # models. Training is stubbed to stop at once (nothing written).
  from nsrnn_jax import train  # pylint: disable=g-import-not-at-top
  calls = []

  def stop(config, workdir):
    calls.append((config.task, config.model, workdir))
    return {"finished": False}

  monkeypatch.setattr(train, "train_and_evaluate", stop)
  loads = []
  load_module = later_protocol.reproduce.load_module
  monkeypatch.setattr(later_protocol.reproduce, "load_module",
                      lambda path: loads.append(path) or load_module(path))
  assert later_protocol.main(["--task=paper", "--models=paper", "--runs=1",
                              f"--workdir={tmp_path}"]) == 0
  # configs/later.py is loaded once for the whole plan, not per config.
  assert len(loads) == 1 and loads[0].endswith("later.py")
  out = capsys.readouterr().out
  assert out.startswith("[1/161] count_3/lstm/run_0")
  assert "stopped in count_3/lstm/run_0" in out and len(calls) == 1
  assert later_protocol.models_for("marked_copy", ["paper"]) == (
      "lstm", "jm-10", "jm-3.3.3", "jm-hidden", "rns-3-3")
  assert later_protocol.models_for("dyck_k120", ["paper"]) == (
      "lstm", "jm-3", "rns-1-3", "rns-2-3", "vrns-1-1-3", "vrns-2-1-3",
      "vrns-2-3-3")
  assert later_protocol.models_for("dyck_k120", ["lstm"]) == ("lstm",)


def test_iclr2022_grid_and_one_protocol_per_workdir(tmp_path, capsys):
  # Run k trains at grid rate k mod 4 with seeds BASE_SEED + k; the workdir
  # then refuses the other protocol.
  workdir = str(tmp_path / "w")
  args = ["--task=dyck", "--models=lstm", f"--workdir={workdir}"]
  assert later_protocol.main(args + ["--protocol=iclr2022", "--runs=5"]
                             + TINY) == 0
  out = capsys.readouterr().out
  assert "[5/5] dyck/lstm/run_4 (lr 0.01)" in out
  assert later_protocol.grid_learning_rates(6) == [
      0.01, 0.005, 0.001, 0.0005, 0.01, 0.005]
  records = os.path.join(workdir, "records", "dyck", "lstm")
  for k in range(5):
    with open(os.path.join(records, f"restart_{k}.json")) as f:
      rec = json.load(f)
    assert rec["learning_rate"] == (0.01, 0.005, 0.001, 0.0005)[k % 4]
    assert rec["config"]["learning_rate"] == rec["learning_rate"]
    assert rec["config"]["data_seed"] == reproduce.BASE_SEED + k
    assert rec["config"]["predict_eos"]
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["protocol"] == "iclr2022"
  (row,) = summary["rows"]
  values = []
  for k in range(5):
    with open(os.path.join(records, f"restart_{k}.json")) as f:
      values.append(json.load(f)["best_valid_ce_diff"])
  assert row["runs"] == 5 and row["best_run"] == int(np.argmin(values))
  with open(os.path.join(workdir, "protocol.json")) as f:
    assert json.load(f) == {"protocol": "iclr2022"}
  # The best run's curves, as both papers plot them, beside its figure.
  with open(os.path.join(workdir, "best_runs", "dyck.json")) as f:
    (curve,) = json.load(f)["models"]
  with open(os.path.join(records, f"restart_{row['best_run']}.json")) as f:
    best = json.load(f)
  assert curve["run"] == row["best_run"]
  assert curve["valid_ce_diff"] == [e["valid_ce_diff"]
                                    for e in best["epochs"]]
  assert curve["test_ce_diff"] == best["test"]["ce_diff"]
  assert os.path.getsize(os.path.join(workdir, "best_runs", "dyck.png")) > 0
  # The other protocol in the same workdir: one line, nothing trained.
  assert later_protocol.main(args + ["--runs=6"] + TINY) == 2
  err = capsys.readouterr().err
  assert err == (f"error: {workdir} holds iclr2022 runs; run "
                 "--protocol=iclr2023 in another --workdir\n")
  assert not os.path.exists(os.path.join(records, "restart_5.json"))


def test_iclr2022_papers_tasks_and_models(tmp_path, capsys, monkeypatch):
  # --protocol=iclr2022 --task=paper --models=paper: the five CoNLL 2020
  # tasks x (LSTM, JM and Gref at m = 2, 20, 40, four NS-RNN variants).
  from nsrnn_jax import train  # pylint: disable=g-import-not-at-top
  calls = []

  def stop(config, workdir):
    calls.append(config)
    return {"finished": False}

  monkeypatch.setattr(train, "train_and_evaluate", stop)
  assert later_protocol.main(["--protocol=iclr2022", "--task=paper",
                              "--models=paper", "--runs=1",
                              f"--workdir={tmp_path}"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("[1/55] marked_reversal/lstm/run_0 (lr 0.01)")
  (config,) = calls
  assert config.task == "marked_reversal" and config.learning_rate == 0.01
  plan = later_protocol.models_for("hardest_cfl", ["paper"],
                                   protocol="iclr2022")
  assert plan[-4:] == ("ns-3-3", "ns+s-3-3", "ns+u-3-3", "ns+s+u-3-3")


def _row(task, model, best, mean, std):
  return {"task": task, "model": model, "best_valid_ce_diff": best,
          "mean_best_valid_ce_diff": mean, "std_best_valid_ce_diff": std}


def test_capacity_series_and_plot(tmp_path):
  rows = [_row("dyck_k40", "lstm", 0.3, 0.4, 0.05),
          _row("dyck_k2", "lstm", 0.1, 0.2, 0.01),
          _row("dyck_k40", "rns-2-3", 0.05, 0.07, 0.02),
          _row("marked_reversal_k200", "lstm", 0.9, 1.0, 0.1),
          _row("marked_copy", "lstm", 0.5, 0.6, 0.1)]   # not capacity
  series = later_protocol.capacity_series(rows)
  assert list(series) == ["dyck", "marked_reversal"]
  assert series["dyck"] == [
      {"label": "lstm", "sizes": [2, 40], "best": [0.1, 0.3],
       "mean": [0.2, 0.4], "std": [0.01, 0.05]},
      {"label": "rns-2-3", "sizes": [40], "best": [0.05], "mean": [0.07],
       "std": [0.02]}]
  fig = later_protocol.plot_capacity(rows)
  axes = fig.get_axes()
  assert [a.get_title() for a in axes] == ["dyck", "marked reversal"]
  # The best-run lines carry the numbers (the bands are collections).
  (lstm_line, rns_line) = axes[0].get_lines()
  np.testing.assert_array_equal(lstm_line.get_xydata(), [[2, 0.1], [40, 0.3]])
  np.testing.assert_array_equal(rns_line.get_xydata(), [[40, 0.05]])
  # One colour per model in every panel, one legend naming each model once.
  (mr_lstm,) = axes[1].get_lines()
  assert mr_lstm.get_color() == lstm_line.get_color() != rns_line.get_color()
  (legend,) = fig.legends
  assert [t.get_text() for t in legend.get_texts()] == ["lstm", "rns-2-3"]
  path = later_protocol.save_capacity_plot(rows, str(tmp_path))
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  # No capacity task, no figure.
  assert later_protocol.plot_capacity(rows[-1:]) is None
  assert later_protocol.save_capacity_plot(rows[-1:], str(tmp_path / "x")) \
      is None


def test_status_counts_records_started_runs_and_time_left(tmp_path, capsys):
  # Runs 0 and 1 of lstm on marked_copy finished (5 epochs of 11 s after a
  # compiling first); run 2 has logged 2 epochs; the rest not started.
  workdir = tmp_path / "later"
  for k in (0, 1):
    rec = dict(_record("lstm", k, 0.1, 0.001), format=run_records.RECORD_FORMAT,
               epochs=[{"epoch": e, "valid_ce_diff": 0.1, "time": t}
                       for e, t in enumerate([60.0] + [11.0] * 4, start=1)],
               setting=f"run_{k}", protocol="iclr2023", num_epochs=5,
               best_epoch=5, last_valid_ce_diff=0.1, train_time_s=104.0)
    path = workdir / "records" / "marked_copy" / "lstm" / f"restart_{k}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec))
  run_2 = workdir / "marked_copy" / "lstm" / "run_2"
  run_2.mkdir(parents=True)
  (run_2 / "metrics.jsonl").write_text('{"epoch": 1}\n{"epoch": 2}\n')
  before = sorted(tmp_path.rglob("*"))
  assert later_protocol.main(["--status", "--task=marked_copy",
                              "--models=lstm", f"--workdir={workdir}",
                              "--runs=4"]) == 0
  text = capsys.readouterr().out
  assert sorted(tmp_path.rglob("*")) == before          # Reads only.
  assert text.startswith("later_protocol (iclr2023): 4 runs, 2 with a "
                         "record, 1 started, 1 not started")
  assert "| marked_copy | lstm | 4 | 2 | 1 | 1 |" in text
  assert "started: marked_copy/lstm/run_2 (epoch 2 logged)" in text
  # Like runs take 5 x 11 s: run 2 has 3 of 5 epochs left, run 3 all.
  assert text.rstrip().endswith(
      "one run after another: " + reproduce.format_duration(33.0 + 55.0))
  # Run 3 in its first epoch in another run of the command (here this
  # process holds it): started, and the process named.
  with workdir_lock.hold(str(workdir / "marked_copy" / "lstm" / "run_3")):
    assert later_protocol.main(["--status", "--task=marked_copy",
                                "--models=lstm", f"--workdir={workdir}",
                                "--runs=4"]) == 0
  text = capsys.readouterr().out
  assert "4 runs, 2 with a record, 2 started, 0 not started" in text
  assert ("started: marked_copy/lstm/run_3 (epoch 0 logged; training now: "
          f"process {os.getpid()} on {socket.gethostname()})") in text
  assert later_protocol.main(["--status", "--task=marked_copy",
                              f"--workdir={workdir}"]) == 2


@pytest.mark.parametrize("args,message", [
    (["--status", "--task=count3", "--models=lstm"], "unknown task 'count3'"),
    (["--status", "--task=marked_copy", "--models=jm-0"],
     "unknown model 'jm-0'"),
    (["--status", "--task=marked_copy,", "--models=lstm"],
     "--task has an empty item"),
    (["--report", "--workdir=NOPE"], "--workdir NOPE is not a directory"),
    (["--task=marked_copy", "--models=lstm", "--workdir=F/w"],
     "--workdir 'F/w' cannot be created"),
    (["--task=marked_copy", "--models=lstm", "--workdir="],
     "--workdir is an empty path"),
])
def test_status_report_and_workdir_refuse_what_a_run_would(
    tmp_path, capsys, monkeypatch, args, message):
  # --status checks the names as a run would (a plan that could never
  # start); --report needs the runs' directory; a run, a writable workdir.
  monkeypatch.chdir(tmp_path)
  (tmp_path / "F").write_text("a file")
  if not any(a.startswith("--workdir") for a in args):
    args = args + ["--workdir=w"]
  assert later_protocol.main(args) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: ") and message in err
  assert sorted(os.listdir(tmp_path)) == ["F"]
