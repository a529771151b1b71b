"""Many models in one program: the paper's grid (learning rates x restarts).

The paper trains every setting of a task x model grid five times (section
5.5; reference-behaviour.md section 9). Here the K = |learning rates| x
restarts models are trained at once: their `train.TrainState`s are stacked
along a leading model axis K and train.py's pure functions (`train_step`,
`eval_step`, `end_of_epoch`) are vmapped over it. Each model keeps its own
learning rate (inside its optimizer state), plateau schedule, early-stopping
counter and best parameters; a model that has stopped no longer changes
(train.py masks the update with `state.stopped`), while the others go on.

Model k = (learning rate i, restart r) uses seeds `seed + r` for its
parameters, batch order and (with `grid_vary_data_seed`, the paper's
protocol) its own training/validation data, so models of different learning
rates but the same restart are paired. Because the K models draw batches of
different lengths at the same step, each step's K batches are right-padded to
the longest of them with a zero mask (all models are causal, so the masked
loss is exact).

Outputs under `workdir`:

  grid_config.json
  checkpoints/                    the stacked state of all K models (resume)
  lr_<lr>/restart_<r>/            one single-run workdir per model (config.json,
                                  metrics.jsonl, TensorBoard events,
                                  test_by_length.{json,csv}, results.json),
                                  readable by plots.py like a single run
  grid_summary.json               per-setting mean/std of the best-epoch
                                  validation CE difference and the selection

The selected setting has the lowest mean best-epoch validation CE difference
over its restarts, ties broken by the lower std (the authors'
print_grid_search.py compares (mean, std) tuples).

On a mesh the K axis is sharded over 'model' and each batch over 'data'
(`make_mesh(num_models=config.grid_model_parallel)`).

CLI:
  python -m nsrnn_jax.grid --config=configs/grid_quick.py --workdir=/tmp/grid
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
import time
from typing import Any, Optional, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from nsrnn_jax import checkpointing
from nsrnn_jax import metrics as metrics_lib
from nsrnn_jax import parallel
from nsrnn_jax import train

PyTree = Any
SUMMARY_FILE = "grid_summary.json"


# ---------------------------------------------------------------------------
# Grid settings.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Member:
  """One model of the grid.

  Attributes:
    index: position k on the model axis.
    learning_rate: initial learning rate.
    restart: restart (trial) index r.
    config: the member's full single-run config.
    subdir: its workdir relative to the grid workdir.
  """
  index: int
  learning_rate: float
  restart: int
  config: ml_collections.ConfigDict
  subdir: str


def _get(config, name, default):
  return config[name] if name in config else default


def grid_learning_rates(config) -> tuple[float, ...]:
  """The learning rates of the grid (`grid_learning_rates` or the paper's)."""
  lrs = _get(config, "grid_learning_rates",
             _get(config, "learning_rate_grid", None))
  if lrs is None:
    raise ValueError("config.grid_learning_rates is missing (e.g. "
                     "(0.01, 0.005, 0.001, 0.0005)).")
  lrs = tuple(float(x) for x in lrs)
  if not lrs or any(not (x > 0 and math.isfinite(x)) for x in lrs):
    raise ValueError(f"config.grid_learning_rates must be positive numbers "
                     f"(got {lrs}).")
  if len(set(lrs)) != len(lrs):
    raise ValueError(f"config.grid_learning_rates has duplicates: {lrs}.")
  return lrs


def members(config) -> list[Member]:
  """Expands a grid config into its K members (learning rate major)."""
  num_restarts = _get(config, "num_restarts", 5)
  if (not isinstance(num_restarts, (int, np.integer))
      or isinstance(num_restarts, bool) or num_restarts < 1):
    raise ValueError(f"config.num_restarts must be a positive integer "
                     f"(got {num_restarts!r}).")
  vary_data = bool(_get(config, "grid_vary_data_seed", True))
  out = []
  for lr in grid_learning_rates(config):
    for r in range(num_restarts):
      c = copy.deepcopy(config)
      with c.unlocked():
        c.learning_rate = lr
        c.param_seed = int(config.param_seed) + r
        c.shuffle_seed = int(config.shuffle_seed) + r
        if vary_data:
          c.data_seed = int(config.data_seed) + r
      out.append(Member(len(out), lr, r, c, os.path.join(f"lr_{lr:g}",
                                                         f"restart_{r}")))
  return out


# ---------------------------------------------------------------------------
# Stacking and padding.
# ---------------------------------------------------------------------------


def stack_states(states: Sequence[train.TrainState]) -> train.TrainState:
  """Stacks K TrainStates along a new leading axis.

  Only the array fields are stacked; the static fields (apply_fn, optimizer,
  schedule) come from the first state. They must agree across members: the
  learning rate lives in the optimizer *state*, so one optimizer serves all.
  """
  arrays = [s.arrays() for s in states]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *arrays)
  return states[0].replace(**stacked)


def unstack(tree: PyTree, k: int) -> PyTree:
  """Member k's slice of a stacked pytree (as numpy)."""
  return jax.tree.map(lambda x: np.asarray(x)[k], tree)


def stack_batches(symbols_list: Sequence[np.ndarray],
                  padded_to: Optional[int] = None) -> train.Batch:
  """K batches of (possibly) different lengths -> one [K, B, N] batch.

  Each is right-padded to the longest (or to `padded_to`) with mask 0.
  """
  shapes = {np.shape(s)[0] for s in symbols_list}
  if len(shapes) != 1:
    raise ValueError(f"Members' batches differ in size: {sorted(shapes)}; "
                     "every member must use the same batch_size.")
  longest = max(np.shape(s)[1] for s in symbols_list)
  padded_to = longest if padded_to is None else max(padded_to, longest)
  batches = [train.make_batch(s, padded_to) for s in symbols_list]
  return {key: np.stack([b[key] for b in batches]) for key in batches[0]}


# ---------------------------------------------------------------------------
# The vmapped loop.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Fns:
  """Jitted, vmapped step functions for one model architecture."""
  train: Any
  eval: Any
  end: Any


def _make_fns(apply_fn, mesh: Optional[jax.sharding.Mesh]) -> _Fns:
  train_fn = jax.vmap(train.train_step)
  eval_fn = jax.vmap(functools.partial(train.eval_step, apply_fn=apply_fn))
  end_fn = jax.vmap(train.end_of_epoch)
  del mesh  # Inputs carry their shardings; jit propagates them.
  return _Fns(train=jax.jit(train_fn, donate_argnums=0),
              eval=jax.jit(eval_fn), end=jax.jit(end_fn, donate_argnums=0))


def _evaluate(fns: _Fns, params_K, splits_K: Sequence[train.Splits],
              which: str, config, num_lengths_K, put_batch) -> list[list[dict]]:
  """Per-member `train.evaluate_batches`-style results on split `which`."""
  batches_K = [getattr(s, which) for s in splits_K]
  num = {len(b) for b in batches_K}
  if len(num) != 1:
    raise ValueError(f"Members' {which} splits differ in number of batches "
                     f"({sorted(num)}).")
  (num,) = num
  pending = []
  for j in range(num):
    symbols = [b[j].symbols for b in batches_K]
    longest = max(s.shape[1] for s in symbols)
    batch = stack_batches(symbols, train.padded_length(longest, config))
    pending.append(fns.eval(params_K, put_batch(batch)))
  sums = parallel.to_host(pending)  # Fetch after dispatching everything.
  results = [[] for _ in batches_K]
  for j in range(num):
    for k, batches in enumerate(batches_K):
      b = batches[j]
      n_strings = b.symbols.shape[0]
      bound = None
      if b.log_prob is not None:
        bound = float(np.sum(metrics_lib.lower_bound_neg_log_prob(
            b.log_prob, b.length_log_prob, num_lengths_K[k])))
      s = {key: np.asarray(v[k], np.float64)[:n_strings]
           for key, v in sums[j].items()}
      results[k].append({
          "length": int(b.symbols.shape[1]), "num_strings": int(n_strings),
          "model_nll": float(np.sum(s["nll"])), "bound_nll": bound,
          "num_tokens": float(np.sum(s["num_tokens"])),
          "num_correct": float(np.sum(s["num_correct"]))})
  return results


def _load_member_splits(grid_members: Sequence[Member], need_test: bool
                        ) -> list[train.Splits]:
  """Each member's data; members with equal data seeds share one copy."""
  cache = {}
  out = []
  for m in grid_members:
    seed = int(m.config.data_seed)
    if seed not in cache:
      cache[seed] = train.load_splits(m.config, need_test=need_test)
    out.append(cache[seed])
  return out


def run_grid(config: ml_collections.ConfigDict, workdir: str,
             splits: Optional[Sequence[train.Splits]] = None,
             model: Any = None,
             mesh: Optional[jax.sharding.Mesh] = None,
             should_stop=None) -> dict:
  """Trains the K models of a grid at once, writes per-model runs + summary.

  Args:
    config: a single-run config (configs/default.py) plus `grid_learning_rates`
      and `num_restarts` (optional: `grid_vary_data_seed`, default True;
      `grid_model_parallel`, mesh size of the 'model' axis, default 1).
    workdir: grid output directory (see the module docstring). Rerunning on
      the same workdir resumes from the grid's latest checkpoint.
    splits: one `train.Splits` per member (tests); default: built from each
      member's config with `train.load_splits`.
    model: Flax model to use instead of `models.build(config)`.
    mesh: device mesh; default `parallel.make_mesh(num_models=
      config.grid_model_parallel)` over all devices.
    should_stop: called after every epoch (once its checkpoint is saved);
      returning True ends this invocation there (rerunning resumes).

  Returns:
    The summary dict (also written to grid_summary.json on process 0).
  """
  grid_members = members(config)
  for m in grid_members:
    train.validate_config(m.config)
  num_models = len(grid_members)
  main = parallel.is_main_process()
  if mesh is None:
    mesh = parallel.make_mesh(
        num_models=int(_get(config, "grid_model_parallel", 1)))
  num_model_shards = int(mesh.shape[parallel.MODEL_AXIS])
  if num_models % num_model_shards:
    raise ValueError(
        f"The grid has K={num_models} models, not divisible by the mesh's "
        f"model axis ({num_model_shards}); change grid_model_parallel.")
  parallel.check_batch_size(int(config.batch_size), mesh)
  need_test = bool(config.run_test)
  if splits is None:
    splits = _load_member_splits(grid_members, need_test)
  if len(splits) != num_models:
    raise ValueError(f"Got {len(splits)} splits for {num_models} members.")
  num_steps = {len(s.train) for s in splits}
  if len(num_steps) != 1:
    raise ValueError(f"Members have different numbers of training batches: "
                     f"{sorted(num_steps)}.")
  (num_steps,) = num_steps

  os.makedirs(workdir, exist_ok=True)
  if main:
    with open(os.path.join(workdir, "grid_config.json"), "w") as f:
      json.dump(json.loads(config.to_json_best_effort()), f, indent=1,
                sort_keys=True)
    for m in grid_members:
      os.makedirs(os.path.join(workdir, m.subdir), exist_ok=True)
      with open(os.path.join(workdir, m.subdir, "config.json"), "w") as f:
        json.dump(json.loads(m.config.to_json_best_effort()), f, indent=1,
                  sort_keys=True)

  model = train.build_model(config) if model is None else model
  # One optimizer/schedule object for all (from member 0); each member's
  # initial learning rate is written into its own optimizer state.
  states = []
  for m in grid_members:
    s = train.create_train_state(grid_members[0].config,
                                 jax.random.key(m.config.param_seed), model)
    states.append(s.replace(opt_state=train._set_learning_rate(  # pylint: disable=protected-access
        s.opt_state, jnp.asarray(m.learning_rate,
                                 train.learning_rate(s).dtype))))
  state_K = stack_states(states)
  del states

  shuffle_rngs = [np.random.RandomState(m.config.shuffle_seed)
                  for m in grid_members]
  orders = [np.arange(num_steps) for _ in grid_members]
  manager = checkpointing.make_manager(
      os.path.join(workdir, "checkpoints"),
      keep=int(config.checkpoints_to_keep))
  restored = checkpointing.restore_latest(manager, state_K.arrays())
  if restored is not None:
    epoch, arrays, host = restored
    state_K = state_K.replace(**arrays)
    for rng, saved in zip(shuffle_rngs, host["shuffle_rngs"]):
      rng.set_state(checkpointing.rng_state_from_json(saved))
    orders = [np.asarray(o, np.int64) for o in host["orders"]]
    logging.info("Resumed the grid from epoch %d.", epoch)

  state_K = state_K.replace(**parallel.shard_models(state_K.arrays(), mesh))

  def put_batch(batch):
    # Every process holds the full [K, B, N] batch here, so take its rows.
    rows = parallel.process_slice(batch["symbols"].shape[1], mesh)
    return parallel.shard_batch({k: v[:, rows] for k, v in batch.items()},
                                mesh, model_axis=True)

  fns = _make_fns(model.apply, mesh)
  valid_num_lengths = [s.valid_num_lengths for s in splits]
  writers = [metrics_lib.MetricWriter(os.path.join(workdir, m.subdir),
                                      enabled=main) for m in grid_members]
  epochs_this_run = 0
  try:
    while True:
      stopped_K = np.asarray(parallel.to_host(state_K.stopped))
      if stopped_K.all():
        break
      start = time.perf_counter()
      for order, rng in zip(orders, shuffle_rngs):
        rng.shuffle(order)
      losses = []
      for i in range(num_steps):
        symbols = [s.train[order[i]] for s, order in zip(splits, orders)]
        longest = max(x.shape[1] for x in symbols)
        batch = stack_batches(symbols, train.padded_length(longest, config))
        state_K, step_metrics = fns.train(state_K, put_batch(batch))
        losses.append(step_metrics["loss"])
      losses_SxK = np.asarray(parallel.to_host(losses), np.float64)
      train_time = time.perf_counter() - start
      valid_K = [train.summarize(r) for r in _evaluate(
          fns, state_K.params, splits, "valid", config, valid_num_lengths,
          put_batch)]
      lr_K = np.asarray(parallel.to_host(train.learning_rate(state_K)))
      ppl_K = np.asarray([v["perplexity"] for v in valid_K], np.float32)
      state_K = fns.end(state_K, parallel.shard_models(ppl_K, mesh))
      host_K = parallel.to_host({
          "epoch": state_K.epoch, "best_epoch": state_K.best_epoch,
          "lr": train.learning_rate(state_K)})
      elapsed = time.perf_counter() - start
      for k, m in enumerate(grid_members):
        if stopped_K[k]:
          continue  # Stopped before this epoch: nothing new to log.
        loss = losses_SxK[:, k]
        if not np.all(np.isfinite(loss)):
          logging.warning("Member %s: non-finite training loss in epoch %d.",
                          m.subdir, int(host_K["epoch"][k]))
        record = {
            "train_loss": float(np.mean(loss)),
            "valid_perplexity": valid_K[k]["perplexity"],
            "valid_cross_entropy": valid_K[k]["cross_entropy"],
            "valid_accuracy": valid_K[k]["accuracy"],
            "learning_rate": float(lr_K[k]),
            "next_learning_rate": float(host_K["lr"][k]),
            "best_epoch": int(host_K["best_epoch"][k]),
            "time": elapsed, "train_time": train_time,
        }
        if "ce_diff" in valid_K[k]:
          record["valid_ce_diff"] = valid_K[k]["ce_diff"]
          record["valid_lower_bound_perplexity"] = (
              valid_K[k]["lower_bound_perplexity"])
        writers[k].write_scalars(int(host_K["epoch"][k]), record)
      epoch_max = int(np.max(host_K["epoch"]))
      now_stopped = np.asarray(parallel.to_host(state_K.stopped))
      if (epoch_max % int(config.checkpoint_every_epochs) == 0
          or now_stopped.all()):
        checkpointing.save(manager, epoch_max, state_K.arrays(), {
            "shuffle_rngs": [checkpointing.rng_state_to_json(r.get_state())
                             for r in shuffle_rngs],
            "orders": [o.tolist() for o in orders], "epoch": epoch_max})
      if main:
        logging.info("Grid epoch %d: %d/%d models running, %.1fs.", epoch_max,
                     int((~now_stopped).sum()), num_models, elapsed)
      epochs_this_run += 1
      if (config.stop_after_epochs
          and epochs_this_run >= int(config.stop_after_epochs)):
        break
      if should_stop is not None and should_stop():
        break
    checkpointing.close(manager)
    finished = bool(np.asarray(parallel.to_host(state_K.stopped)).all())
    if not finished:
      logging.info("Grid stopped after %d epochs this run; rerun to resume.",
                   epochs_this_run)
      return {"finished": False}
    results_K = _final_results(fns, state_K, splits, grid_members, config,
                               workdir, put_batch, writers, main)
  finally:
    for w in writers:
      w.close()
  summary = summarize_grid(grid_members, results_K)
  if main:
    with open(os.path.join(workdir, SUMMARY_FILE), "w") as f:
      json.dump(summary, f, indent=1, sort_keys=True)
    print(format_summary(summary))
  return summary


def _final_results(fns, state_K, splits, grid_members, config, workdir,
                   put_batch, writers, main) -> list[dict]:
  """Best-parameter validation and test of every member; results.json files."""
  host = parallel.to_host({
      "epoch": state_K.epoch, "step": state_K.step,
      "best_epoch": state_K.best_epoch, "best_metric": state_K.best_metric,
      "lr": train.learning_rate(state_K)})
  best_valid = [train.summarize(r) for r in _evaluate(
      fns, state_K.best_params, splits, "valid", config,
      [s.valid_num_lengths for s in splits], put_batch)]
  tests = None
  if config.run_test and all(s.test for s in splits):
    num_lengths = [s.test_num_lengths if config.test_bound_includes_num_lengths
                   else None for s in splits]
    tests = _evaluate(fns, state_K.best_params, splits, "test", config,
                      num_lengths, put_batch)
  results_K = []
  for k, m in enumerate(grid_members):
    results = {
        "finished": True, "epochs": int(host["epoch"][k]),
        "steps": int(host["step"][k]),
        "best_epoch": int(host["best_epoch"][k]),
        "best_valid_perplexity": float(host["best_metric"][k]),
        "final_learning_rate": float(host["lr"][k]),
    }
    results.update({f"best_valid_{key}": v
                    for key, v in best_valid[k].items()})
    run_dir = os.path.join(workdir, m.subdir)
    if tests is not None:
      table = train.test_table(tests[k])
      overall = train.summarize(tests[k])
      results.update({f"test_{key}": v for key, v in overall.items()})
      lengths = np.asarray(table["lengths"])
      diffs = np.asarray(table["ce_diff"])
      inside = lengths <= config.train_max_length
      if inside.any():
        results["test_ce_diff_in_train_range"] = float(np.mean(diffs[inside]))
      if (~inside).any():
        results["test_ce_diff_longer"] = float(np.mean(diffs[~inside]))
      metrics_lib.write_test_table(run_dir, table, enabled=main)
    writers[k].write_scalars(results["epochs"], {
        key: v for key, v in results.items() if isinstance(v, float)})
    if main:
      with open(os.path.join(run_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    results_K.append(results)
  return results_K


# ---------------------------------------------------------------------------
# Summary (selection as in the authors' print_grid_search.py).
# ---------------------------------------------------------------------------


def summarize_grid(grid_members: Sequence[Member],
                   results_K: Sequence[dict],
                   key: str = "best_valid_ce_diff") -> dict:
  """Mean/std over restarts of each setting's best-epoch metric; the winner.

  Args:
    grid_members: the members (for learning rate and restart).
    results_K: each member's results (with `key`).
    key: the per-run metric (lower is better); falls back to the best
      validation cross-entropy when the data carries no lower bound.

  Returns:
    {"metric", "settings": [{learning_rate, mean, std, values, subdirs}],
     "best": {learning_rate, mean, std}, "selection"}.
  """
  if not all(key in r for r in results_K):
    key = "best_valid_cross_entropy"
  by_lr = {}
  for m, r in zip(grid_members, results_K):
    by_lr.setdefault(m.learning_rate, []).append((m, float(r[key])))
  settings = []
  for lr, runs in by_lr.items():
    values = np.asarray([v for _, v in runs], np.float64)
    settings.append({
        "learning_rate": lr, "mean": float(np.mean(values)),
        # Population std (numpy default); only its ordering matters here.
        "std": float(np.std(values)), "values": values.tolist(),
        "best_epochs": [int(results_K[m.index]["best_epoch"])
                        for m, _ in runs],
        "subdirs": [m.subdir for m, _ in runs]})
  best = select_best(settings)
  return {"metric": key, "settings": settings,
          "best": {k: best[k] for k in ("learning_rate", "mean", "std")},
          "selection": "lowest mean over restarts, ties by lowest std"}


def select_best(settings: Sequence[dict]) -> dict:
  """The setting with the lowest (mean, std); NaN means count as worst."""
  if not settings:
    raise ValueError("No settings to select from.")

  def rank(s):
    mean, std = s["mean"], s["std"]
    return (math.isnan(mean), mean if not math.isnan(mean) else 0.0,
            math.isnan(std), std if not math.isnan(std) else 0.0)

  return min(settings, key=rank)


def format_summary(summary: dict) -> str:
  """The summary as a text table (the selected setting marked with *)."""
  rows = []
  for s in summary["settings"]:
    mark = "*" if s["learning_rate"] == summary["best"]["learning_rate"] else ""
    rows.append([f"{s['learning_rate']:g}{mark}", s["mean"], s["std"],
                 " ".join(f"{v:.4f}" for v in s["values"])])
  return (f"Grid summary ({summary['metric']} at each run's best epoch):\n"
          + metrics_lib.format_table(
              ["learning_rate", "mean", "std", "per restart"], rows))


# ---------------------------------------------------------------------------
# CLI.
# ---------------------------------------------------------------------------


def main(argv: Sequence[str]) -> None:
  """python -m nsrnn_jax.grid --config=... --workdir=... [--distributed]."""
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  # Explicit multi-host setups come through NSRNN_* environment variables
  # (launch/local_multiprocess.sh); clusters are auto-detected.
  parallel.maybe_initialize_distributed(f.distributed)
  run_grid(f.config, f.workdir)


def _define_flags() -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  config_flags.DEFINE_config_file("config", None, "Grid config file.",
                                  lock_config=False)
  flags.DEFINE_string("workdir", None, "Grid output directory.")
  flags.DEFINE_bool("distributed", False,
                    "Call jax.distributed.initialize() (multi-host).")
  flags.mark_flags_as_required(["config", "workdir"])


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  _define_flags()
  app.run(main)
