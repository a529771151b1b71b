"""Reproduce the paper: the whole protocol, resumable, with records.

One command runs the paper's grid for one task, several, or all five
(DuSell & Chiang 2020, section 5.5; reference-behaviour.md section 9) and
writes one small JSON record per finished run, which is what gets committed;
a second command regenerates the report (`docs/reproduction.md` and the
Figure 3/4 images) from the records alone:

  python -m nsrnn_jax.reproduce --task=dyck --workdir=runs/dyck \
      [--models=lstm,jm,gref,ns] [--learning_rates=0.005] [--restarts=3] \
      [--budget_minutes=60] [--cpu_devices=2] [--restart_ids=1,2] \
      [--workers=2]
  python -m nsrnn_jax.reproduce --task=all --workdir=runs/paper --workers=2
  python -m nsrnn_jax.reproduce --report

Several tasks (`--task=all` or a comma-separated list) are one grid,
restart-major across the tasks (restart 0 of every task first), each task in
`<workdir>/<task>`: the workdir a single-task command would use for it, so
the two continue each other's runs.

The protocol. LSTM and NS-RNN: every learning rate of the grid x restarts;
JM and Gref: learning rate x stack embedding size m x restarts; the NS-RNN
uses the paper's Q and S of the task (`NS_SHAPES`). Restart r (0-based) uses
data, parameter and shuffle seeds `1 + r`, so every restart has its own
training and validation data (as the authors' runs do) and the settings of
one restart are paired, exactly like `grid.members`. The test set is fixed
(seed 0).

Execution. On an accelerator the restarts and learning rates of one (model,
m) are trained at once on a model axis (`grid.run_grid`); on the CPU the runs
go one after another: on 2 cores, K vmapped train steps (n=60, B=10) gave
0.75x (JM, K=5), 0.76x (Gref), 0.20x (NS-RNN) and 0.31-0.53x at K=20 the
throughput of K sequential steps (only the LSTM gained, 2.3x at K=5, and its
runs take minutes anyway), while 20 NS-RNNs on an H200 gave 8.2x (README
"Benchmarks"). The choice is printed. `--cpu_devices=2` splits each batch
over two CPU devices (both cores of one run; NS-RNN steps 1.3-2.1x faster on
2 cores). `--workers=2` trains two runs at once, each in its own process on
one CPU device (`python -m nsrnn_jax.reproduce` for that run alone, same
workdir and results; its output in `<workdir>/worker_logs/`): on 2 cores,
NS-RNN runs of 5 epochs, 1.76x the runs per hour of one after another and
1.55x those of `--cpu_devices=2`, in one run
(`benchmarks/reproduce_workers.py`). On Linux each worker runs on its own
share of the cores (`--cpu_cores`; `--pin_workers=off` to not): two NS-RNN
or JM processes ran 1.3x the train steps pinned (Q=S=3: 0.96-1.15x;
`benchmarks/concurrent_steps.py`), 2 NS-RNN runs of 5 epochs 1.10x faster. Runs in one process clear JAX's caches
between them: each run's programs are its own, and kept they used up the
kernel's memory mappings by the third NS-RNN run.

Resuming. Every run checkpoints every epoch under `--workdir`; rerunning the
same command skips runs whose record exists, continues unfinished ones from
their last checkpoint and starts the rest, so a crash or kill loses at most
one epoch of one run (of one group on the model axis). `--budget_minutes`
stops at the first epoch boundary after the budget and prints the command
that continues. `--restart_ids` runs only some restarts, to split one
task's protocol over processes or machines (each with its own --workdir;
the records from all of them go into one results/).

Records (`--results`, default `results/` of the repository), one per
finished run: `results/<task>/<model>/<setting>/restart_<r>.json` where
setting is `lr_<lr>` or `m_<m>-lr_<lr>`; the format is documented in
`results/README.md` (RECORD_FORMAT below).

Selection (the authors' print_grid_search.py): per model, the setting with
the lowest mean best-epoch validation CE difference over its restarts (ties
by lower std); only settings with the most finished restarts of that model
compete, so a partly run grid never prefers a setting for having fewer runs.
Reported: the last epoch's validation CE difference, mean +- std (ddof=0)
over the selected restarts (the paper's Figure 3 end points), and the mean
test CE difference over lengths 40-80 and 81-100 (Figure 4).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
from typing import (Any, Callable, Iterable, Mapping, Optional, Sequence,
                    Union)

import numpy as np

from nsrnn_jax import paper_figures

RECORD_FORMAT = "nsrnn_jax.run_record.v1"
MANIFEST_FILE = "reproduce.json"
MODELS = ("lstm", "jm", "gref", "ns")
STACK_MODELS = ("jm", "gref")
TASKS = ("marked_reversal", "unmarked_reversal", "padded_reversal", "dyck",
         "hardest_cfl")
# The NS-RNN's (Q, S) per task (paper section 5.5).
NS_SHAPES = {"marked_reversal": (2, 2), "unmarked_reversal": (2, 2),
             "padded_reversal": (3, 2), "dyck": (2, 2), "hardest_cfl": (3, 3)}
LEARNING_RATES = (0.01, 0.005, 0.001, 0.0005)
STACK_SIZES = (2, 20, 40)
NUM_RESTARTS = 5
# Seeds of restart r are BASE_SEED + r (as grid.members with seed 1).
BASE_SEED = 1
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

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RESULTS = os.path.join(REPO_ROOT, "results")
DEFAULT_REPORT = os.path.join(REPO_ROOT, "docs", "reproduction.md")
# The paper's Figure 3/4 data under the results directory (paper_figures).
PAPER_FIGURES_FILE = os.path.basename(paper_figures.DEFAULT_PATH)


class ReproduceError(ValueError):
  """Bad input to the reproduction tool (reported as one line, exit 2)."""


# ---------------------------------------------------------------------------
# The protocol: which runs exist.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One run of the protocol.

  Attributes:
    task: languages task name.
    model: lstm, jm, gref or ns.
    learning_rate: initial Adam learning rate.
    stack_size: JM/Gref stack embedding size m (None for lstm/ns).
    restart: restart index r (0-based); seeds are BASE_SEED + r.
  """
  task: str
  model: str
  learning_rate: float
  stack_size: Optional[int]
  restart: int

  @property
  def group(self) -> str:
    """Path of the runs trained together on a model axis: model[/m_<m>]."""
    if self.stack_size is None:
      return self.model
    return f"{self.model}/m_{self.stack_size}"

  @property
  def setting(self) -> str:
    """Name of the grid point (restarts excluded)."""
    lr = f"lr_{self.learning_rate:g}"
    return lr if self.stack_size is None else f"m_{self.stack_size}-{lr}"

  @property
  def run_subdir(self) -> str:
    """Run directory under the workdir (grid.py's member layout)."""
    return os.path.join(self.group, f"lr_{self.learning_rate:g}",
                        f"restart_{self.restart}")

  @property
  def record_path(self) -> str:
    """Record path under the results directory."""
    return os.path.join(self.task, self.model, self.setting,
                        f"restart_{self.restart}.json")

  @property
  def name(self) -> str:
    return f"{self.model}/{self.setting}/restart_{self.restart}"


def plan(task: str, models: Sequence[str],
         learning_rates: Sequence[float] = LEARNING_RATES,
         stack_sizes: Sequence[int] = STACK_SIZES,
         restarts: int = NUM_RESTARTS,
         restart_ids: Optional[Sequence[int]] = None) -> list[RunSpec]:
  """All runs of the protocol, restart-major so early stops cover every cell.

  Within a restart the cheap models come first (in `MODELS` order), so a
  budgeted invocation finishes whole cells of restart 0 before spending
  hours on restart 1 of the NS-RNN. `restart_ids` (each < `restarts`)
  keeps only those restarts (None: all).
  """
  runs = []
  for r in range(restarts):
    if restart_ids is not None and r not in restart_ids:
      continue
    for model in MODELS:
      if model not in models:
        continue
      sizes = stack_sizes if model in STACK_MODELS else (None,)
      for m in sizes:
        for lr in learning_rates:
          runs.append(RunSpec(task, model, float(lr), m, r))
  return runs


def parse_tasks(value: Union[str, Sequence[str]]) -> list[str]:
  """Task names from "all", one name, a comma-separated list or a sequence.

  Raises ReproduceError naming an unknown or repeated task.
  """
  if isinstance(value, str):
    value = TASKS if value.strip() == "all" else [
        t.strip() for t in value.split(",") if t.strip()]
  tasks = list(value)
  if not tasks:
    raise ReproduceError(f"--task is empty; expected 'all' or some of "
                         f"{', '.join(TASKS)}")
  for t in tasks:
    if t not in TASKS:
      raise ReproduceError(f"--task: unknown task {t!r}; expected 'all' or "
                           f"some of {', '.join(TASKS)}")
  repeated = sorted({t for t in tasks if tasks.count(t) > 1})
  if repeated:
    raise ReproduceError(f"--task names {', '.join(repeated)} more than once")
  return tasks


def plan_tasks(tasks: Sequence[str], models: Sequence[str],
               learning_rates: Sequence[float] = LEARNING_RATES,
               stack_sizes: Sequence[int] = STACK_SIZES,
               restarts: int = NUM_RESTARTS,
               restart_ids: Optional[Sequence[int]] = None) -> list[RunSpec]:
  """`plan` of several tasks, restart-major across them.

  Restart 0 of every task comes before restart 1 of any, so a budgeted
  invocation of the whole paper covers every cell of every task first;
  within a restart, the tasks in the given order.
  """
  per_task = [plan(t, models, learning_rates, stack_sizes, restarts,
                   restart_ids) for t in tasks]
  return sorted((s for runs in per_task for s in runs),
                key=lambda s: s.restart)  # Stable: task, then plan order.


def load_module(path: str):
  """A configs/*.py file as a module, importable from any directory.

  Its functions import `configs.default` when called, so `get_config` is
  called through `call_with_repo_on_path`.
  """
  if not os.path.isfile(path):
    raise ReproduceError(f"config file {path} not found")
  with _repo_on_path():
    spec = importlib.util.spec_from_file_location(
        "_reproduce_" + os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  return module


class _repo_on_path:  # pylint: disable=invalid-name
  """Context: the repository root on sys.path (configs import `configs`)."""

  def __enter__(self):
    self.added = REPO_ROOT not in sys.path
    if self.added:
      sys.path.insert(0, REPO_ROOT)

  def __exit__(self, *exc):
    if self.added:
      sys.path.remove(REPO_ROOT)


def call_with_repo_on_path(fn, *args):
  """fn(*args) with the repository root on sys.path."""
  with _repo_on_path():
    return fn(*args)


def _load_config_file(path: str):
  """get_config() of a configs/*.py file, importable from any directory."""
  return call_with_repo_on_path(load_module(path).get_config)


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
  """`field=value` strings into a dict (values as Python literals)."""
  import ast  # pylint: disable=g-import-not-at-top
  out = {}
  for item in items:
    if "=" not in item:
      raise ReproduceError(f"--set expects field=value, got {item!r}")
    field, value = item.split("=", 1)
    try:
      out[field.strip()] = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      out[field.strip()] = value.strip()
  return out


def run_config(spec: RunSpec, overrides: Mapping[str, Any] = ()):
  """The full single-run config of a run: configs/<task>_<model>.py + spec."""
  config = _load_config_file(os.path.join(
      REPO_ROOT, "configs", f"{spec.task}_{spec.model}.py"))
  with config.unlocked():
    config.learning_rate = spec.learning_rate
    if spec.stack_size is not None:
      config.stack_embedding_size = spec.stack_size
    if spec.model == "ns":
      config.num_states, config.num_stack_symbols = NS_SHAPES[spec.task]
    config.data_seed = BASE_SEED + spec.restart
    config.param_seed = BASE_SEED + spec.restart
    config.shuffle_seed = BASE_SEED + spec.restart
    config.progress_bar = False
    for field, value in dict(overrides).items():
      if field not in config:
        raise ReproduceError(f"--set {field}: unknown config field "
                             "(fields: configs/default.py)")
      if field in ("task", "model", "learning_rate", "stack_embedding_size",
                   "data_seed", "param_seed", "shuffle_seed"):
        raise ReproduceError(f"--set {field}: set by the protocol; use "
                             "--task/--models/--learning_rates/--stack_sizes/"
                             "--restarts")
      config[field] = value
  return config


# ---------------------------------------------------------------------------
# Records.
# ---------------------------------------------------------------------------


def hardware() -> dict[str, Any]:
  """What the run ran on (the invocation that finished it)."""
  import jax  # pylint: disable=g-import-not-at-top
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  from nsrnn_jax import parallel  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  cores = parallel.usable_cores()
  return {"backend": jax.default_backend(),
          "device_kind": devices[0].device_kind,
          "num_devices": len(devices), "cpu": cpu,
          "cpu_count": os.cpu_count(),
          "process_cores": None if cores is None else len(cores),
          "jax": jax.__version__}


def _read_json(path: str):
  with open(path) as f:
    return json.load(f)


def make_record(spec: RunSpec, run_dir: str, overrides: Mapping[str, Any],
                hw: Mapping[str, Any]) -> dict[str, Any]:
  """The committed record of a finished run, from its run directory."""
  from nsrnn_jax import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  results = _read_json(os.path.join(run_dir, "results.json"))
  config = _read_json(os.path.join(run_dir, "config.json"))
  epochs = {}
  for rec in metrics_lib.read_jsonl(os.path.join(run_dir, "metrics.jsonl")):
    if "epoch" in rec and "valid_ce_diff" in rec:
      epochs[int(rec["epoch"])] = rec  # The last record of an epoch wins.
  keys = ("train_loss", "valid_ce_diff", "valid_perplexity", "learning_rate",
          "time")
  history = [{"epoch": e, **{k: epochs[e].get(k) for k in keys}}
             for e in sorted(epochs)]
  if [h["epoch"] for h in history] != list(range(1, results["epochs"] + 1)):
    raise ReproduceError(f"{run_dir}: metrics.jsonl does not hold epochs "
                         f"1..{results['epochs']}")
  test = None
  test_path = os.path.join(run_dir, "test_by_length.json")
  if os.path.isfile(test_path):
    table = _read_json(test_path)
    test = {k: table[k] for k in ("lengths", "ce_diff", "perplexity",
                                  "lower_bound_perplexity", "num_strings")
            if k in table}
  return {
      "format": RECORD_FORMAT,
      "task": spec.task, "model": spec.model, "setting": spec.setting,
      "learning_rate": spec.learning_rate, "stack_size": spec.stack_size,
      "restart": spec.restart,
      "protocol": "paper" if not overrides else "custom",
      "overrides": dict(overrides),
      "config": config,
      "epochs": history,
      "num_epochs": results["epochs"],
      "best_epoch": results["best_epoch"],
      "best_valid_ce_diff": results.get("best_valid_ce_diff"),
      "last_valid_ce_diff": history[-1]["valid_ce_diff"],
      "test": test,
      "train_time_s": float(sum(h["time"] or 0.0 for h in history)),
      "hardware": dict(hw),
      "finished_on": datetime.date.today().isoformat(),
  }


def write_json_atomic(path: str, obj) -> None:
  """Writes JSON via a temporary file and a rename (never half a file)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)


def load_records(results_dir: str, task: Optional[str] = None
                 ) -> list[dict[str, Any]]:
  """Every record under results_dir (of one task if given), sorted by path."""
  out = []
  root = results_dir if task is None else os.path.join(results_dir, task)
  for dirpath, _, filenames in sorted(os.walk(root)):
    for name in sorted(filenames):
      if name.startswith("restart_") and name.endswith(".json"):
        path = os.path.join(dirpath, name)
        try:
          rec = _read_json(path)
        except (OSError, json.JSONDecodeError) as e:
          raise ReproduceError(f"unreadable record {path}: {e}") from e
        if rec.get("format") != RECORD_FORMAT:
          raise ReproduceError(f"{path} is not a {RECORD_FORMAT} record")
        out.append(rec)
  return out


# ---------------------------------------------------------------------------
# Running the protocol.
# ---------------------------------------------------------------------------


class Budget:
  """A wall-clock budget checked at epoch boundaries."""

  def __init__(self, minutes: Optional[float]):
    self.seconds = None if minutes is None else 60.0 * float(minutes)
    self.start = time.monotonic()

  def expired(self) -> bool:
    return (self.seconds is not None
            and time.monotonic() - self.start >= self.seconds)

  def minutes_left(self) -> Optional[float]:
    """Minutes until the budget expires (None: no budget; may be <= 0)."""
    if self.seconds is None:
      return None
    return (self.seconds - (time.monotonic() - self.start)) / 60.0


def choose_execution(requested: str, backend: str) -> tuple[str, str]:
  """("sequential" | "model_axis", why) for the requested mode and backend."""
  if requested == "sequential":
    return "sequential", "requested"
  if requested == "model_axis":
    return "model_axis", "requested"
  if backend == "cpu":
    return "sequential", ("cpu backend: vmapped models ran slower than "
                          "one after another on 2 cores (JM, Gref, NS-RNN: "
                          "0.2-0.8x the throughput)")
  return "model_axis", (f"{backend} backend: a model axis turns many "
                        "launch-bound runs into one (8.2x for 20 NS-RNNs on "
                        "an H200)")


# The manifest's task of a workdir of several tasks (one subdirectory each).
SEVERAL_TASKS = "several (one subdirectory per task)"


def _manifest(task, overrides) -> dict[str, Any]:
  return {"task": task, "overrides": dict(overrides)}


def check_workdir(workdir: str, task: str, overrides: Mapping[str, Any]
                  ) -> None:
  """Claims `workdir` for (task, overrides) or fails if it holds other runs.

  `task` is a task name, or SEVERAL_TASKS for the parent of several tasks'
  workdirs (`<workdir>/<task>`), which a single task's workdir cannot be.
  """
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ReproduceError(f"--workdir {workdir} is a file")
  path = os.path.join(workdir, MANIFEST_FILE)
  want = _manifest(task, overrides)
  if os.path.isfile(path):
    try:
      have = _read_json(path)
    except (OSError, json.JSONDecodeError) as e:
      raise ReproduceError(f"{path} is unreadable ({e}); use a new "
                           "--workdir") from e
    if have != want and have.get("task") == SEVERAL_TASKS != task:
      raise ReproduceError(
          f"--workdir {workdir} holds the runs of several tasks, one "
          f"subdirectory each; for {task} alone use --workdir="
          f"{os.path.join(workdir, task)}")
    if have != want:
      diff = [k for k in sorted(set(have) | set(want))
              if have.get(k) != want.get(k)]
      raise ReproduceError(
          f"--workdir {workdir} holds runs of task={have.get('task')} with "
          f"overrides {have.get('overrides')}, not task={task} with overrides "
          f"{dict(overrides)} (differs in: {', '.join(diff)}); use a new "
          "--workdir")
    return
  entries = os.listdir(workdir) if os.path.isdir(workdir) else []
  # A parent of tasks' workdirs made one task at a time (<workdir>/<task>,
  # each checked on its own) can become one of several tasks.
  if entries and not (task == SEVERAL_TASKS and set(entries) <= set(TASKS)):
    raise ReproduceError(f"--workdir {workdir} is not empty and was not made "
                         "by nsrnn_jax.reproduce; use a new --workdir")
  try:
    write_json_atomic(path, want)
  except OSError as e:
    raise ReproduceError(f"cannot write to --workdir {workdir}: "
                         f"{e.strerror}") from e


def check_results_dir(results_dir: str, runs: Sequence[RunSpec],
                      overrides: Mapping[str, Any]) -> None:
  """Existing records of these runs must come from the same overrides."""
  for spec in runs:
    path = os.path.join(results_dir, spec.record_path)
    if os.path.isfile(path):
      rec = _read_json(path)
      if rec.get("overrides") != dict(overrides):
        raise ReproduceError(
            f"{path} was made with overrides {rec.get('overrides')}, not "
            f"{dict(overrides)}; use another --results directory")


def _fmt_duration(seconds: Optional[float]) -> str:
  if seconds is None or not math.isfinite(seconds):
    return "unknown"
  minutes = int(round(seconds / 60))
  return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else (
      f"{minutes}m")


def training_seconds(record: Mapping[str, Any]) -> float:
  """A finished run's training time, robust to pauses of the machine.

  The median epoch time (epochs after the first, which also compiles) times
  the number of epochs: a run stopped or starved for a while (other work on
  the cores, a suspended process) has a few long epochs, which
  `train_time_s`, their sum, counts in full. Compilation (a minute or two
  per run) is left out.
  """
  times = [e.get("time") for e in record.get("epochs", [])]
  times = [t for t in times[1:] if t is not None]
  if not times:
    return float(record["train_time_s"])
  return float(np.median(times)) * len(record["epochs"])


def estimate_seconds(spec: RunSpec, records: Sequence[Mapping[str, Any]],
                     epochs_done: int = 0) -> Optional[float]:
  """Expected training time left of a run: mean over finished runs like it
  (`training_seconds`).

  The same task and model first, else the same model on any task. A run
  that has trained `epochs_done` epochs (a resumed one) is left with the
  mean time per epoch of those runs times the rest of their mean epoch
  count, and at least one epoch.
  """
  for same in (lambda r: r["task"] == spec.task and r["model"] == spec.model,
               lambda r: r["model"] == spec.model):
    like = [r for r in records if same(r)]
    if like:
      total = float(np.mean([training_seconds(r) for r in like]))
      if not epochs_done:
        return total
      epochs = float(np.mean([max(len(r.get("epochs", [])), 1)
                              for r in like]))
      return total / epochs * max(epochs - epochs_done, 1.0)
  return None


def epochs_logged(run_dir: str) -> int:
  """How many epochs a run directory's metrics.jsonl holds (0 if none).

  The epochs 1..E it holds completely: what a resume keeps at most
  (`metrics.last_complete_epoch`; a line cut by a kill does not count).
  """
  from nsrnn_jax import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  return metrics_lib.last_complete_epoch(run_dir)


class Progress:
  """Prints which runs are done, running and pending, and the time left."""

  def __init__(self, runs: Sequence[RunSpec], results_dir: str,
               run_dir: Callable[[RunSpec], str], out=None,
               label: Callable[[RunSpec], str] = lambda s: s.name,
               lanes: int = 1):
    """Runs' directories (where they resume from: their epochs count) are
    `run_dir(spec)`.
    `lanes` runs train at once (workers), each taking the next pending run
    when it frees up: the time left is that schedule's length."""
    self.lanes = lanes
    self.runs = list(runs)
    self.results_dir = results_dir
    self.out = out or sys.stdout   # Resolved now, not at import.
    self.run_dir = run_dir
    self.label = label

  def done(self) -> list[RunSpec]:
    return [s for s in self.runs
            if os.path.isfile(os.path.join(self.results_dir, s.record_path))]

  def line(self, running: Sequence[RunSpec]) -> str:
    done = set(self.done())
    running = list(running)
    pending = [s for s in self.runs if s not in done and s not in running]
    records = load_records(self.results_dir)
    free_at = [0.0] * self.lanes  # When each lane finishes its runs so far.
    for s in running + pending:
      done_epochs = epochs_logged(self.run_dir(s))
      est = estimate_seconds(s, records, done_epochs)
      if est is None:
        free_at = None
        break
      free_at[free_at.index(min(free_at))] += est
    left = None if free_at is None else max(free_at)
    at_once = f" ({self.lanes} runs at a time)" if self.lanes > 1 else ""
    now = ", ".join(self.label(s) for s in running) or "-"
    return (f"[{len(done)} done | running {now} | {len(pending)} pending] "
            f"estimated time left {_fmt_duration(left)}{at_once}")

  def show(self, running: Sequence[RunSpec]) -> None:
    print(self.line(running), file=self.out, flush=True)


def _record_finished(spec, run_dir, results_dir, overrides, hw) -> bool:
  results_path = os.path.join(run_dir, "results.json")
  if not os.path.isfile(results_path):
    return False
  if not _read_json(results_path).get("finished"):
    return False
  write_json_atomic(os.path.join(results_dir, spec.record_path),
                    make_record(spec, run_dir, overrides, hw))
  return True


def run_protocol(task: Union[str, Sequence[str]], workdir: str, *,
                 models: Sequence[str] = MODELS,
                 learning_rates: Sequence[float] = LEARNING_RATES,
                 stack_sizes: Sequence[int] = STACK_SIZES,
                 restarts: int = NUM_RESTARTS,
                 restart_ids: Optional[Sequence[int]] = None,
                 budget_minutes: Optional[float] = None,
                 results_dir: str = DEFAULT_RESULTS,
                 overrides: Mapping[str, Any] = (),
                 execution: str = "auto",
                 workers: int = 1,
                 worker_flags: Sequence[str] = (),
                 pin_workers: bool = True,
                 out=None,
                 train_fn: Optional[Callable[..., dict]] = None) -> dict:
  """Runs (or continues) the protocol of one task or several; writes records.

  Args:
    task: a task name, or several (a sequence, a comma-separated string or
      "all": the paper's five). Several tasks run as one grid, restart-major
      across them (`plan_tasks`), each in its own `<workdir>/<task>`, which
      is what `run_protocol(<task>, <workdir>/<task>)` would use: the two
      ways continue each other's runs. One task, however given, uses
      `workdir` itself.
    models, learning_rates, stack_sizes, restarts, restart_ids: the grid of
      every task (`plan`).
    workdir: run directories and checkpoints (not committed).
    budget_minutes: stop at the first epoch boundary after this many minutes
      (None: no limit), over all tasks.
    results_dir: where records go (`results/` of the repository).
    overrides: config fields set on every run (a non-paper protocol; its
      records say so).
    execution: "auto", "sequential" or "model_axis".
    workers: sequential execution only: how many runs train at once, each
      in its own process (`python -m nsrnn_jax.reproduce` for that one run,
      same task workdir and results; its output in
      `<task workdir>/worker_logs/<model>-<setting>-restart_<r>.log`). 1:
      every run in this process.
    worker_flags: extra command-line flags for each worker process (the
      CLI passes its --cpu_devices and --compilation_cache).
    pin_workers: run each worker on its own share of this process's CPU
      cores (`core_groups`; Linux), as long as there are enough of them.
    out: where progress lines go (default: sys.stdout at the time of the
      call).
    train_fn: `train.train_and_evaluate` (tests may wrap it).

  Returns:
    {"finished": bool, "done": [names], "pending": [names], "execution"};
    with several tasks the names start with "<task>/".
  """
  out = out or sys.stdout
  tasks = parse_tasks(task)
  several = len(tasks) > 1
  overrides = dict(overrides)
  # As stored in JSON (tuples become lists), for comparisons with the disk.
  stored_overrides = json.loads(json.dumps(overrides))
  runs = plan_tasks(tasks, models, learning_rates, stack_sizes, restarts,
                    restart_ids)
  configs = {s: run_config(s, overrides) for s in runs}  # Validates overrides.
  from nsrnn_jax import train  # pylint: disable=g-import-not-at-top
  for config in configs.values():
    train.validate_config(config)
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
    raise ReproduceError(f"--workers must be an integer >= 1 (got "
                         f"{workers!r})")
  import jax  # pylint: disable=g-import-not-at-top
  mode, why = choose_execution(execution, jax.default_backend())
  if workers > 1 and mode != "sequential":
    raise ReproduceError(f"--workers={workers} needs the sequential "
                         f"execution, not {mode} ({why}); use "
                         "--execution=sequential or --workers=1")
  if several:
    task_dirs = {t: os.path.join(workdir, t) for t in tasks}
    check_workdir(workdir, SEVERAL_TASKS, stored_overrides)
  else:
    task_dirs = {tasks[0]: workdir}
  for t in tasks:  # Every task's workdir is claimed before any run starts.
    check_workdir(task_dirs[t], t, stored_overrides)
  check_results_dir(results_dir, runs, stored_overrides)
  label = (lambda s: f"{s.task}/{s.name}") if several else (lambda s: s.name)
  run_dir = lambda s: os.path.join(task_dirs[s.task], s.run_subdir)
  groups = None
  if workers > 1:
    from nsrnn_jax import parallel  # pylint: disable=g-import-not-at-top
    logs = os.path.join(workdir, "<task>" if several else "", WORKER_LOGS)
    why += (f"; {workers} runs at a time in worker processes, their output "
            f"in {logs}")
    if pin_workers:
      groups = core_groups(workers, parallel.usable_cores())
    if groups:
      why += (", each on its own core(s): "
              + " | ".join(parallel.format_cores(g) for g in groups))
  print(f"reproduce {', '.join(tasks)}: {len(runs)} runs "
        f"({', '.join(m for m in MODELS if m in models)}); execution: {mode} "
        f"({why})", file=out, flush=True)
  budget = Budget(budget_minutes)
  progress = Progress(runs, results_dir, run_dir, out, label=label,
                      lanes=workers if mode == "sequential" else 1)
  hw = hardware()
  train_fn = train.train_and_evaluate if train_fn is None else train_fn

  def pending():
    done = set(progress.done())
    return [s for s in runs if s not in done]

  stopped = False
  if mode == "sequential" and workers > 1:
    stopped = _run_workers(
        pending(), workers, budget, progress, out,
        lambda spec, minutes: _worker_argv(spec, restarts,
                                           task_dirs[spec.task], results_dir,
                                           overrides, minutes, worker_flags),
        lambda spec: os.path.join(task_dirs[spec.task], WORKER_LOGS),
        label, groups)
  elif mode == "sequential":
    trained = False
    for spec in pending():
      if budget.expired():
        stopped = True
        break
      if _record_finished(spec, run_dir(spec), results_dir, overrides, hw):
        continue  # Finished earlier, record not yet written.
      if trained:
        # Every run compiles its own programs (its train state's static
        # fields, the model's apply function and the optimizer, are new
        # objects, so the jitted steps trace again) and JAX keeps them all:
        # on the CPU each holds memory mappings (a tiny NS-RNN run adds
        # ~2,100 and takes as long with the caches kept as cleared), and a
        # third NS-RNN run in one process hit the kernel's limit (65,530)
        # and died in LLVM ("Cannot allocate memory").
        jax.clear_caches()
      trained = True
      progress.show([spec])
      results = train_fn(configs[spec], run_dir(spec),
                         should_stop=budget.expired)
      if not results.get("finished"):
        stopped = True
        break
      _record_finished(spec, run_dir(spec), results_dir, overrides, hw)
  else:
    stopped = _run_model_axis(pending(), configs, task_dirs, run_dir,
                              results_dir, overrides, hw, budget, progress)
  left = pending()
  if left and stopped:
    print(f"stopped at the budget ({budget_minutes:g} min): "
          f"{len(runs) - len(left)} of {len(runs)} runs done. Continue with:\n"
          f"  {continue_command()}", file=out, flush=True)
  elif not left:
    print(f"all {len(runs)} runs of {', '.join(tasks)} done; records in "
          f"{results_dir}. Regenerate the report with: python -m "
          "nsrnn_jax.reproduce --report", file=out, flush=True)
  return {"finished": not left, "execution": mode,
          "done": [label(s) for s in runs if s not in left],
          "pending": [label(s) for s in left]}


def _run_model_axis(runs, configs, task_dirs, run_dir, results_dir,
                    overrides, hw, budget, progress) -> bool:
  """Trains each (task, model, m) group's runs at once with grid.run_grid."""
  import jax  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import grid  # pylint: disable=g-import-not-at-top
  groups: dict[tuple[str, str], list[RunSpec]] = {}
  for spec in runs:
    groups.setdefault((spec.task, spec.group), []).append(spec)
  for k, ((task, name), specs) in enumerate(groups.items()):
    if budget.expired():
      return True
    if k:
      jax.clear_caches()  # As between sequential runs (run_protocol).
    lrs = sorted({s.learning_rate for s in specs}, reverse=True)
    restart_ids = sorted({s.restart for s in specs})
    # The grid's members are every (lr, restart in restart_ids); their seeds
    # (seed + r) and layout equal the sequential runs'. A member whose run
    # finished earlier resumes as stopped and costs nothing.
    config = configs[specs[0]].copy_and_resolve_references()
    with config.unlocked():
      config.data_seed = config.param_seed = config.shuffle_seed = BASE_SEED
      config.grid_learning_rates = tuple(lrs)
      config.num_restarts = restart_ids[-1] + 1
      config.grid_restart_ids = tuple(restart_ids)
    progress.show(specs)
    summary = grid.run_grid(config, os.path.join(task_dirs[task], name),
                            should_stop=budget.expired)
    if not summary.get("finished", True):
      return True
    for spec in specs:
      _record_finished(spec, run_dir(spec), results_dir, overrides, hw)
  return False


WORKER_LOGS = "worker_logs"
# Seconds between checks of the worker processes.
WORKER_POLL_SECONDS = 1.0


def _worker_argv(spec: RunSpec, restarts: int, workdir: str, results_dir: str,
                 overrides: Mapping[str, Any], budget_minutes: Optional[float],
                 extra: Sequence[str]) -> list[str]:
  """The command line that trains `spec` alone (same workdir and results)."""
  argv = [sys.executable, "-m", "nsrnn_jax.reproduce", f"--task={spec.task}",
          f"--models={spec.model}",
          f"--learning_rates={spec.learning_rate!r}",
          f"--restarts={restarts}", f"--restart_ids={spec.restart}",
          f"--workdir={workdir}", f"--results={results_dir}",
          "--execution=sequential", "--workers=1"]
  if spec.stack_size is not None:
    argv.append(f"--stack_sizes={spec.stack_size}")
  if budget_minutes is not None:
    argv.append(f"--budget_minutes={budget_minutes!r}")
  argv += [f"--set={k}={v!r}" for k, v in overrides.items()]
  return argv + list(extra)


def _last_line(path: str) -> str:
  try:
    with open(path, errors="replace") as f:
      lines = [l.strip() for l in f.read().splitlines() if l.strip()]
  except OSError:
    return ""
  return lines[-1] if lines else ""


def core_groups(workers: int, cores: Optional[Sequence[int]]
                ) -> Optional[list[list[int]]]:
  """Disjoint, contiguous shares of `cores`, one per worker (None: no pins).

  Two workers on a 2-core machine unpinned share both cores, each with its
  own XLA thread pool sized for both; pinned, each on its own core, they ran
  1.30x the train steps (NS-RNN Q=S=2, JM) and 0.96-1.15x (Q=S=3; README,
  benchmarks/concurrent_steps.py).
  Fewer cores than workers, or one worker, or unknown cores: no pinning.
  """
  if cores is None or workers < 2 or len(cores) < workers:
    return None
  cores = sorted(cores)
  n = len(cores)
  return [cores[k * n // workers:(k + 1) * n // workers]
          for k in range(workers)]


def _run_workers(runs, workers, budget, progress, out, make_argv,
                 log_dir_of, label, groups=None) -> bool:
  """Trains `runs` in up to `workers` processes at once; True if stopped.

  Each worker trains one run and writes its record. A worker stopped by the
  budget (exit 3) stops the launches; a failed one stops them too, the
  others finish their runs, then a ReproduceError names it and its log. An
  interrupt of this process interrupts the workers (each keeps its last
  checkpoint) and waits for them. With `groups` (`core_groups`), each
  worker runs on a share of the cores no other running worker has.
  """
  import signal  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import parallel  # pylint: disable=g-import-not-at-top
  free_groups = list(groups or [])
  env = dict(os.environ)
  # The workers import this copy of the package, wherever it is installed.
  env["PYTHONPATH"] = os.pathsep.join(
      [REPO_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  queue = list(runs)
  # RunSpec -> (Popen, log file object, log path, its cores or None)
  running: dict = {}
  failed = []
  stopped = False
  try:
    while queue or running:
      launched = False
      while queue and len(running) < workers and not (stopped or failed):
        minutes = budget.minutes_left()
        if minutes is not None and minutes <= 0:
          stopped = True
          break
        spec = queue.pop(0)
        log_dir = log_dir_of(spec)
        os.makedirs(log_dir, exist_ok=True)
        path = os.path.join(log_dir, f"{spec.model}-{spec.setting}-restart_"
                            f"{spec.restart}.log")
        argv = make_argv(spec, minutes)
        cores = free_groups.pop(0) if free_groups else None
        if cores is not None:
          argv.append(f"--cpu_cores={parallel.format_cores(cores)}")
        log = open(path, "a")  # pylint: disable=consider-using-with
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                env=env, stdin=subprocess.DEVNULL)
        running[spec] = (proc, log, path, cores)
        launched = True
      if launched:
        progress.show(list(running))
      if not running:
        break
      time.sleep(WORKER_POLL_SECONDS)
      for spec, (proc, log, path, cores) in list(running.items()):
        code = proc.poll()
        if code is None:
          continue
        log.close()
        del running[spec]
        if cores is not None:
          free_groups.append(cores)
        if code == 3:
          stopped = True
        elif code != 0:
          failed.append((spec, code, path))
        else:
          print(f"finished {label(spec)}", file=out, flush=True)
  except BaseException:
    for proc, log, _, _ in running.values():
      if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    for proc, log, _, _ in running.values():
      proc.wait()
      log.close()
    raise
  if failed:
    spec, code, path = failed[0]
    more = f" ({len(failed) - 1} more failed)" if len(failed) > 1 else ""
    raise ReproduceError(f"run {label(spec)} failed in its worker (exit code "
                         f"{code}): {_last_line(path) or 'no output'}; its "
                         f"log: {path}{more}")
  return stopped or bool(queue)


def continue_command() -> str:
  """The command line of this invocation (rerun it to continue)."""
  import shlex  # pylint: disable=g-import-not-at-top
  return " ".join(["python -m nsrnn_jax.reproduce"] +
                  [shlex.quote(a) for a in sys.argv[1:]])


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
    return [] if self.selected is None else self.selected.records

  def last_valid(self) -> Optional[tuple[float, float]]:
    if not self.runs:
      return None
    values = np.asarray([r["last_valid_ce_diff"] for r in self.runs])
    return float(np.mean(values)), float(np.std(values))

  def test_bin_stats(self) -> Optional[list[Optional[tuple[float, float]]]]:
    """(mean, std) over restarts of each bin's per-length mean (None if
    missing); std with ddof=0, as for the validation figures."""
    tested = [r for r in self.runs if r.get("test")]
    if not tested:
      return None
    out = []
    for lo, hi in TEST_BINS:
      means = [_bin_mean(r["test"], lo, hi) for r in tested]
      means = [m for m in means if m is not None]
      out.append((float(np.mean(means)), float(np.std(means)))
                 if means else None)
    return out


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


def _compared(cells, task, models, which) -> list:
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
  values = _compared(cells, task, models, which)
  if any(v is None for v in values):
    return None
  return bool(_VERDICTS[kind]([mean for mean, _ in values]))


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
                   zip(models, _compared(cells, task, models, which)))


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


def _hardware_summary(records) -> str:
  kinds = sorted({f"{r['hardware']['device_kind']} "
                  f"({r['hardware']['backend']}, {r['hardware']['cpu_count']} "
                  "cores)" for r in records})
  return "; ".join(kinds) if kinds else "—"


def figure_series(cell: Cell) -> Optional[dict]:
  """Figure 3/4 series of a cell's selected restarts (plots.py's rules)."""
  from nsrnn_jax import plots  # pylint: disable=g-import-not-at-top
  if not cell.runs:
    return None
  curves = [np.asarray([e["valid_ce_diff"] for e in r["epochs"]])
            for r in cell.runs]
  runs_RxE = plots.pad_with_last(curves)
  out = {"label": LABELS[cell.model], "setting": cell.selected.name,
         "restarts": [r["restart"] for r in cell.runs],
         "epochs": list(range(1, runs_RxE.shape[1] + 1)),
         "mean": runs_RxE.mean(axis=0).tolist(),
         "std": runs_RxE.std(axis=0).tolist(), "test": None}
  tested = [r["test"] for r in cell.runs if r.get("test")]
  if tested:
    lengths_L, table_RxL = plots.align_by_length(
        [(t["lengths"], t["ce_diff"]) for t in tested])
    out["test"] = {"label": LABELS[cell.model], "lengths": lengths_L.tolist(),
                   "mean": np.nanmean(table_RxL, axis=0).tolist(),
                   "std": np.nanstd(table_RxL, axis=0).tolist()}
  return out


def draw_figures(cells, task: str, out_dir: str,
                 paper: Optional[Mapping[str, Any]] = None) -> list[str]:
  """figure3.png / figure4.png / series.json of one task; returns the files.

  `paper`: the paper's figure data (`paper_figures.load`); its mean curves
  of the models we plot are drawn dashed beside ours.
  """
  from nsrnn_jax import plots  # pylint: disable=g-import-not-at-top
  drawn = {m: figure_series(cells[(task, m)]) for m in REPORT_ORDER}
  drawn = {m: s for m, s in drawn.items() if s is not None}
  series = list(drawn.values())

  def reference(kind):
    curves = [(m, paper_figures.curve(paper, kind, task, m)) for m in drawn]
    return [{"label": LABELS[m], "x": c["x"], "mean": c["mean"]}
            for m, c in curves if c is not None] or None

  if not series:  # Nothing to draw: remove figures of earlier records.
    for name in ("figure3.png", "figure4.png", "series.json"):
      if os.path.isfile(os.path.join(out_dir, name)):
        os.remove(os.path.join(out_dir, name))
    return []
  os.makedirs(out_dir, exist_ok=True)
  title = TASK_TITLES[task]
  files = []
  # No "Software" metadata: the PNG depends on the numbers only.
  png = {"Software": None}
  fig = plots.plot_train(series, title, reference("train"))
  files.append(os.path.join(out_dir, "figure3.png"))
  fig.savefig(files[-1], dpi=120, metadata=png)
  tests = [s["test"] for s in series if s["test"] is not None]
  if tests:
    fig = plots.plot_test(tests, title, reference("test"))
    files.append(os.path.join(out_dir, "figure4.png"))
    fig.savefig(files[-1], dpi=120, metadata=png)
  files.append(os.path.join(out_dir, "series.json"))
  write_json_atomic(files[-1], {"title": title, "series": series})
  return files


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
      "and the figures, and a test checks that they match. Runs are made "
      "with `python -m nsrnn_jax.reproduce --task=<task>`. Our strings are "
      "drawn with NumPy's generator: same grammars and distributions as the "
      "authors', not their strings. Restart r of every model and setting "
      f"uses seed {BASE_SEED} + r for its data, parameters and shuffling, "
      "so models and settings are compared on the same "
      f"{NUM_RESTARTS} datasets (paired); the authors drew fresh seeds for "
      "every run.",
      "",
      f"Records: {len(paper_runs)} finished runs of the paper's protocol, on "
      f"{_hardware_summary(paper_runs)}. {_ns_table_summary(paper_runs)}"
      .rstrip(),
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
  for task in TASKS:
    for model in REPORT_ORDER:
      cell = cells[(task, model)]
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
  for task in TASKS:
    for model in REPORT_ORDER:
      bins = cells[(task, model)].test_bin_stats() or [None, None]
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
            "(the selection is made among finished settings only).", "",
            "| task | claim | ours | compared (mean ± std) | grid |",
            "|---|---|---|---|---|"]
  for task in TASKS:
    for text, kind, models, which in CLAIMS[task]:
      verdict = claim_verdict(cells, task, kind, models, which)
      word = {True: "agrees", False: "**disagrees**",
              None: "not decidable yet (cells missing)"}[verdict]
      lines.append(f"| {TASK_TITLES[task]} | {text} | {word} | "
                   f"{_evidence(cells, task, models, which)} | "
                   f"{_grid_column(cells, task, models)} |")
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
  for task in TASKS:
    for model in REPORT_ORDER:
      cell = cells[(task, model)]
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
  for task in TASKS:
    for model in REPORT_ORDER:
      done = sum(len(s.records) for s in cells[(task, model)].settings)
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
  """Writes the report and the figures next to it; returns the paths."""
  records = load_records(results_dir)
  figures_dir = os.path.join(os.path.dirname(report_path), "figures")
  cells = summarize_cells(records, selection=selection)
  try:
    paper = paper_figures.load(os.path.join(results_dir, PAPER_FIGURES_FILE))
  except paper_figures.PaperFiguresError as e:
    raise ReproduceError(str(e)) from e
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


# ---------------------------------------------------------------------------
# CLI.
# ---------------------------------------------------------------------------


def _split_list(value: str, cast, what: str) -> list:
  items = [v.strip() for v in value.split(",") if v.strip()]
  if not items:
    raise ReproduceError(f"--{what} is empty")
  try:
    return [cast(v) for v in items]
  except ValueError as e:
    raise ReproduceError(f"--{what}: {value!r} is not a list of "
                         f"{cast.__name__}s") from e


class OneLineArgumentParser(argparse.ArgumentParser):
  """An argparse parser whose errors raise ReproduceError (one line, exit 2
  from `main`) instead of printing usage and exiting."""

  def error(self, message):
    raise ReproduceError(message)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """CLI entry point; returns the exit code (2 with one line on bad input)."""
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  parser = OneLineArgumentParser(prog="python -m nsrnn_jax.reproduce",
                  description=__doc__.split("\n\n")[0])
  parser.add_argument("--task", help=f"one of {', '.join(TASKS)}; several "
                      "(comma-separated) or 'all' run as one grid, each "
                      "task in <workdir>/<task>")
  parser.add_argument("--workdir", help="run directories and checkpoints")
  parser.add_argument("--models", default=",".join(MODELS),
                      help=f"comma-separated subset of {','.join(MODELS)}")
  parser.add_argument("--learning_rates",
                      default=",".join(f"{x:g}" for x in LEARNING_RATES),
                      help="comma-separated learning-rate grid (default: the "
                      "paper's)")
  parser.add_argument("--stack_sizes",
                      default=",".join(str(x) for x in STACK_SIZES),
                      help="comma-separated stack embedding sizes m of the "
                      "JM and Gref grids (default: the paper's)")
  parser.add_argument("--restarts", type=int, default=NUM_RESTARTS,
                      help="restarts per grid point, each with its own data, "
                      "parameter and shuffle seeds")
  parser.add_argument("--restart_ids", default=None,
                      help="run only these restarts (comma-separated, each "
                      "< --restarts), e.g. to split a task over machines")
  parser.add_argument("--budget_minutes", type=float, default=None,
                      help="stop at the first epoch boundary past this many "
                      "minutes and print the command that continues")
  parser.add_argument("--results", default=DEFAULT_RESULTS,
                      help="records directory (default: results/)")
  parser.add_argument("--set", action="append", default=[],
                      metavar="FIELD=VALUE",
                      help="config override for every run (not the paper's "
                      "protocol: records say so)")
  parser.add_argument("--execution", default="auto",
                      choices=("auto", "sequential", "model_axis"),
                      help="auto: decided from the backend (printed); "
                      "sequential: one run after another; model_axis: a "
                      "(model, m) group's runs vmapped in one program")
  parser.add_argument("--workers", type=int, default=1,
                      help="CPU: train this many runs at once, each in its "
                      "own process with --cpu_devices devices (e.g. one per "
                      "core); output in <workdir>/worker_logs/")
  parser.add_argument("--pin_workers", default="on", choices=("on", "off"),
                      help="with --workers: each worker on its own share of "
                      "the cores (Linux; up to 1.3x the train steps of "
                      "unpinned workers on 2 cores)")
  parser.add_argument("--cpu_cores", default=None,
                      help="run this process on these CPU cores only, e.g. "
                      "0-3 (Linux; --workers sets it for each worker)")
  parser.add_argument("--cpu_devices", type=int, default=1,
                      help="CPU backend: split each batch over this many "
                      "devices (one per core to use)")
  parser.add_argument("--compilation_cache",
                      default=cli.DEFAULT_COMPILATION_CACHE,
                      help="persistent XLA compilation cache directory "
                      "('' = off; default ~/.cache/nsrnn_jax/xla): runs of "
                      "one model share their compiled steps")
  parser.add_argument("--report", action="store_true",
                      help="regenerate the report from --results and exit")
  parser.add_argument("--report_path", default=DEFAULT_REPORT,
                      help="where --report writes the Markdown report")
  parser.add_argument("--selection", default="mean", choices=SELECTIONS,
                      help="mean: the paper's (best mean over restarts); "
                      "best_run: the later papers' (best single run)")
  try:
    args = parser.parse_args(argv)
    if args.report:
      for path in write_report(args.results, args.report_path,
                               args.selection):
        print(path)
      pending = uncommitted_records(args.results)
      if pending:
        print(f"warning: the report read {len(pending)} file(s) that git "
              "does not track yet; commit them with the report (the "
              "committed report must match the committed records): "
              + " ".join(pending), file=sys.stderr)
      return 0
    if args.task is None:
      raise ReproduceError(f"--task is required: one of {', '.join(TASKS)}, "
                           "several (comma-separated) or 'all'")
    tasks = parse_tasks(args.task)
    if not args.workdir:
      raise ReproduceError("--workdir is required")
    models = _split_list(args.models, str, "models")
    for m in models:
      if m not in MODELS:
        raise ReproduceError(f"--models: unknown model {m!r}; expected "
                             f"some of {', '.join(MODELS)}")
    lrs = _split_list(args.learning_rates, float, "learning_rates")
    if any(not (x > 0 and math.isfinite(x)) for x in lrs):
      raise ReproduceError(f"--learning_rates must be positive ({lrs})")
    sizes = _split_list(args.stack_sizes, int, "stack_sizes")
    if any(x < 1 for x in sizes):
      raise ReproduceError(f"--stack_sizes must be >= 1 ({sizes})")
    if args.restarts < 1:
      raise ReproduceError(f"--restarts must be >= 1 (got {args.restarts})")
    restart_ids = None
    if args.restart_ids is not None:
      restart_ids = _split_list(args.restart_ids, int, "restart_ids")
      if any(not 0 <= r < args.restarts for r in restart_ids):
        raise ReproduceError(f"--restart_ids must be in [0, "
                             f"{args.restarts}) (got {restart_ids})")
    from nsrnn_jax import parallel  # pylint: disable=g-import-not-at-top
    if args.cpu_cores is not None:
      # Before JAX starts its thread pools, which it sizes by these cores.
      parallel.pin_to_cores(parallel.parse_cores(args.cpu_cores))
    parallel.use_cpu_devices(args.cpu_devices)
    cli.use_compilation_cache(args.compilation_cache)
    if args.budget_minutes is not None and not args.budget_minutes > 0:
      raise ReproduceError(f"--budget_minutes must be > 0 (got "
                           f"{args.budget_minutes:g})")
    result = run_protocol(
        tasks if len(tasks) > 1 else tasks[0], args.workdir, models=models, learning_rates=lrs,
        stack_sizes=sizes, restarts=args.restarts, restart_ids=restart_ids,
        budget_minutes=args.budget_minutes, results_dir=args.results,
        overrides=parse_overrides(args.set), execution=args.execution,
        workers=args.workers, pin_workers=args.pin_workers == "on",
        worker_flags=[f"--cpu_devices={args.cpu_devices}",
                      f"--compilation_cache={args.compilation_cache}"])
  except ValueError as e:  # ReproduceError and config validation errors.
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    cli.interrupted("every run keeps its last checkpoint (one per epoch); "
                    "rerun the same command to continue")
  return 0 if result["finished"] else 3


if __name__ == "__main__":
  sys.exit(main())
