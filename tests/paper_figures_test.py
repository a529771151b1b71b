"""Tests for nsrnn_jax/paper_figures.py.

The parser is checked on a synthetic LaTeX source built here from known
curves, the committed data against the paper's headline numbers that
reference-behaviour.md section 10 read off the same figures (the constants
`reproduction_report.PAPER_VALID` / `PAPER_TEST`, curve lengths and the lengths
present), and the figures against the curves they are given.
"""

import json
import os

import numpy as np
import pytest

from nsrnn_jax import paper_figures
from nsrnn_jax import plots
from nsrnn_jax import reproduction_report
from nsrnn_jax import run_records


def _figure_file(kind, task, curves, legends=True):
  """One pgfplots figure file as the paper's source writes it.

  curves: [(x, mean, std)] in line order (line0 = LSTM, ...). The band is
  matplotlib's fill_between polygon: (x0, upper), the lower edge forward,
  the upper edge back (its last point twice), closed by --cycle.
  """
  text = [f"%% file: figures/{kind}-{task}.tex", "\\begin{tikzpicture}",
          "\\begin{axis}[", "title={Some Task},", "]"]
  for k, (x, mean, std) in enumerate(curves):
    low = [m - s for m, s in zip(mean, std)]
    high = [m + s for m, s in zip(mean, std)]
    pts = ([(x[0], high[0])] + list(zip(x, low)) + [(x[-1], high[-1])]
           + list(zip(x[::-1], high[::-1])))
    text.append(f"\\path [draw=color{k}, fill=color{k}, bars]")
    text.append(f"(axis cs:{pts[0][0]!r},{pts[0][1]!r})")
    text += [f"--(axis cs:{a!r},{b!r})" for a, b in pts[1:]]
    text.append("--cycle;")
  for k, (x, mean, _) in enumerate(curves):
    text += [f"\\addplot [line{k}]", "table {%"]
    text += [f"{a!r} {b!r}" for a, b in zip(x, mean)]
    label = list(paper_figures.MODELS)[k]
    text.append(f"}} node[linelabel,pos=1,right] {{{label}}};")
    if legends:
      text.append(f"\\addlegendentry{{{label}}}")
  text += ["\\end{axis}", "", "\\end{tikzpicture}", ""]
  return "\n".join(text)


_TRAIN = [([1.0, 2.0, 3.0], [0.35, 0.2, 0.125], [0.01, 0.05, 0.0]),
          ([1.0, 2.0], [0.3, -0.001], [0.02, 0.003])]
_TEST = [([41.0, 43.0], [0.05, 0.25], [0.001, 0.02]),
         ([41.0, 43.0], [0.04, 0.5], [0.0, 0.1]),
         ([41.0, 43.0], [0.03, 0.125], [0.002, 0.004]),
         ([41.0, 43.0], [-0.005, 0.0625], [0.5, 0.25])]


def _source():
  return "\n".join([
      "%% file: paper.tex", "\\section{Experiments} text $x$ {braces}",
      _figure_file("train", "dyck", _TRAIN),
      # The paper's padded-reversal panel has no legend entries at all.
      _figure_file("test", "marked-reversal", _TEST, legends=False),
      "%% file: paper.bbl", "\\bibitem{x} (axis cs:9,9)"])


def test_parse_reads_every_line_and_its_band():
  data = paper_figures.parse(_source())
  assert set(data) == {"train", "test"}
  assert list(data["train"]) == ["dyck"]
  assert list(data["test"]) == ["marked_reversal"]
  for panel, curves in ((data["train"]["dyck"], _TRAIN),
                        (data["test"]["marked_reversal"], _TEST)):
    assert list(panel) == ["lstm", "gref", "jm", "ns"][:len(curves)]
    for (x, mean, std), got in zip(curves, panel.values()):
      assert got["x"] == x and got["mean"] == mean
      np.testing.assert_allclose(got["std"], std, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("edit,match", [
    (lambda s: s.replace("%% file: figures/", "%% file: figs/"),
     "no '%% file"),
    (lambda s: s.replace("train-dyck", "train-dyke"), "unknown task"),
    # Gref's line labelled JM: the styles' order and the legend disagree.
    (lambda s: s.replace("\\addlegendentry{Gref}", "\\addlegendentry{JM}"),
     "line1 is Gref in every panel, but its legend entry says 'JM'"),
    # Bands swapped: each line would get the other's band.
    (lambda s: s.replace("fill=color0", "fill=colorX").replace(
        "fill=color1", "fill=color0").replace("fill=colorX", "fill=color1"),
     "does not cover|not centred"),
    # A line moved off its band's centre.
    (lambda s: s.replace("\n2.0 0.2\n", "\n2.0 0.21\n"), "not centred"),
    (lambda s: s.replace("\\addplot [line", "\\addplot [curve"),
     "no \\\\addplot line"),
    # A band point that is not a number.
    (lambda s: s.replace("(axis cs:2.0,", "(axis cs:e,", 1),
     "unreadable band color"),
])
def test_parse_refuses_what_it_cannot_read(edit, match):
  source = edit(_source())
  assert source != _source()
  with pytest.raises(paper_figures.PaperFiguresError, match=match):
    paper_figures.parse(source)


def test_cli_writes_what_load_reads_and_fails_in_one_line(tmp_path, capsys):
  tex, out = tmp_path / "paper.tex", tmp_path / "figures.json"
  tex.write_text(_source())
  assert paper_figures.main([f"--tex={tex}", f"--out={out}"]) == 0
  assert paper_figures.load(str(out)) == paper_figures.parse(_source())
  assert paper_figures.load(str(tmp_path / "absent.json")) is None
  capsys.readouterr()
  assert paper_figures.main([f"--tex={tmp_path / 'absent.tex'}",
                             f"--out={out}"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1
  # An unwritable --out: one line, exit 2 (flag errors: cli_test.py).
  assert paper_figures.main([f"--tex={tex}",
                             f"--out={tmp_path / 'no_dir' / 'f.json'}"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --out: ") and err.count("\n") == 1
  out.write_text(json.dumps({"format": "something else"}))
  with pytest.raises(paper_figures.PaperFiguresError, match="is not a"):
    paper_figures.load(str(out))
  out.write_text("{not json")
  with pytest.raises(paper_figures.PaperFiguresError, match="unreadable"):
    paper_figures.load(str(out))
  out.write_bytes(b"\x89PNG\r\n")
  with pytest.raises(paper_figures.PaperFiguresError, match="unreadable"):
    paper_figures.load(str(out))
  # The right format with curves that are not curves: named, not a
  # KeyError or AttributeError from the report that reads them.
  good = paper_figures.parse(_source())
  task, panel = next(iter(good["train"].items()))
  model = next(iter(panel))
  for data, what in [
      ({"test": good["test"]}, "train/-/- is missing"),
      ({"train": 5, "test": {}}, "train/-/- is missing or not an object"),
      ({"train": {task: 5}, "test": {}}, f"train/{task}/- is not an"),
      ({"train": {task: {model: {"x": [1]}}}, "test": {}},
       f"train/{task}/{model} lacks the lists"),
      ({"train": {task: {model: {"x": [1], "mean": [1], "std": []}}},
        "test": {}}, "of different lengths"),
      ({"train": {task: {model: {"x": [1], "mean": ["a"], "std": [1]}}},
        "test": {}}, "not a finite number")]:
    out.write_text(json.dumps({"format": paper_figures.FORMAT, **data}))
    with pytest.raises(paper_figures.PaperFiguresError, match=what):
      paper_figures.load(str(out))
  # Not UTF-8 LaTeX: one line, exit 2.
  tex.write_bytes(b"\x89PNG\r\n\x1a\n")
  assert paper_figures.main([f"--tex={tex}", f"--out={out}"]) == 2
  err = capsys.readouterr().err
  assert "is not UTF-8 text" in err and err.count("\n") == 1


# Curve lengths of the training figures (reference-behaviour.md 10.1).
_EPOCHS = {"marked_reversal": {"lstm": 107, "gref": 104, "jm": 104, "ns": 71},
           "dyck": {"lstm": 135, "gref": 42, "jm": 63, "ns": 48},
           "hardest_cfl": {"lstm": 116, "gref": 104, "jm": 80, "ns": 82}}
# Lengths present in the test figures (reference-behaviour.md 10.2).
_LENGTHS = {"marked_reversal": range(41, 100, 2),
            "unmarked_reversal": range(40, 101, 2), "dyck": range(40, 101, 2),
            "padded_reversal": range(40, 101),
            "hardest_cfl": range(40, 101)}


def test_committed_data_gives_the_papers_headline_numbers():
  data = paper_figures.load()
  assert data is not None, "results/paper_figures.json is missing"
  # The source has no training figure of unmarked or padded reversal.
  paper_valid = reproduction_report.PAPER_VALID
  assert set(data["train"]) == {t for t, v in paper_valid.items()
                                if v is not None} == set(_EPOCHS)
  assert set(data["test"]) == set(run_records.TASKS)
  for task, models in data["train"].items():
    assert set(models) == set(run_records.MODELS)
    for model, c in models.items():
      assert c["x"] == list(range(1, _EPOCHS[task][model] + 1))
      mean, std = reproduction_report.PAPER_VALID[task][model]
      # Section 10 rounded to 4 places (marked JM: 0.033848 written 0.0339).
      assert abs(c["mean"][-1] - mean) <= 1e-4, (task, model)
      assert abs(c["std"][-1] - std) <= 1e-4, (task, model)
  for task, models in data["test"].items():
    assert set(models) == set(run_records.MODELS)
    for model, c in models.items():
      assert c["x"] == list(_LENGTHS[task])
      x, mean = np.asarray(c["x"]), np.asarray(c["mean"])
      assert np.all(np.asarray(c["std"]) >= 0)
      for (lo, hi), want in zip(reproduction_report.TEST_BINS,
                                reproduction_report.PAPER_TEST[task][model]):
        got = mean[(x >= lo) & (x <= hi)].mean()
        assert abs(got - want) <= 5.01e-5, (task, model, lo, got, want)


def test_figures_draw_the_reference_dashed_in_each_models_colour():
  ours = [{"label": "LSTM", "lengths": [40, 41], "mean": [0.1, 0.2],
           "std": [0.01, 0.02]},
          {"label": "Ours", "lengths": [40, 41], "mean": [0.3, 0.4],
           "std": [0.0, 0.0]}]
  reference = [{"label": "Ours", "x": [40, 42, 44], "mean": [0.5, 0.6, 0.7]},
               {"label": "LSTM", "x": [40], "mean": [0.9]}]
  ax = plots.plot_test(ours, "T", reference).axes[0]
  solid = [l for l in ax.get_lines() if l.get_linestyle() == "-"]
  dashed = [l for l in ax.get_lines() if l.get_linestyle() == "--"
            and len(l.get_xdata())]
  assert [list(l.get_ydata()) for l in solid] == [[0.1, 0.2], [0.3, 0.4]]
  assert [list(l.get_ydata()) for l in dashed] == [[0.5, 0.6, 0.7], [0.9]]
  assert dashed[0].get_color() == solid[1].get_color()   # Ours
  assert dashed[1].get_color() == solid[0].get_color()   # LSTM
  assert [t.get_text() for t in ax.get_legend().get_texts()] == [
      "LSTM", "Ours", "paper"]
  # Without a reference: no dashed line, no legend entry for it.
  ax = plots.plot_test(ours, "T").axes[0]
  assert all(l.get_linestyle() == "-" for l in ax.get_lines())
  assert len(ax.get_legend().get_texts()) == 2


def test_report_refuses_corrupt_paper_data(tmp_path):
  results = tmp_path / "results"
  results.mkdir()
  (results / reproduction_report.PAPER_FIGURES_FILE).write_text("[1, 2")
  with pytest.raises(run_records.ReproduceError, match="unreadable"):
    reproduction_report.write_report(str(results),
                                     str(tmp_path / "docs" / "r.md"))
  assert not os.path.exists(tmp_path / "docs")
