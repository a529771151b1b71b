"""Many models in one program: the paper's grid (learning rates x restarts).

The paper trains every setting of a task x model grid five times (section
5.5; reference-behaviour.md section 9). Here the K = |learning rates| x
restarts models are trained at once by `loop.run_models`, the same loop a
single run uses (stacked states, vmapped steps; each model keeps its own
learning rate, schedule, early stopping and best parameters).

Model k = (learning rate i, restart r) uses seeds `seed + r` for its
parameters, batch order and (with `grid_vary_data_seed`, the paper's
protocol) its own training/validation data, so models of different learning
rates but the same restart are paired.

Outputs under `workdir`:

  grid_config.json
  lr_<lr>/restart_<r>/            one run directory per model, the same files
                                  as a single run (config.json, metrics.jsonl,
                                  TensorBoard events, checkpoints/,
                                  test_by_length.{json,csv}, results.json):
                                  `evaluate`, `plots` and the notebooks read
                                  it like a single run; resuming restores
                                  each model from its own checkpoints
  grid_summary.json               per-setting mean/std of the best-epoch
                                  validation CE difference and the selection

The selected setting has the lowest mean best-epoch validation CE difference
over its restarts, ties broken by the lower std (the authors'
print_grid_search.py compares (mean, std) tuples).

On a mesh the K axis is sharded over 'model' and each batch over 'data'
(`make_mesh(num_models=config.grid_model_parallel)`).

CLI:
  python -m nsrnn_jax.grid --config=configs/dyck_ns.py --workdir=runs/grid_dyck_ns
The rates come from --config.learning_rate_grid (default: the paper's), the
restarts from --config.num_restarts and --config.grid_restart_ids (configs/
default.py); --config.learning_rate, which every member overwrites, is
refused.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
from typing import Any, Optional, Sequence

import jax
import ml_collections
import numpy as np

from nsrnn_jax import checkpointing
from nsrnn_jax import data
from nsrnn_jax import loop
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
  """The learning rates of the grid: `learning_rate_grid` (configs/
  default.py: the paper's), or `grid_learning_rates` where a config sets
  that (programs that build grid configs, e.g. reproduce's model axis)."""
  field = ("grid_learning_rates" if "grid_learning_rates" in config
           else "learning_rate_grid")
  lrs = _get(config, field, None)
  if lrs is None:
    raise ValueError("config.learning_rate_grid is missing (e.g. "
                     "(0.01, 0.005, 0.001, 0.0005)).")
  lrs = tuple(float(x) for x in lrs)
  if not lrs or any(not (x > 0 and math.isfinite(x)) for x in lrs):
    raise ValueError(f"config.{field} must be positive numbers (got {lrs}).")
  if len(set(lrs)) != len(lrs):
    raise ValueError(f"config.{field} has duplicates: {lrs}.")
  return lrs


def members(config) -> list[Member]:
  """Expands a grid config into its K members (learning rate major)."""
  num_restarts = _get(config, "num_restarts", 5)
  if (not isinstance(num_restarts, (int, np.integer))
      or isinstance(num_restarts, bool) or num_restarts < 1):
    raise ValueError(f"config.num_restarts must be a positive integer "
                     f"(got {num_restarts!r}).")
  restart_ids = _get(config, "grid_restart_ids", None)
  if restart_ids is None or (isinstance(restart_ids, (tuple, list))
                             and not restart_ids):
    restart_ids = tuple(range(num_restarts))   # () or unset: every restart
  else:
    ids = tuple(restart_ids) if isinstance(restart_ids, (tuple, list)) else ()
    if (not ids or len(set(ids)) != len(ids) or any(
        not isinstance(r, (int, np.integer)) or isinstance(r, bool)
        or not 0 <= r < num_restarts for r in ids)):
      raise ValueError(f"config.grid_restart_ids must be distinct integers in "
                       f"[0, num_restarts={num_restarts}) (got "
                       f"{restart_ids!r}).")
    restart_ids = tuple(sorted(int(r) for r in ids))
  vary_data = bool(_get(config, "grid_vary_data_seed", True))
  out = []
  for lr in grid_learning_rates(config):
    for r in restart_ids:
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


# Kept for benchmarks/scale.py; the loop owns them.
stack_states = loop.stack_states
stack_batches = loop.stack_batches


def run_grid(config: ml_collections.ConfigDict, workdir: str,
             splits: Optional[Sequence[data.Splits]] = None,
             model: Any = None,
             mesh: Optional[jax.sharding.Mesh] = None,
             should_stop=None) -> dict:
  """Trains the K models of a grid at once, writes per-model runs + summary.

  Args:
    config: a single-run config (configs/default.py) plus `grid_learning_rates`
      and `num_restarts` (optional: `grid_vary_data_seed`, default True;
      `grid_model_parallel`, mesh size of the 'model' axis, default 1;
      `grid_restart_ids`, the restarts to train, default all, so that a
      grid can be split over processes or machines restart by restart).
    workdir: grid output directory (see the module docstring). Rerunning on
      the same workdir resumes every model from its own checkpoints.
    splits: one `data.Splits` per member (tests); default: built from each
      member's config (members with equal data seeds share one copy).
    model: Flax model to use instead of `models.build(config)`.
    mesh: device mesh; default `parallel.make_mesh(num_models=
      config.grid_model_parallel)` over all devices.
    should_stop: called after every epoch (once its checkpoints are saved);
      returning True ends this invocation there (rerunning resumes).

  Returns:
    The summary dict (also written to grid_summary.json on process 0), or
    {"finished": False} when the invocation stopped early.
  """
  grid_members = members(config)
  configs_json = []
  for m in grid_members:
    train.validate_config(m.config)
    configs_json.append(train.config_to_json(m.config))
    checkpointing.check_workdir(os.path.join(workdir, m.subdir),
                                configs_json[-1])
  # The grid's own files (grid_config.json, the summary) go here too; an
  # empty path (the working directory) passed the members' checks above.
  checkpointing.check_writable(workdir)
  if splits is None:
    by_seed = {}
    for m in grid_members:
      seed = int(m.config.data_seed)
      if seed not in by_seed:
        by_seed[seed] = data.from_config(m.config,
                                         need_test=bool(config.run_test))
    splits = [by_seed[int(m.config.data_seed)] for m in grid_members]
  if len(splits) != len(grid_members):
    raise ValueError(f"Got {len(splits)} splits for {len(grid_members)} "
                     "members.")
  if mesh is None:
    mesh = parallel.make_mesh(
        num_models=int(_get(config, "grid_model_parallel", 1)))
  model = train.build_model(config) if model is None else model
  if os.path.isdir(os.path.join(workdir, "checkpoints")):
    _split_stacked_checkpoint(workdir, grid_members, model)
  runs = []
  for m, s in zip(grid_members, splits):
    loop.check_splits(s, m.config, m.subdir)
  for m, s, config_json in zip(grid_members, splits, configs_json):
    run_dir = os.path.join(workdir, m.subdir)
    config_json.update(alphabet=list(s.alphabet), vocab_size=len(s.alphabet))
    if parallel.is_main_process():
      checkpointing.write_config(run_dir, config_json)
    runs.append(loop.Run(m.config, run_dir, s, m.subdir))
  if parallel.is_main_process():
    checkpointing.write_json(workdir, "grid_config.json",
                             train.config_to_json(config))
  results_K = loop.run_models(runs, model, mesh=mesh, should_stop=should_stop)
  if not all(r["finished"] for r in results_K):
    return {"finished": False}
  summary = summarize_grid(grid_members, results_K)
  if parallel.is_main_process():
    checkpointing.write_json(workdir, SUMMARY_FILE, summary)
    print(format_summary(summary))
  return summary


def _split_stacked_checkpoint(workdir: str, grid_members: Sequence[Member],
                              model) -> None:
  """Resumes a grid written by an older version (one stacked checkpoint).

  Its `checkpoints/` held the [K, ...] state of all members; each member's
  slice becomes a checkpoint of its own run directory (at that member's
  epoch), and the stacked directory is moved aside to
  `checkpoints_stacked/`, never deleted.
  """
  if any(os.path.isdir(checkpointing.checkpoint_dir(
      os.path.join(workdir, m.subdir))) for m in grid_members):
    raise ValueError(f"{workdir!r} holds both a stacked grid checkpoint "
                     "(checkpoints/) and per-run ones; move one of them away")
  template = loop.stack_states([train.create_train_state(
      grid_members[0].config, jax.random.key(0), model)] * len(grid_members))
  template = jax.tree.map(np.asarray, template.arrays())
  manager = checkpointing.make_manager(os.path.join(workdir, "checkpoints"),
                                       read_only=True)
  try:
    restored = checkpointing.restore_latest(manager, template)
  finally:
    checkpointing.close(manager)
  if restored is not None and parallel.is_main_process():
    _, arrays, host = restored
    for k, m in enumerate(grid_members):
      epoch = int(np.asarray(arrays["epoch"])[k])
      member = checkpointing.make_manager(checkpointing.checkpoint_dir(
          os.path.join(workdir, m.subdir)))
      checkpointing.save(member, epoch, jax.tree.map(
          lambda x: np.asarray(x)[k], arrays),  # pylint: disable=cell-var-from-loop
                         {"shuffle_rng": host["shuffle_rngs"][k],
                          "order": host["orders"][k], "epoch": epoch})
      checkpointing.close(member)
  if parallel.is_main_process():
    os.rename(os.path.join(workdir, "checkpoints"),
              os.path.join(workdir, "checkpoints_stacked"))


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


# Fields every member overwrites (`members`): set on the command line they
# would be ignored, so the CLI refuses them and names what to set instead.
_GRID_SETS = {"learning_rate": "the grid sets it for every model "
                               "(config.learning_rate_grid x restarts); use "
                               "--config.learning_rate_grid=(0.01,0.005)"}


def check_command_line(argv: Sequence[str]) -> None:
  """Refuses `--config.<field>` overrides that the grid would ignore.

  Raises:
    ValueError: naming the field and what to set instead.
  """
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  cli.refuse_config_overrides(argv, _GRID_SETS)


def main(argv: Sequence[str]) -> None:
  """python -m nsrnn_jax.grid --config=... --workdir=... [--distributed]."""
  del argv  # absl's leftovers; the overrides are in sys.argv.
  check_command_line(sys.argv[1:])
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  # Explicit multi-host setups come through NSRNN_* environment variables
  # (launch/local_multiprocess.sh); clusters are auto-detected.
  parallel.maybe_initialize_distributed(f.distributed)
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  cli.use_compilation_cache(f.compilation_cache)
  run_grid(f.config, f.workdir)


def _define_flags() -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  cli.define_config_file("config", "Grid config file.", lock_config=False)
  flags.DEFINE_string("workdir", None, "Grid output directory.")
  flags.DEFINE_bool("distributed", False,
                    "Call jax.distributed.initialize() (multi-host).")
  flags.DEFINE_string("compilation_cache", cli.DEFAULT_COMPILATION_CACHE,
                      "Persistent XLA compilation cache directory ('' = "
                      "off).")
  flags.mark_flags_as_required(["config", "workdir"])


if __name__ == "__main__":
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  _define_flags()
  cli.run(main)
