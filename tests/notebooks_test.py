"""Runs the notebooks end to end (nbclient, kernel python3) on tiny workdirs.

The test trains tiny runs with `train.train_and_evaluate` (two NS-RNN
restarts that stop at different epochs, one LSTM), injects their paths into
each notebook's "parameters" cell and executes every cell. Besides "no cell
raised", it checks numbers the notebooks print against independent sources:
the model's log-probability from `evaluate.score`, and the plotted series
against a by-hand recomputation from the metrics files. The run-records
notebook reads the committed records under results/ instead, and its
printed selection is checked against the record files read by hand.
"""

import glob
import json
import os
import re

import numpy as np
import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from nsrnn_jax import evaluate  # pylint: disable=g-import-not-at-top
from nsrnn_jax import inspection  # pylint: disable=g-import-not-at-top
from nsrnn_jax import train  # pylint: disable=g-import-not-at-top

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(REPO_ROOT, "notebooks")


@pytest.fixture(name="workdirs", scope="module")
def fixture_workdirs(tmp_path_factory):
  """{name: workdir} of three tiny trained runs."""
  from configs import default  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp("runs")
  runs = {}
  for name, model, seed, epochs in (("ns-0", "ns", 1, 3), ("ns-1", "ns", 2, 2),
                                    ("lstm-0", "lstm", 1, 2)):
    config = inspection.tiny_training_config(
        default.get_config(), "marked_reversal", model, seed=seed,
        max_epochs=epochs)
    workdir = str(root / name)
    train.train_and_evaluate(config, workdir)
    runs[name] = workdir
  return runs


def _run_notebook(name, parameters):
  """Executes notebooks/<name> with its parameters cell replaced.

  The kernel inherits the environment; JAX_DISABLE_MOST_OPTIMIZATIONS cuts
  its compile time the same way as in this process.
  """

  with open(os.path.join(NOTEBOOKS, name)) as f:
    notebook = nbformat.read(f, as_version=4)
  # Committed notebooks carry no outputs (stripped before commit).
  for cell in notebook.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, name
  param_cells = [c for c in notebook.cells
                 if "parameters" in c.metadata.get("tags", [])]
  assert len(param_cells) == 1 and notebook.cells.index(param_cells[0]) <= 1
  param_cells[0].source = "\n".join(f"{k} = {v!r}"
                                    for k, v in parameters.items())
  client = nbclient.NotebookClient(
      notebook, timeout=300, kernel_name="python3",
      resources={"metadata": {"path": NOTEBOOKS}})
  client.execute(env={**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"})
  return notebook


def _outputs(notebook):
  """(all stdout text, number of PNG images) of an executed notebook."""
  text, images = [], 0
  for cell in notebook.cells:
    for out in cell.get("outputs", []):
      assert out.output_type != "error", out
      if out.output_type == "stream":
        text.append(out.text)
      elif "image/png" in out.get("data", {}):
        images += 1
  return "".join(text), images


def test_inspect_model_notebook_runs_on_a_trained_workdir(workdirs):
  workdir = workdirs["ns-0"]
  notebook = _run_notebook("inspect_model.ipynb", {
      "WORKDIR": workdir, "STRING": "0110#0110", "STRING_LENGTH": 9,
      "SEED": 0})
  text, images = _outputs(notebook)
  assert images == 3  # actions, readings, next-symbol distributions
  # The Viterbi table has one line per stack update (n - 1 = 8).
  table = text[text.index("stack (bottom → top)"):].splitlines()[1:9]
  assert [int(line.split()[0]) for line in table] == list(range(1, 9))
  # The printed -ln p_model(w) is the model's own score of the string.
  printed = float(re.search(r"-ln p_model\(w\) = ([0-9.]+)", text).group(1))
  expected = -evaluate.score(workdir, ["0110#0110"])[0]
  assert printed == pytest.approx(expected, abs=2e-4)
  # Marked reversal of length 9: -ln p_true(w | n) = 4 ln 2 exactly.
  printed_true = float(re.search(r"-ln p_true\(w \| n\) = ([0-9.]+)",
                                 text).group(1))
  assert printed_true == pytest.approx(4 * np.log(2), abs=1e-4)


def test_compare_models_notebook_draws_both_figures(workdirs, tmp_path):
  out = str(tmp_path / "figures")
  notebook = _run_notebook("compare_models.ipynb", {
      "WORKDIRS": [os.path.join(os.path.dirname(workdirs["ns-0"]), "lstm-*"),
                   os.path.join(os.path.dirname(workdirs["ns-0"]), "ns-*")],
      "LABELS": None, "GROUP_BY": "pattern", "OUT": out, "PAPER": True})
  text, images = _outputs(notebook)
  assert images == 2
  assert "LSTM" in text and "Ours" in text
  # Marked reversal: the paper has both figures for both models.
  assert "the paper's curves in Figure 3: LSTM, Ours" in text
  assert "the paper's curves in Figure 4: LSTM, Ours" in text
  for name in ("figure3.png", "figure3.pdf", "figure4.png", "figure4.pdf"):
    assert os.path.getsize(os.path.join(out, name)) > 1000
  with open(os.path.join(out, "series.json")) as f:
    series = json.load(f)
  ours = next(s for s in series["figure3"] if s["label"] == "Ours")
  curves = []
  for name in ("ns-0", "ns-1"):
    with open(os.path.join(workdirs[name], "metrics.jsonl")) as f:
      curves.append([r["valid_ce_diff"] for r in map(json.loads, f)
                     if "valid_ce_diff" in r])
  assert [len(c) for c in curves] == [3, 2]
  padded = np.array([curves[0], curves[1] + [curves[1][-1]]])
  np.testing.assert_allclose(ours["mean"], padded.mean(0), rtol=1e-12)
  np.testing.assert_allclose(ours["std"], padded.std(0), rtol=1e-12,
                             atol=1e-15)


def test_corpus_model_notebook_scores_the_sentence(tmp_path):
  from configs import quick_corpus  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import corpus  # pylint: disable=g-import-not-at-top
  corpus.write_synthetic(str(tmp_path / "corpus"), "dyck", (40, 8, 8), 4, 8)
  config = quick_corpus.get_config()
  config.corpus_dir = str(tmp_path / "corpus")
  config.hidden_size, config.batch_size, config.bptt_length = 6, 4, 7
  config.stack_window = 3
  config.max_epochs = 2
  config.progress_bar = False
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(config, workdir)
  notebook = _run_notebook("corpus_model.ipynb", {
      "WORKDIR": workdir, "SENTENCE": "( [ ] )"})
  text, images = _outputs(notebook)
  assert images == 3  # learning curve, next-token distributions, readings
  printed = float(re.search(
      r"-ln p_model\(sentence, <eos> \| <eos>\) = ([0-9.]+)", text).group(1))
  assert printed == pytest.approx(
      -evaluate.score(workdir, ["( [ ] )"])[0], abs=2e-4)
  # One line per token and the final <eos>, probabilities in (0, 1].
  lines = re.findall(r"^\s*(\S+)  p = ([0-9.]+)$", text, re.M)
  assert [t for t, _ in lines] == ["(", "[", "]", ")", "<eos>"]
  assert all(0 < float(p) <= 1 for _, p in lines)
  # The stack margin of the sentence read after <eos> (as scored), that of
  # stack_margins.
  margin = float(re.search(r"stack margin (-?[0-9.]+) nats \(proven exact\)",
                           text).group(1))
  assert margin == pytest.approx(
      evaluate.stack_margins(workdir, ["( [ ] )"])[0], abs=0.051)


def test_languages_notebook_enumerates_and_samples_dyck():
  notebook = _run_notebook("languages.ipynb", {
      "TASK": "dyck", "SHORT_LENGTH": 6, "NUM_SAMPLES": 4000, "SEED": 0})
  text, images = _outputs(notebook)
  assert images == 1
  # Dyck-2 has Catalan(3) * 2^3 = 40 strings of length 6; the authors'
  # unary-rule removal drops the 2 * Catalan(2) * 2^2 = 16 that are one
  # top-level group, "(" w ")" or "[" w "]" (reference-behaviour.md §5.2).
  assert "4096 strings of length 6; 24 have positive probability" in text
  assert "sum of their probabilities given the length: 1.000000000000" in text
  tv = float(re.search(r"samples vs exact: ([0-9.]+)", text).group(1))
  assert tv < 0.06   # 4000 draws over 24 strings: ~0.03 expected
  # The printed lower bounds are -ln G(w) + ln G(n) + ln N_L, N_L = 21.
  rows = re.findall(
      r"n = (\d+):.*\n\s+ln G\(w\) = (-[0-9.]+)\s+ln G\(n\) = (-[0-9.]+)"
      r"\s+lower bound ([0-9.]+) nats", text)
  assert len(rows) == 4
  for n, g_w, g_n, bound in rows:
    assert 40 <= int(n) <= 80 and int(n) % 2 == 0
    assert float(bound) == pytest.approx(
        -float(g_w) + float(g_n) + np.log(21), abs=2e-3)


def _selected_by_hand(results, task, model):
  """(setting, its records) the paper's rule selects, read from the JSON
  files directly: among the settings with the most finished restarts, the
  lowest mean best-epoch validation difference (ties: std, then name)."""
  settings = {}
  for path in glob.glob(os.path.join(results, task, model, "*",
                                     "restart_*.json")):
    with open(path) as f:
      record = json.load(f)
    if record["protocol"] == "paper":
      settings.setdefault(os.path.basename(os.path.dirname(path)),
                          []).append(record)
  most = max(len(r) for r in settings.values())
  name = min((n for n, r in settings.items() if len(r) == most),
             key=lambda n: (np.mean([r["best_valid_ce_diff"]
                                     for r in settings[n]]),
                            np.std([r["best_valid_ce_diff"]
                                    for r in settings[n]]), n))
  return name, sorted(settings[name], key=lambda r: r["restart"])


def test_run_records_notebook_matches_the_record_files():
  results = os.path.join(REPO_ROOT, "results")
  notebook = _run_notebook("run_records.ipynb", {
      "TASK": "dyck", "MODEL": "jm", "SELECTION": "mean", "RESULTS": results,
      "PAPER": True})
  text, images = _outputs(notebook)
  # Figures 3 and 4, every setting of JM, the restarts of its selection.
  assert images == 4
  for model, label in (("lstm", "LSTM"), ("gref", "Gref"), ("jm", "JM"),
                       ("ns", "Ours")):
    name, records = _selected_by_hand(results, "dyck", model)
    row = re.search(rf"^{label} +(\S+) +(\d+) +([-+][0-9.]+) ± ([0-9.]+)",
                    text, re.M)
    assert row.group(1) == name
    assert int(row.group(2)) == len(records)
    last = [r["last_valid_ce_diff"] for r in records]
    assert float(row.group(3)) == pytest.approx(np.mean(last), abs=6e-5)
    assert float(row.group(4)) == pytest.approx(np.std(last), abs=6e-5)
  # JM's grid: its 12 settings, the selected one marked; then one line
  # per restart of it with that record's epochs and best epoch.
  name, records = _selected_by_hand(results, "dyck", "jm")
  assert "JM on dyck: 12 setting(s)" in text
  assert re.search(rf"^{re.escape(name)} .*<- selected$", text, re.M)
  rows = re.findall(r"^ +(\d) +(\d+) +(\d+) +([-+][0-9.]+)", text, re.M)
  assert [(int(r), int(e), int(b)) for r, e, b, _ in rows] == [
      (r["restart"], r["num_epochs"], r["best_epoch"]) for r in records]
  for (_, _, _, best), record in zip(rows, records):
    assert float(best) == pytest.approx(record["best_valid_ce_diff"],
                                        abs=6e-5)
  # Dyck's two claims, each read restart by restart too.
  assert text.count("holds in") == 2
