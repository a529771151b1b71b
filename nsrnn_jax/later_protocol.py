"""The later papers' protocols: many runs per (task, model), the best reported.

DuSell & Chiang (ICLR 2023), rns-vrns-reference.md §4.3: for each (task,
model), 10 runs, each with a learning rate drawn log-uniformly from
[5e-4, 1e-2] and its own data, parameter and shuffle seeds; the run with
the lowest best-epoch validation CE difference is reported (its test CE
difference per length), and the capacity plots add the mean ± std of the
best-epoch validation CE difference over the runs. Tasks and models are
those of `configs/later.py` (`<task>,<model>`, e.g. `marked_copy,rns-3-3`).

  python -m nsrnn_jax.later_protocol --task=marked_copy \\
      --models=lstm,jm-10,rns-3-3 --workdir=runs/later
  python -m nsrnn_jax.later_protocol --task=paper --models=paper \\
      --workdir=runs/later
  python -m nsrnn_jax.later_protocol --workdir=runs/later --report

`--task=paper` is every task of the paper's study (the seven non-context-
free tasks and the capacity tasks at K = 2, 40, ..., 200); `--models=paper`
is, per task, the models the paper runs on it (`configs/later.py`
NON_CF_MODELS or CAPACITY_MODELS).

`--protocol=iclr2022` runs DuSell & Chiang (ICLR 2022)'s context-free study
instead (§4.2): the learning-rate grid 0.01, 0.005, 0.001, 0.0005 with 5
runs at each (run k at rate k mod 4 of the grid, so every rate is run
before any is repeated; 20 runs per (task, model) by default), the single
best run by validation CE difference reported. Its `--task=paper` is the
five CoNLL 2020 tasks and its `--models=paper` their models: LSTM, JM and
Gref with m in 2, 20, 40, and the NS-RNN variants ns, ns+s, ns+u, ns+s+u
at (Q, S) = (2, 3) or (3, 3) (`configs/later.py` iclr2022_models):

  python -m nsrnn_jax.later_protocol --protocol=iclr2022 --task=dyck \\
      --models=paper --workdir=runs/iclr2022

A workdir holds one protocol's runs (`protocol.json`); another protocol
there is refused.

Resumable: rerunning the same command skips finished runs and resumes an
interrupted one from its last checkpoint (`train.train_and_evaluate`). Run
k of every model uses the same learning rate and seeds (BASE_SEED + k): the
draws are a function of (--seed, k) only, so a later invocation with more
--runs keeps the first runs' rates. The authors drew every run afresh; the
pairing changes no distribution, only makes models' runs comparable one to
one. Run k's record is `<workdir>/records/<task>/<model>/restart_<k>.json`
(the format of results/README.md, with "setting" run_<k> and "protocol"
"iclr2023" or "iclr2022"); the summary table is printed and saved as
`<workdir>/summary.json`, and the capacity tasks' results are drawn as the
paper's capacity figure, `<workdir>/capacity.png`. Both papers plot, per
task, each model's best run: its validation CE difference per epoch and
its test CE difference by length, here `<workdir>/best_runs/<task>.png`
(the curves also in `<task>.json`).
"""

import json
import math
import os
import sys
import types
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from nsrnn_jax import cli
from nsrnn_jax import reproduce
from nsrnn_jax import run_records
from nsrnn_jax import workdir_lock

# rns-vrns-reference.md §4.3.
LEARNING_RATE_RANGE = (5e-4, 1e-2)
NUM_RUNS = 10
PROTOCOL = "iclr2023"
# rns-vrns-reference.md §4.2: the grid, 5 runs at each rate.
ICLR2022 = "iclr2022"
ICLR2022_LEARNING_RATES = (0.01, 0.005, 0.001, 0.0005)
ICLR2022_NUM_RUNS = 5 * len(ICLR2022_LEARNING_RATES)
PROTOCOLS = (PROTOCOL, ICLR2022)
PROTOCOL_FILE = "protocol.json"
# --task / --models value: the paper's tasks, each task's paper models.
PAPER = "paper"
RECORDS_DIR = "records"
SUMMARY_FILE = "summary.json"
CAPACITY_PLOT = "capacity.png"
BEST_RUNS_DIR = "best_runs"

__all__ = ["LEARNING_RATE_RANGE", "NUM_RUNS", "ICLR2022_LEARNING_RATES",
           "ICLR2022_NUM_RUNS", "PROTOCOLS", "learning_rates",
           "grid_learning_rates", "run_config", "run", "summarize",
           "render_table", "best_run_curves", "plot_best_runs",
           "save_best_run_plots", "main"]


def learning_rates(num_runs: int, seed: int = 0) -> list[float]:
  """Log-uniform draws from LEARNING_RATE_RANGE; run k's is entry k.

  One generator stream per seed, so the first k draws do not depend on
  `num_runs`.
  """
  _check_num_runs(num_runs)
  lo, hi = (math.log(x) for x in LEARNING_RATE_RANGE)
  draws = np.random.default_rng(seed).uniform(lo, hi, size=num_runs)
  return [float(math.exp(x)) for x in draws]


def grid_learning_rates(num_runs: int) -> list[float]:
  """ICLR 2022's rates for runs 0..num_runs-1: run k at grid rate k mod 4."""
  _check_num_runs(num_runs)
  grid = ICLR2022_LEARNING_RATES
  return [grid[k % len(grid)] for k in range(num_runs)]


def _check_num_runs(num_runs) -> None:
  if isinstance(num_runs, bool) or not isinstance(num_runs, int) or (
      num_runs < 1):
    raise run_records.ReproduceError(f"--runs must be a positive integer, got "
                                   f"{num_runs!r}")


def _check_protocol(protocol: str) -> None:
  if protocol not in PROTOCOLS:
    raise run_records.ReproduceError(
        f"--protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")


def _workdir_protocol(workdir: str) -> Optional[str]:
  """The protocol of the runs already in `workdir`, or None if it has none.

  From `protocol.json`; workdirs made before it existed name theirs in
  summary.json.
  """
  for name in (PROTOCOL_FILE, SUMMARY_FILE):
    path = os.path.join(workdir, name)
    if os.path.isfile(path):
      try:
        with open(path) as f:
          return json.load(f)["protocol"]
      except (OSError, ValueError, KeyError, TypeError):
        raise run_records.ReproduceError(
            f"{path} is unreadable; it names the protocol of the workdir's "
            "runs") from None
  return None


def _later_module():
  """configs/later.py, loaded afresh (edits to it are seen by the next call)."""
  return reproduce.load_module(
      os.path.join(run_records.REPO_ROOT, "configs", "later.py"))


def _later_config(task: str, model: str, module=None):
  module = module or _later_module()
  try:
    return reproduce.call_with_repo_on_path(module.get_config,
                                            f"{task},{model}")
  except ValueError as e:
    raise run_records.ReproduceError(str(e)) from None


def models_for(task: str, models: Sequence[str], module=None,
               protocol: str = PROTOCOL) -> tuple[str, ...]:
  """`models`, or the paper's models for `task` where they are ['paper'].

  `module`: configs/later.py as loaded by `_later_module` (loaded here if
  None; `run` loads it once for its whole plan). `protocol`: whose paper
  (iclr2023: `paper_models`, iclr2022: `iclr2022_models`).
  """
  if list(models) != [PAPER]:
    if PAPER in models:
      raise run_records.ReproduceError("--models=paper stands alone (the "
                                     "paper's models of each task)")
    return tuple(models)
  try:
    module = module or _later_module()
    return tuple(reproduce.call_with_repo_on_path(
        module.iclr2022_models if protocol == ICLR2022
        else module.paper_models, task))
  except ValueError as e:
    raise run_records.ReproduceError(f"--models=paper: {e}") from None


def run_config(task: str, model: str, run_index: int, learning_rate: float,
               overrides: Mapping[str, Any] = (), module=None):
  """configs/later.py:<task>,<model> for run k, validated.

  `module`: as for `models_for`.
  """
  from nsrnn_jax import train  # pylint: disable=g-import-not-at-top
  config = _later_config(task, model, module)
  with config.unlocked():
    config.learning_rate = float(learning_rate)
    seed = run_records.BASE_SEED + run_index
    config.data_seed = config.param_seed = config.shuffle_seed = seed
    config.progress_bar = False
    for field, value in dict(overrides).items():
      run_records.set_field(config, "--set", field, value)
  try:
    train.validate_config(config)
  except ValueError as e:
    raise run_records.ReproduceError(str(e)) from None
  return config


def _spec(task, model, k, lr):
  # The fields run_records.make_record reads.
  return types.SimpleNamespace(task=task, model=model, setting=f"run_{k}",
                               learning_rate=lr, stack_size=None, restart=k)


def _parse_list(value, what) -> list[str]:
  if isinstance(value, str):
    from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
    return cli.comma_list(value, what)
  items = list(value)
  if not items:
    raise run_records.ReproduceError(f"{what} is empty")
  if len(set(items)) != len(items):
    raise run_records.ReproduceError(f"{what} repeats an entry: {value!r}")
  return items


def _plan(tasks, models, workdir, num_runs, seed, protocol):
  """(plan [(k, task, model)], learning rate of run k, configs/later.py):
  the runs `run` trains, run-major, checked against the workdir's
  protocol."""
  _check_protocol(protocol)
  if protocol == ICLR2022 and seed is not None:
    raise run_records.ReproduceError(
        "--seed draws the iclr2023 learning rates; iclr2022 runs the grid "
        f"{', '.join(map(str, ICLR2022_LEARNING_RATES))} (no draws)")
  # configs/later.py is loaded once for the whole plan (1610 configs for
  # --task=paper --models=paper).
  module = _later_module()
  tasks = _parse_list(tasks, "--task")
  if tasks == [PAPER] and protocol == ICLR2022:
    tasks = list(module.ICLR2022_TASKS)
  elif tasks == [PAPER]:
    from nsrnn_jax import tasks_ncf  # pylint: disable=g-import-not-at-top
    tasks = list(tasks_ncf.TASKS)
  elif PAPER in tasks:
    raise run_records.ReproduceError("--task=paper stands alone (every task "
                                   "of the paper)")
  models = _parse_list(models, "--models")
  if num_runs is None:
    num_runs = ICLR2022_NUM_RUNS if protocol == ICLR2022 else NUM_RUNS
  rates = (grid_learning_rates(num_runs) if protocol == ICLR2022
           else learning_rates(num_runs, seed or 0))
  held = _workdir_protocol(workdir)
  if held is not None and held != protocol:
    raise run_records.ReproduceError(
        f"{workdir} holds {held} runs; run --protocol={protocol} in another "
        "--workdir")
  plan = [(k, t, m) for k in range(num_runs) for t in tasks
          for m in models_for(t, models, module, protocol)]
  return plan, rates, module


def _run_dir(workdir, t, m, k):
  return os.path.join(workdir, t, m, f"run_{k}")


def _record_path(workdir, t, m, k):
  return os.path.join(workdir, RECORDS_DIR, t, m, f"restart_{k}.json")


def status(tasks, models, workdir: str, num_runs: Optional[int] = None,
           seed: Optional[int] = None, protocol: str = PROTOCOL) -> str:
  """Where `run`'s plan stands, as text; reads only (no JAX, no claim).

  Per (task, model): runs with a record, started (epochs logged, or a live
  process training it now; no record yet) and not started; the started
  runs' epochs and the process training each now (`workdir_lock.holder`);
  and the time left, run after run, from the records of finished runs like
  them (`run_records.estimate_seconds`).
  """
  plan, rates, module = _plan(tasks, models, workdir, num_runs, seed,
                              protocol)
  # The names as `run` checks them (configs/later.py; no JAX): a status of
  # runs that could never start would only mislead.
  for t, m in dict.fromkeys((t, m) for _, t, m in plan):
    _later_config(t, m, module)
  records = run_records.load_records(os.path.join(workdir, RECORDS_DIR))
  done = {p for p in plan if os.path.isfile(_record_path(workdir, *p[1:],
                                                         p[0]))}
  epochs = {p: reproduce.epochs_logged(_run_dir(workdir, p[1], p[2], p[0]))
            for p in plan if p not in done}
  # The live process training each run now (another run of this command
  # on the workdir; its first epoch too).
  holders = {p: workdir_lock.holder(_run_dir(workdir, p[1], p[2], p[0]))
             for p in epochs}
  holders = {p: h for p, h in holders.items() if h}
  started = [p for p, e in epochs.items() if e > 0 or p in holders]
  lines = [f"later_protocol ({protocol}): {len(plan)} runs, {len(done)} with "
           f"a record, {len(started)} started, "
           f"{len(plan) - len(done) - len(started)} not started", ""]
  lines += reproduce.status_lines(
      [(t, m, f"{t}/{m}/run_{k}",
        "record" if (k, t, m) in done else
        "started" if (k, t, m) in started else "not started",
        epochs.get((k, t, m), 0)) for k, t, m in plan],
      {f"{t}/{m}/run_{k}": h for (k, t, m), h in holders.items()})
  left = 0.0
  for k, t, m in (p for p in plan if p not in done):
    est = run_records.estimate_seconds(_spec(t, m, k, rates[k]), records,
                                       epochs[(k, t, m)])
    left = None if left is None or est is None else left + est
  lines.append("estimated time left, one run after another: " + (
      "unknown (no finished run like them yet)" if left is None
      else reproduce.format_duration(left)))
  return "\n".join(lines)


def run(tasks, models, workdir: str, num_runs: Optional[int] = None,
        seed: Optional[int] = None, overrides: Mapping[str, Any] = (),
        out=None, protocol: str = PROTOCOL) -> list[dict[str, Any]]:
  """Trains every missing run (run-major: run 0 of every model first).

  `num_runs` per (task, model) defaults to the protocol's (NUM_RUNS,
  ICLR2022_NUM_RUNS); `seed` (default 0) seeds the iclr2023 rate draws
  and is refused with iclr2022, whose rates are the grid's. Progress goes
  to `out` (default: sys.stdout at the time of the call). Returns the
  summary rows of `summarize` over the workdir's records.
  """
  from nsrnn_jax import checkpointing  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import train  # pylint: disable=g-import-not-at-top
  out = out or sys.stdout
  checkpointing.check_writable(workdir, "--workdir")
  plan, rates, module = _plan(tasks, models, workdir, num_runs, seed,
                              protocol)
  # Every config is built (and checked) before the first run starts.
  configs = {(k, t, m): run_config(t, m, k, rates[k], overrides, module)
             for k, t, m in plan}
  run_records.write_json_atomic(os.path.join(workdir, PROTOCOL_FILE),
                              {"protocol": protocol})
  records_dir = os.path.join(workdir, RECORDS_DIR)
  maker = run_records.made_by()
  for i, (k, t, m) in enumerate(plan, start=1):
    run_dir = _run_dir(workdir, t, m, k)
    record_path = _record_path(workdir, t, m, k)
    name = f"{t}/{m}/run_{k} (lr {rates[k]:.6g})"
    if not os.path.isfile(record_path):
      # Held by another live process (another run of this command on the
      # same workdir): left to it.
      def train_run(i=i, name=name, config=configs[(k, t, m)],
                    run_dir=run_dir):
        print(f"[{i}/{len(plan)}] {name}", file=out, flush=True)
        return train.train_and_evaluate(config, run_dir)

      other, results = workdir_lock.run_claimed(run_dir, train_run)
      if other is not None:
        print(f"[{i}/{len(plan)}] {name}: left to process {other['pid']} "
              f"on {other['host']}, which trains it", file=out, flush=True)
        continue
      if not results.get("finished"):
        print(f"stopped in {name}; rerun the command to continue", file=out)
        break
      record = run_records.make_record(_spec(t, m, k, rates[k]), run_dir,
                                     overrides, maker)
      record["protocol"] = protocol if not overrides else "custom"
      run_records.write_json_atomic(record_path, record)
  rows = summarize(run_records.load_records(records_dir))
  run_records.write_json_atomic(os.path.join(workdir, SUMMARY_FILE),
                              {"protocol": protocol, "rows": rows})
  return rows


def capacity_series(rows: Sequence[Mapping[str, Any]]
                    ) -> dict[str, list[dict[str, Any]]]:
  """The capacity study's curves from `summarize` rows.

  Returns {family: [per model {"label", "sizes" (alphabet sizes K,
  increasing), "best" (the best run's best-epoch validation CE
  difference), "mean", "std" (over the runs)}]} for the rows of capacity
  tasks (`<family>_k<K>`), families and models in the order first seen
  after sorting by family; other rows are left out.
  """
  from nsrnn_jax import tasks_ncf  # pylint: disable=g-import-not-at-top
  points: dict = {}
  for r in rows:
    family, _, size = r["task"].rpartition("_k")
    if family in tasks_ncf.CAPACITY_FAMILIES and size.isdigit():
      points.setdefault(family, {}).setdefault(r["model"], []).append(
          (int(size), r["best_valid_ce_diff"], r["mean_best_valid_ce_diff"],
           r["std_best_valid_ce_diff"]))
  out = {}
  for family in sorted(points):
    out[family] = []
    for model, pts in points[family].items():
      sizes, best, mean, std = zip(*sorted(pts))
      out[family].append({"label": model, "sizes": list(sizes),
                          "best": list(best), "mean": list(mean),
                          "std": list(std)})
  return out


def plot_capacity(rows: Sequence[Mapping[str, Any]]):
  """The capacity figure: CE difference against the alphabet size K.

  One panel per task family; per model its best run's best-epoch
  validation CE difference (line with markers) and the mean ± std over
  its runs (band), as the paper draws them. None if no row is a capacity
  task. A `matplotlib.figure.Figure` (no pyplot state).
  """
  import matplotlib.figure  # pylint: disable=g-import-not-at-top
  series = capacity_series(rows)
  if not series:
    return None
  # One colour per model across the panels (families may have different
  # models, e.g. while results come in), and one legend for all of them.
  colors = {}
  for curves in series.values():
    for c in curves:
      colors.setdefault(c["label"], f"C{len(colors) % 10}")
  fig = matplotlib.figure.Figure(figsize=(4.2 * len(series), 4.2),
                                 layout="constrained")
  axes = fig.subplots(1, len(series), squeeze=False)[0]
  handles = {}
  for ax, (family, curves) in zip(axes, series.items()):
    for c in curves:
      color = colors[c["label"]]
      mean, std = np.asarray(c["mean"]), np.asarray(c["std"])
      ax.fill_between(c["sizes"], mean - std, mean + std, color=color,
                      alpha=0.2, linewidth=0)
      (handles[c["label"]],) = ax.plot(c["sizes"], c["best"], color=color,
                                       marker="o", markersize=3,
                                       label=c["label"])
    ax.set_title(family.replace("_", " "))
    ax.set_xlabel("Alphabet size K")
    ax.grid(True, alpha=0.3)
  axes[0].set_ylabel("Validation cross-entropy diff.")
  fig.legend([handles[m] for m in colors], list(colors),
             loc="outside lower center", ncol=min(len(colors), 4),
             fontsize="small", frameon=False)
  return fig


def save_capacity_plot(rows: Sequence[Mapping[str, Any]], workdir: str
                       ) -> Optional[str]:
  """Writes `<workdir>/capacity.png` if there are capacity rows; its path."""
  fig = plot_capacity(rows)
  if fig is None:
    return None
  path = os.path.join(workdir, CAPACITY_PLOT)
  fig.savefig(path, dpi=120)
  return path


def _best(recs: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
  """The run with the lowest best-epoch validation CE difference (ties: the
  lower run index)."""
  recs = sorted(recs, key=lambda r: r["restart"])
  return recs[int(np.argmin([r["best_valid_ce_diff"] for r in recs]))]


def _groups(records: Sequence[Mapping[str, Any]]) -> dict:
  """Finished records by (task, model), sorted."""
  groups: dict = {}
  for rec in records:
    if rec.get("best_valid_ce_diff") is None:
      continue
    groups.setdefault((rec["task"], rec["model"]), []).append(rec)
  return dict(sorted(groups.items()))


def best_run_curves(records: Sequence[Mapping[str, Any]]
                    ) -> dict[str, list[dict[str, Any]]]:
  """Per task, each model's best run's curves (what both papers plot).

  Returns {task: [per model, in name order, {"model", "run",
  "learning_rate", "epochs", "valid_ce_diff" (per epoch, the validation
  CE difference), "lengths", "test_ce_diff" (per test length; None where
  a length has no value)}]}; a run without a test has empty test lists.
  """
  out: dict = {}
  for (task, model), recs in _groups(records).items():
    best = _best(recs)
    epochs = best.get("epochs") or []
    test = best.get("test") or {}
    out.setdefault(task, []).append({
        "model": model, "run": best["restart"],
        "learning_rate": best["learning_rate"],
        "epochs": [int(e["epoch"]) for e in epochs],
        "valid_ce_diff": [e.get("valid_ce_diff") for e in epochs],
        "lengths": list(test.get("lengths", [])),
        "test_ce_diff": list(test.get("ce_diff", [])),
    })
  return out


def plot_best_runs(task: str, curves: Sequence[Mapping[str, Any]]):
  """One task's figure: each model's best run, validation CE difference per
  epoch (left) and test CE difference by length (right). A
  `matplotlib.figure.Figure` (no pyplot state)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  import matplotlib.figure  # pylint: disable=g-import-not-at-top
  fig = matplotlib.figure.Figure(figsize=(9.0, 4.0), layout="constrained")
  left, right = fig.subplots(1, 2)
  # 20 distinct colours: the ICLR 2022 study has 11 models per task.
  cmap = matplotlib.colormaps["tab20"]
  nan = lambda v: np.asarray([np.nan if x is None else x for x in v], float)
  for i, c in enumerate(curves):
    color = cmap(i % 20)
    label = f"{c['model']} (run {c['run']}, lr {c['learning_rate']:.3g})"
    left.plot(c["epochs"], nan(c["valid_ce_diff"]), color=color,
              linewidth=1.2, label=label)
    if c["lengths"]:
      right.plot(c["lengths"], nan(c["test_ce_diff"]), color=color,
                 linewidth=1.2)
  left.set_title(f"{task.replace('_', ' ')}: validation")
  left.set_xlabel("Epoch")
  right.set_title("test (best epoch's parameters)")
  right.set_xlabel("Length")
  for ax in (left, right):
    ax.set_ylabel("Cross-entropy diff. (nats/symbol)")
    ax.grid(True, alpha=0.3)
  fig.legend(loc="outside lower center", ncol=3, fontsize="x-small",
             frameon=False)
  return fig


def save_best_run_plots(records: Sequence[Mapping[str, Any]], workdir: str
                        ) -> Optional[str]:
  """Writes `<workdir>/best_runs/<task>.{png,json}` for every task with
  records; returns the directory (None if there are none)."""
  curves = best_run_curves(records)
  if not curves:
    return None
  out_dir = os.path.join(workdir, BEST_RUNS_DIR)
  os.makedirs(out_dir, exist_ok=True)
  for task, task_curves in curves.items():
    run_records.write_json_atomic(os.path.join(out_dir, f"{task}.json"),
                                {"task": task, "models": task_curves})
    plot_best_runs(task, task_curves).savefig(
        os.path.join(out_dir, f"{task}.png"), dpi=120)
  return out_dir


def _bins(record) -> Optional[list[Optional[float]]]:
  """Mean test CE difference over the training lengths and the longer ones
  (the paper: 40-80 and 81-100)."""
  test = record.get("test")
  if not test:
    return None
  longest = record["config"]["train_max_length"]
  out = []
  for inside in (True, False):
    values = [d for n, d in zip(test["lengths"], test["ce_diff"])
              if (n <= longest) == inside and d is not None]
    out.append(float(np.mean(values)) if values else None)
  return out


def summarize(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """Per (task, model): the best run and the spread over runs.

  Each row: task, model, runs (finished), best_run, best_learning_rate,
  best_valid_ce_diff (the best run's), mean_best_valid_ce_diff and
  std_best_valid_ce_diff (ddof=0, over the runs) and the best run's test
  CE difference averaged over the training lengths and over the longer
  ones (`test_ce_diff_bins`; the paper's 40-80 and 81-100). Ties go to the
  lower run index.
  """
  rows = []
  for (task, model), recs in _groups(records).items():
    values = np.asarray([r["best_valid_ce_diff"] for r in recs], float)
    best = _best(recs)
    rows.append({
        "task": task, "model": model, "runs": len(recs),
        "best_run": best["restart"],
        "best_learning_rate": best["learning_rate"],
        "best_valid_ce_diff": best["best_valid_ce_diff"],
        "mean_best_valid_ce_diff": float(values.mean()),
        "std_best_valid_ce_diff": float(values.std()),
        "test_ce_diff_bins": _bins(best),
    })
  return rows


def render_table(rows: Sequence[Mapping[str, Any]]) -> str:
  """The summary as a Markdown table."""
  f = lambda x: "—" if x is None else f"{x:.4f}"
  lines = ["| task | model | runs | best run (lr) | best valid CE diff | "
           "mean ± std over runs | best run's test: training lengths / longer |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    bins = r["test_ce_diff_bins"] or [None, None]
    lines.append(
        f"| {r['task']} | {r['model']} | {r['runs']} | {r['best_run']} "
        f"({r['best_learning_rate']:.3g}) | {f(r['best_valid_ce_diff'])} | "
        f"{f(r['mean_best_valid_ce_diff'])} ± "
        f"{f(r['std_best_valid_ce_diff'])} | {f(bins[0])} / {f(bins[1])} |")
  return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """CLI; returns the exit code (2 with one line on bad input)."""
  parser = cli.OneLineArgumentParser(
      prog="python -m nsrnn_jax.later_protocol",
      description=__doc__.split("\n")[0],
      error_type=run_records.ReproduceError)
  parser.add_argument("--task", help="comma-separated configs/later.py "
                      "tasks, or 'paper' (all of the paper's)")
  parser.add_argument("--models", help="comma-separated configs/later.py "
                      "models, e.g. lstm,jm-10,rns-3-3,vrns-2-1-3, or "
                      "'paper' (each task's models in the paper)")
  parser.add_argument("--workdir", required=True,
                      help="run directories, checkpoints and records")
  parser.add_argument("--protocol", default=PROTOCOL,
                      help=f"one of {', '.join(PROTOCOLS)}: random learning "
                      "rates (ICLR 2023) or the grid (ICLR 2022)")
  parser.add_argument("--runs", type=int, default=None,
                      help="runs per (task, model), each with its own "
                      f"learning rate and seeds (default {NUM_RUNS}; "
                      f"iclr2022: {ICLR2022_NUM_RUNS})")
  parser.add_argument("--seed", type=int, default=None,
                      help="seed of the learning-rate draws (iclr2023; "
                      "default 0)")
  parser.add_argument("--set", action="append", default=[],
                      metavar="FIELD=VALUE",
                      help="config override for every run (records say so)")
  parser.add_argument("--report", action="store_true",
                      help="print the summary of the workdir's records and "
                      "exit")
  parser.add_argument("--status", action="store_true",
                      help="print where the plan of --task/--models stands "
                      "(records, runs started and their epochs, time left) "
                      "and exit; runs nothing, so it can run beside it")
  try:
    args = parser.parse_args(argv)
    if not args.workdir:
      raise run_records.ReproduceError("--workdir is an empty path")
    if os.path.exists(args.workdir) and not os.path.isdir(args.workdir):
      raise run_records.ReproduceError(
          f"--workdir {args.workdir} is a file, not a directory of runs")
    if args.seed is not None and args.seed < 0:
      raise run_records.ReproduceError(
          f"--seed must be an integer >= 0, got {args.seed}")
    records_dir = os.path.join(args.workdir, RECORDS_DIR)
    if args.status:
      if not args.task or not args.models:
        raise run_records.ReproduceError("--status needs --task and --models")
      print(status(args.task, args.models, args.workdir, args.runs,
                   args.seed, protocol=args.protocol))
      return 0
    if args.report:
      if not os.path.isdir(args.workdir):
        raise run_records.ReproduceError(
            f"--workdir {args.workdir} is not a directory of runs")
      records = run_records.load_records(records_dir)
      rows = summarize(records)
    else:
      if not args.task or not args.models:
        raise run_records.ReproduceError("--task and --models are required "
                                       "(or --report)")
      rows = run(args.task, args.models, args.workdir, args.runs, args.seed,
                 reproduce.parse_overrides(args.set),
                 protocol=args.protocol)
      records = run_records.load_records(records_dir)
  except (ValueError, OSError) as e:  # ReproduceError is a ValueError.
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  print(render_table(rows))
  plot = save_capacity_plot(rows, args.workdir)
  if plot:
    print(f"capacity plot: {plot}")
  figures = save_best_run_plots(records, args.workdir)
  if figures:
    print(f"best runs' curves per task: {figures}")
  return 0


if __name__ == "__main__":
  cli.run_argparse_command(main)
