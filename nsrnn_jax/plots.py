"""The paper's Figures 3 and 4 from our own training runs (library + CLI).

Figure 3 of DuSell & Chiang (2020) plots the validation cross-entropy
difference (model minus source distribution, nats/symbol) per epoch; Figure 4
plots the test cross-entropy difference binned by string length. Each line is
one model (LSTM, Gref, JM, Ours), averaged over its random restarts, with a
shaded band of one standard deviation.

Grouping runs into models. A *group* is the set of restarts of one model. The
CLI takes a comma-separated list of group specifications; each one is a path
or a glob pattern, and every run directory it matches (see `find_runs`) joins
that group:

  python -m nsrnn_jax.plots \
      --workdirs='runs/lstm-*,runs/gref-*,runs/jm-*,runs/ns-*' \
      --labels=LSTM,Gref,JM,Ours --out=figures/marked_reversal

A grid workdir written by grid.py (runs under lr_<lr>/restart_<r>/ plus a
grid_summary.json) stands for the restarts of its *selected* learning rate,
as in the paper's figures. Any other directory that holds no
`metrics.jsonl` itself is searched one level down (and then two), so a
parent of one directory per restart (or per model) can be given as one
pattern. With `--group_by=model` all runs found
under all patterns are regrouped by the model named in their `config.json`,
ordered like the paper (LSTM, Gref, JM, Ours) and labelled accordingly.

Padding rule (reference behaviour section 9): a restart that stopped early
contributes its *last* epoch's value to every later epoch, and the curve is as
long as the longest restart. Mean and standard deviation are over restarts,
with the population standard deviation (ddof=0, NumPy's default, as the
authors' plotting script used).

`--paper` draws the paper's own mean curves of the runs' task dashed beside
them (`paper_figures`, from the figure data in the paper's LaTeX source).

Outputs in `--out`: figure3.png/.pdf, figure4.png/.pdf (when the runs have a
`test_by_length.json`) and series.json holding every plotted number, so that
tests and reports can compare the curves with the metrics files.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.figure
import numpy as np

METRICS_FILE = "metrics.jsonl"
GRID_SUMMARY_FILE = "grid_summary.json"
TEST_FILE = "test_by_length.json"
CONFIG_FILE = "config.json"

# Model names used in configs -> labels used in the paper's figures, in the
# paper's legend order; then the later papers' stacks (DuSell & Chiang 2022,
# 2023), which the CoNLL 2020 figures do not have.
MODEL_LABELS = {"lstm": "LSTM", "gref": "Gref", "jm": "JM", "ns": "Ours",
                "rns": "RNS-RNN", "vrns": "VRNS-RNN"}
TASK_TITLES = {
    "marked_reversal": "Marked Reversal",
    "unmarked_reversal": "Unmarked Reversal",
    "padded_reversal": "Padded Reversal",
    "dyck": "Dyck",
    "hardest_cfl": "Hardest CFL",
}
# One fixed colour per paper label so that every figure matches.
_LABEL_COLORS = {"LSTM": "C0", "Gref": "C1", "JM": "C2", "Ours": "C3"}
# Characters of legend labels that fit one row under a figure (the paper's
# five entries, "LSTM" to "paper", take one row); longer or more labels
# wrap onto more rows, and the figure grows to keep its axes' height.
_LEGEND_ROW_CHARS = 60
_LEGEND_ROW_INCHES = 0.22
Y_LABEL = "Difference in Cross Entropy"


@dataclasses.dataclass(frozen=True)
class RunGroup:
  """The restarts of one model: one line in each figure.

  Attributes:
    label: legend label (e.g. "Ours").
    workdirs: single-run workdirs (each holds a metrics.jsonl).
  """
  label: str
  workdirs: tuple[str, ...]


# ---------------------------------------------------------------------------
# Reading workdirs
# ---------------------------------------------------------------------------


def is_run_dir(path: str) -> bool:
  """Whether `path` is a single-run workdir (holds a metrics.jsonl)."""
  return os.path.isfile(os.path.join(path, METRICS_FILE))


def grid_selected_runs(grid_dir: str) -> list[str] | None:
  """Run directories of the selected setting of a grid workdir (grid.py).

  A grid workdir holds one run per (learning rate, restart) and a
  grid_summary.json naming the selected setting; the paper plots only the
  selected setting's restarts.

  Returns:
    The selected setting's run directories, or None if `grid_dir` has no
    grid_summary.json.

  Raises:
    ValueError: if the summary is malformed or names no existing runs.
  """
  path = os.path.join(grid_dir, GRID_SUMMARY_FILE)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    summary = json.load(f)
  try:
    best_lr = summary["best"]["learning_rate"]
    setting = next(s for s in summary["settings"]
                   if s["learning_rate"] == best_lr)
    runs = [os.path.join(grid_dir, d) for d in setting["subdirs"]]
  except (KeyError, TypeError, StopIteration) as e:
    raise ValueError(f"{path} does not name the selected setting's runs "
                     f"({e!r}).") from e
  runs = [r for r in runs if is_run_dir(r)]
  if not runs:
    raise ValueError(f"{path}: the selected setting's run directories hold "
                     f"no {METRICS_FILE}.")
  return runs


def find_runs(pattern: str) -> list[str]:
  """Single-run workdirs matched by a path or glob pattern, sorted.

  A matched directory that is a grid workdir (has grid_summary.json) gives
  the runs of its selected setting (`grid_selected_runs`); any other matched
  directory that is not itself a run is searched one level down, then two
  (a parent holding one directory per restart or per model).

  Args:
    pattern: a directory path or a `glob` pattern.

  Returns:
    Sorted list of run directories.

  Raises:
    ValueError: if nothing matches or no run directory is found.
  """
  matches = sorted(glob.glob(os.path.expanduser(pattern)))
  if not matches:
    raise ValueError(f"No file or directory matches {pattern!r}.")
  runs = []
  for match in matches:
    if not os.path.isdir(match):
      continue
    if is_run_dir(match):
      runs.append(match)
      continue
    selected = grid_selected_runs(match)
    if selected is not None:
      runs.extend(selected)
      continue
    for depth_pattern in ("*", os.path.join("*", "*")):
      below = [d for d in sorted(glob.glob(os.path.join(match, depth_pattern)))
               if is_run_dir(d)]
      if below:
        runs.extend(below)
        break
  if not runs:
    raise ValueError(
        f"{pattern!r} matches no run directory (a directory containing "
        f"{METRICS_FILE}, at most two levels down).")
  return sorted(dict.fromkeys(runs))


def read_config(workdir: str) -> dict[str, Any]:
  """The run's config.json as a dict ({} when the file is missing)."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _lookup(config: Mapping[str, Any], *keys: str) -> Any:
  """First present value among dotted `keys` in a nested config dict."""
  for key in keys:
    node: Any = config
    for part in key.split("."):
      if not isinstance(node, Mapping) or part not in node:
        node = None
        break
      node = node[part]
    if node is not None and not isinstance(node, Mapping):
      return node
  return None


def model_name(workdir: str) -> str | None:
  """The model name ("lstm", "gref", "jm", "ns") from the run's config."""
  name = _lookup(read_config(workdir), "model", "model_name", "model.name")
  return None if name is None else str(name)


def task_name(workdir: str) -> str | None:
  """The task name (e.g. "dyck") from the run's config, if recorded."""
  name = _lookup(read_config(workdir), "task", "task_name", "data.task")
  return None if name is None else str(name)


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """All records of a run's metrics.jsonl, in file order.

  Raises:
    ValueError: if the file is missing or a line is not a JSON object.
  """
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.isfile(path):
    raise ValueError(f"{workdir!r} has no {METRICS_FILE}.")
  records = []
  with open(path) as f:
    for line_number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{line_number} is not valid JSON: {e}") from e
      if not isinstance(record, dict):
        raise ValueError(f"{path}:{line_number} is not a JSON object.")
      records.append(record)
  return records


def validation_curve(workdir: str, key: str = "valid_ce_diff"
                     ) -> tuple[np.ndarray, np.ndarray]:
  """Per-epoch values of `key` for one run.

  Records without `epoch` or `key` (e.g. summaries) are ignored. Training
  keeps one record per epoch; a workdir written before it truncated metrics
  on resume can repeat an epoch: the last record wins, with a warning.

  Returns:
    (epochs_E, values_E), sorted by epoch, float64 values.

  Raises:
    ValueError: if the run has no such records or its epochs have gaps.
  """
  by_epoch = {}
  repeated = set()
  for record in read_metrics(workdir):
    if "epoch" in record and record.get(key) is not None:
      epoch, value = record["epoch"], record[key]
      # JSON's types as training writes them: a string "nan" or an epoch
      # 43.7 would be read as numbers and change the curve.
      if (not isinstance(epoch, int) or isinstance(epoch, bool)
          or not isinstance(value, (int, float)) or isinstance(value, bool)):
        raise ValueError(f"{workdir!r}: {METRICS_FILE} has a record whose "
                         f"epoch {epoch!r} or {key} {value!r} is not a "
                         "number of its kind")
      if epoch in by_epoch:
        repeated.add(epoch)
      by_epoch[epoch] = float(value)
  if repeated:
    warnings.warn(f"{workdir!r}: {METRICS_FILE} repeats epochs "
                  f"{sorted(repeated)}; using the last record of each")
  if not by_epoch:
    raise ValueError(f"{workdir!r}: no record in {METRICS_FILE} has both "
                     f"'epoch' and {key!r}.")
  epochs_E = np.array(sorted(by_epoch), dtype=np.int64)
  if np.any(np.diff(epochs_E) != 1):
    raise ValueError(f"{workdir!r}: epochs in {METRICS_FILE} are not "
                     f"consecutive: {epochs_E.tolist()}.")
  values_E = np.array([by_epoch[e] for e in epochs_E], dtype=np.float64)
  return epochs_E, values_E


def read_test_by_length(workdir: str, key: str = "ce_diff"
                        ) -> tuple[np.ndarray, np.ndarray]:
  """(lengths_L, values_L) from a run's test_by_length.json, sorted by length.

  Raises:
    ValueError: if the file is missing or malformed.
  """
  path = os.path.join(workdir, TEST_FILE)
  if not os.path.isfile(path):
    raise ValueError(f"{workdir!r} has no {TEST_FILE}.")
  try:
    with open(path) as f:
      table = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path} is not JSON: {e}") from None
  if not isinstance(table, dict) or "lengths" not in table or key not in table:
    raise ValueError(f"{path} lacks 'lengths' or {key!r}.")
  lengths, values = table["lengths"], table[key]
  # JSON's types as evaluation writes them: a length 9.5 or "13", or a
  # value "nan", would be read as numbers and move the curve.
  if not (isinstance(lengths, list) and isinstance(values, list)
          and all(isinstance(n, int) and not isinstance(n, bool)
                  for n in lengths)
          and all(v is None or (isinstance(v, (int, float))
                                and not isinstance(v, bool))
                  for v in values)):
    raise ValueError(f"{path}: 'lengths' must be a list of integers and "
                     f"{key!r} a list of numbers (or null)")
  if len(set(lengths)) != len(lengths):
    raise ValueError(f"{path}: 'lengths' repeats a length")
  lengths_L = np.asarray(lengths, dtype=np.int64)
  values_L = np.asarray([np.nan if v is None else v for v in values],
                        dtype=np.float64)
  if lengths_L.shape != values_L.shape or lengths_L.ndim != 1:
    raise ValueError(f"{path}: 'lengths' and {key!r} differ in shape "
                     f"({lengths_L.shape} vs {values_L.shape}).")
  order = np.argsort(lengths_L, kind="stable")
  return lengths_L[order], values_L[order]


# ---------------------------------------------------------------------------
# Grouping
# ---------------------------------------------------------------------------


def group_runs(patterns: Sequence[str], labels: Sequence[str] | None = None,
               group_by: str = "pattern") -> list[RunGroup]:
  """Turns CLI-style patterns into groups of restarts.

  Args:
    patterns: paths or glob patterns (see `find_runs`).
    labels: with group_by="pattern", one label per pattern; default: the
      paper label of the model in the first run's config, else the pattern.
      With group_by="model" labels are not allowed (they come from configs).
    group_by: "pattern" (each pattern is one model) or "model" (all runs are
      regrouped by the model named in their config.json).

  Returns:
    The groups, in pattern order (group_by="pattern") or paper order.

  Raises:
    ValueError: for a bad `group_by`, a label count that does not match, or a
      run without a model name when grouping by model.
  """
  if group_by not in ("pattern", "model"):
    raise ValueError(
        f"group_by must be 'pattern' or 'model', got {group_by!r}.")
  # One string is one pattern (or label), not a sequence of characters.
  if isinstance(patterns, str):
    patterns = [patterns]
  if isinstance(labels, str):
    labels = [labels]
  if not patterns:
    raise ValueError("No workdirs given.")
  runs_per_pattern = [find_runs(p) for p in patterns]
  if group_by == "model":
    if labels:
      raise ValueError("labels cannot be given with group_by='model': they "
                       "come from each run's config.json.")
    by_model: dict[str, list[str]] = {}
    for run in (r for runs in runs_per_pattern for r in runs):
      name = model_name(run)
      if name is None:
        raise ValueError(f"{run!r}: config.json names no model; cannot group "
                         "by model.")
      by_model.setdefault(name, []).append(run)
    paper_order = list(MODEL_LABELS)
    names = sorted(by_model, key=lambda n: (
        paper_order.index(n) if n in paper_order else len(paper_order), n))
    return [RunGroup(MODEL_LABELS.get(n, n), tuple(by_model[n]))
            for n in names]
  if labels is not None and len(labels) != len(patterns):
    raise ValueError(f"Got {len(labels)} labels for {len(patterns)} workdir "
                     "patterns; give one label per pattern.")
  groups = []
  for i, (pattern, runs) in enumerate(zip(patterns, runs_per_pattern)):
    if labels is not None:
      label = labels[i]
    else:
      name = model_name(runs[0])
      label = MODEL_LABELS.get(name, name) if name else pattern
    groups.append(RunGroup(label, tuple(runs)))
  return groups


# ---------------------------------------------------------------------------
# Series (the numbers that get plotted)
# ---------------------------------------------------------------------------


def pad_with_last(curves: Sequence[np.ndarray]) -> np.ndarray:
  """Stacks ragged curves into [R, E], padding each with its last value.

  E is the length of the longest curve (the paper's rule for restarts that
  stopped early: their last epoch's value stands for every later epoch).

  Raises:
    ValueError: if there are no curves or one is empty.
  """
  if not curves:
    raise ValueError("No curves to pad.")
  if any(len(c) == 0 for c in curves):
    raise ValueError("Cannot pad an empty curve.")
  num_epochs = max(len(c) for c in curves)
  padded_RxE = np.empty((len(curves), num_epochs), dtype=np.float64)
  for r, curve in enumerate(curves):
    padded_RxE[r, :len(curve)] = curve
    padded_RxE[r, len(curve):] = curve[-1]
  return padded_RxE


def align_by_length(tables: Sequence[tuple[Sequence[int], Sequence[float]]]
                    ) -> tuple[np.ndarray, np.ndarray]:
  """Aligns per-restart (lengths, values) tables on the union of lengths.

  Returns:
    (lengths_L sorted, runs_RxL) with NaN where a restart lacks a length.
  """
  lengths_L = np.unique(np.concatenate(
      [np.asarray(lengths, dtype=np.int64) for lengths, _ in tables]))
  runs_RxL = np.full((len(tables), len(lengths_L)), np.nan)
  for r, (lengths, values) in enumerate(tables):
    runs_RxL[r, np.searchsorted(lengths_L, lengths)] = values
  return lengths_L, runs_RxL


def train_series(group: RunGroup, key: str = "valid_ce_diff"
                 ) -> dict[str, Any]:
  """Figure-3 series of one group: per-epoch mean and std over restarts.

  Returns:
    {"label", "workdirs", "epochs", "mean", "std", "runs" (padded, [R][E]),
     "num_epochs" (per run, before padding), "final_mean", "final_std"};
     lists of floats, ready for JSON.

  Raises:
    ValueError: if the restarts do not start at the same epoch.
  """
  curves = [validation_curve(w, key) for w in group.workdirs]
  first_epochs = {int(epochs[0]) for epochs, _ in curves}
  if len(first_epochs) != 1:
    raise ValueError(f"Restarts of {group.label!r} start at different epochs "
                     f"{sorted(first_epochs)}.")
  runs_RxE = pad_with_last([values for _, values in curves])
  epochs_E = first_epochs.pop() + np.arange(runs_RxE.shape[1])
  mean_E = runs_RxE.mean(axis=0)
  std_E = runs_RxE.std(axis=0)
  return {
      "label": group.label,
      "workdirs": list(group.workdirs),
      "epochs": epochs_E.tolist(),
      "mean": mean_E.tolist(),
      "std": std_E.tolist(),
      "runs": runs_RxE.tolist(),
      "num_epochs": [len(values) for _, values in curves],
      "final_mean": float(mean_E[-1]),
      "final_std": float(std_E[-1]),
  }


def test_series(group: RunGroup, key: str = "ce_diff") -> dict[str, Any]:
  """Figure-4 series of one group: per-length mean and std over restarts.

  Restarts are aligned on the union of their lengths; a length missing from
  some restart is averaged over the restarts that have it ("count" says how
  many). Restarts without a test_by_length.json are left out and listed under
  "missing".

  Returns:
    {"label", "workdirs", "missing", "lengths", "mean", "std", "count",
     "runs" ([R][L], NaN where a restart lacks the length)}.

  Raises:
    ValueError: if no restart of the group has a test_by_length.json.
  """
  tables, present, missing = [], [], []
  for workdir in group.workdirs:
    if os.path.isfile(os.path.join(workdir, TEST_FILE)):
      tables.append(read_test_by_length(workdir, key))
      present.append(workdir)
    else:
      missing.append(workdir)
  if not tables:
    raise ValueError(f"No run of {group.label!r} has a {TEST_FILE}.")
  lengths_L, runs_RxL = align_by_length(tables)
  count_L = np.sum(~np.isnan(runs_RxL), axis=0)
  mean_L = np.nanmean(runs_RxL, axis=0)
  std_L = np.nanstd(runs_RxL, axis=0)
  return {
      "label": group.label,
      "workdirs": present,
      "missing": missing,
      "lengths": lengths_L.tolist(),
      "mean": mean_L.tolist(),
      "std": std_L.tolist(),
      "count": count_L.tolist(),
      "runs": [[None if math.isnan(v) else v for v in row]
               for row in runs_RxL.tolist()],
  }


# ---------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------


def _new_figure() -> matplotlib.figure.Figure:
  """A figure that is not registered with pyplot.

  Building `Figure` objects directly needs no GUI backend and leaves no
  global pyplot state behind (nothing to close), so the CLI, tests and
  notebooks behave the same; notebooks show them with `display(fig)`.
  """
  return matplotlib.figure.Figure(figsize=(5.0, 3.6), layout="constrained")


def _plot_bands(ax, series_list, x_key: str, reference=None) -> None:
  """Mean lines with ±1 std bands, one per series, coloured by label.

  `reference` (optional): series {"label", "x", "mean"} drawn as thin
  dashed lines in their label's colour (the paper's means), with one
  legend entry for all of them.
  """
  colors = {}
  for i, series in enumerate(series_list):
    x = np.asarray(series[x_key])
    mean = np.asarray(series["mean"], dtype=np.float64)
    std = np.asarray(series["std"], dtype=np.float64)
    color = _LABEL_COLORS.get(series["label"],
                              _other_color(i, len(series_list)))
    colors[series["label"]] = color
    ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.25,
                    linewidth=0)
    ax.plot(x, mean, color=color, label=series["label"], linewidth=1.5)
  for i, series in enumerate(reference or ()):
    color = colors.get(series["label"],
                       _LABEL_COLORS.get(series["label"], f"C{i % 10}"))
    ax.plot(series["x"], series["mean"], color=color, linewidth=1.0,
            linestyle="--", alpha=0.9)
  if reference:  # One grey legend entry stands for all dashed lines.
    ax.plot([], [], color="0.35", linewidth=1.0, linestyle="--",
            label="paper")
  ax.set_ylabel(Y_LABEL)
  ax.grid(True, alpha=0.3)
  labels = [s["label"] for s in series_list] + (["paper"] if reference
                                                 else [])
  columns = legend_columns(labels)
  rows = math.ceil(len(labels) / columns) if labels else 1
  if rows > 1:
    width, height = ax.figure.get_size_inches()
    ax.figure.set_size_inches(width, height + _LEGEND_ROW_INCHES * (rows - 1))
  ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18),
            ncol=columns, frameon=False)


def _other_color(i: int, count: int):
  """Colour of series i of `count` whose label has no colour of its own:
  the default cycle from its fifth colour (after the models'), or with
  more than 6 series the 20 colours of "tab20", so that up to 20 differ."""
  if count > 6:
    return matplotlib.colormaps["tab20"](i % 20)
  return f"C{(i + 4) % 10}"


def legend_columns(labels: Sequence[str]) -> int:
  """Legend entries per row for `labels` (at least 1): as many of the
  longest label (with its line sample) as fit `_LEGEND_ROW_CHARS`."""
  if not labels:
    return 1
  width = max(len(label) for label in labels) + 6
  return max(1, min(len(labels), _LEGEND_ROW_CHARS // width))


def _plot_figure(series_list, x_key: str, x_label: str,
                 title: str | None, reference=None
                 ) -> matplotlib.figure.Figure:
  fig = _new_figure()
  ax = fig.add_subplot()
  _plot_bands(ax, series_list, x_key, reference)
  ax.set_xlabel(x_label)
  if title:
    ax.set_title(title)
  return fig


def plot_train(series_list: Sequence[Mapping[str, Any]],
               title: str | None = None,
               reference: Sequence[Mapping[str, Any]] | None = None
               ) -> matplotlib.figure.Figure:
  """Figure 3: validation CE difference per epoch (from `train_series`).

  `reference`: curves {"label", "x", "mean"} drawn dashed beside ours (the
  paper's, `paper_figures`).
  """
  return _plot_figure(series_list, "epochs", "Epoch", title, reference)


def plot_test(series_list: Sequence[Mapping[str, Any]],
              title: str | None = None,
              reference: Sequence[Mapping[str, Any]] | None = None
              ) -> matplotlib.figure.Figure:
  """Figure 4: test CE difference by string length (from `test_series`).

  `reference`: as for `plot_train`.
  """
  return _plot_figure(series_list, "lengths", "Length", title, reference)


def default_title(groups: Sequence[RunGroup]) -> str | None:
  """The paper's panel title when every run names the same task."""
  tasks = {task_name(w) for g in groups for w in g.workdirs}
  if len(tasks) == 1 and None not in tasks:
    task = tasks.pop()
    return TASK_TITLES.get(task, task)
  return None


def paper_reference(groups: Sequence[RunGroup], paper: Mapping[str, Any],
                    kind: str) -> list[dict[str, Any]] | None:
  """The paper's mean curves for these groups, labelled like them.

  Args:
    groups: from `group_runs`; each group whose runs are all of one model
      gets that model's paper curve under the group's label.
    paper: `paper_figures.load()`.
    kind: "train" (Figure 3) or "test" (Figure 4).

  Returns:
    [{"label", "x", "mean"}] for `plot_train` / `plot_test`, or None where
    the paper has no such curve.

  Raises:
    ValueError: the runs are not all of one task.
  """
  from nsrnn_jax import paper_figures  # pylint: disable=g-import-not-at-top
  tasks = {task_name(w) for g in groups for w in g.workdirs}
  if len(tasks) != 1 or None in tasks:
    raise ValueError("the paper's curves are drawn for runs of one task; "
                     f"these runs name {sorted(map(str, tasks))}")
  task = tasks.pop()
  out = []
  for group in groups:
    models = {model_name(w) for w in group.workdirs}
    c = (paper_figures.curve(paper, kind, task, models.pop())
         if len(models) == 1 else None)
    if c is not None:
      out.append({"label": group.label, "x": c["x"], "mean": c["mean"]})
  return out or None


def make_figures(groups: Sequence[RunGroup], out_dir: str,
                 title: str | None = None,
                 formats: Sequence[str] = ("png", "pdf"),
                 paper: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """Draws and saves Figures 3 and 4 plus series.json.

  Figure 4 is skipped (with "figure4": null in the result) when no group has
  a test_by_length.json; groups without one are left out of Figure 4 only.

  Args:
    groups: from `group_runs`.
    out_dir: created if missing.
    title: panel title; default from the runs' task (`default_title`).
    formats: file formats to save each figure in.
    paper: the paper's figure data (`paper_figures.load()`) to draw its
      mean curves dashed beside the groups' (`paper_reference`; the runs
      must be of one task).

  Returns:
    The dict written to series.json: {"title", "figure3": [train series],
    "figure4": [test series] or None, "files": [saved paths]}.
  """
  if not groups:
    raise ValueError("No run groups to plot.")
  if not all(isinstance(g, RunGroup) for g in groups):
    raise TypeError("groups must be RunGroups (group_runs)")
  if isinstance(formats, str):
    formats = (formats,)  # "png", not "p", "n", "g"
  labels = [g.label for g in groups]
  if len(set(labels)) != len(labels):
    raise ValueError(f"Group labels must be distinct, got {labels}.")
  if title is None:
    title = default_title(groups)
  reference = {}
  if paper is not None:
    reference = {kind: paper_reference(groups, paper, kind)
                 for kind in ("train", "test")}
  os.makedirs(out_dir, exist_ok=True)
  files = []
  train = [train_series(g) for g in groups]
  fig = plot_train(train, title, reference.get("train"))
  for fmt in formats:
    files.append(os.path.join(out_dir, f"figure3.{fmt}"))
    fig.savefig(files[-1], dpi=150)
  test = []
  for group in groups:
    if any(os.path.isfile(os.path.join(w, TEST_FILE))
           for w in group.workdirs):
      test.append(test_series(group))
  if test:
    fig = plot_test(test, title, reference.get("test"))
    for fmt in formats:
      files.append(os.path.join(out_dir, f"figure4.{fmt}"))
      fig.savefig(files[-1], dpi=150)
  result = {"title": title, "figure3": train, "figure4": test or None,
            "files": files}
  files.append(os.path.join(out_dir, "series.json"))
  with open(files[-1], "w") as f:
    json.dump(result, f, indent=1)
  return result


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _split(value: str | None, what: str) -> list[str] | None:
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  return None if value is None else cli.comma_list(value, what)


def main(argv: Sequence[str] | None = None) -> int:
  """CLI entry point; see the module docstring. Returns the exit status."""
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  parser = cli.OneLineArgumentParser(
      prog="python -m nsrnn_jax.plots",
      description="Draw the paper's Figures 3 and 4 from training workdirs.")
  parser.add_argument(
      "--workdirs", required=True,
      help="comma-separated paths or glob patterns; each is one model's "
      "restarts (or, with --group_by=model, any set of runs)")
  parser.add_argument("--labels", default=None,
                      help="comma-separated legend labels, one per pattern")
  parser.add_argument("--group_by", default="pattern",
                      choices=("pattern", "model"))
  parser.add_argument("--out", required=True, help="output directory")
  parser.add_argument("--title", default=None, help="panel title")
  parser.add_argument("--formats", default="png,pdf")
  parser.add_argument("--paper", action="store_true",
                      help="draw the paper's mean curves of the runs' task "
                      "dashed beside them (results/paper_figures.json)")
  args = parser.parse_args(argv)
  from nsrnn_jax import paper_figures  # pylint: disable=g-import-not-at-top
  try:
    paper = None
    if args.paper:
      paper = paper_figures.load()
      if paper is None:
        raise ValueError(f"--paper: {paper_figures.DEFAULT_PATH} not found "
                         "(it is part of the repository, not the package)")
    formats = tuple(_split(args.formats, "--formats"))
    groups = group_runs(_split(args.workdirs, "--workdirs"),
                        _split(args.labels, "--labels"), args.group_by)
    result = make_figures(groups, args.out, args.title, formats, paper)
  except (ValueError, OSError) as e:
    parser.exit(2, f"error: {e}\n")
  print(f"{'model':<8} {'runs':>4} {'epochs':>6} {'final valid diff':>22}")
  for s in result["figure3"]:
    print(f"{s['label']:<8} {len(s['workdirs']):>4} {len(s['epochs']):>6} "
          f"{s['final_mean']:>12.4f} ± {s['final_std']:.4f}")
  for path in result["files"]:
    print("wrote", path)
  return 0


if __name__ == "__main__":
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  cli.run_argparse_command(main)
