"""Tests of nsrnn_jax.workdir_lock: one training process per run directory.

`hold` is what training takes; `holder` is what another process reads (the
reproduction driver, `--status`) to tell whether a live process holds a run
directory, without taking it. Each state is checked through both.
"""

import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from nsrnn_jax import workdir_lock


def _write_lock(path, lock):
  with open(path, "w") as f:
    json.dump(lock, f)


def _lock_pid(path):
  with open(path) as f:
    return json.load(f)["pid"]


def test_a_live_holder_is_refused_and_reported_a_dead_one_taken_over(
    tmp_path):
  workdir = str(tmp_path / "run")
  lock = os.path.join(workdir, workdir_lock.LOCK_FILE)
  assert workdir_lock.holder(workdir) is None          # No directory yet.
  with workdir_lock.hold(workdir):
    assert os.path.exists(lock)
    assert workdir_lock.holder(workdir) == {"pid": os.getpid(),
                                            "host": socket.gethostname()}
    # A second holder while this (live) process holds it: one-line error.
    with pytest.raises(workdir_lock.WorkdirInUse,
                       match="in use by process") as info:
      with workdir_lock.hold(workdir):
        pass
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)
  assert not os.path.exists(lock)  # Released.
  assert workdir_lock.holder(workdir) is None
  # A lock left by a process that has exited (kill -9, crash) is stale:
  # reported as no one, and taken over.
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  _write_lock(lock, {"pid": int(dead.stdout), "host": socket.gethostname()})
  assert workdir_lock.holder(workdir) is None
  assert os.path.exists(lock)  # holder reads only.
  with workdir_lock.hold(workdir):
    assert _lock_pid(lock) == os.getpid()
  # Half-written (unreadable) locks are stale too.
  with open(lock, "w") as f:
    f.write('{"pid": 12')
  assert workdir_lock.holder(workdir) is None
  with workdir_lock.hold(workdir):
    assert _lock_pid(lock) == os.getpid()
  # A stale lock whose pid is now a thread of a live process (thread ids
  # share the pid space; seen after a session's runs were killed), or a
  # process that started later (the pid reused), is taken over too.
  if os.path.isdir("/proc/self/task"):
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
      tid = thread.native_id
      assert tid != os.getpid()
      for stale in ({"pid": tid, "host": socket.gethostname()},
                    {"pid": os.getpid(), "host": socket.gethostname(),
                     "start": "0"}):
        _write_lock(lock, stale)
        assert workdir_lock.holder(workdir) is None
        with workdir_lock.hold(workdir):
          assert _lock_pid(lock) == os.getpid()
    finally:
      stop.set()
      thread.join()
  # Another host's lock cannot be checked: reported, and refused.
  _write_lock(lock, {"pid": 1, "host": "elsewhere"})
  assert workdir_lock.holder(workdir) == {"pid": 1, "host": "elsewhere"}
  with pytest.raises(workdir_lock.WorkdirInUse, match="on elsewhere"):
    with workdir_lock.hold(workdir):
      pass


def test_a_claim_is_reported_like_a_lock_and_lets_its_own_run_train(
    tmp_path):
  # A command sharing a grid claims a run's directory before it builds the
  # run's data; the training then takes the lock beside the claim.
  workdir = str(tmp_path / "run")
  claim = os.path.join(workdir, workdir_lock.CLAIM_FILE)
  with workdir_lock.hold(workdir, workdir_lock.CLAIM_FILE):
    assert workdir_lock.holder(workdir) == {"pid": os.getpid(),
                                            "host": socket.gethostname()}
    with workdir_lock.hold(workdir):
      assert os.path.exists(claim)
      assert os.path.exists(os.path.join(workdir, workdir_lock.LOCK_FILE))
    # A second claim is refused like a second lock.
    with pytest.raises(workdir_lock.WorkdirInUse, match="in use by process"):
      with workdir_lock.hold(workdir, workdir_lock.CLAIM_FILE):
        pass
  assert not os.path.exists(claim)
  assert workdir_lock.holder(workdir) is None
  # Another host's claim: reported (cannot be checked).
  _write_lock(claim, {"pid": 7, "host": "elsewhere"})
  assert workdir_lock.holder(workdir) == {"pid": 7, "host": "elsewhere"}


def test_a_run_directory_that_is_a_file_has_no_holder(tmp_path):
  # The reproduction driver asks before it claims the run.
  path = tmp_path / "restart_0"
  path.write_text("")
  assert workdir_lock.holder(str(path)) is None
  # Nor can it be held: one line naming it (not an OSError from makedirs).
  for name in (workdir_lock.LOCK_FILE, workdir_lock.CLAIM_FILE):
    with pytest.raises(ValueError, match="is a file, not a directory") as e:
      with workdir_lock.hold(str(path), name):
        pass
    assert not isinstance(e.value, workdir_lock.WorkdirInUse)
