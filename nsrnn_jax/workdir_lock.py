"""One training process per run directory: the workdir's lock file.

A run directory is written by one process at a time (two writers would
interleave checkpoints and metrics). `hold` takes `<workdir>/.lock`, which
names the process (pid, its start time, host), for as long as a run trains
there; `holder` tells another process, without taking anything, whether a
live process holds it. A lock left by a process that died (a crash, kill -9)
is stale: `hold` takes it over and `holder` reports no one.

A command that picks runs from a grid shared with other commands
(`reproduce`) claims a run's directory first (`hold(run_dir, CLAIM_FILE)`,
the same kind of lock under another name), before it builds the run's data
and compiles: the others then see it taken at once, not minutes later when
the training takes `.lock`. `holder` reports either.

Standard library only: `python -m nsrnn_jax.reproduce --status` reads locks
without starting JAX.
"""

import contextlib
import json
import os
import socket
from typing import Any, Callable, Optional

LOCK_FILE = ".lock"
# A run picked from a shared grid, from the moment it is picked.
CLAIM_FILE = ".claim"


class WorkdirInUse(ValueError):
  """Another live process holds the run directory (`hold`); one line."""


def _process_start(pid: int) -> Optional[str]:
  """When process `pid` started (clock ticks since boot, /proc/<pid>/stat),
  or None where /proc does not tell (no such process, not Linux)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      stat = f.read()
  except OSError:
    return None
  # Fields after the command name (which may hold spaces) in parentheses;
  # the start time is field 22, the 20th after it.
  fields = stat[stat.rindex(")") + 2:].split()
  return fields[19] if len(fields) > 19 else None


def _process_alive(pid: int, start: Optional[str] = None) -> bool:
  """Whether the process that wrote a lock is still running.

  `start`: its start time as the lock recorded it (`_process_start`); the
  pid is then that process only if it started then. Without it (a lock
  written before the field), the pid must be a process, not a thread of
  another: thread ids share the pid space, and a killed run's stale lock
  was once taken for live because its pid had become a thread of the next
  run's worker.
  """
  if start is not None and os.path.isdir("/proc/self"):
    return _process_start(pid) == start
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("Tgid:"):
          return int(line.split()[1]) == pid
  except OSError:
    pass
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # Alive, owned by another user.
  return True


def _live_holder(path: str) -> Optional[dict[str, Any]]:
  """{"pid", "host"} of the live process whose lock is at `path`; None if
  there is no lock or it is stale (its process is gone, or unreadable:
  half-written). A lock from another host cannot be checked: it counts as
  live."""
  try:
    with open(path) as f:
      lock = json.load(f)
    pid, host = int(lock["pid"]), str(lock["host"])
    start = lock.get("start")
  except FileNotFoundError:
    return None
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    return None  # Unreadable (half-written): stale.
  if host != socket.gethostname() or _process_alive(pid, start):
    return {"pid": pid, "host": host}
  return None


def holder(workdir: str) -> Optional[dict[str, Any]]:
  """The live process that holds `workdir` ({"pid", "host"}): its training
  lock, or else its claim; None if neither is held.

  Reads only: a stale lock is left for `hold` to take over. A holder found
  here may finish a moment later, and a directory found free may be taken
  a moment later (`hold` is what decides).
  """
  for name in (LOCK_FILE, CLAIM_FILE):
    found = _live_holder(os.path.join(workdir, name))
    if found is not None:
      return found
  return None


@contextlib.contextmanager
def hold(workdir: str, lock_file: str = LOCK_FILE):
  """Holds `workdir/<lock_file>` (pid, start time and host) while a run
  trains there (`LOCK_FILE`), or from the moment a command picks it
  (`CLAIM_FILE`).

  Raises:
    WorkdirInUse (a ValueError; one line) if another live process holds
    it. A lock whose process is gone (same host, no process of that pid and
    start time: a crash or kill -9, also when the pid was reused since) is
    taken over; a lock from another host cannot be checked and is refused.
    ValueError (one line) if `workdir` is a file.
  """
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"workdir {workdir!r} is a file, not a directory")
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, lock_file)
  me = {"pid": os.getpid(), "host": socket.gethostname(),
        "start": _process_start(os.getpid())}
  while True:
    try:
      fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      other = _live_holder(path)
      if other is not None:
        raise WorkdirInUse(
            f"{workdir!r} is in use by process {other['pid']} on "
            f"{other['host']} (a second run would overwrite its "
            "checkpoints): wait for it to finish, or delete "
            f"{path} if that process is gone") from None
      try:
        os.remove(path)  # Stale: its process died without releasing it.
      except FileNotFoundError:
        pass
      continue
    with os.fdopen(fd, "w") as f:
      json.dump(me, f)
    break
  try:
    yield
  finally:
    try:
      os.remove(path)
    except FileNotFoundError:
      pass


def run_claimed(workdir: str, fn: Callable[[], Any]
                ) -> tuple[Optional[dict[str, Any]], Any]:
  """Calls `fn()` with `workdir` claimed (`CLAIM_FILE`), unless another live
  process holds it: `(None, fn's result)`, or `(holder, None)` when it was
  held before the claim or was found held by `fn` (`WorkdirInUse` from the
  training's own lock; holder `?` if that process has let go since).

  How a command sharing a grid takes a run: the claim goes before the run's
  data and programs are built, so the others pass it by at once.
  """
  other = holder(workdir)
  if other is None:
    try:
      with hold(workdir, CLAIM_FILE):
        return None, fn()
    except WorkdirInUse:
      other = holder(workdir) or {"pid": "?", "host": "?"}
  return other, None
