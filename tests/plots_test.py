"""Tests for nsrnn_jax/plots.py against tiny synthetic workdirs.

The oracle for every plotted number is a naive recomputation straight from
the metrics.jsonl / test_by_length.json files written by the test itself
(plain Python loops, the paper's padding rule spelled out by hand).
"""

import json
import os
import subprocess
import sys

import matplotlib.colors
import matplotlib.image
import numpy as np
import pytest

from nsrnn_jax import plots

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_run(workdir, curve, model="ns", task="dyck", test=None,
               extra_records=()):
  """Writes a single-run workdir with the given validation curve."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"model": model, "task": task}, f)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for epoch, value in enumerate(curve, start=1):
      f.write(json.dumps({"epoch": epoch, "valid_ce_diff": value,
                          "valid_perplexity": 1.5, "train_loss": 3.0}) + "\n")
    for record in extra_records:
      f.write(json.dumps(record) + "\n")
  if test is not None:
    lengths, diffs = test
    with open(os.path.join(workdir, "test_by_length.json"), "w") as f:
      json.dump({"lengths": list(lengths), "ce_diff": list(diffs),
                 "num_strings": [100] * len(lengths)}, f)


def _naive_padded_stats(curves):
  """Mean/std per epoch with last-value padding, by explicit loops."""
  num_epochs = max(len(c) for c in curves)
  means, stds = [], []
  for e in range(num_epochs):
    column = [c[e] if e < len(c) else c[-1] for c in curves]
    mean = sum(column) / len(column)
    means.append(mean)
    stds.append((sum((v - mean) ** 2 for v in column) / len(column)) ** 0.5)
  return means, stds


@pytest.fixture(name="runs")
def fixture_runs(tmp_path):
  """Two models, restarts of different lengths, test tables per restart."""
  rng = np.random.default_rng(0)
  curves = {
      "lstm": [list(rng.uniform(0, 0.4, size=n)) for n in (7, 4, 9)],
      "ns": [list(rng.uniform(-0.01, 0.3, size=n)) for n in (5, 8)],
  }
  lengths = [40, 42, 44, 46]
  tests = {}
  for model, model_curves in curves.items():
    tests[model] = []
    for r, curve in enumerate(model_curves):
      diffs = list(rng.normal(0.02, 0.01, size=len(lengths)))
      tests[model].append(diffs)
      _write_run(str(tmp_path / "grid" / f"{model}-{r}"), curve, model=model,
                 test=(lengths, diffs),
                 extra_records=[{"final": True, "test_ce_diff": 0.1}])
  return tmp_path, curves, lengths, tests


def test_pad_with_last_uses_last_value_not_best():
  padded = plots.pad_with_last([np.array([3.0, 1.0, 2.0]), np.array([5.0])])
  np.testing.assert_array_equal(padded, [[3.0, 1.0, 2.0], [5.0, 5.0, 5.0]])


def test_train_series_matches_naive_padding(runs):
  tmp_path, curves, _, _ = runs
  group = plots.RunGroup("LSTM", tuple(plots.find_runs(
      str(tmp_path / "grid" / "lstm-*"))))
  series = plots.train_series(group)
  means, stds = _naive_padded_stats(curves["lstm"])
  assert series["epochs"] == list(range(1, 10))
  np.testing.assert_allclose(series["mean"], means, rtol=1e-12)
  np.testing.assert_allclose(series["std"], stds, rtol=1e-12, atol=1e-15)
  assert series["num_epochs"] == [7, 4, 9]
  assert series["final_mean"] == pytest.approx(means[-1])


def test_duplicate_epoch_keeps_last_record(tmp_path):
  _write_run(str(tmp_path / "run"), [0.5, 0.4],
             extra_records=[{"epoch": 2, "valid_ce_diff": 0.3}])
  with pytest.warns(UserWarning, match=r"repeats epochs \[2\]"):
    epochs, values = plots.validation_curve(str(tmp_path / "run"))
  np.testing.assert_array_equal(epochs, [1, 2])
  np.testing.assert_array_equal(values, [0.5, 0.3])


def test_test_series_aligns_lengths_and_averages(tmp_path):
  _write_run(str(tmp_path / "a"), [0.1], test=([44, 40, 42], [3.0, 1.0, 2.0]))
  _write_run(str(tmp_path / "b"), [0.1], test=([40, 46], [5.0, 7.0]))
  _write_run(str(tmp_path / "c"), [0.1])  # no test table: left out
  group = plots.RunGroup("Ours", tuple(str(tmp_path / d) for d in "abc"))
  series = plots.test_series(group)
  assert series["lengths"] == [40, 42, 44, 46]
  np.testing.assert_allclose(series["mean"], [3.0, 2.0, 3.0, 7.0])
  np.testing.assert_allclose(series["std"], [2.0, 0.0, 0.0, 0.0])
  assert series["count"] == [2, 1, 1, 1]
  assert series["missing"] == [str(tmp_path / "c")]


def test_group_by_model_uses_paper_order_and_labels(runs):
  tmp_path, curves, _, _ = runs
  groups = plots.group_runs([str(tmp_path / "grid")], group_by="model")
  assert [g.label for g in groups] == ["LSTM", "Ours"]
  assert [len(g.workdirs) for g in groups] == [len(curves["lstm"]),
                                               len(curves["ns"])]


def test_later_stacks_are_labelled_after_the_papers_models(tmp_path):
  for model in ("vrns", "custom", "rns", "ns", "lstm"):
    _write_run(str(tmp_path / "grid" / model), [0.3, 0.2], model=model)
  groups = plots.group_runs([str(tmp_path / "grid")], group_by="model")
  assert [g.label for g in groups] == ["LSTM", "Ours", "RNS-RNN", "VRNS-RNN",
                                       "custom"]
  labels = [plots.group_runs([str(tmp_path / "grid" / m)])[0].label
            for m in ("rns", "vrns")]
  assert labels == ["RNS-RNN", "VRNS-RNN"]


def test_cli_writes_pngs_whose_series_match_metrics(runs):
  tmp_path, curves, lengths, tests = runs
  out = tmp_path / "figures"
  proc = subprocess.run(
      [sys.executable, "-m", "nsrnn_jax.plots",
       f"--workdirs={tmp_path}/grid/lstm-*,{tmp_path}/grid/ns-*",
       "--labels=LSTM,Ours", f"--out={out}"],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr
  assert "LSTM" in proc.stdout and "Ours" in proc.stdout
  for name in ("figure3", "figure4"):
    for fmt in ("png", "pdf"):
      assert os.path.getsize(out / f"{name}.{fmt}") > 1000
    with open(out / f"{name}.png", "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(str(out / f"{name}.png"))
    # Something besides the white background was drawn in colour.
    rgb = pixels[..., :3]
    assert np.sum(np.ptp(rgb, axis=-1) > 0.2) > 500
  with open(out / "series.json") as f:
    series = json.load(f)
  assert series["title"] == "Dyck"
  for entry, model in zip(series["figure3"], ("lstm", "ns")):
    # Re-read every metrics file by hand: the oracle never calls plots.
    raw = []
    for workdir in sorted(entry["workdirs"]):
      with open(os.path.join(workdir, "metrics.jsonl")) as f:
        raw.append([json.loads(line)["valid_ce_diff"] for line in f
                    if "valid_ce_diff" in json.loads(line)])
    assert raw == curves[model]
    means, stds = _naive_padded_stats(raw)
    np.testing.assert_allclose(entry["mean"], means, rtol=1e-12)
    np.testing.assert_allclose(entry["std"], stds, rtol=1e-12, atol=1e-15)
  for entry, model in zip(series["figure4"], ("lstm", "ns")):
    assert entry["lengths"] == lengths
    np.testing.assert_allclose(entry["mean"], np.mean(tests[model], axis=0))
    np.testing.assert_allclose(entry["std"], np.std(tests[model], axis=0))


def test_figure_axes_are_labelled_like_the_paper(runs):
  tmp_path, _, _, _ = runs
  groups = plots.group_runs([str(tmp_path / "grid")], group_by="model")
  fig = plots.plot_train([plots.train_series(g) for g in groups], "Dyck")
  ax = fig.axes[0]
  assert ax.get_xlabel() == "Epoch"
  assert ax.get_ylabel() == "Difference in Cross Entropy"
  assert [t.get_text() for t in ax.get_legend().get_texts()] == ["LSTM",
                                                                 "Ours"]
  fig = plots.plot_test([plots.test_series(g) for g in groups])
  assert fig.axes[0].get_xlabel() == "Length"
  # The plotted line is the series' mean.
  line = fig.axes[0].get_lines()[0]
  np.testing.assert_allclose(line.get_ydata(),
                             plots.test_series(groups[0])["mean"])


def test_bad_input_gives_clear_errors(tmp_path, runs):
  runs_path, _, _, _ = runs
  with pytest.raises(ValueError, match="matches"):
    plots.find_runs(str(tmp_path / "nowhere-*"))
  with pytest.raises(ValueError, match="one label per pattern"):
    plots.group_runs([str(runs_path / "grid" / "lstm-*")], labels=["a", "b"])
  with pytest.raises(ValueError, match="group_by"):
    plots.group_runs([str(runs_path / "grid")], group_by="task")
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "metrics.jsonl").write_text('{"epoch": 1, "valid_ce_diff": 0.1}\n'
                                     '{"epoch": 3, "valid_ce_diff": 0.1}\n')
  with pytest.raises(ValueError, match="not consecutive"):
    plots.validation_curve(str(bad))
  (bad / "metrics.jsonl").write_text("not json\n")
  with pytest.raises(ValueError, match="not valid JSON"):
    plots.read_metrics(str(bad))
  # Values of the wrong JSON type: not read as numbers (a string "nan", an
  # epoch 1.5 would change the curve), nor a traceback.
  for record in ('{"epoch": 1.5, "valid_ce_diff": 0.1}',
                 '{"epoch": null, "valid_ce_diff": 0.1}',
                 '{"epoch": 1, "valid_ce_diff": "nan"}',
                 '{"epoch": 1, "valid_ce_diff": [1]}'):
    (bad / "metrics.jsonl").write_text(record + "\n")
    with pytest.raises(ValueError, match="is not a number of its kind"):
      plots.validation_curve(str(bad))
  for table in ("5", '{"lengths": [{}], "ce_diff": [1]}', "{",
                '{"lengths": [9.5, 11], "ce_diff": [0.1, 0.2]}',
                '{"lengths": [9, "11"], "ce_diff": [0.1, 0.2]}',
                '{"lengths": [9, 11], "ce_diff": [0.1, "nan"]}',
                '{"lengths": [9, 9], "ce_diff": [0.1, 0.2]}'):
    (bad / "test_by_length.json").write_text(table)
    with pytest.raises(ValueError, match="test_by_length.json"):
      plots.read_test_by_length(str(bad))
  with pytest.raises(SystemExit):
    plots.main([f"--workdirs={tmp_path}/nowhere", "--out=x"])


def test_cli_reports_bad_pattern_without_traceback(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "nsrnn_jax.plots",
       f"--workdirs={tmp_path}/missing", f"--out={tmp_path}/o"],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 2
  assert "error:" in proc.stderr and "Traceback" not in proc.stderr


def test_grid_workdir_stands_for_its_selected_setting(tmp_path):
  # Layout of grid.py: lr_<lr>/restart_<r>/ and grid_summary.json.
  grid = tmp_path / "grid_ns"
  for lr in ("0.01", "0.005"):
    for r in range(2):
      _write_run(str(grid / f"lr_{lr}" / f"restart_{r}"),
                 [0.3, 0.2 if lr == "0.005" else 0.25])
  summary = {"best": {"learning_rate": 0.005},
             "settings": [
                 {"learning_rate": 0.01,
                  "subdirs": ["lr_0.01/restart_0", "lr_0.01/restart_1"]},
                 {"learning_rate": 0.005,
                  "subdirs": ["lr_0.005/restart_0", "lr_0.005/restart_1"]}]}
  (grid / "grid_summary.json").write_text(json.dumps(summary))
  runs = plots.find_runs(str(grid))
  assert runs == [str(grid / "lr_0.005" / f"restart_{r}") for r in range(2)]
  (groups,) = plots.group_runs([str(grid)])
  assert groups.label == "Ours"
  assert plots.train_series(groups)["mean"] == [0.3, 0.2]


def test_runs_without_test_tables_draw_figure3_only(tmp_path):
  """Unfinished runs (no test_by_length.json yet) still give Figure 3."""
  curves = [[0.3, 0.2, 0.1], [0.4, 0.05]]
  for r, curve in enumerate(curves):
    _write_run(str(tmp_path / f"run{r}"), curve)
  group = plots.RunGroup("Ours", tuple(str(tmp_path / f"run{r}")
                                        for r in range(len(curves))))
  result = plots.make_figures([group], str(tmp_path / "out"),
                              formats=("png",))
  assert result["figure4"] is None
  assert sorted(os.listdir(tmp_path / "out")) == ["figure3.png",
                                                  "series.json"]
  means, _ = _naive_padded_stats(curves)
  np.testing.assert_allclose(result["figure3"][0]["mean"], means)
  with open(tmp_path / "out" / "series.json") as f:
    assert json.load(f)["figure4"] is None


def test_paper_reference_is_the_papers_curve_of_each_groups_model(
    runs, tmp_path, capsys):
  runs_path, _, _, _ = runs
  groups = plots.group_runs([str(runs_path / "grid")], group_by="model")
  paper = {"train": {"dyck": {"ns": {"x": [1, 2], "mean": [0.3, 0.1],
                                     "std": [0, 0]}}},
           "test": {"dyck": {"lstm": {"x": [40], "mean": [0.5], "std": [0]},
                             "ns": {"x": [40], "mean": [0.25], "std": [0]}},
                    "marked_reversal": {"lstm": {"x": [41], "mean": [9.0],
                                                 "std": [0]}}}}
  # The runs are Dyck runs of the LSTM and the NS-RNN ("Ours").
  assert plots.paper_reference(groups, paper, "train") == [
      {"label": "Ours", "x": [1, 2], "mean": [0.3, 0.1]}]
  assert plots.paper_reference(groups, paper, "test") == [
      {"label": "LSTM", "x": [40], "mean": [0.5]},
      {"label": "Ours", "x": [40], "mean": [0.25]}]
  assert plots.paper_reference(groups, {"train": {}, "test": {}},
                               "test") is None
  other = runs_path / "other"
  _write_run(str(other), [0.1], model="jm", task="marked_reversal")
  mixed = groups + [plots.RunGroup("JM", (str(other),))]
  with pytest.raises(ValueError, match="runs of one task"):
    plots.paper_reference(mixed, paper, "train")
  # The CLI draws the committed data (Dyck has both figures there).
  assert plots.main([f"--workdirs={runs_path / 'grid'}", "--group_by=model",
                     f"--out={tmp_path / 'fig'}", "--formats=png",
                     "--paper"]) == 0
  assert "wrote" in capsys.readouterr().out
  assert (tmp_path / "fig" / "figure4.png").is_file()
  with pytest.raises(SystemExit) as info:
    plots.main([f"--workdirs={runs_path / 'grid'},{other}",
                "--group_by=model", f"--out={tmp_path / 'fig2'}", "--paper"])
  assert info.value.code == 2
  assert "runs of one task" in capsys.readouterr().err


def test_one_string_is_one_pattern_label_and_format(runs, tmp_path):
  runs_path, _, _, _ = runs
  pattern = str(runs_path / "grid" / "lstm-*")
  (group,) = plots.group_runs(pattern, labels="LSTM")
  assert group.label == "LSTM"
  assert list(group.workdirs) == list(plots.find_runs(pattern))
  result = plots.make_figures([group], str(tmp_path / "out"), formats="png")
  assert sorted(os.path.basename(f) for f in result["files"]) == [
      "figure3.png", "figure4.png", "series.json"]
  with pytest.raises(TypeError, match="RunGroups"):
    plots.make_figures(["x"], str(tmp_path / "out2"))


def _series(labels):
  return [{"label": label, "epochs": [1, 2, 3], "mean": [0.3, 0.2, 0.1],
           "std": [0.0, 0.0, 0.0]} for label in labels]


def test_many_or_long_legend_labels_wrap_and_keep_distinct_colours():
  # The paper's four models and "paper": one row, the figure's own size.
  paper = [{"label": m, "x": [1, 2], "mean": [0.2, 0.1]}
           for m in ("LSTM", "Gref", "JM", "Ours")]
  fig = plots.plot_train(_series(["LSTM", "Gref", "JM", "Ours"]),
                         reference=paper)
  assert plots.legend_columns(["LSTM", "Gref", "JM", "Ours", "paper"]) == 5
  assert tuple(fig.get_size_inches()) == pytest.approx((5.0, 3.6))
  # A JM grid: 12 settings of up to 14 characters wrap into rows of 3, the
  # figure grows by a row's height per extra row, and no two share a colour.
  names = [f"m_{m}-lr_{lr}" for m in (2, 20, 40)
           for lr in (0.01, 0.005, 0.001, 0.0005)]
  assert plots.legend_columns(names) == 3
  fig = plots.plot_train(_series(names))
  assert fig.get_size_inches()[1] == pytest.approx(3.6 + 3 * 0.22)
  lines = fig.axes[0].get_lines()
  assert [line.get_label() for line in lines] == names
  colours = {tuple(matplotlib.colors.to_rgba(line.get_color()))
             for line in lines}
  assert len(colours) == 12
