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

Sharing a grid. Several commands may run on one workdir at once (in other
shells, or on machines that share the directory: a SLURM job array,
`launch/reproduce_array.sbatch`): each claims a run before building its
data (`workdir_lock.CLAIM_FILE`) and leaves any run another live process
holds, going round once more at the end for those whose process stopped
without finishing them (on the model axis a group is claimed and left
whole); each writes the records of the runs it finished.
`--status` names the process training each started run.

Records (`--results`, default `results/` of the repository), one per
finished run: `results/<task>/<model>/<setting>/restart_<r>.json` where
setting is `lr_<lr>` or `m_<m>-lr_<lr>`; the format is documented in
`results/README.md` (`run_records.RECORD_FORMAT`).

Selection (the authors' print_grid_search.py): per model, the setting with
the lowest mean best-epoch validation CE difference over its restarts (ties
by lower std); only settings with the most finished restarts of that model
compete, so a partly run grid never prefers a setting for having fewer runs.
Reported: the last epoch's validation CE difference, mean +- std (ddof=0)
over the selected restarts (the paper's Figure 3 end points), and the mean
test CE difference over lengths 40-80 and 81-100 (Figure 4).

This module is the runner and the command line; the grid's constants, the
runs (`RunSpec`, `plan`) and the records live in `run_records`, the report
and the paper's numbers in `reproduction_report`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from typing import (Any, Callable, Iterable, Mapping, Optional, Sequence,
                    Union)

from nsrnn_jax import reproduction_report
from nsrnn_jax import workdir_lock
from nsrnn_jax.run_records import BASE_SEED
from nsrnn_jax.run_records import DEFAULT_RESULTS
from nsrnn_jax.run_records import estimate_seconds
from nsrnn_jax.run_records import LEARNING_RATES
from nsrnn_jax.run_records import load_records
from nsrnn_jax.run_records import made_by
from nsrnn_jax.run_records import make_record
from nsrnn_jax.run_records import MODELS
from nsrnn_jax.run_records import NS_SHAPES
from nsrnn_jax.run_records import NUM_RESTARTS
from nsrnn_jax.run_records import plan
from nsrnn_jax.run_records import read_json
from nsrnn_jax.run_records import REPO_ROOT
from nsrnn_jax.run_records import ReproduceError
from nsrnn_jax.run_records import RunSpec
from nsrnn_jax.run_records import set_field
from nsrnn_jax.run_records import STACK_SIZES
from nsrnn_jax.run_records import TASKS
from nsrnn_jax.run_records import write_json_atomic
MANIFEST_FILE = "reproduce.json"


# ---------------------------------------------------------------------------
# The runs: tasks, configs and overrides.
# ---------------------------------------------------------------------------


def parse_tasks(value: Union[str, Sequence[str]]) -> list[str]:
  """Task names from "all", one name, a comma-separated list or a sequence.

  Raises ReproduceError naming an unknown or repeated task.
  """
  if isinstance(value, str):
    value = TASKS if value.strip() == "all" else [
        t.strip() for t in value.split(",")]
  tasks = list(value)
  if "" in tasks:
    raise ReproduceError(f"--task has an empty item: {','.join(tasks)!r}")
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
  within a restart, the tasks in the given order. `tasks` as for
  `parse_tasks` (a name, "a,b", "all" or a list).
  """
  tasks = parse_tasks(tasks)
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
      if field in ("task", "model", "learning_rate", "stack_embedding_size",
                   "data_seed", "param_seed", "shuffle_seed"):
        raise ReproduceError(f"--set {field}: set by the protocol; use "
                             "--task/--models/--learning_rates/--stack_sizes/"
                             "--restarts")
      set_field(config, "--set", field, value)
    # The NS-RNN's share stack also measures its product margin on the
    # validation and test strings (one more stack sweep per string there;
    # training unchanged), so its records say on how many strings its
    # numbers are proven exact.
    if (spec.model == "ns" and "valid_stack_margin" not in overrides
        and config.get("stack_table", "shares") == "shares"):
      config.valid_stack_margin = True
  return config


# ---------------------------------------------------------------------------
# Running the protocol.
# ---------------------------------------------------------------------------


class Budget:
  """A wall-clock budget checked at epoch boundaries."""

  def __init__(self, minutes: Optional[float]):
    self.seconds = None if minutes is None else 60.0 * float(minutes)
    self.start = time.monotonic()

  def expired(self) -> bool:
    """Whether the budget is spent (never, without one)."""
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
  # As JSON stores it (tuples become lists), to compare with the disk.
  return {"task": task,
          "overrides": json.loads(json.dumps(dict(overrides)))}


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
      have = read_json(path)
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
  # Another command's claim being written at this moment (commands sharing
  # a new workdir, e.g. a job array) is no foreign content.
  entries = [e for e in (os.listdir(workdir) if os.path.isdir(workdir)
                         else []) if not e.startswith(MANIFEST_FILE + ".")]
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
  # Claimed at the same moment by a command with other settings: the last
  # rename won, and one of the two says so here.
  check_workdir(workdir, task, overrides)


def check_results_dir(results_dir: str, runs: Sequence[RunSpec],
                      overrides: Mapping[str, Any]) -> None:
  """Existing records of these runs must come from the same overrides."""
  for spec in runs:
    path = os.path.join(results_dir, spec.record_path)
    if os.path.isfile(path):
      rec = read_json(path)
      if rec.get("overrides") != dict(overrides):
        raise ReproduceError(
            f"{path} was made with overrides {rec.get('overrides')}, not "
            f"{dict(overrides)}; use another --results directory")


def format_duration(seconds: Optional[float]) -> str:
  """"2h05m", "7m" or "unknown" (None or not finite)."""
  if seconds is None or not math.isfinite(seconds):
    return "unknown"
  minutes = int(round(seconds / 60))
  return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else (
      f"{minutes}m")


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
    """The runs that have a record under `results_dir`."""
    return [s for s in self.runs
            if os.path.isfile(os.path.join(self.results_dir, s.record_path))]

  def line(self, running: Sequence[RunSpec], what: str = "running") -> str:
    """One line: runs done, `running` (named, as `what`), pending, time
    left.

    A pending run that another live process trains now (several commands
    sharing the grid, `workdir_lock.holder`) counts as running there, in a
    lane of its own: the time left is that of the lanes together."""
    done = set(self.done())
    running = list(running)
    pending = [s for s in self.runs if s not in done and s not in running]
    elsewhere = [s for s in pending
                 if workdir_lock.holder(self.run_dir(s)) is not None]
    pending = [s for s in pending if s not in elsewhere]
    lanes = self.lanes + len(elsewhere)
    records = load_records(self.results_dir)
    free_at = [0.0] * lanes  # When each lane finishes its runs so far.
    for s in running + elsewhere + pending:
      done_epochs = epochs_logged(self.run_dir(s))
      est = estimate_seconds(s, records, done_epochs)
      if est is None:
        free_at = None
        break
      free_at[free_at.index(min(free_at))] += est
    left = None if free_at is None else max(free_at)
    at_once = f" ({lanes} runs at a time)" if lanes > 1 else ""
    now = ", ".join(self.label(s) for s in running) or "-"
    if elsewhere:
      now += f" (+{len(elsewhere)} in other processes)"
    return (f"[{len(done)} done | {what} {now} | {len(pending)} pending] "
            f"estimated time left {format_duration(left)}{at_once}")

  def show(self, running: Sequence[RunSpec]) -> None:
    """Prints `line(running)`."""
    print(self.line(running), file=self.out, flush=True)


def _layout(tasks: Sequence[str], workdir: str):
  """(task -> its workdir, spec -> its run directory, spec -> its label):
  one task uses `workdir` itself, several `<workdir>/<task>` each, their
  runs labelled `<task>/<run>`."""
  several = len(tasks) > 1
  task_dirs = ({t: os.path.join(workdir, t) for t in tasks} if several
               else {tasks[0]: workdir})
  run_dir = lambda s: os.path.join(task_dirs[s.task], s.run_subdir)
  label = (lambda s: f"{s.task}/{s.name}") if several else (lambda s: s.name)
  return task_dirs, run_dir, label


def status_lines(states: Sequence[tuple[str, str, str, str, int]],
                 holders: Optional[Mapping[str, Mapping[str, Any]]] = None
                 ) -> list[str]:
  """`--status`'s table and started runs, from each run's (task, model,
  label, state, epochs logged), state "record", "started" or "not started":
  a row per (task, model) in the order first given, then a line per started
  run, naming the live process that trains it where `holders` (label ->
  `workdir_lock.holder`) has one. Shared by this module's and
  later_protocol's `status`."""
  holders = holders or {}
  lines = ["| task | model | runs | records | started | not started |",
           "|---|---|---|---|---|---|"]
  for t, m in dict.fromkeys((t, m) for t, m, *_ in states):
    mine = [state for t2, m2, _, state, _ in states if (t2, m2) == (t, m)]
    lines.append(f"| {t} | {m} | {len(mine)} | {mine.count('record')} | "
                 f"{mine.count('started')} | {mine.count('not started')} |")
  started = []
  for _, _, label, state, e in states:
    if state == "started":
      other = holders.get(label)
      now = ("" if other is None else f"; training now: process "
             f"{other['pid']} on {other['host']}")
      started.append(f"started: {label} (epoch {e} logged{now})")
  return lines + [""] + started


def status(task: Union[str, Sequence[str]], workdir: str, *,
           models: Sequence[str] = MODELS,
           learning_rates: Sequence[float] = LEARNING_RATES,
           stack_sizes: Sequence[int] = STACK_SIZES,
           restarts: int = NUM_RESTARTS,
           restart_ids: Optional[Sequence[int]] = None,
           results_dir: str = DEFAULT_RESULTS, workers: int = 1) -> str:
  """Where the grid `run_protocol` would run stands, as text; reads only.

  Per (task, model): runs with a record, runs started (epochs in their run
  directory, no record yet) and runs not started; then the runs started,
  their epochs and the live process that trains each now, if one does
  (`workdir_lock.holder`), and `Progress`'s line (the time left at
  `workers` runs at a time, or as many as are training now if more, the
  started runs counted as running). Starts
  nothing, claims nothing and imports no JAX, so it can run beside the grid
  it describes.
  """
  tasks = parse_tasks(task)
  runs = plan_tasks(tasks, models, learning_rates, stack_sizes, restarts,
                    restart_ids)
  _, run_dir, label = _layout(tasks, workdir)
  progress = Progress(runs, results_dir, run_dir, label=label,
                      lanes=max(int(workers), 1))
  done = set(progress.done())
  epochs = {s: epochs_logged(run_dir(s)) for s in runs if s not in done}
  # The live process training each run now (its first epoch too).
  holders = {s: workdir_lock.holder(run_dir(s)) for s in epochs}
  holders = {s: h for s, h in holders.items() if h}
  started = [s for s, e in epochs.items() if e > 0 or s in holders]
  states = sorted(  # task by task, models in MODELS' order
      ((s.task, s.model, label(s),
        "record" if s in done else "started" if s in started
        else "not started", epochs.get(s, 0)) for s in runs),
      key=lambda x: (tasks.index(x[0]), MODELS.index(x[1])))
  where = (results_dir if os.path.isdir(results_dir)
           else f"{results_dir} (no such directory yet)")
  lines = [f"reproduce {', '.join(tasks)}: {len(runs)} runs, {len(done)} "
           f"with a record in {where}, {len(started)} started, "
           f"{len(runs) - len(done) - len(started)} not started", ""]
  lines += status_lines(states, {label(s): h for s, h in holders.items()})
  # Started, training now or not (stopped, or killed): the lines above say.
  # Runs trained at once: `workers`, or as many as are training now (several
  # commands sharing the grid), whichever is more.
  progress.lanes = max(progress.lanes, len(holders))
  lines.append(progress.line(started, what="started"))
  return "\n".join(lines)


def _left_to(other: Mapping[str, Any], name: str, out) -> None:
  """Says that run `name` is left to `other`, the live process holding its
  run directory (another `reproduce` over the same workdir, e.g. on another
  machine sharing it): this one goes on with the next run."""
  print(f"left to process {other['pid']} on {other['host']}, which trains "
        f"it: {name}", file=out, flush=True)


def _record_finished(spec, run_dir, results_dir, overrides, maker) -> bool:
  results_path = os.path.join(run_dir, "results.json")
  if not os.path.isfile(results_path):
    return False
  if not read_json(results_path).get("finished"):
    return False
  write_json_atomic(os.path.join(results_dir, spec.record_path),
                    make_record(spec, run_dir, overrides, maker))
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

  A run whose directory another live process holds (another `reproduce`
  over the same workdir: a second command on this machine, or one on
  another machine sharing the directory) is left to it
  (`workdir_lock.holder`): this one trains the next. So several commands
  can share one grid; each writes the records of the runs it finished.

  Returns:
    {"finished": bool (every run has a record), "stopped": bool (the
    budget stopped it), "done": [names], "pending": [names], "execution"};
    with several tasks the names start with "<task>/". Pending without
    "stopped": left to other processes.
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
  from nsrnn_jax import loop  # pylint: disable=g-import-not-at-top
  mode, why = choose_execution(execution, jax.default_backend())
  if workers > 1 and mode != "sequential":
    raise ReproduceError(f"--workers={workers} needs the sequential "
                         f"execution, not {mode} ({why}); use "
                         "--execution=sequential or --workers=1")
  task_dirs, run_dir, label = _layout(tasks, workdir)
  if several:
    check_workdir(workdir, SEVERAL_TASKS, stored_overrides)
  for t in tasks:  # Every task's workdir is claimed before any run starts.
    check_workdir(task_dirs[t], t, stored_overrides)
  check_results_dir(results_dir, runs, stored_overrides)
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
  maker = made_by()
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
        label, run_dir, groups)
  elif mode == "sequential":
    trained = False

    def train_one(spec) -> str:
      """Trains `spec` here: "done", "stopped" (the budget) or "left" (to
      the live process that holds its directory)."""
      if _record_finished(spec, run_dir(spec), results_dir, overrides,
                          maker):
        return "done"  # Finished earlier, record not yet written.

      def train():
        nonlocal trained
        if trained:
          # Every run compiles its own programs (its train state's static
          # fields, the model's apply function and the optimizer, are new
          # objects, so the jitted steps trace again) and JAX keeps them
          # all: on the CPU each holds memory mappings (a tiny NS-RNN run
          # adds ~2,100 and takes as long with the caches kept as cleared),
          # and a third NS-RNN run in one process hit the kernel's limit
          # (65,530) and died in LLVM ("Cannot allocate memory").
          loop.drop_compiled_programs()
        trained = True
        progress.show([spec])
        return train_fn(configs[spec], run_dir(spec),
                        should_stop=budget.expired)

      other, results = workdir_lock.run_claimed(run_dir(spec), train)
      if other is not None:
        _left_to(other, label(spec), out)
        return "left"
      if not results.get("finished"):
        return "stopped"
      _record_finished(spec, run_dir(spec), results_dir, overrides,
                       maker)
      return "done"

    queue = pending()
    retried = set()
    while queue and not stopped:
      left_to_others = []
      for spec in queue:
        if budget.expired():
          stopped = True
          break
        outcome = train_one(spec)
        if outcome == "stopped":
          stopped = True
          break
        if outcome == "left":
          left_to_others.append(spec)
      # A run left to a process that has since stopped (or died) without
      # finishing it is free again: one more round for those (once each: a
      # run that keeps being taken is left to the next invocation).
      not_done = set(pending())
      queue = [s for s in left_to_others if s in not_done and s not in
               retried and workdir_lock.holder(run_dir(s)) is None]
      retried.update(queue)
  else:
    stopped = _run_model_axis(pending(), configs, task_dirs, run_dir,
                              results_dir, overrides, maker, budget,
                              progress, label, out)
  left = pending()
  if left and stopped:
    print(f"stopped at the budget ({budget_minutes:g} min): "
          f"{len(runs) - len(left)} of {len(runs)} runs done. Continue with:\n"
          f"  {continue_command()}", file=out, flush=True)
  elif not left:
    print(f"all {len(runs)} runs of {', '.join(tasks)} done; records in "
          f"{results_dir}. Regenerate the report with: python -m "
          "nsrnn_jax.reproduce --report", file=out, flush=True)
  else:
    print(f"{len(runs) - len(left)} of {len(runs)} runs done; the other "
          f"{len(left)} are being trained by other processes (their run "
          "directories are held). Rerun this command when they stop: it "
          "writes the records of the runs they finished and trains any "
          "they left.", file=out, flush=True)
  return {"finished": not left, "stopped": bool(left and stopped),
          "execution": mode,
          "done": [label(s) for s in runs if s not in left],
          "pending": [label(s) for s in left]}


def _claim_all(run_dirs: Sequence[str]) -> Optional[contextlib.ExitStack]:
  """Claims every run directory (`workdir_lock.CLAIM_FILE`), or none: the
  held claims (close the stack to release them), or None if another live
  process holds one of them."""
  if any(workdir_lock.holder(d) is not None for d in run_dirs):
    return None   # Asked first: a group left creates nothing.
  stack = contextlib.ExitStack()
  try:
    for d in run_dirs:
      stack.enter_context(workdir_lock.hold(d, workdir_lock.CLAIM_FILE))
  except workdir_lock.WorkdirInUse:   # Taken since: release ours.
    stack.close()
    return None
  return stack


def _run_model_axis(runs, configs, task_dirs, run_dir, results_dir,
                    overrides, maker, budget, progress, label, out) -> bool:
  """Trains each (task, model, m) group's runs at once with grid.run_grid.

  A group trains as a whole: it is claimed as a whole before it starts, and
  left to the other processes if one of them holds any of its runs. As on
  the sequential path, a group left to a process that has since stopped
  without finishing it gets one more round at the end.
  """
  groups: dict[tuple[str, str], list[RunSpec]] = {}
  for spec in runs:
    groups.setdefault((spec.task, spec.group), []).append(spec)
  trained = False

  def try_group(task, name, specs) -> str:
    """"left", "stopped" (the budget) or "done" for one group."""
    nonlocal trained
    claims = _claim_all([run_dir(s) for s in specs])
    if claims is None:
      held = [(s, workdir_lock.holder(run_dir(s))) for s in specs]
      held = [(s, h) for s, h in held if h] or [(s, None) for s in specs]
      _left_to(held[0][1] or {"pid": "?", "host": "?"},
               ", ".join(label(s) for s, _ in held), out)
      return "left"
    with claims:
      stopped = _train_group(trained, task, name, specs, configs, task_dirs,
                             run_dir, results_dir, overrides, maker, budget,
                             progress)
    trained = True
    return "stopped" if stopped else "done"

  left = []
  for (task, name), specs in groups.items():
    if budget.expired():
      return True
    outcome = try_group(task, name, specs)
    if outcome == "stopped":
      return True
    if outcome == "left":
      left.append((task, name))
  # Once each: the runs of a left group its holder did not finish, if no
  # live process holds any of them now.
  done = set(progress.done())
  for task, name in left:
    specs = [s for s in groups[(task, name)] if s not in done]
    if not specs or any(workdir_lock.holder(run_dir(s)) is not None
                        for s in specs):
      continue
    if budget.expired() or try_group(task, name, specs) == "stopped":
      return True
  return False


def _train_group(after_another, task, name, specs, configs, task_dirs,
                 run_dir, results_dir, overrides, maker, budget,
                 progress) -> bool:
  """One claimed group of `_run_model_axis` (`after_another`: not the first
  this process trains); True if the budget stopped it."""
  from nsrnn_jax import grid  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import loop  # pylint: disable=g-import-not-at-top
  if after_another:
    loop.drop_compiled_programs()  # As between sequential runs.
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
    _record_finished(spec, run_dir(spec), results_dir, overrides, maker)
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


# "ValueError: ...", "jax.errors.JaxRuntimeError: ...", "KeyboardInterrupt".
_EXCEPTION_LINE = re.compile(
    r"([\w.]+\.)?\w*(Error|Exception|Interrupt)(:|$)")


def failure_line(path: str, start: int = 0) -> str:
  """The line of a failed worker's log that says why ('' if none).

  The worker's own one-line error (`error: ...`) where it printed one, else
  its last exception line (`SomethingError: ...`), else its last line. Not
  simply the last line: threads and warnings still write after the error
  (a failed checkpoint save ended its log with "RuntimeWarning: Enable
  tracemalloc to get the object allocation traceback"). Reads from byte
  `start`, where this attempt's output begins (a rerun appends to the log).
  """
  try:
    with open(path, "rb") as f:
      f.seek(start)
      text = f.read().decode(errors="replace")
  except OSError:
    return ""
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  for says_why in (lambda l: l.startswith("error: "), _EXCEPTION_LINE.match):
    found = [l for l in lines if says_why(l)]
    if found:
      return found[-1]
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
                 log_dir_of, label, run_dir_of, groups=None) -> bool:
  """Trains `runs` in up to `workers` processes at once; True if stopped.

  Each worker trains one run and writes its record. A worker stopped by the
  budget (exit 3) stops the launches; a failed one stops them too, the
  others finish their runs, then a ReproduceError names it and its log. An
  interrupt of this process interrupts the workers (each keeps its last
  checkpoint) and waits for them. With `groups` (`core_groups`), each
  worker runs on a share of the cores no other running worker has. A run
  whose directory (`run_dir_of`) another live process holds is left to it
  (`workdir_lock.holder`), at launch or by its worker.
  """
  import signal  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import parallel  # pylint: disable=g-import-not-at-top
  free_groups = list(groups or [])
  env = dict(os.environ)
  # The workers import this copy of the package, wherever it is installed.
  env["PYTHONPATH"] = os.pathsep.join(
      [REPO_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  queue = list(runs)
  is_done = lambda spec: spec in set(progress.done())
  # Runs left to other processes, and those given a second round.
  deferred, retried = [], set()
  # RunSpec -> (Popen, log file object, log path, its cores or None)
  running: dict = {}
  failed = []
  stopped = False
  try:
    while True:  # Ends when nothing runs and nothing is left to launch.
      launched = False
      while queue and len(running) < workers and not (stopped or failed):
        minutes = budget.minutes_left()
        if minutes is not None and minutes <= 0:
          stopped = True
          break
        spec = queue.pop(0)
        other = workdir_lock.holder(run_dir_of(spec))
        if other is not None:
          _left_to(other, label(spec), out)
          deferred.append(spec)
          continue
        log_dir = log_dir_of(spec)
        os.makedirs(log_dir, exist_ok=True)
        path = os.path.join(log_dir, f"{spec.model}-{spec.setting}-restart_"
                            f"{spec.restart}.log")
        argv = make_argv(spec, minutes)
        cores = free_groups.pop(0) if free_groups else None
        if cores is not None:
          argv.append(f"--cpu_cores={parallel.format_cores(cores)}")
        log = open(path, "a")  # pylint: disable=consider-using-with
        start = os.path.getsize(path)   # This attempt's output from here.
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                env=env, stdin=subprocess.DEVNULL)
        running[spec] = (proc, log, (path, start), cores)
        launched = True
      if launched:
        progress.show(list(running))
      if not running:
        # A run left to a process that has since stopped (or died) without
        # finishing it is free again: one more round for those (once each).
        again = [s for s in deferred if s not in retried and not is_done(s)
                 and workdir_lock.holder(run_dir_of(s)) is None]
        if again and not (stopped or failed or queue):
          retried.update(again)
          deferred = [s for s in deferred if s not in again]
          queue.extend(again)
          continue
        break
      time.sleep(WORKER_POLL_SECONDS)
      for spec, (proc, log, (path, start), cores) in list(running.items()):
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
          failed.append((spec, code, path, start))
          # Said now: the error itself waits for the running workers.
          print(f"failed {label(spec)} (exit code {code}): "
                f"{failure_line(path, start) or 'no output'}; no new run "
                f"starts, {len(running)} still running", file=out,
                flush=True)
        elif not is_done(spec):
          # It found the run held by another process (its own log says
          # which) and left it.
          print(f"left to another process: {label(spec)} (the worker "
                f"found its run directory held; {path})", file=out,
                flush=True)
          deferred.append(spec)
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
    spec, code, path, start = failed[0]
    more = f" ({len(failed) - 1} more failed)" if len(failed) > 1 else ""
    reason = failure_line(path, start) or "no output"
    raise ReproduceError(f"run {label(spec)} failed in its worker (exit code "
                         f"{code}): {reason}; its log: {path}{more}")
  return stopped or bool(queue)


def continue_command() -> str:
  """The command line of this invocation (rerun it to continue)."""
  import shlex  # pylint: disable=g-import-not-at-top
  return " ".join(["python -m nsrnn_jax.reproduce"] +
                  [shlex.quote(a) for a in sys.argv[1:]])


# ---------------------------------------------------------------------------
# CLI.
# ---------------------------------------------------------------------------


def _split_list(value: str, cast, what: str) -> list:
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  return cli.comma_list(value, f"--{what}", cast)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """CLI entry point; returns the exit code (2 with one line on bad input)."""
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  parser = cli.OneLineArgumentParser(prog="python -m nsrnn_jax.reproduce",
                                     description=__doc__.split("\n\n")[0],
                                     error_type=ReproduceError)
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
  parser.add_argument("--status", action="store_true",
                      help="print where the grid of --task/--workdir (and "
                      "the grid flags) stands: records, runs started and "
                      "their epochs, time left at --workers; runs nothing "
                      "and can run beside the grid")
  parser.add_argument("--report_path", default=reproduction_report.DEFAULT_REPORT,
                      help="where --report writes the Markdown report")
  parser.add_argument("--selection", default="mean", choices=reproduction_report.SELECTIONS,
                      help="mean: the paper's (best mean over restarts); "
                      "best_run: the later papers' (best single run)")
  try:
    args = parser.parse_args(argv)
    if args.report and (args.status or args.task is not None or args.set):
      raise ReproduceError("--report reads every record under --results "
                           "and stands alone (no --status, --task or --set)")
    if args.report:
      for path in reproduction_report.write_report(args.results, args.report_path,
                               args.selection):
        print(path)
      pending = reproduction_report.uncommitted_records(args.results)
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
    if args.workers < 1:
      raise ReproduceError(f"--workers must be an integer >= 1 (got "
                           f"{args.workers})")
    for flag, path in (("--workdir", args.workdir), ("--results", args.results)):
      if os.path.exists(path) and not os.path.isdir(path):
        raise ReproduceError(f"{flag} {path!r} is a file, not a directory")
    if args.status:
      print(status(tasks, args.workdir, models=models, learning_rates=lrs,
                   stack_sizes=sizes, restarts=args.restarts,
                   restart_ids=restart_ids, results_dir=args.results,
                   workers=args.workers))
      return 0
    from nsrnn_jax import checkpointing  # pylint: disable=g-import-not-at-top
    from nsrnn_jax import parallel  # pylint: disable=g-import-not-at-top
    # Before any run: a record that cannot be written would be found only
    # after its run trained.
    checkpointing.check_writable(args.workdir, "--workdir")
    checkpointing.check_writable(args.results, "--results")
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
  except (ValueError, OSError) as e:
    # ReproduceError, config validation errors, and files that cannot be
    # written (e.g. --report_path a directory).
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    cli.interrupted("every run keeps its last checkpoint (one per epoch); "
                    "rerun the same command to continue")
  # 3: stopped at the budget (rerun to continue); 0 also when the runs
  # not done are left to other processes that hold them.
  return 3 if result["stopped"] else 0


if __name__ == "__main__":
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  cli.run_argparse_command(main)
