"""The paper's protocol grid and the records of its runs.

What `reproduce` runs and what it writes, shared by the runner and the
report (`reproduction_report`): the grid's constants (tasks, models,
learning rates, JM/Gref stack sizes, restarts and their seeds), `RunSpec`
(one run: its setting name, run directory and record path) and `plan`
(all runs of one task, restart-major), and the records themselves
(format `RECORD_FORMAT`, documented in results/README.md): made from a
finished run's directory, written atomically, loaded and checked, and the
training time they imply for runs still to come.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import threading
from typing import Any, Mapping, Optional, Sequence

import numpy as np

RECORD_FORMAT = "nsrnn_jax.run_record.v1"
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

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RESULTS = os.path.join(REPO_ROOT, "results")


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
    """`<model>/<setting>/restart_<r>`."""
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

  Raises:
    ReproduceError: an unknown task or model, no model, a learning rate or
      stack size that is not positive, restarts < 1, a restart id outside
      [0, restarts) (a plan of nothing would report itself finished).
  """
  if task not in TASKS:
    raise ReproduceError(f"unknown task {task!r}; expected one of "
                         f"{', '.join(TASKS)}")
  if isinstance(models, str) or not models or any(
      m not in MODELS for m in models):
    raise ReproduceError(f"models must be a non-empty list of "
                         f"{', '.join(MODELS)} (got {models!r})")
  if isinstance(restarts, bool) or not isinstance(
      restarts, (int, np.integer)) or restarts < 1:
    raise ReproduceError(f"restarts must be an integer >= 1 (got "
                         f"{restarts!r})")
  if restart_ids is not None and (
      isinstance(restart_ids, (str, int)) or not restart_ids
      or any(isinstance(r, bool) or r not in range(restarts)
             for r in restart_ids)):
    raise ReproduceError(f"restart_ids must be a non-empty list of integers "
                         f"in [0, {restarts}) (got {restart_ids!r})")
  for name, values, ok in (
      ("learning_rates", learning_rates,
       lambda v: isinstance(v, (int, float, np.number)) and 0 < v < math.inf),
      ("stack_sizes", stack_sizes,
       lambda v: isinstance(v, (int, np.integer)) and v >= 1)):
    if isinstance(values, (str, int, float)) or not values or not all(
        ok(v) and not isinstance(v, bool) for v in values):
      raise ReproduceError(f"{name} must be a non-empty list of positive "
                           f"numbers (got {values!r})")
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


def code_version(root: Optional[str] = None) -> dict[str, Any]:
  """The code a run trains with: the package checkout's git commit.

  {"commit": HEAD's hash, "modified": whether nsrnn_jax/ or configs/ differ
  from it (uncommitted or untracked files)}; both None where the package is
  not the top of a git checkout (e.g. installed into site-packages) or git
  is unavailable. Take it when the process starts, as its modules are
  imported then: the checkout can move on while a long command runs.
  Training is chaotic: code that rounds differently (same function) can
  change when a run learns, so a record names the code that made it.

  Args:
    root: the checkout to read; default, the one holding this package.
  """
  if root is None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  unknown = {"commit": None, "modified": None}

  def git(*args):
    return subprocess.run(["git", *args], cwd=root, capture_output=True,
                          text=True, timeout=60, check=True).stdout.strip()

  try:
    top = git("rev-parse", "--show-toplevel")
    if os.path.realpath(top) != os.path.realpath(root):
      return unknown            # e.g. site-packages inside some other repo
    commit = git("rev-parse", "HEAD")
    changes = git("status", "--porcelain", "--", "nsrnn_jax", "configs")
  except (OSError, subprocess.SubprocessError):
    return unknown
  return {"commit": commit, "modified": bool(changes)}


def unknown_field(flag: str, field: str, fields) -> ReproduceError:
  """The one-line error for `--set field=...` naming no config field, with
  the fields it may have meant: those holding all of its words (e.g.
  test_strings_per_length for test_per_length), then the closest spellings.
  """
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  guesses = cli.similar_fields(field, fields)
  hint = f"; did you mean {' or '.join(guesses)}?" if guesses else ""
  return ReproduceError(f"{flag} {field}: unknown config field{hint} "
                        "(fields: configs/default.py)")


def set_field(config, flag: str, field: str, value: Any) -> None:
  """config[field] = value for `--set field=value`, or a one-line error
  naming the field where the value is not of its type (ml_collections
  refuses, e.g., hidden_size=abc)."""
  if field not in config:
    raise unknown_field(flag, field, config.keys())
  try:
    config[field] = value
  except (TypeError, ValueError) as e:
    old = config[field]
    kind = (f"{type(old).__name__} values" if old is not None
            else "values of another type")
    raise ReproduceError(f"{flag} {field}={value!r}: the field holds "
                         f"{kind} (configs/default.py)") from e


def made_by() -> dict[str, Any]:
  """What a record says made it: {"hardware": `hardware()`, "code":
  `code_version()`}. Take it once when an invocation starts (see
  `code_version`) and pass it to `make_record` for every run it finishes."""
  return {"hardware": hardware(), "code": code_version()}


def read_json(path: str):
  """A JSON file's contents."""
  with open(path) as f:
    return json.load(f)


# Per-epoch keys a record keeps where the run measured them: the share
# stack's product margin on the validation strings (config.valid_stack_margin).
MARGIN_KEYS = ("valid_stack_margin", "valid_stack_exact_fraction")
# And, at the test, how many test strings the margin did not prove exact
# and the largest |ln p − ln p_float64| among them (nats).
UNPROVEN_KEYS = ("unproven_strings", "unproven_max_error")


def make_record(spec: RunSpec, run_dir: str, overrides: Mapping[str, Any],
                maker: Mapping[str, Any]) -> dict[str, Any]:
  """The committed record of a finished run, from its run directory.

  `maker` (`made_by()`) describes the invocation that finishes the run.
  """
  from nsrnn_jax import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  results = read_json(os.path.join(run_dir, "results.json"))
  config = read_json(os.path.join(run_dir, "config.json"))
  epochs = {}
  for rec in metrics_lib.read_jsonl(os.path.join(run_dir, "metrics.jsonl")):
    if "epoch" in rec and "valid_ce_diff" in rec:
      epochs[int(rec["epoch"])] = rec  # The last record of an epoch wins.
  keys = ("train_loss", "valid_ce_diff", "valid_perplexity", "learning_rate",
          "time")
  history = [{"epoch": e, **{k: epochs[e].get(k) for k in keys},
              **{k: epochs[e][k] for k in MARGIN_KEYS if k in epochs[e]}}
             for e in sorted(epochs)]
  if [h["epoch"] for h in history] != list(range(1, results["epochs"] + 1)):
    raise ReproduceError(f"{run_dir}: metrics.jsonl does not hold epochs "
                         f"1..{results['epochs']}")
  test = None
  test_path = os.path.join(run_dir, "test_by_length.json")
  if os.path.isfile(test_path):
    table = read_json(test_path)
    test = {k: table[k] for k in ("lengths", "ce_diff", "perplexity",
                                  "lower_bound_perplexity", "num_strings",
                                  "stack_margin", "stack_exact_fraction")
            if k in table}
    if "test_stack_margin_kind" in results:
      test["stack_margin_kind"] = results["test_stack_margin_kind"]
    # The strings the margin does not prove, scored again in float64.
    for key in UNPROVEN_KEYS:
      if f"test_stack_{key}" in results:
        test[key] = results[f"test_stack_{key}"]
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
      "hardware": dict(maker["hardware"]),
      "code": dict(maker["code"]),
      "finished_on": datetime.datetime.now(
          datetime.timezone.utc).date().isoformat(),
  }


def write_json_atomic(path: str, obj) -> None:
  """Writes JSON via a temporary file and a rename (never half a file).

  The temporary file is this writer's own (`<path>.<pid>-<thread>.tmp`):
  commands sharing a grid may write the same record or workdir manifest at
  once, and with one shared name the second rename would find the file
  gone (or move a file still being written). The last rename wins.
  """
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
  try:
    with open(tmp, "w") as f:
      json.dump(obj, f, indent=1, sort_keys=True)
      f.write("\n")
    os.replace(tmp, path)
  except BaseException:
    # A value JSON cannot write (or an interrupt): no half file left behind.
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def load_records(results_dir: str, task: Optional[str] = None
                 ) -> list[dict[str, Any]]:
  """Every record under results_dir (of one task if given), sorted by path."""
  out = []
  root = results_dir if task is None else os.path.join(results_dir, task)
  for dirpath, dirnames, filenames in sorted(os.walk(root)):
    for name in dirnames:
      if _is_record_name(name):
        raise ReproduceError(f"{os.path.join(dirpath, name)} is a directory,"
                             " not a record file")
    for name in sorted(filenames):
      if _is_record_name(name):
        path = os.path.join(dirpath, name)
        try:
          rec = read_json(path)
        except (OSError, json.JSONDecodeError) as e:
          raise ReproduceError(f"unreadable record {path}: {e}") from e
        check_record(rec, path)
        out.append(rec)
  return out


def _is_record_name(name: str) -> bool:
  return name.startswith("restart_") and name.endswith(".json")


def _non_finite(value: Any) -> bool:
  """Whether a number, or a list of them, holds NaN or ±inf (Python's json
  reads NaN and Infinity)."""
  if isinstance(value, list):
    return any(_non_finite(v) for v in value)
  return isinstance(value, float) and not math.isfinite(value)


# The numbers the reports average that a finished run has finite (training
# raises on a non-finite loss or validation perplexity): NaN or inf there
# is damage. (A stack margin is +inf where a string forms no product.)
_FINITE_EPOCH_KEYS = ("train_loss", "valid_ce_diff", "valid_perplexity",
                      "time")
_FINITE_TEST_KEYS = ("ce_diff", "perplexity", "lower_bound_perplexity")


# A record's fields that the reports read, and their JSON types.
_NUMBER = (int, float)
_RECORD_FIELDS = {
    "task": str, "model": str, "setting": str, "restart": int,
    "learning_rate": _NUMBER, "protocol": str, "epochs": list,
    "num_epochs": int, "best_epoch": int, "train_time_s": _NUMBER,
    "best_valid_ce_diff": _NUMBER + (type(None),),
    "last_valid_ce_diff": _NUMBER + (type(None),),
}


def check_record(rec: Any, path: str) -> None:
  """Raises ReproduceError (one line naming `path`) unless `rec` is a run
  record whose fields have their types and whose file is its own:
  restart_<r>.json for its restart r, under its task's and model's
  directories (a record copied to another restart's file would count as
  a run that never trained)."""
  if not isinstance(rec, dict) or rec.get("format") != RECORD_FORMAT:
    raise ReproduceError(f"{path} is not a {RECORD_FORMAT} record")
  for field, kind in _RECORD_FIELDS.items():
    value = rec.get(field)
    if not isinstance(value, kind) or isinstance(value, bool):
      raise ReproduceError(f"{path}: field {field!r} is {value!r}, not a "
                           "record's")
  if not all(isinstance(e, dict) for e in rec["epochs"]):
    raise ReproduceError(f"{path}: field 'epochs' holds a non-object")
  if not isinstance(rec.get("test"), (dict, type(None))):  # None: no test
    raise ReproduceError(f"{path}: field 'test' is {rec['test']!r}, not an "
                         "object")
  places = [(f, rec.get(f)) for f in _RECORD_FIELDS] + [
      (f"test.{k}", (rec.get("test") or {}).get(k))
      for k in _FINITE_TEST_KEYS]
  places += [(f"epochs[{i}].{k}", e.get(k))
             for i, e in enumerate(rec["epochs"]) for k in _FINITE_EPOCH_KEYS]
  for where, value in places:
    if _non_finite(value):
      raise ReproduceError(f"{path}: {where} holds NaN or an infinity")
  parts = os.path.normpath(path).split(os.sep)
  if (parts[-1] != f"restart_{rec['restart']}.json"
      or rec["task"] not in parts[:-1] or rec["model"] not in parts[:-1]):
    raise ReproduceError(
        f"{path} holds the record of {rec['task']}/{rec['model']}/"
        f"{rec['setting']} restart {rec['restart']}, which belongs in "
        f"its own restart_{rec['restart']}.json")


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
