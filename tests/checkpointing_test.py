"""Tests of nsrnn_jax.checkpointing: round trip, retention, fallback."""

import os

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


def _restore(directory):
  manager = checkpointing.make_manager(directory, keep=2)
  try:
    return checkpointing.restore_latest(manager, _state(0.0))
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


def test_corrupt_latest_falls_back_with_warning(tmp_path, caplog):
  _save_steps(str(tmp_path), [1, 2])
  _corrupt(str(tmp_path / "2"))
  with caplog.at_level("WARNING"):
    step, state, host = _restore(str(tmp_path))
  assert step == 1 and host["epoch"] == 1
  np.testing.assert_array_equal(state["params"]["w"], np.ones((2, 3)))
  assert any("step 2" in r.getMessage() and "unreadable" in r.getMessage()
             for r in caplog.records)
  # The unreadable step is removed so that it can be saved again.
  assert sorted(os.listdir(tmp_path)) == ["1"]
  _save_steps(str(tmp_path), [2])
  assert _restore(str(tmp_path))[0] == 2


def test_partial_save_is_ignored(tmp_path):
  _save_steps(str(tmp_path), [1])
  # A crash during save leaves only a temporary directory behind.
  os.makedirs(tmp_path / "2.orbax-checkpoint-tmp-99" / "state")
  assert _restore(str(tmp_path))[0] == 1


def test_all_corrupt_gives_none(tmp_path, caplog):
  _save_steps(str(tmp_path), [1])
  _corrupt(str(tmp_path / "1"))
  with caplog.at_level("WARNING"):
    assert _restore(str(tmp_path)) is None
  assert any("No readable checkpoint" in r.getMessage()
             for r in caplog.records)


def test_rng_state_json_round_trip():
  rng = np.random.RandomState(7)
  rng.shuffle(np.arange(10))
  saved = checkpointing.rng_state_to_json(rng.get_state())
  expected = rng.permutation(50)
  other = np.random.RandomState(0)
  other.set_state(checkpointing.rng_state_from_json(saved))
  np.testing.assert_array_equal(other.permutation(50), expected)
