"""Run directories: checkpoints (a thin wrapper over Orbax) and their safety.

A checkpoint holds two items:
  "state": the array fields of train.TrainState (params, optimizer state with
           the current learning rate, schedule and early-stopping counters,
           best parameters, epoch), saved with StandardSave;
  "host":  JSON with the data-order RNG state and batch order.

Safety rules (README "Outputs"):
* Orbax writes every step into a temporary directory and renames it only when
  complete, so a partial save is never listed; `LatestN(keep >= 2)` deletes
  old steps only after a newer one is finalised.
* A checkpoint is never deleted for being unreadable. When the newest cannot
  be read, training moves it aside to `checkpoints_unreadable/` and resumes
  from the previous one; when none can be read, `restore_latest` raises.
  Training restores no checkpoint newer than the last epoch its metrics log
  holds completely (`max_step`): newer ones (a directory put together from
  copies of different times) move to `checkpoints_ahead_of_metrics/`; when
  every kept checkpoint is newer, `restore_latest` raises.
  Reading commands (evaluate, notebooks) open checkpoints read-only.
* `check_workdir` compares a workdir's stored config.json with the requested
  config before anything is written: a difference that changes the run is a
  one-line error naming the fields.
The lock that keeps a second training process out of a run directory is
`workdir_lock.hold`.

Keeping Orbax behind these functions means a move to its V1 API touches only
this file.
"""

import contextlib
import hashlib
import io
import json
import logging as logging_std
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Mapping, Optional

from absl import logging
import jax
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any
CONFIG_FILE = "config.json"
UNREADABLE_DIR = "checkpoints_unreadable"
# Checkpoints newer than the run's metrics log (a directory put together
# from copies of different times) are moved here on resume, not deleted.
AHEAD_DIR = "checkpoints_ahead_of_metrics"

# Config fields that may change between invocations on one workdir: they
# change how a run is executed or reported, never what it computes.
RESUME_SAFE_FIELDS = frozenset({
    "progress_bar", "stop_after_epochs", "checkpoint_every_epochs",
    "checkpoints_to_keep", "compile_strategy", "length_buckets",
    # Grid members' configs carry the grid's fields; growing a grid adds
    # members without changing the existing ones.
    "grid_learning_rates", "learning_rate_grid", "num_restarts",
    "grid_model_parallel", "grid_restart_ids",
    # The NS-RNN's two dynamic programs compute the same function (the
    # exact one where the other would flush): a run may switch tables.
    "stack_table",
    # How many strings the stack runs at once, and how far the time loop is
    # unrolled: the same values (a run may move to a GPU and back).
    "stack_batch_chunk", "scan_unroll",
    # What validation also measures (the stack's product margin), not what
    # trains.
    "valid_stack_margin",
    # The controller's input by row lookup or one-hot product: same values.
    "input_lookup",
    # Where the corpus lies (a moved copy resumes; its content is checked by
    # corpus_digest, stored beside it).
    "corpus_dir",
    # Written by train_and_evaluate next to the config, derived from it.
    "alphabet", "vocab_size",
})


# ---------------------------------------------------------------------------
# Workdir checks.
# ---------------------------------------------------------------------------


def checkpoint_dir(workdir: str) -> str:
  """The checkpoint directory of a run directory."""
  return os.path.join(workdir, "checkpoints")


def check_writable(path: str, what: str = "workdir") -> None:
  """Raises ValueError unless `path` is (or can be made) a writable directory.

  Nothing is created: an existing directory is probed with a temporary file,
  a missing one must have a writable existing ancestor.
  """
  if not path:
    # os.path.abspath("") is the working directory: a run would write there.
    raise ValueError(f"{what} is an empty path; give a directory")
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"{what} {path!r} is a file, not a directory")
  probe_dir = os.path.abspath(path)
  while not os.path.exists(probe_dir):
    probe_dir = os.path.dirname(probe_dir)
  if not os.path.isdir(probe_dir):
    raise ValueError(f"{what} {path!r} cannot be created: "
                     f"{probe_dir!r} is a file")
  try:
    # A unique name: several processes (hosts) may probe one directory.
    fd, probe = tempfile.mkstemp(prefix=".nsrnn_write_probe_", dir=probe_dir)
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise ValueError(f"{what} {path!r} is not writable ({e.strerror})") from e


def read_config(workdir: str) -> dict:
  """The stored config.json of a run directory (ValueError if unusable)."""
  if not os.path.exists(workdir):
    raise ValueError(f"workdir {workdir!r} does not exist")
  if not os.path.isdir(workdir):
    raise ValueError(f"workdir {workdir!r} is a file, not a directory")
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path):
    raise ValueError(f"{workdir!r} is not a training workdir: no {CONFIG_FILE}")
  try:
    with open(path) as f:
      stored = json.load(f)
  except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path} is unreadable: {e}") from e
  if not isinstance(stored, dict):
    raise ValueError(f"{path} is not a config (a JSON object of fields)")
  return stored


def config_differences(stored: Mapping[str, Any],
                       requested: Mapping[str, Any]) -> list[str]:
  """Fields that differ and change the run, as 'name (stored X, requested Y)'.

  Only fields present in both are compared: a field added to (or removed
  from) configs/default.py after the run started does not block a resume.
  Exceptions: a run stored before `predict_eos` existed predicted no EOS
  (its model has V outputs), so a missing field counts as False there; one
  stored before the JM variants had `jm_num_stacks` 1 and
  `jm_push_hidden_state` False.
  """
  out = []
  if "predict_eos" in requested:
    stored = {"predict_eos": False, **stored}
  # Runs stored before the JM variants existed had one stack with a learned
  # push layer.
  for name, before in (("jm_num_stacks", 1), ("jm_push_hidden_state", False)):
    if name in requested:
      stored = {name: before, **stored}
  for name in sorted(set(stored) & set(requested) - RESUME_SAFE_FIELDS):
    a, b = stored[name], requested[name]
    if json.loads(json.dumps(a)) != json.loads(json.dumps(b)):
      out.append(f"{name} (stored {a!r}, requested {b!r})")
  return out


def _holds_checkpoints(workdir: str) -> bool:
  """Whether `workdir` holds a checkpoint (also one moved aside)."""
  for name in ("checkpoints", UNREADABLE_DIR, AHEAD_DIR):
    path = os.path.join(workdir, name)
    if os.path.isdir(path) and os.listdir(path):
      return True
  return False


def run_started(workdir: str) -> bool:
  """Whether `workdir` holds any trained state: a checkpoint (also one moved
  aside) or a logged metric. A config.json alone (a run that failed before
  its first epoch, e.g. out of memory) is not."""
  if _holds_checkpoints(workdir):
    return True
  log = os.path.join(workdir, "metrics.jsonl")
  return os.path.isfile(log) and os.path.getsize(log) > 0


def check_workdir(workdir: str, config_json: Mapping[str, Any]) -> None:
  """Raises a one-line ValueError before a run would write into `workdir`.

  Checks that the workdir is (or can be) a writable directory and that a
  stored config.json, if any, does not differ in fields that change the run
  -- unless the stored run never started (`run_started`): then the new
  config replaces it. Checkpoints without config.json are refused.
  Touches nothing.
  """
  check_writable(workdir)
  if not os.path.exists(os.path.join(workdir, CONFIG_FILE)):
    if _holds_checkpoints(workdir):
      # Resuming would train on with the checkpoint's state under whatever
      # config is requested, and record that config as the run's. (A
      # metrics.jsonl alone resumes nothing: the run starts anew.)
      raise ValueError(
          f"{workdir!r} holds checkpoints but no {CONFIG_FILE}, so the "
          "requested config cannot be checked against the run they "
          f"resume: restore {CONFIG_FILE}, or use a new --workdir")
    return
  diffs = config_differences(read_config(workdir), config_json)
  if diffs and run_started(workdir):
    raise ValueError(
        f"{workdir!r} holds a run with a different config: {'; '.join(diffs)}."
        " Use a new --workdir, or the stored values to resume")


def write_config(workdir: str, config_json: Mapping[str, Any]) -> None:
  """Writes config.json unless the workdir already has one of a run that
  started (`run_started`: that run's own config is kept)."""
  os.makedirs(workdir, exist_ok=True)
  if (not os.path.exists(os.path.join(workdir, CONFIG_FILE))
      or not run_started(workdir)):
    write_json(workdir, CONFIG_FILE, config_json)


def write_json(directory: str, name: str, value: Any) -> None:
  """Writes `value` as indented, sorted JSON (via a rename: never partial)."""
  path = os.path.join(directory, name)
  with open(path + ".tmp", "w") as f:
    json.dump(value, f, indent=1, sort_keys=True)
  os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------
# Orbax.
# ---------------------------------------------------------------------------


def make_manager(directory: str, keep: int = 2,
                 read_only: bool = False) -> ocp.CheckpointManager:
  """Creates (or opens) a checkpoint directory.

  Saves are synchronous: `save` returns once the checkpoint is final, so a
  background write would overlap nothing. Orbax's asynchronous save also
  hands its steps between threads with a 300 s wall-clock timeout, and a
  process paused mid-save for longer (a laptop suspended, a job stopped
  with SIGSTOP) failed that save and ended the run on resuming; the
  synchronous save waits on nothing (tests/checkpointing_test.py).

  Args:
    directory: absolute or relative path; created if missing (unless
      read_only).
    keep: number of most recent checkpoints kept (>= 2 recommended).
    read_only: never create, save or delete anything (reading commands).
  """
  options = ocp.CheckpointManagerOptions(
      preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
      enable_async_checkpointing=False,
      create=not read_only, read_only=read_only,
      # Read-only managers never save; Orbax warns when this is left > 0.
      save_interval_steps=0 if read_only else 1)
  with _without_read_only_notice():
    return ocp.CheckpointManager(os.path.abspath(directory), options=options,
                                 item_names=("state", "host"))


class _ReadOnlyNoticeFilter:
  """Drops Orbax's "Given directory is read only" warning (a logging filter).

  Orbax logs it at WARNING whenever a manager is opened read-only, which
  every reading command (evaluate, scoring, a grid's resume) does on
  purpose: it would be the only line of an otherwise quiet command's
  stderr.
  """

  def filter(self, record) -> bool:
    return not str(record.msg).startswith("Given directory is read only")


@contextlib.contextmanager
def _without_read_only_notice():
  """Filters Orbax's read-only notice out of absl's logger for a block."""
  logger = logging.get_absl_logger()
  notice_filter = _ReadOnlyNoticeFilter()
  logger.addFilter(notice_filter)
  try:
    yield
  finally:
    logger.removeFilter(notice_filter)


_CLOSED_LOOP_ERROR = "RuntimeError: Event loop is closed"


# The Orbax coroutine that reads one array of a checkpoint.
_ARRAY_READ_COROUTINE = "_read_array_index_and_device_put"


class _AbandonedReadFilter(logging_std.Filter):
  """Drops asyncio's "exception was never retrieved" for abandoned reads.

  The reads a failed restore leaves behind (see
  `_without_closed_loop_tracebacks`) end in exceptions nobody awaits, which
  asyncio logs with their whole tensorstore spec when the garbage collector
  reaches them, at any later point of the run. Only those are dropped: the
  message names an array read, or (a `gather` of reads, whose message holds
  only the exception's text) its traceback passes through one.
  """

  def filter(self, record) -> bool:
    message = record.getMessage()
    return not ("exception was never retrieved" in message
                and ("tensorstore" in message
                     or "async_deserialize" in message
                     or _ARRAY_READ_COROUTINE in message
                     or _raised_in_array_read(record.exc_info)))


def _raised_in_array_read(exc_info) -> bool:
  """Whether a logged exception was raised inside Orbax's array read."""
  traceback = exc_info[2] if exc_info else None
  while traceback is not None:
    if traceback.tb_frame.f_code.co_name == _ARRAY_READ_COROUTINE:
      return True
    traceback = traceback.tb_next
  return False


_ABANDONED_READ_FILTER = _AbandonedReadFilter()


def _drop_abandoned_read_reports() -> None:
  """Drops what Python reports later about the array reads a failed
  restore left behind: asyncio's "exception was never retrieved"
  (`_ABANDONED_READ_FILTER`), "Exception ignored in <coroutine ...>" with
  the array's whole tensorstore spec (sys.unraisablehook, when the garbage
  collector or the interpreter's exit reaches them; ~1,200 lines for one
  restore of a model whose shapes differ) and "coroutine ... was never
  awaited". Any other unraisable exception still goes to the previous
  hook. Idempotent."""
  # Idempotent: a logger holds a filter object once.
  logging_std.getLogger("asyncio").addFilter(_ABANDONED_READ_FILTER)
  if getattr(sys.unraisablehook, "_nsrnn_drops_reads", False):
    return
  previous = sys.unraisablehook

  def hook(unraisable):
    code = getattr(unraisable.object, "cr_code", None)
    if getattr(code, "co_name", None) != _ARRAY_READ_COROUTINE:
      previous(unraisable)

  hook._nsrnn_drops_reads = True  # pylint: disable=protected-access
  sys.unraisablehook = hook
  warnings.filterwarnings(
      "ignore", message=f"coroutine '{_ARRAY_READ_COROUTINE}' was never "
      "awaited", category=RuntimeWarning)


class _HeldStderr:
  """What `_without_closed_loop_tracebacks` yields: mark a failed read."""

  def __init__(self):
    self.buffer = io.StringIO()
    self.read_failed = False


@contextlib.contextmanager
def _without_closed_loop_tracebacks():
  """Drops the tracebacks a failed Orbax restore prints, keeps other stderr.

  When one array of a damaged checkpoint fails to read, Orbax stops and
  closes its event loop while tensorstore still finishes the other reads;
  each late read's callback then fails with "Event loop is closed" and its
  traceback is printed to sys.stderr from tensorstore's threads, outside any
  exception handler (up to hundreds per restore, depending on a race). The
  restore already reports the checkpoint as unreadable in one line, so these
  tracebacks are noise: stderr is held for the block and written back
  without them. After a failed read (the caller sets `read_failed`) the
  block waits for the late callbacks to stop (at most a second) before it
  hands stderr back. The swap is process-wide: one restore at a time (as
  `restore_latest` runs them).
  """
  held = _HeldStderr()
  real_stderr = sys.stderr
  sys.stderr = held.buffer
  try:
    yield held
  finally:
    try:
      if held.read_failed:
        quiet_polls, size = 0, -1
        for _ in range(40):
          time.sleep(0.025)
          new_size = len(held.buffer.getvalue())
          quiet_polls = quiet_polls + 1 if new_size == size else 0
          size = new_size
          if quiet_polls == 4:
            break
    finally:
      # Also after a Ctrl-C in the wait: stderr must never stay held, nor
      # what it held be lost.
      sys.stderr = real_stderr
      text = held.buffer.getvalue()
      if _CLOSED_LOOP_ERROR in text:
        # Threads interleave their lines, so drop every line a traceback
        # of this kind is made of rather than matching whole blocks.
        text = "".join(
            line for line in text.splitlines(keepends=True)
            if not (line.startswith((" ", "\t",
                                     "Traceback (most recent call"))
                    or line.strip() == _CLOSED_LOOP_ERROR))
      if text:
        real_stderr.write(text)
        real_stderr.flush()


@contextlib.contextmanager
def interrupts_deferred():
  """Holds back Ctrl-C (SIGINT) until the block ends, then raises it.

  An interrupt inside a save leaves it unfinished (with Orbax's background
  save, which this module used before, also its finalising thread running
  into interpreter shutdown: a traceback, exit status 1); deferred, the
  save completes (seconds) first. Only the main thread can take signals;
  elsewhere this does nothing.
  """
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  received = []
  previous = signal.signal(signal.SIGINT,
                           lambda signum, frame: received.append(frame))
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)
    if received:
      if previous is signal.default_int_handler:
        raise KeyboardInterrupt
      if callable(previous):
        previous(signal.SIGINT, received[-1])


# Key of the state's checksum in a checkpoint's host item.
DIGEST_KEY = "state_sha256"


def state_digest(state: PyTree) -> Optional[str]:
  """SHA-256 of every leaf's dtype, shape and bytes (in tree order).

  None when a leaf is not fully addressable (sharded across processes),
  where one process cannot read it whole.
  """
  leaves = jax.tree.leaves(state)
  if not all(getattr(x, "is_fully_addressable", True) for x in leaves):
    return None
  h = hashlib.sha256()
  for x in leaves:
    a = np.ascontiguousarray(np.asarray(jax.device_get(x)))
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def save(manager: ocp.CheckpointManager, step: int, state: PyTree,
         host: dict) -> None:
  """Saves `state` (pytree of arrays) and `host` (JSON-able dict) at `step`.

  Returns once the checkpoint is final on disk, so a kill leaves either the
  whole checkpoint or none of it (a partial save is a tmp directory that
  restore ignores); an interrupt (Ctrl-C) waits for the save to finish.
  The host item also holds the state's `state_digest`, which restore checks:
  damaged bytes that still decode are an unreadable checkpoint, not silently
  different numbers.
  """
  digest = state_digest(state)
  if digest is not None:
    host = {**host, DIGEST_KEY: digest}
  with interrupts_deferred():
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), host=ocp.args.JsonSave(host)),
                 force=True)
    manager.wait_until_finished()


def restore_latest(manager: ocp.CheckpointManager, target: PyTree,
                   move_aside: bool = False, max_step: Optional[int] = None
                   ) -> Optional[tuple[int, PyTree, dict]]:
  """Restores the newest readable checkpoint (of step <= max_step, if given).

  Args:
    manager: from `make_manager`.
    target: a pytree with the structure, shapes and dtypes of the saved state
      (e.g. a freshly initialised state).
    move_aside: move unreadable checkpoints newer than the restored one to
      `checkpoints_unreadable/`, and those above `max_step` to
      `checkpoints_ahead_of_metrics/`, next to the checkpoint directory, so
      that training can save those steps again (training only; never
      deletes).
    max_step: restore no newer step (training: the last epoch its metrics
      log holds completely, `metrics.last_complete_epoch`).

  Returns:
    (step, state, host), or None when the directory holds no checkpoint.

  Raises:
    ValueError: there are checkpoints but none is readable, or all are newer
      than `max_step` (nothing moved).
  """
  manager.wait_until_finished()
  manager.reload()
  steps = sorted(manager.all_steps(), reverse=True)
  ahead = [s for s in steps if max_step is not None and s > max_step]
  steps = [s for s in steps if s not in ahead]
  if ahead and not steps:
    held = {0: "no complete epoch", 1: "epoch 1"}.get(
        max_step, f"epochs 1-{max_step}")
    raise ValueError(
        f"the checkpoints in {str(manager.directory)!r} (epochs "
        f"{', '.join(map(str, sorted(ahead)))}) are newer than the run's "
        f"metrics.jsonl, which holds {held}, and no older checkpoint is "
        "kept: the run directory mixes copies of different times; nothing "
        "was changed: restore the whole directory from one copy, or move it "
        "away to start again")
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
  bad = []
  for step in steps:
    try:
      with _without_closed_loop_tracebacks() as held_stderr:
        try:
          restored = manager.restore(step, args=ocp.args.Composite(
              state=ocp.args.StandardRestore(abstract),
              host=ocp.args.JsonRestore()))
        except Exception:
          held_stderr.read_failed = True
          raise
      state, host = restored["state"], restored["host"]
      _check_tree(state, target)
      if not isinstance(host, dict):
        raise ValueError("host item is not a JSON object")
      host = dict(host)
      saved = host.pop(DIGEST_KEY, None)   # None: saved before checksums.
      if saved is not None and saved != state_digest(state):
        raise ValueError("the state does not match the checksum it was "
                         "saved with (damaged data)")
    except Exception as e:  # pylint: disable=broad-except
      _drop_abandoned_read_reports()
      reason = str(e).splitlines()[0][:200] if str(e) else ""
      bad.append(f"{step} ({type(e).__name__}: {reason})")
      continue
    if bad:
      logging.warning("Unreadable checkpoint(s) in %s: %s; using step %d.",
                      manager.directory, "; ".join(bad), step)
      if move_aside:
        _move_aside(manager, [int(b.split()[0]) for b in bad])
    if ahead:
      logging.warning(
          "Checkpoint(s) %s in %s are newer than the run's metrics.jsonl "
          "(complete to epoch %d); resuming from step %d.",
          ", ".join(map(str, sorted(ahead))), manager.directory, max_step,
          step)
      if move_aside:
        _move_aside(manager, ahead, AHEAD_DIR, "newer than the metrics log")
    return step, state, host
  if steps:
    mismatch = ("not compatible with the stored shape",
                "different tree structure", "restored shape")
    if all(any(m in b for m in mismatch) for b in bad):
      # Readable, but not this model: the config it was built from differs
      # from the one that trained (e.g. config.json edited by hand).
      raise ValueError(
          f"the checkpoints in {str(manager.directory)!r} hold a model of "
          f"other shapes than the config describes ({bad[0]}): was "
          "config.json edited after training? Nothing was changed")
    raise ValueError(
        f"no readable checkpoint in {str(manager.directory)!r} (tried "
        f"{'; '.join(bad)}); nothing was changed: move the directory away to "
        "start again")
  return None


def _move_aside(manager: ocp.CheckpointManager, steps,
                into: str = UNREADABLE_DIR, why: str = "unreadable") -> None:
  directory = str(manager.directory)
  aside = os.path.join(os.path.dirname(directory), into)
  os.makedirs(aside, exist_ok=True)
  for step in steps:
    target = os.path.join(aside, str(step))
    n = 1
    while os.path.exists(target):
      target, n = os.path.join(aside, f"{step}.{n}"), n + 1
    shutil.move(os.path.join(directory, str(step)), target)
    logging.warning("Moved checkpoint %d (%s) to %s.", step, why, target)
  manager.reload()


def _check_tree(restored: PyTree, target: PyTree) -> None:
  """Raises if the restored tree does not match the target's structure."""
  if jax.tree.structure(restored) != jax.tree.structure(target):
    raise ValueError("restored state has a different tree structure")
  for r, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
    if np.shape(r) != np.shape(t):
      raise ValueError(f"restored shape {np.shape(r)} != {np.shape(t)}")


def close(manager: ocp.CheckpointManager) -> None:
  """Waits for pending saves (through Ctrl-C) and releases the manager."""
  with interrupts_deferred():
    manager.wait_until_finished()
    manager.close()


def rng_state_to_json(rng_state) -> dict:
  """numpy RandomState.get_state() -> JSON-able dict."""
  name, keys, pos, has_gauss, cached = rng_state
  return {"name": name, "keys": np.asarray(keys).tolist(), "pos": int(pos),
          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def rng_state_from_json(d: dict):
  """Inverse of rng_state_to_json (for RandomState.set_state)."""
  return (d["name"], np.asarray(d["keys"], np.uint32), int(d["pos"]),
          int(d["has_gauss"]), float(d["cached_gaussian"]))
