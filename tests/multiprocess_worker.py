"""Helper process for tests/parallel_test.py (not a test module itself).

Runs a few training steps of the loop's per-device train step on a device
mesh (batch sharded on 'data', gradients summed once per step) and writes what
the test checks.
The device count must be fixed before JAX starts, so the tests run this file
in fresh subprocesses:

  python tests/multiprocess_worker.py devices OUT.json [MODEL]
      (with XLA_FLAGS=--xla_force_host_platform_device_count=8): trains on an
      8-device mesh and on one device in the same process; writes both.
  python tests/multiprocess_worker.py multiprocess WORKDIR
      (with NSRNN_COORDINATOR_ADDRESS / NSRNN_NUM_PROCESSES / NSRNN_PROCESS_ID):
      one process of a multi-host run; each process builds only its rows of
      every batch; process 0 writes metrics; all processes save the Orbax
      checkpoint; each writes WORKDIR/losses_<process>.json.
"""

import json
import os
import sys

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# pylint: disable=g-import-not-at-top,wrong-import-position
from configs import default
from nsrnn_jax import parallel
from nsrnn_jax import train

GLOBAL_BATCH = 8
LENGTH = 7
NUM_STEPS = 3


def tiny_config(model="lstm"):
  """A small config; batch 8 splits over 1, 2, 4 or 8 devices."""
  c = default.get_config()
  c.model = model
  c.hidden_size = 8
  c.batch_size = GLOBAL_BATCH
  c.learning_rate = 0.05
  c.progress_bar = False
  return c


def global_batches(vocab_size):
  """NUM_STEPS deterministic global batches (the same in every process)."""
  rng = np.random.default_rng(1234)
  return [train.make_batch(rng.integers(0, vocab_size, (GLOBAL_BATCH, LENGTH),
                                        dtype=np.int32))
          for _ in range(NUM_STEPS)]


def reference_run(config, batches):
  """Plain single-device training (no mesh): losses and final params."""
  state = train.create_train_state(config, jax.random.key(0))
  step = jax.jit(train.train_step)
  losses = []
  for b in batches:
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  return losses, jax.tree.map(np.asarray, state.params), state


def mesh_run(config, batches, mesh):
  """Data-parallel training through the loop's per-device train step.

  The state is stacked on the model axis (K = 1) as in loop.py; each process
  contributes only its rows of every batch (`put_model_batch`).
  """
  from nsrnn_jax import loop  # pylint: disable=g-import-not-at-top
  state = train.create_train_state(config, jax.random.key(0))
  state = state.replace(**parallel.shard_models(
      jax.tree.map(lambda x: np.asarray(x)[None], state.arrays()), mesh))
  step = loop.jitted_steps(mesh).train
  losses = []
  for b in batches:
    state, m = step(state, parallel.put_model_batch(
        {k: v[None] for k, v in b.items()}, mesh))
    # One step in flight at a time, as loop.py does on several CPU devices.
    losses.append(float(parallel.to_host(m["loss"])[0]))
  state = state.replace(**jax.tree.map(lambda x: x[0], state.arrays()))
  return losses, state, parallel.process_slice(GLOBAL_BATCH, mesh)


def run_devices(out_path, model):
  config = tiny_config(model)
  batches = global_batches(3)
  ref_losses, ref_params, _ = reference_run(config, batches)
  mesh = parallel.make_mesh()
  losses, state, _ = mesh_run(config, batches, mesh)
  params = parallel.to_host(state.params)
  param_sharding = jax.tree.leaves(state.params)[0].sharding
  diffs = [float(np.max(np.abs(a - b))) for a, b in
           zip(jax.tree.leaves(params), jax.tree.leaves(ref_params))]
  scale = max(float(np.max(np.abs(a))) for a in jax.tree.leaves(ref_params))
  with open(out_path, "w") as f:
    json.dump({"device_count": jax.device_count(),
               "mesh": dict(mesh.shape),
               "params_replicated": bool(param_sharding.is_fully_replicated),
               "losses": losses, "reference_losses": ref_losses,
               "max_param_diff": max(diffs), "param_scale": scale}, f)


def run_multiprocess(workdir):
  parallel.maybe_initialize_distributed(True)
  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import checkpointing
  from nsrnn_jax import metrics as metrics_lib
  config = tiny_config("lstm")
  batches = global_batches(3)
  mesh = parallel.make_mesh()
  losses, state, rows = mesh_run(config, batches, mesh)
  with metrics_lib.MetricWriter(workdir,
                                enabled=parallel.is_main_process()) as writer:
    for i, loss in enumerate(losses):
      writer.write_scalars(i + 1, {"train_loss": loss})
  manager = checkpointing.make_manager(os.path.join(workdir, "checkpoints"))
  checkpointing.save(manager, NUM_STEPS, state.arrays(), {"steps": NUM_STEPS})
  checkpointing.close(manager)
  with open(os.path.join(workdir, f"losses_{jax.process_index()}.json"),
            "w") as f:
    json.dump({"losses": losses, "rows": [rows.start, rows.stop],
               "process_count": jax.process_count(),
               "device_count": jax.device_count()}, f)


if __name__ == "__main__":
  if sys.argv[1] == "devices":
    run_devices(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "lstm")
  elif sys.argv[1] == "multiprocess":
    run_multiprocess(sys.argv[2])
  else:
    raise SystemExit(f"unknown mode {sys.argv[1]!r}")
