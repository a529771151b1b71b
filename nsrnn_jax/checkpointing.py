"""Thin wrapper over Orbax's (V0) CheckpointManager.

A checkpoint holds two items:
  "state": the array fields of train.TrainState (params, optimizer state with
           the current learning rate, schedule and early-stopping counters,
           best parameters, epoch), saved with StandardSave;
  "host":  JSON with the data-order RNG state and batch order.

Safety: Orbax writes every step into a temporary directory and renames it
only when complete, so a partial save is never listed. `LatestN(keep >= 2)`
deletes old steps only after a newer one is finalised, so the last good
checkpoint always survives. If the latest finalised checkpoint cannot be read
(corrupted files), `restore_latest` warns, falls back to the previous one and
deletes the unreadable newer steps so they can be written again.

Keeping this behind three functions means a move to the Orbax V1 API touches
only this file.
"""

import os
from typing import Any, Optional

from absl import logging
import jax
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any


def make_manager(directory: str, keep: int = 2,
                 async_save: bool = True) -> ocp.CheckpointManager:
  """Creates (or opens) a checkpoint directory.

  Args:
    directory: absolute or relative path; created if missing.
    keep: number of most recent checkpoints kept (>= 2 recommended).
    async_save: write in a background thread (waited for before the next
      save and in `close`).
  """
  options = ocp.CheckpointManagerOptions(
      preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
      enable_async_checkpointing=async_save,
      create=True)
  return ocp.CheckpointManager(os.path.abspath(directory), options=options,
                               item_names=("state", "host"))


def save(manager: ocp.CheckpointManager, step: int, state: PyTree,
         host: dict) -> None:
  """Saves `state` (pytree of arrays) and `host` (JSON-able dict) at `step`.

  Returns once the checkpoint is final on disk: callers log an epoch only
  after its checkpoint exists, so a kill loses at most the epoch in progress.
  """
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), host=ocp.args.JsonSave(host)),
               force=True)
  manager.wait_until_finished()


def restore_latest(manager: ocp.CheckpointManager, target: PyTree
                   ) -> Optional[tuple[int, PyTree, dict]]:
  """Restores the newest readable checkpoint.

  Args:
    manager: from `make_manager`.
    target: a pytree with the structure, shapes and dtypes of the saved state
      (e.g. a freshly initialised state); restored arrays follow its
      shardings.

  Returns:
    (step, state, host) or None when there is no readable checkpoint.
  """
  manager.wait_until_finished()
  manager.reload()
  steps = sorted(manager.all_steps(), reverse=True)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
  bad = []
  for step in steps:
    try:
      restored = manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract),
          host=ocp.args.JsonRestore()))
      state, host = restored["state"], restored["host"]
      _check_tree(state, target)
      if not isinstance(host, dict):
        raise ValueError("host item is not a JSON object")
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("Checkpoint at step %d in %s is unreadable (%s: %s); "
                      "falling back to an earlier one.", step,
                      manager.directory, type(e).__name__,
                      str(e).splitlines()[0][:200] if str(e) else "")
      bad.append(step)
      continue
    for b in bad:  # Newer unreadable steps would block re-saving that step.
      manager.delete(b)
    return step, state, host
  if steps:
    logging.warning("No readable checkpoint in %s; starting from scratch.",
                    manager.directory)
    for b in bad:
      manager.delete(b)
  return None


def _check_tree(restored: PyTree, target: PyTree) -> None:
  """Raises if the restored tree does not match the target's structure."""
  if jax.tree.structure(restored) != jax.tree.structure(target):
    raise ValueError("restored state has a different tree structure")
  for r, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
    if np.shape(r) != np.shape(t):
      raise ValueError(f"restored shape {np.shape(r)} != {np.shape(t)}")


def close(manager: ocp.CheckpointManager) -> None:
  """Waits for pending saves and releases the manager."""
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
