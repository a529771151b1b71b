"""The reproduction report: run records beside the paper's numbers.

`write_report` (what `python -m nsrnn_jax.reproduce --report` calls) reads
every record under results/ (`run_records`) and writes
`docs/reproduction.md` and the Figure 3/4 images under `docs/figures/`,
from the records alone: per task and model the setting the paper's rule
selects (`summarize_cells`), its validation and test cross-entropy
differences beside the paper's (`PAPER_VALID`, `PAPER_TEST`; the figure
curves from `paper_figures`), the verdict on each of the paper's claims
(`CLAIMS`), how much of each grid has run, and what is left.
`tests/reproduction_report_test.py` checks that the committed report matches.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from nsrnn_jax import metrics as metrics_lib
from nsrnn_jax import paper_figures
from nsrnn_jax.run_records import BASE_SEED
from nsrnn_jax.run_records import DEFAULT_RESULTS
from nsrnn_jax.run_records import LEARNING_RATES
from nsrnn_jax.run_records import NUM_RESTARTS
from nsrnn_jax.run_records import REPO_ROOT
from nsrnn_jax.run_records import ReproduceError
from nsrnn_jax.run_records import RunSpec
from nsrnn_jax.run_records import STACK_MODELS
from nsrnn_jax.run_records import STACK_SIZES
from nsrnn_jax.run_records import TASKS
from nsrnn_jax.run_records import estimate_seconds
from nsrnn_jax.run_records import load_records
from nsrnn_jax.run_records import write_json_atomic

LABELS = {"lstm": "LSTM", "gref": "Gref", "jm": "JM", "ns": "Ours"}
TASK_TITLES = {"marked_reversal": "Marked reversal",
               "unmarked_reversal": "Unmarked reversal",
               "padded_reversal": "Padded reversal", "dyck": "Dyck",
               "hardest_cfl": "Hardest CFL"}
# Report order of the models (the paper's figures: LSTM, Gref, JM, Ours).
REPORT_ORDER = ("lstm", "gref", "jm", "ns")
# Length bins of the test table (the paper's Figure 4 discussion).
TEST_BINS = ((40, 80), (81, 100))

# The paper's numbers (reference-behaviour.md section 10, read off the
# figures' data): last-epoch validation CE difference (mean, std), and the
# mean test CE difference over lengths 40-80 and 81-100. The paper source
# lacks the training figures of unmarked and padded reversal (None).
PAPER_VALID = {
    "marked_reversal": {"lstm": (0.0871, 0.0148), "gref": (0.0350, 0.0355),
                        "jm": (0.0339, 0.0362), "ns": (0.0038, 0.0022)},
    "unmarked_reversal": None,
    "padded_reversal": None,
    "dyck": {"lstm": (0.0235, 0.0102), "gref": (0.0021, 0.0041),
             "jm": (-0.0003, 0.0024), "ns": (-0.0004, 0.0029)},
    "hardest_cfl": {"lstm": (0.0363, 0.0034), "gref": (0.0334, 0.0026),
                    "jm": (0.0318, 0.0050), "ns": (0.0284, 0.0048)},
}
PAPER_TEST = {
    "marked_reversal": {"lstm": (0.0514, 0.1869), "gref": (0.0161, 0.1169),
                        "jm": (0.0175, 0.0976), "ns": (-0.0055, 0.0796)},
    "unmarked_reversal": {"lstm": (0.1741, 0.2673), "gref": (0.1465, 0.2523),
                          "jm": (0.1508, 0.2631), "ns": (0.1242, 0.2288)},
    "padded_reversal": {"lstm": (0.1039, 0.1962), "gref": (0.0575, 0.1471),
                        "jm": (0.0490, 0.1437), "ns": (0.0782, 0.1831)},
    "dyck": {"lstm": (0.0056, 0.0680), "gref": (-0.0084, 0.0236),
             "jm": (-0.0081, 0.0206), "ns": (-0.0090, 0.0253)},
    "hardest_cfl": {"lstm": (0.0285, 0.0504), "gref": (0.0242, 0.0470),
                    "jm": (0.0238, 0.0459), "ns": (0.0213, 0.0493)},
}

DEFAULT_REPORT = os.path.join(REPO_ROOT, "docs", "reproduction.md")
# The paper's Figure 3/4 data under the results directory (paper_figures).
PAPER_FIGURES_FILE = os.path.basename(paper_figures.DEFAULT_PATH)


# ---------------------------------------------------------------------------
# Summaries and selection.
# ---------------------------------------------------------------------------


def _bin_mean(test: Optional[Mapping[str, Any]], lo: int, hi: int
              ) -> Optional[float]:
  if not test:
    return None
  values = [d for n, d in zip(test["lengths"], test["ce_diff"])
            if lo <= n <= hi]
  return float(np.mean(values)) if values else None


@dataclasses.dataclass
class Setting:
  """The finished restarts of one grid point of one (task, model)."""
  task: str
  model: str
  name: str
  records: list

  @property
  def best_valid(self) -> np.ndarray:
    """Best-epoch validation CE difference of each record."""
    return np.asarray([r["best_valid_ce_diff"] for r in self.records])

  def rank(self) -> tuple[float, float]:
    """The authors' selection key: (mean, std) of best-epoch differences."""
    return (float(np.mean(self.best_valid)), float(np.std(self.best_valid)))


@dataclasses.dataclass
class Cell:
  """One (task, model) of the report: its settings and the selected one."""
  task: str
  model: str
  settings: list
  selected: Optional[Setting]

  @property
  def runs(self) -> list:
    """The selected setting's records (none if nothing is selected)."""
    return [] if self.selected is None else self.selected.records

  def per_run(self, which) -> dict:
    """{restart: value} of the selected runs: the mean of test bin `which`
    (an index of TEST_BINS) or, for 'last', the last-epoch validation
    difference; runs without the value are left out."""
    out = {}
    for r in self.runs:
      value = (r["last_valid_ce_diff"] if which == "last"
               else _bin_mean(r.get("test"), *TEST_BINS[which]))
      if value is not None:
        out[r["restart"]] = value
    return out

  def last_valid(self) -> Optional[tuple[float, float]]:
    """(mean, std) over the selected runs of the last-epoch validation
    difference (None without runs)."""
    return _mean_std(self.per_run("last").values())

  def test_bin_stats(self) -> Optional[list[Optional[tuple[float, float]]]]:
    """(mean, std) over restarts of each bin's per-length mean (None if
    missing); std with ddof=0, as for the validation figures."""
    if not any(r.get("test") for r in self.runs):
      return None
    return [_mean_std(self.per_run(i).values())
            for i in range(len(TEST_BINS))]


def _mean_std(values) -> Optional[tuple[float, float]]:
  """(mean, std with ddof=0) of `values`, None if there are none."""
  values = np.asarray(list(values))
  if not values.size:
    return None
  return float(np.mean(values)), float(np.std(values))


SELECTIONS = ("mean", "best_run")


def summarize_cells(records: Sequence[Mapping[str, Any]],
                    include_custom: bool = False,
                    selection: str = "mean") -> dict:
  """{(task, model): Cell} with a selection rule applied.

  Args:
    records: run records.
    include_custom: also use records made with --set overrides.
    selection: "mean" (CoNLL 2020: the setting with the lowest mean
      best-epoch validation CE difference over its restarts, ties by std) or
      "best_run" (the later papers, rns-vrns-reference.md section 4.2: the one
      run with the lowest best-epoch validation CE difference, over all
      settings and restarts).
  """
  if selection not in SELECTIONS:
    raise ReproduceError(f"selection is {selection!r}; expected one of "
                         f"{', '.join(SELECTIONS)}")
  settings: dict = {}
  for rec in records:
    if rec["protocol"] != "paper" and not include_custom:
      continue
    key = (rec["task"], rec["model"], rec["setting"])
    settings.setdefault(key, []).append(rec)
  cells = {}
  for task in TASKS:
    for model in REPORT_ORDER:
      group = [Setting(task, model, name, sorted(recs,
                                                 key=lambda r: r["restart"]))
               for (t, m, name), recs in sorted(settings.items())
               if t == task and m == model]
      selected = None
      if group and selection == "best_run":
        best = min((r for g in group for r in g.records),
                   key=lambda r: (r["best_valid_ce_diff"], r["setting"],
                                  r["restart"]))
        selected = Setting(task, model,
                           f"{best['setting']}/restart_{best['restart']}",
                           [best])
      elif group:
        most = max(len(s.records) for s in group)
        candidates = [s for s in group if len(s.records) == most]
        selected = min(candidates, key=lambda s: (s.rank(), s.name))
      cells[(task, model)] = Cell(task, model, group, selected)
  return cells


# ---------------------------------------------------------------------------
# The paper's qualitative claims (reference-behaviour.md section 10.2).
# ---------------------------------------------------------------------------


def compared_stats(cells, task, models, which) -> list:
  """(mean, std) of each model, None where missing: test bin `which` (0 =
  lengths 40-80, 1 = 81-100) or 'last' (last-epoch validation)."""
  out = []
  for m in models:
    cell = cells[(task, m)]
    if which == "last":
      out.append(cell.last_valid())
    else:
      stats = cell.test_bin_stats()
      out.append(None if stats is None else stats[which])
  return out


# How a claim reads the means of its models (in the claim's model order).
_VERDICTS = {
    "lowest": lambda v: all(v[0] < x for x in v[1:]),     # the first is best
    "between": lambda v: v[0] < v[1] < v[2],
    "near_zero": lambda v: all(abs(x) < 0.005 for x in v),
    "worse": lambda v: v[0] > min(v[1:]),                  # than the best other
}


def claim_verdict(cells, task, kind, models, which) -> Optional[bool]:
  """True / False, or None while a compared cell has no runs."""
  values = compared_stats(cells, task, models, which)
  if any(v is None for v in values):
    return None
  return bool(_VERDICTS[kind]([mean for mean, _ in values]))


def paired_agreement(cells, task, kind, models, which
                     ) -> Optional[tuple[int, int]]:
  """(restarts where the claim holds, restarts compared), or None.

  Restart r of every model and setting trains on the same data (seed 1 + r),
  so a claim can be read restart by restart: its verdict applied to the
  compared models' values of restart r, over the restarts that every
  compared model's selected setting has finished. None when there is no
  such restart (e.g. with the best-run selection, one run per model).
  """
  per_model = [cells[(task, m)].per_run(which) for m in models]
  common = sorted(set.intersection(*(set(p) for p in per_model)))
  if not common:
    return None
  agree = sum(1 for r in common
              if _VERDICTS[kind]([p[r] for p in per_model]))
  return agree, len(common)


def grid_progress(cell: "Cell") -> tuple[int, int]:
  """(settings with all restarts finished, settings in the paper's grid).

  The selection can only change while the first is below the second: a
  verdict drawn from an incomplete grid may flip when the rest is run.
  """
  done = sum(1 for s in cell.settings if len(s.records) >= NUM_RESTARTS)
  return done, _grid_size(cell.model) // NUM_RESTARTS


def _grid_column(cells, task, models) -> str:
  """'complete', or each compared model's finished / total settings."""
  progress = [grid_progress(cells[(task, m)]) for m in models]
  if all(done >= total for done, total in progress):
    return "complete"
  return ", ".join(f"{LABELS[m]} {done}/{total}"
                   for m, (done, total) in zip(models, progress))


def _evidence(cells, task, models, which) -> str:
  """The compared numbers: 'Ours 0.0123 ± 0.0010, JM …'."""
  return ", ".join(f"{LABELS[m]} {_pm(v)}" for m, v in
                   zip(models, compared_stats(cells, task, models, which)))


_NS_FIRST = ("ns", "jm", "gref", "lstm")
_JM_FIRST = ("jm", "ns", "gref", "lstm")

# (claim, verdict kind, the models it compares in that kind's order, bin).
CLAIMS = {
    "marked_reversal": [
        ("the NS-RNN has the lowest test difference on lengths 40-80",
         "lowest", _NS_FIRST, 0)],
    "unmarked_reversal": [
        ("the NS-RNN has the lowest test difference on lengths 40-80",
         "lowest", _NS_FIRST, 0)],
    "padded_reversal": [
        ("JM has the lowest test difference on lengths 40-80",
         "lowest", _JM_FIRST, 0),
        ("the NS-RNN lies between JM and the LSTM on lengths 40-80",
         "between", ("jm", "ns", "lstm"), 0)],
    "dyck": [
        ("all stack models end near 0 (last validation difference within ±0.005)",
         "near_zero", ("ns", "jm", "gref"), "last"),
        ("the NS-RNN generalises worse than JM or Gref to lengths 81-100",
         "worse", ("ns", "jm", "gref"), 1)],
    "hardest_cfl": [
        ("the NS-RNN has the lowest test difference on lengths 40-80",
         "lowest", _NS_FIRST, 0),
        ("the NS-RNN generalises worse than JM or Gref to lengths 81-100",
         "worse", ("ns", "jm", "gref"), 1)],
}


# ---------------------------------------------------------------------------
# The report.
# ---------------------------------------------------------------------------


def _f(x: Optional[float], digits: int = 4) -> str:
  return "—" if x is None else f"{x:.{digits}f}"


def _pm(pair) -> str:
  return "—" if pair is None else f"{pair[0]:.4f} ± {pair[1]:.4f}"


def _grid_size(model: str) -> int:
  per_lr = len(STACK_SIZES) if model in STACK_MODELS else 1
  return len(LEARNING_RATES) * per_lr * NUM_RESTARTS


def _hours(seconds: float) -> str:
  return f"{seconds / 3600:.1f} h"


def _ns_table_summary(records) -> str:
  """One sentence: which stack table the NS-RNN records ran on ('' if none).

  Records written before `config.stack_table` existed ran ns_stack's scaled
  table (the field's default has since become the exact "shares").
  """
  counts = {}
  for r in records:
    if r["model"] == "ns":
      table = r.get("config", {}).get("stack_table", "scaled")
      counts[table] = counts.get(table, 0) + 1
  if not counts:
    return ""
  parts = ", ".join(f"{n} on the {t!r} table" for t, n in sorted(
      counts.items()))
  return (f"NS-RNN runs: {parts} (`config.stack_table`; both compute the "
          "same function, 'shares' exactly for any weights, 'scaled' to "
          "within 2e-6 in float32 on trained models' own strings; README, "
          "\"The stack\").")


def _ns_margin_summary(records) -> str:
  """One sentence: on how many test strings the NS-RNN records that measured
  the share stack's margin (`config.valid_stack_margin`) are proven
  exact, per task ('' if none measured it)."""
  per_task, factor = {}, 0
  for r in records:
    test = r.get("test") or {}
    if r["model"] == "ns" and "stack_exact_fraction" in test:
      factor += "stack_margin_kind" not in test
      runs, proven, strings, low = per_task.get(r["task"], (0, 0.0, 0, 0.0))
      n = test["num_strings"]
      per_task[r["task"]] = (
          runs + 1,
          proven + sum(f * k for f, k in zip(test["stack_exact_fraction"], n)),
          strings + sum(n), min([low] + list(test["stack_margin"])))
  if not per_task:
    return ""
  parts = [f"{TASK_TITLES[t]} {metrics_lib.percent(proven / strings)} of "
           f"{strings:,} ({runs} run{'s' if runs > 1 else ''}, smallest "
           f"{low:.1f} nats)"
           for t, (runs, proven, strings, low) in sorted(
               per_task.items(), key=lambda kv: list(TASK_TITLES).index(
                   kv[0]))]
  checked = {}
  for r in records:
    test = r.get("test") or {}
    if r["model"] == "ns" and "unproven_max_error" in test:
      runs, strings, worst = checked.get(r["task"], (0, 0, 0.0))
      checked[r["task"]] = (runs + 1, strings + test["unproven_strings"],
                            max(worst, test["unproven_max_error"]))
  rescored = "; ".join(
      f"{TASK_TITLES[t]} {strings:,} string{'s' if strings != 1 else ''} "
      f"({runs} run{'s' if runs > 1 else ''})"
      + (f", ln p within {worst:.1e} nats of float64" if strings else "")
      for t, (runs, strings, worst) in sorted(
          checked.items(), key=lambda kv: list(TASK_TITLES).index(kv[0])))
  older = (f" ({factor} of these records "
           "measured the factor margin of before 2026-12-06, never above the "
           "product margin: a lower bound)" if factor else "")
  return ("NS-RNN test strings on which the share stack is proven exact "
          "(its product margin above ½ ln of the float type's flush, −40.2 "
          "nats in float32; records that measured it, "
          f"`config.valid_stack_margin`): {'; '.join(parts)}{older}. The "
          "margin is conservative: the unproven test strings scored again "
          "in float64 with the same parameters (records from 2026-12-07 "
          f"on, `test.unproven_max_error`): {rescored or 'none yet'}; "
          "`python -m nsrnn_jax.evaluate --workdir=RUN --stack_margin` does "
          "the same for any run.")


def _hardware_summary(records) -> str:
  kinds = sorted({f"{r['hardware']['device_kind']} "
                  f"({r['hardware']['backend']}, {r['hardware']['cpu_count']} "
                  "cores)" for r in records})
  return "; ".join(kinds) if kinds else "—"


def _code_summary(records) -> str:
  """Which code made the records (their `code` field, where they have one)."""
  named = [r["code"] for r in records if r.get("code")
           and r["code"].get("commit")]
  if not named:
    return ""
  commits = {c["commit"] for c in named}
  modified = sum(1 for c in named if c.get("modified"))
  text = (f"Code: {len(named)} records name the commit that made them "
          f"(`code`), {len(commits)} commit(s)")
  if modified:
    text += f", {modified} of them with uncommitted changes"
  if len(named) < len(records):
    text += (f"; {len(records) - len(named)} name none (made before the "
             "field, or outside a git checkout)")
  return text + "."


def records_series(records: Sequence[Mapping[str, Any]], label: str
                   ) -> Optional[dict]:
  """Figure 3/4 series of any runs (plots.py's rules), labelled `label`.

  Figure 3: each run's validation CE difference per epoch, a run that
  stopped early padded with its last value, mean ± std (ddof=0) over the
  runs; Figure 4 (``"test"``; None if no run has a test table): the test
  CE difference by length, mean ± std over the runs that have the length.
  None if there are no runs.
  """
  from nsrnn_jax import plots  # pylint: disable=g-import-not-at-top
  if not records:
    return None
  curves = [np.asarray([e["valid_ce_diff"] for e in r["epochs"]])
            for r in records]
  runs_RxE = plots.pad_with_last(curves)
  out = {"label": label, "restarts": [r["restart"] for r in records],
         "epochs": list(range(1, runs_RxE.shape[1] + 1)),
         "mean": runs_RxE.mean(axis=0).tolist(),
         "std": runs_RxE.std(axis=0).tolist(), "test": None}
  tested = [r["test"] for r in records if r.get("test")]
  if tested:
    lengths_L, table_RxL = plots.align_by_length(
        [(t["lengths"], t["ce_diff"]) for t in tested])
    out["test"] = {"label": label, "lengths": lengths_L.tolist(),
                   "mean": np.nanmean(table_RxL, axis=0).tolist(),
                   "std": np.nanstd(table_RxL, axis=0).tolist()}
  return out


def figure_series(cell: Cell) -> Optional[dict]:
  """Figure 3/4 series of a cell's selected restarts (`records_series`)."""
  out = records_series(cell.runs, LABELS[cell.model])
  if out is not None:
    out["setting"] = cell.selected.name
  return out


def task_figures(cells, task: str,
                 paper: Optional[Mapping[str, Any]] = None) -> dict:
  """One task's Figures 3 and 4 from its selected runs (not saved).

  Returns ``{"title", "series", "figure3", "figure4"}``: the series of
  each model that has runs (report order), and matplotlib figures (None
  where there is nothing to draw). `paper`: the paper's figure data
  (`paper_figures.load`); its mean curves of the models drawn are dashed
  beside ours.
  """
  from nsrnn_jax import plots  # pylint: disable=g-import-not-at-top
  drawn = {m: figure_series(cells[(task, m)]) for m in REPORT_ORDER}
  drawn = {m: s for m, s in drawn.items() if s is not None}
  series = list(drawn.values())
  title = TASK_TITLES[task]

  def reference(kind):
    curves = [(m, paper_figures.curve(paper, kind, task, m)) for m in drawn]
    return [{"label": LABELS[m], "x": c["x"], "mean": c["mean"]}
            for m, c in curves if c is not None] or None

  out = {"title": title, "series": series, "figure3": None, "figure4": None}
  if series:
    out["figure3"] = plots.plot_train(series, title, reference("train"))
  tests = [s["test"] for s in series if s["test"] is not None]
  if tests:
    out["figure4"] = plots.plot_test(tests, title, reference("test"))
  return out


def draw_figures(cells, task: str, out_dir: str,
                 paper: Optional[Mapping[str, Any]] = None) -> list[str]:
  """figure3.png / figure4.png / series.json of one task (`task_figures`);
  returns the files."""
  drawn = task_figures(cells, task, paper)
  if not drawn["series"]:  # Nothing to draw: remove earlier figures.
    for name in ("figure3.png", "figure4.png", "series.json"):
      if os.path.isfile(os.path.join(out_dir, name)):
        os.remove(os.path.join(out_dir, name))
    return []
  os.makedirs(out_dir, exist_ok=True)
  files = []
  # No "Software" metadata: the PNG depends on the numbers only.
  png = {"Software": None}
  for name in ("figure3", "figure4"):
    if drawn[name] is not None:
      files.append(os.path.join(out_dir, f"{name}.png"))
      drawn[name].savefig(files[-1], dpi=120, metadata=png)
  files.append(os.path.join(out_dir, "series.json"))
  write_json_atomic(files[-1], {"title": drawn["title"],
                                "series": drawn["series"]})
  return files


def _in_report_order(cells):
  """(task, model, cell) of every task and model, in the report's order."""
  for task in TASKS:
    for model in REPORT_ORDER:
      yield task, model, cells[(task, model)]


def render_report(records: Sequence[Mapping[str, Any]],
                  figures_rel: str = "figures", selection: str = "mean",
                  paper_data: Optional[Mapping[str, Any]] = None) -> str:
  """docs/reproduction.md from the records (deterministic text).

  `paper_data`: the paper's figure data (`paper_figures.load`), for the lengths
  of its Figure 3 curves ("—" without it).
  """
  cells = summarize_cells(records, selection=selection)
  paper_runs = [r for r in records if r["protocol"] == "paper"]
  lines = [
      "# Reproduction report",
      "",
      "<!-- Generated by `python -m nsrnn_jax.reproduce --report` from the "
      "records under results/; do not edit by hand. -->",
      "",
      "Our runs of the paper's protocol (DuSell & Chiang 2020, section 5.5) "
      "beside the paper's numbers. Every number below is computed from the "
      "committed run records in `results/<task>/<model>/<setting>/"
      "restart_<r>.json` (format: `results/README.md`), one per finished "
      "run; `python -m nsrnn_jax.reproduce --report` regenerates this file "
      "and the figures, and a test checks that they match; "
      "`notebooks/run_records.ipynb` reads the same records for one task "
      "(every setting's curve, each restart). Runs are made "
      "with `python -m nsrnn_jax.reproduce --task=<task>`. Our strings are "
      "drawn with NumPy's generator: same grammars and distributions as the "
      "authors', not their strings. Restart r of every model and setting "
      f"uses seed {BASE_SEED} + r for its data, parameters and shuffling, "
      "so models and settings are compared on the same "
      f"{NUM_RESTARTS} datasets (paired); the authors drew fresh seeds for "
      "every run. Training is chaotic: the same seeds under code that only "
      "rounds differently can learn at another epoch, so a restart's record "
      "is one draw, not what its seeds always give (README, \"Records and "
      "the code that made them\", measures it).",
      "",
      (f"Records: {len(paper_runs)} finished runs of the paper's protocol, "
       f"on {_hardware_summary(paper_runs)}. " + " ".join(
          part for part in (_ns_table_summary(paper_runs),
                            _ns_margin_summary(paper_runs),
                            _code_summary(paper_runs)) if part)).rstrip(),
      "",
      ("Selection as in the paper: per model, the setting (learning rate, "
       "and m for JM/Gref) with the lowest mean best-epoch validation CE "
       "difference over its restarts; among settings with the most finished "
       "restarts only. *Setting* names the selected one, *restarts* its "
       "finished restarts." if selection == "mean" else
       "Selection as in the later papers (`--selection=best_run`): per "
       "model, the single run with the lowest best-epoch validation CE "
       "difference over all settings and restarts; ± std is 0."),
      "",
      "## Validation cross-entropy difference (nats/symbol)",
      "",
      "Last epoch's value, mean ± std (ddof=0) over the selected restarts "
      "(the paper's Figure 3 end points; reference-behaviour.md §10.1). "
      "✓: our mean lies within the paper's mean ± std. *Epochs*: the "
      "length of the Figure 3 curve, i.e. of the longest selected restart "
      "(ours / the paper's).",
      "",
      "| task | model | setting | restarts | settings tried | ours | paper "
      "| within | epochs |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for task, model, cell in _in_report_order(cells):
    paper = (PAPER_VALID[task] or {}).get(model)
    ours = cell.last_valid()
    within = "—"
    if ours is not None and paper is not None:
      within = "✓" if abs(ours[0] - paper[0]) <= paper[1] else "✗"
    setting = cell.selected.name if cell.selected else "not run"
    curve = paper_figures.curve(paper_data, "train", task, model)
    epochs = (f"{max(r['num_epochs'] for r in cell.runs) if cell.runs else '—'}"
              f" / {len(curve['x']) if curve else '—'}")
    lines.append(f"| {TASK_TITLES[task]} | {LABELS[model]} | {setting} | "
                 f"{len(cell.runs)} | {len(cell.settings)} | {_pm(ours)} | "
                 f"{_pm(paper) if paper else 'no figure'} | {within} | "
                 f"{epochs} |")
  lines += [
      "",
      "## Test cross-entropy difference by length",
      "",
      "Mean ± std (ddof=0) over the restarts of the mean per-length "
      "difference in lengths 40–80 / 81–100, best-epoch parameters "
      "(per-length bound including ln N_L,test, which reproduces the "
      "paper's figures; reference-behaviour.md §6, §10.2). The paper's "
      "columns are means only (from its Figure 4 data).",
      "",
      "| task | model | ours 40–80 | ours 81–100 | paper 40–80 | paper 81–100 |",
      "|---|---|---|---|---|---|",
  ]
  for task, model, cell in _in_report_order(cells):
    bins = cell.test_bin_stats() or [None, None]
    paper = PAPER_TEST[task][model]
    lines.append(f"| {TASK_TITLES[task]} | {LABELS[model]} | "
                 f"{_pm(bins[0])} | {_pm(bins[1])} | {paper[0]:.4f} | "
                 f"{paper[1]:.4f} |")
  lines += ["", "## The paper's qualitative claims", "",
            "Each verdict compares our means; the numbers it compares are "
            "shown with their std over restarts, so a verdict decided by "
            "less than a std can be read as such. *Grid*: complete when "
            "every compared model has finished all restarts of every "
            "setting of the paper's grid; otherwise each model's finished / "
            "total settings, and the verdict may change as the rest is run "
            "(the selection is made among finished settings only). "
            "*Restarts*: the claim read restart by restart (restart r of "
            "every model trains on the same data): in how many of the "
            "restarts that all compared models finished it holds.", "",
            "| task | claim | ours | compared (mean ± std) | restarts | "
            "grid |",
            "|---|---|---|---|---|---|"]
  for task in TASKS:
    for text, kind, models, which in CLAIMS[task]:
      verdict = claim_verdict(cells, task, kind, models, which)
      word = {True: "agrees", False: "**disagrees**",
              None: "not decidable yet (cells missing)"}[verdict]
      paired = paired_agreement(cells, task, kind, models, which)
      lines.append(f"| {TASK_TITLES[task]} | {text} | {word} | "
                   f"{_evidence(cells, task, models, which)} | "
                   + ("—" if paired is None
                      else f"{paired[0]} of {paired[1]}")
                   + f" | {_grid_column(cells, task, models)} |")
  lines += ["", "## Figures", "",
            "Lines and shaded bands: our selected restarts, mean ± std "
            "(Figure 3 pads a finished restart with its last value, as the "
            "paper does). Dashed: the paper's means, from the figure data "
            "in its LaTeX source (`results/" + PAPER_FIGURES_FILE + "`, "
            "written by `python -m nsrnn_jax.paper_figures`); the source "
            "has no Figure 3 panel for unmarked or padded reversal.", ""]
  for task in TASKS:
    if not any(cells[(task, m)].runs for m in REPORT_ORDER):
      continue
    lines.append(f"### {TASK_TITLES[task]}")
    lines.append("")
    lines.append(f"![{TASK_TITLES[task]}, Figure 3]({figures_rel}/{task}/"
                 "figure3.png)")
    if any(cells[(task, m)].test_bin_stats() for m in REPORT_ORDER):
      lines.append(f"![{TASK_TITLES[task]}, Figure 4]({figures_rel}/{task}/"
                   "figure4.png)")
    lines.append("")
  lines += _grid_section(cells, selection)
  lines += _gaps_section(cells, paper_runs)
  return "\n".join(lines) + "\n"


def _grid_section(cells, selection: str) -> list[str]:
  """Every grid point that has finished runs: what the selection chose from."""
  lines = [
      "## Every grid point",
      "",
      "Best-epoch validation CE difference, mean ± std (ddof=0) over each "
      "setting's finished restarts, with the best single run: the numbers "
      "the selection compares. "
      + ("*Selected*: the setting of the tables above; *fewer restarts*: "
         "left out of the selection until it has as many finished restarts "
         "as the most complete setting of its model."
         if selection == "mean" else
         "*Selected*: the setting of the single best run (`best_run`)."),
      "",
      "| task | model | setting | restarts | best-epoch validation | best run "
      "| |",
      "|---|---|---|---|---|---|---|",
  ]
  for task, model, cell in _in_report_order(cells):
    if not cell.settings:
      continue
    most = max(len(s.records) for s in cell.settings)
    chosen = (cell.selected.name.split("/")[0] if cell.selected else None)
    for setting in cell.settings:
      note = ""
      if setting.name == chosen:
        note = "selected"
      elif selection == "mean" and len(setting.records) < most:
        note = "fewer restarts"
      best = int(np.argmin(setting.best_valid))
      lines.append(
          f"| {TASK_TITLES[task]} | {LABELS[model]} | {setting.name} | "
          f"{len(setting.records)} | {_pm(setting.rank())} | "
          f"{_f(float(setting.best_valid[best]))} (restart "
          f"{setting.records[best]['restart']}) | {note} |")
  return lines + [""]


def _gaps_section(cells, records) -> list[str]:
  """What of the full protocol has not run, with its measured cost."""
  lines = [
      "## What has not run yet, and what it would take",
      "",
      "The full protocol is, per task, 20 LSTM + 60 JM + 60 Gref + 20 NS-RNN "
      "runs (4 learning rates × 5 restarts, × 3 values of m for JM/Gref). "
      "Cost estimates use the mean training time of our finished runs of the "
      "same task and model (else the same model on any task), on the "
      "hardware the records name; a run's time is its median epoch time × "
      "its epochs (robust to pauses of the machine, compilation left out).",
      "",
      "| task | model | finished | of | missing | estimated time for the "
      "rest |",
      "|---|---|---|---|---|---|",
  ]
  all_done = all_total = 0
  all_seconds = 0.0
  unknown = 0  # Missing runs of models with no finished run to time.
  for task, model, cell in _in_report_order(cells):
    done = sum(len(s.records) for s in cell.settings)
    total = _grid_size(model)
    missing = max(total - done, 0)
    all_done, all_total = all_done + min(done, total), all_total + total
    probe = RunSpec(task, model, 0.005, None, 0)
    est = estimate_seconds(probe, records)
    if missing == 0:
      rest = "—"
    elif est is None:
      rest = "unknown (no run of this model yet)"
      unknown += missing
    else:
      rest = _hours(est * missing)
      all_seconds += est * missing
    lines.append(f"| {TASK_TITLES[task]} | {LABELS[model]} | {done} | "
                 f"{total} | {total - done} | {rest} |")
  rest = _hours(all_seconds)
  if unknown:
    rest += f" + {unknown} runs of unknown cost"
  lines += [f"| **All** | | {all_done} | {all_total} | {all_total - all_done} "
            f"| {rest} |",
            "",
            "Times are of one run at a time. `python -m nsrnn_jax.reproduce "
            "--task=all --workdir=<dir>` runs all of what is missing, restart "
            "0 of every task first, and continues where it stopped; on a CPU "
            "with N cores add `--workers=N` (N runs at once)."]
  return lines


def write_report(results_dir: str = DEFAULT_RESULTS,
                 report_path: str = DEFAULT_REPORT,
                 selection: str = "mean") -> list[str]:
  """Writes the report and the figures next to it; returns the paths.

  A `results_dir` that is not a directory, or holds no run record, or a
  `report_path` that is empty or a directory, raises ReproduceError
  before anything is written (a mistyped path must not
  replace the report with an empty one and delete its figures).
  """
  if not os.path.isdir(results_dir):
    raise ReproduceError(f"--results: {results_dir} is not a directory of "
                         "run records")
  if not report_path or os.path.isdir(report_path):
    raise ReproduceError(f"--report_path {report_path!r} is not a file name "
                         "(e.g. docs/reproduction.md)")
  records = load_records(results_dir)
  try:
    paper = paper_figures.load(os.path.join(results_dir, PAPER_FIGURES_FILE))
  except paper_figures.PaperFiguresError as e:
    raise ReproduceError(str(e)) from e
  if not records:
    raise ReproduceError(f"--results: {results_dir} holds no run record "
                         "(restart_<r>.json); nothing written")
  figures_dir = os.path.join(os.path.dirname(report_path), "figures")
  cells = summarize_cells(records, selection=selection)
  files = []
  for task in TASKS:
    files += draw_figures(cells, task, os.path.join(figures_dir, task),
                          paper)
  text = render_report(records, selection=selection, paper_data=paper)
  os.makedirs(os.path.dirname(report_path) or ".", exist_ok=True)
  with open(report_path, "w") as f:
    f.write(text)
  return [report_path] + files


def uncommitted_records(results_dir: str = DEFAULT_RESULTS) -> list[str]:
  """Report inputs under `results_dir` that git does not track (sorted paths).

  The run records and the paper's figure data (`PAPER_FIGURES_FILE`): any
  JSON file there that is new or modified.

  The committed report must be generated from committed records only (a test
  regenerates it from a clean clone), so `--report` names any record it read
  that is not committed yet. Empty when `results_dir` is not in a git work
  tree or git is unavailable.
  """
  if not os.path.isdir(results_dir):
    return []
  try:
    out = subprocess.run(
        ["git", "ls-files", "--others", "--modified", "--exclude-standard",
         "--", "."], cwd=results_dir, capture_output=True, text=True,
        timeout=60, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return []
  # A deleted record is "modified" to git but was not read: leave it out.
  paths = {os.path.join(results_dir, line) for line in out.splitlines()
           if line.endswith(".json")}
  return sorted(p for p in paths if os.path.isfile(p))
