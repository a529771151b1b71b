"""Tests of nsrnn_jax.checkpointing: round trip, retention, fallback,
never deleting, read-only opening, workdir checks."""

import io
import json
import logging as logging_std
import os
import signal
import subprocess
import sys
import time

from absl import logging
import pytest

import jax.numpy as jnp
import numpy as np

from nsrnn_jax import checkpointing


def _state(x):
  return {"params": {"w": jnp.full((2, 3), x, jnp.float32)},
          "step": jnp.asarray(int(x), jnp.int32),
          "stopped": jnp.asarray(x > 2),
          "opt": (jnp.arange(4.0) * x, {"lr": jnp.asarray(0.1 * x)})}


def _save_steps(directory, steps):
  manager = checkpointing.make_manager(directory, keep=2)
  for s in steps:
    checkpointing.save(manager, s, _state(float(s)), {"epoch": s, "order": [s]})
  checkpointing.close(manager)


def _restore(directory, move_aside=True, read_only=False, max_step=None):
  manager = checkpointing.make_manager(directory, keep=2, read_only=read_only)
  try:
    return checkpointing.restore_latest(manager, _state(0.0),
                                        move_aside=move_aside,
                                        max_step=max_step)
  finally:
    checkpointing.close(manager)


def test_round_trip_is_exact_and_keeps_two(tmp_path):
  _save_steps(str(tmp_path), [1, 2, 3])
  assert sorted(os.listdir(tmp_path)) == ["2", "3"]
  step, state, host = _restore(str(tmp_path))
  assert step == 3 and host == {"epoch": 3, "order": [3]}
  expected = _state(3.0)
  np.testing.assert_array_equal(state["params"]["w"], expected["params"]["w"])
  np.testing.assert_array_equal(state["opt"][0], expected["opt"][0])
  assert state["stopped"].dtype == np.bool_ and bool(state["stopped"])
  assert int(state["step"]) == 3 and state["step"].dtype == np.int32


def test_empty_directory_restores_none(tmp_path):
  assert _restore(str(tmp_path / "none")) is None


def _corrupt(step_dir):
  for root, _, files in os.walk(os.path.join(step_dir, "state")):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"\x00corrupt")


def test_corrupt_latest_falls_back_and_is_moved_aside(tmp_path, caplog):
  ckpt = tmp_path / "checkpoints"
  _save_steps(str(ckpt), [1, 2])
  _corrupt(str(ckpt / "2"))
  # Read-only: falls back, moves nothing.
  assert _restore(str(ckpt), move_aside=False, read_only=True)[0] == 1
  assert sorted(os.listdir(ckpt)) == ["1", "2"]
  with caplog.at_level("WARNING"):
    step, state, host = _restore(str(ckpt))
  assert step == 1 and host["epoch"] == 1
  np.testing.assert_array_equal(state["params"]["w"], np.ones((2, 3)))
  assert any("2 (" in r.getMessage() and "Unreadable" in r.getMessage()
             for r in caplog.records)
  # The unreadable step is moved aside (never deleted), so that it can be
  # saved again.
  assert sorted(os.listdir(ckpt)) == ["1"]
  aside = tmp_path / checkpointing.UNREADABLE_DIR
  assert os.listdir(aside) == ["2"] and os.listdir(aside / "2" / "state")
  _save_steps(str(ckpt), [2])
  assert _restore(str(ckpt))[0] == 2


def _big_state(x):
  return {"params": {"w": jnp.linspace(x, x + 1.0, 4096, dtype=jnp.float32)},
          "step": jnp.asarray(int(x), jnp.int32)}


def save_steps_1_and_2(ckpt, make_state):
  """Checkpoints of `make_state(1.0)`, `make_state(2.0)` as steps 1, 2."""
  manager = checkpointing.make_manager(ckpt, keep=2)
  for s in (1, 2):
    checkpointing.save(manager, s, make_state(float(s)), {"epoch": s})
  checkpointing.close(manager)


def data_files_of_step_2(ckpt):
  """Paths of step 2's array data files (OCDBT's `d/` directories)."""
  for root, _, files in os.walk(os.path.join(ckpt, "2", "state")):
    if os.path.basename(root) == "d":
      yield from (os.path.join(root, name) for name in files)


def test_damaged_bytes_that_still_decode_are_an_unreadable_checkpoint(
    tmp_path, monkeypatch):
  ckpt = str(tmp_path / "checkpoints")
  save_steps_1_and_2(ckpt, _big_state)
  # One bit flipped in the middle of each data file of step 2 (a disk or
  # copy error): the file still decodes, to different numbers.
  for path in data_files_of_step_2(ckpt):
    if os.path.getsize(path) > 1000:
      with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x40]))

  def restore(move_aside):
    manager = checkpointing.make_manager(ckpt, keep=2,
                                         read_only=not move_aside)
    try:
      return checkpointing.restore_latest(manager, _big_state(0.0),
                                          move_aside=move_aside)
    finally:
      checkpointing.close(manager)

  # Without the checksum the damage goes unnoticed (what the check is for).
  with monkeypatch.context() as m:
    m.setattr(checkpointing, "DIGEST_KEY", "no_such_key")
    step, state, _ = restore(move_aside=False)
  assert step == 2
  assert not np.array_equal(state["params"]["w"],
                            _big_state(2.0)["params"]["w"])
  # With it: step 2 is unreadable, moved aside, and step 1 restored exactly.
  step, state, host = restore(move_aside=True)
  assert step == 1 and host == {"epoch": 1}
  np.testing.assert_array_equal(state["params"]["w"],
                                _big_state(1.0)["params"]["w"])
  assert os.listdir(tmp_path / checkpointing.UNREADABLE_DIR) == ["2"]


_TRUNCATED_RESTORE = """
import gc, sys
sys.path.insert(0, sys.argv[2])
import jax.numpy as jnp
from nsrnn_jax import checkpointing
import checkpointing_test as helpers

def many_arrays(x):
  return {"params": {f"w{i}": jnp.full((50, 3), x + i, jnp.float32)
                     for i in range(150)}}

ckpt = sys.argv[1]
helpers.save_steps_1_and_2(ckpt, many_arrays)
for path in helpers.data_files_of_step_2(ckpt):
  with open(path, "r+b") as f:
    f.truncate(10)
for _ in range(6):
  manager = checkpointing.make_manager(ckpt, keep=2, read_only=True)
  step, state, _ = checkpointing.restore_latest(manager, many_arrays(0.0))
  checkpointing.close(manager)
  assert step == 1 and float(state["params"]["w7"][0, 0]) == 8.0
gc.collect()
print("restored step 1 six times")
"""


def test_a_truncated_checkpoint_prints_no_tracebacks(tmp_path):
  # Truncated data files: Orbax gives up at the first array that fails and
  # closes its event loop while tensorstore finishes the others; their
  # callbacks used to print "Event loop is closed" tracebacks (0 to ~860
  # lines per restore, a race: with 150 arrays most restores print some in a
  # process of its own, few under pytest's capture, hence the subprocess,
  # and six restores) and asyncio later logged each abandoned read's whole
  # tensorstore spec.
  done = subprocess.run(
      [sys.executable, "-c", _TRUNCATED_RESTORE, str(tmp_path / "ckpt"),
       os.path.dirname(os.path.abspath(__file__))],
      capture_output=True, text=True, timeout=120, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout == "restored step 1 six times\n"
  # One line per restore; nothing else but Orbax's own notices (a save that
  # waited on a loaded machine logs one).
  assert done.stderr.count("Unreadable checkpoint(s)") == 6
  for noise in ("Event loop is closed", "Traceback", "never retrieved",
                "tensorstore_spec"):
    assert noise not in done.stderr, done.stderr[:2000]


def test_held_stderr_is_given_back_after_an_interrupt_in_the_wait(
    monkeypatch):
  # Ctrl-C while the block waits for late callbacks (after a failed read):
  # stderr is the real one again and the held text is written.
  real = sys.stderr
  sys.stderr = out = io.StringIO()

  def interrupted(_):
    raise KeyboardInterrupt

  try:
    with pytest.raises(KeyboardInterrupt):
      with checkpointing._without_closed_loop_tracebacks() as held:
        print("held line", file=sys.stderr)
        held.read_failed = True
        monkeypatch.setattr(checkpointing.time, "sleep", interrupted)
    assert sys.stderr is out
  finally:
    sys.stderr = real
  assert out.getvalue() == "held line\n"


def test_held_stderr_keeps_other_output():
  real = sys.stderr
  sys.stderr = out = io.StringIO()
  try:
    with checkpointing._without_closed_loop_tracebacks():
      print("a warning of its own", file=sys.stderr)
      print("Traceback (most recent call last):\n  File \"x.py\", line 1, "
            "in f\nRuntimeError: Event loop is closed", file=sys.stderr)
      print("another line", file=sys.stderr)
    print("after", file=sys.stderr)
  finally:
    sys.stderr = real
  assert out.getvalue() == "a warning of its own\nanother line\nafter\n"


def test_checkpoints_saved_without_a_checksum_still_restore(tmp_path):
  # Runs saved before checksums existed: host without the key.
  ckpt = str(tmp_path / "checkpoints")
  manager = checkpointing.make_manager(ckpt, keep=2)
  manager.save(3, args=checkpointing.ocp.args.Composite(
      state=checkpointing.ocp.args.StandardSave(_state(3.0)),
      host=checkpointing.ocp.args.JsonSave({"epoch": 3})), force=True)
  checkpointing.close(manager)
  step, state, host = _restore(ckpt)
  assert step == 3 and host == {"epoch": 3}
  np.testing.assert_array_equal(state["opt"][0], _state(3.0)["opt"][0])


def test_partial_save_is_ignored(tmp_path):
  _save_steps(str(tmp_path), [1])
  # A crash during save leaves only a temporary directory behind.
  os.makedirs(tmp_path / "2.orbax-checkpoint-tmp-99" / "state")
  assert _restore(str(tmp_path))[0] == 1


def test_all_corrupt_is_an_error_and_nothing_moves(tmp_path):
  _save_steps(str(tmp_path), [1, 2])
  _corrupt(str(tmp_path / "1"))
  _corrupt(str(tmp_path / "2"))
  with pytest.raises(ValueError, match=r"no readable checkpoint .*\(tried 2 "
                     r"\(.*\); 1 \("):
    _restore(str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == ["1", "2"]


def test_checkpoints_past_max_step_are_skipped_and_moved_aside(tmp_path,
                                                              caplog):
  # The run's log holds epochs 1-2 only: checkpoint 3 is from a later copy.
  ckpt = tmp_path / "run" / "checkpoints"
  _save_steps(str(ckpt), [1, 2, 3])
  with caplog.at_level("WARNING"):
    step, state, host = _restore(str(ckpt), max_step=2)
  assert step == 2 and host == {"epoch": 2, "order": [2]}
  np.testing.assert_array_equal(state["params"]["w"],
                                _state(2.0)["params"]["w"])
  assert any("newer than the run's metrics.jsonl" in r.getMessage()
             for r in caplog.records)
  assert sorted(os.listdir(ckpt)) == ["2"]  # Step 3 can be saved again...
  aside = tmp_path / "run" / checkpointing.AHEAD_DIR
  assert os.listdir(aside) == ["3"]         # ...and the old one is kept.
  # Without move_aside (processes other than 0): skipped, left in place.
  _save_steps(str(tmp_path / "b"), [4, 5])
  assert _restore(str(tmp_path / "b"), move_aside=False, max_step=4)[0] == 4
  assert sorted(os.listdir(tmp_path / "b")) == ["4", "5"]


@pytest.mark.parametrize("max_step,held", [(3, "epochs 1-3"),
                                           (0, "no complete epoch")])
def test_every_checkpoint_past_max_step_is_an_error_and_nothing_moves(
    tmp_path, max_step, held):
  _save_steps(str(tmp_path), [4, 5])
  with pytest.raises(ValueError, match=r"\(epochs 4, 5\) are newer than the "
                     rf"run's metrics.jsonl, which holds {held}, and no older "
                     "checkpoint is kept"):
    _restore(str(tmp_path), max_step=max_step)
  assert sorted(os.listdir(tmp_path)) == ["4", "5"]
  assert _restore(str(tmp_path), max_step=5)[0] == 5


def test_read_only_manager_logs_no_warning(tmp_path, caplog):
  # Orbax warns on every read-only manager; a reading command (evaluate,
  # scoring) stays quiet.
  _save_steps(str(tmp_path), [1])
  with caplog.at_level("INFO"):
    assert _restore(str(tmp_path), read_only=True)[0] == 1
  assert not [r for r in caplog.records if r.levelname == "WARNING"], (
      caplog.text)
  # The filter is gone afterwards: other warnings still pass.
  with caplog.at_level("WARNING"):
    logging.warning("Given directory is read only=%s (test)", tmp_path)
  assert "Given directory is read only" in caplog.text


def test_read_only_manager_creates_nothing(tmp_path):
  assert _restore(str(tmp_path / "none"), read_only=True) is None
  assert not os.path.exists(tmp_path / "none")


def test_check_workdir(tmp_path):
  config = {"hidden_size": 20, "learning_rate": 0.01, "progress_bar": True}
  checkpointing.check_workdir(str(tmp_path / "new" / "run"), config)
  assert not os.path.exists(tmp_path / "new")  # checks create nothing
  (tmp_path / "file").write_text("")
  with pytest.raises(ValueError, match="is a file, not a directory"):
    checkpointing.check_workdir(str(tmp_path / "file"), config)
  with pytest.raises(ValueError, match="cannot be created: .* is a file"):
    checkpointing.check_workdir(str(tmp_path / "file" / "sub"), config)
  checkpointing.write_config(str(tmp_path / "run"), config)
  checkpointing.check_workdir(str(tmp_path / "run"), config)
  # A config.json alone (a run that failed before its first epoch) may be
  # replaced; once the run has a metric or a checkpoint, it may not.
  checkpointing.check_workdir(str(tmp_path / "run"), dict(config,
                                                          hidden_size=21))
  (tmp_path / "run" / "metrics.jsonl").write_text('{"epoch": 1}\n')
  # Fields that only change how the run is executed may differ; fields
  # missing on either side (added to the defaults later) are not compared.
  checkpointing.check_workdir(str(tmp_path / "run"), dict(
      config, progress_bar=False, new_field=1))
  with pytest.raises(ValueError, match=r"hidden_size \(stored 20, requested "
                     r"21\); learning_rate \(stored 0.01, requested 0.1\)"):
    checkpointing.check_workdir(str(tmp_path / "run"), dict(
        config, hidden_size=21, learning_rate=0.1))
  # write_config keeps the run's own config.
  checkpointing.write_config(str(tmp_path / "run"), dict(config, x=1))
  assert json.loads((tmp_path / "run" / "config.json").read_text()) == config
  # Checkpoints whose config.json is gone cannot be checked: refused (the
  # run would resume them under any config and record that config); a
  # metrics.jsonl alone resumes nothing (the run starts anew).
  os.remove(tmp_path / "run" / "config.json")
  checkpointing.check_workdir(str(tmp_path / "run"), config)
  (tmp_path / "run" / "checkpoints" / "3").mkdir(parents=True)
  with pytest.raises(ValueError, match="holds checkpoints but no "
                     "config.json"):
    checkpointing.check_workdir(str(tmp_path / "run"), config)
  # An empty path would be the working directory.
  for what in ("workdir", "--out"):
    with pytest.raises(ValueError, match=f"^{what} is an empty path"):
      checkpointing.check_writable("", what)


def test_rng_state_json_round_trip():
  rng = np.random.RandomState(7)
  rng.shuffle(np.arange(10))
  saved = checkpointing.rng_state_to_json(rng.get_state())
  expected = rng.permutation(50)
  other = np.random.RandomState(0)
  other.set_state(checkpointing.rng_state_from_json(saved))
  np.testing.assert_array_equal(other.permutation(50), expected)


def test_a_run_stored_before_predict_eos_resumes_only_without_eos():
  # Fields missing from a stored config are not compared, except
  # predict_eos: such a run predicted no EOS (a model with V outputs).
  stored = {"learning_rate": 0.01}
  assert checkpointing.config_differences(
      stored, {"learning_rate": 0.01, "predict_eos": False}) == []
  diffs = checkpointing.config_differences(
      stored, {"learning_rate": 0.01, "predict_eos": True})
  assert diffs == ["predict_eos (stored False, requested True)"]
  assert checkpointing.config_differences(
      stored, {"learning_rate": 0.01, "new_field": 3}) == []


def test_a_run_stored_before_the_jm_variants_resumes_only_as_one_stack():
  # Such a run had one stack with a learned push layer.
  stored = {"model": "jm", "stack_embedding_size": 3}
  same = {"model": "jm", "stack_embedding_size": 3, "jm_num_stacks": 1,
          "jm_push_hidden_state": False}
  assert checkpointing.config_differences(stored, same) == []
  assert checkpointing.config_differences(
      stored, dict(same, jm_num_stacks=3)) == [
          "jm_num_stacks (stored 1, requested 3)"]
  assert checkpointing.config_differences(
      stored, dict(same, jm_push_hidden_state=True)) == [
          "jm_push_hidden_state (stored False, requested True)"]


def test_a_run_may_switch_the_ns_stack_table_on_resume():
  # Both tables compute the same function; runs stored before the field
  # existed (or with the other table) resume, other fields still count.
  for stored in ({"learning_rate": 0.01},
                 {"learning_rate": 0.01, "stack_table": "scaled"}):
    assert checkpointing.config_differences(
        stored, {"learning_rate": 0.01, "stack_table": "shares"}) == []
  assert checkpointing.config_differences(
      {"learning_rate": 0.01, "stack_table": "scaled"},
      {"learning_rate": 0.02, "stack_table": "shares"}) == [
          "learning_rate (stored 0.01, requested 0.02)"]
  # Nor does how many strings the stack runs at once.
  assert checkpointing.config_differences(
      {"learning_rate": 0.01}, {"learning_rate": 0.01,
                                "stack_batch_chunk": 2}) == []
  # Nor how far the time loop is unrolled (same values).
  assert checkpointing.config_differences(
      {"learning_rate": 0.01, "scan_unroll": 1, "stack_batch_chunk": 5},
      {"learning_rate": 0.01, "scan_unroll": 8, "stack_batch_chunk": 2}) == []


def test_an_interrupt_is_held_back_to_the_end_of_the_block():
  ran_on = []
  with pytest.raises(KeyboardInterrupt):
    with checkpointing.interrupts_deferred():
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.05)  # Where an undeferred interrupt would strike.
      ran_on.append(True)
  assert ran_on == [True]
  # The handler is back: no interrupt, nothing raised.
  with checkpointing.interrupts_deferred():
    pass
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_interrupt_during_a_save_lets_the_save_finish(tmp_path,
                                                         monkeypatch):
  # Ctrl-C while Orbax writes: the interrupt comes after the checkpoint is
  # final, so it restores at once (and nothing is left in flight).
  manager = checkpointing.make_manager(str(tmp_path), keep=2)
  wait = manager.wait_until_finished

  def interrupted_wait():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    wait()

  monkeypatch.setattr(manager, "wait_until_finished", interrupted_wait)
  with pytest.raises(KeyboardInterrupt):
    checkpointing.save(manager, 4, _state(4.0), {"epoch": 4, "order": [4]})
  monkeypatch.undo()
  checkpointing.close(manager)
  step, state, _ = _restore(str(tmp_path))
  assert step == 4 and float(state["params"]["w"][0, 0]) == 4.0


def test_a_save_survives_a_wall_clock_jump(tmp_path, monkeypatch):
  # A machine suspended (or a process stopped) mid-save resumes with the
  # wall clock far ahead. Orbax's asynchronous save timed out its own steps
  # then ("ChainedFuture completed 1/4 futures but timed out after 4000 s")
  # and the run ended; here every reading of the clock jumps 1000 s.
  _save_steps(str(tmp_path), [1])
  manager = checkpointing.make_manager(str(tmp_path), keep=2)
  real, jumps = time.time, []

  def jumping_clock():
    jumps.append(1000.0)
    return real() + sum(jumps)

  monkeypatch.setattr(time, "time", jumping_clock)
  for s in (2, 3):
    checkpointing.save(manager, s, _state(float(s)), {"epoch": s,
                                                      "order": [s]})
  monkeypatch.undo()
  checkpointing.close(manager)
  assert jumps   # The save read the clock.
  step, state, _ = _restore(str(tmp_path))
  assert step == 3 and float(state["params"]["w"][0, 0]) == 3.0


def test_read_config_refuses_what_is_not_a_config(tmp_path):
  path = tmp_path / "config.json"
  for text, message in [("[1, 2]", "is not a config"),
                        ("{", "is unreadable"),
                        (b"\xff\xfe", "is unreadable")]:
    if isinstance(text, bytes):
      path.write_bytes(text)
    else:
      path.write_text(text)
    with pytest.raises(ValueError, match=message):
      checkpointing.read_config(str(tmp_path))
  path.write_text('{"hidden_size": 20}')
  assert checkpointing.read_config(str(tmp_path)) == {"hidden_size": 20}


def _read_array_index_and_device_put():  # Orbax's array read, by name.
  raise ValueError("Requested shape: (7, 3) is not compatible with the "
                   "stored shape: (6, 3).")


def _other_coroutine():
  raise ValueError("Requested shape: (7, 3) is not compatible with the "
                   "stored shape: (6, 3).")


@pytest.mark.parametrize("raiser,dropped", [
    (_read_array_index_and_device_put, True), (_other_coroutine, False)])
def test_a_gathered_abandoned_read_is_dropped_and_nothing_else(raiser,
                                                               dropped):
  # asyncio's report of a `gather` of reads names only the exception's text
  # ("_GatheringFuture exception was never retrieved ... ValueError(...)"):
  # what marks it as an abandoned read is its traceback. Seen once as 6
  # extra stderr lines of `evaluate` on an edited config.json.
  try:
    raiser()
  except ValueError:
    exc_info = sys.exc_info()
  record = logging_std.LogRecord(
      "asyncio", logging_std.ERROR, "base_events.py", 1771,
      "_GatheringFuture exception was never retrieved\nfuture: "
      "<_GatheringFuture finished exception=ValueError('Requested shape')>",
      (), exc_info)
  assert checkpointing._AbandonedReadFilter().filter(record) is not dropped
