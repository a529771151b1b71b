"""The epoch loop: K >= 1 models trained at once; a single run is K = 1.

`run_models(runs, model)` is the only training loop of the package:
`train.train_and_evaluate` calls it with one run, `grid.run_grid` with the
K = |learning rates| x restarts members of a grid. The K `train.TrainState`s
are stacked along a leading model axis and `train`'s pure functions
(`train_step`, `eval_step`, `end_of_epoch`) are vmapped over it. Each model
keeps its own learning rate (in its optimizer state), plateau schedule,
early-stopping counter and best parameters; a model that has stopped no
longer changes (the steps mask the update with `state.stopped`).

Every run has its own directory with the same files, whether it trains alone
or in a grid (README "Outputs"): config.json, metrics.jsonl (one record per
epoch), TensorBoard events, checkpoints/ (that run's state alone),
test_by_length.{json,csv} and results.json. Resuming restores each run from
its own checkpoints and truncates its metrics past the restored epoch.

Because the K models draw batches of different lengths at the same step,
each step's K batches are right-padded to the longest of them (or its
`length_buckets` bound) with a zero mask; all models are causal, so the
masked loss is exact. On a mesh the K axis is sharded over 'model' and each
batch over 'data' (parallel.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import sys
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from nsrnn_jax import checkpointing
from nsrnn_jax import data
from nsrnn_jax import metrics as metrics_lib
from nsrnn_jax import parallel
from nsrnn_jax import train
from nsrnn_jax import workdir_lock

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Run:
  """One model of the loop.

  Attributes:
    config: the run's full config (learning rate and seeds included).
    workdir: its run directory.
    splits: its data.
    name: how messages name it (the workdir, or lr_<lr>/restart_<r>).
  """
  config: ml_collections.ConfigDict
  workdir: str
  splits: data.Splits
  name: str


# ---------------------------------------------------------------------------
# Stacking, padding and the vmapped steps.
# ---------------------------------------------------------------------------


def stack_states(states: Sequence[train.TrainState]) -> train.TrainState:
  """Stacks K TrainStates along a new leading axis.

  Only the array fields are stacked; the static fields (apply_fn, optimizer,
  schedule) come from the first state, so they must agree across models (the
  learning rate lives in the optimizer *state*, so one optimizer serves all).
  """
  arrays = [s.arrays() for s in states]
  return states[0].replace(**jax.tree.map(lambda *xs: jnp.stack(xs), *arrays))


def stack_batches(symbols_list: Sequence[np.ndarray],
                  padded_to: Optional[int] = None,
                  eos: Optional[int] = None) -> train.Batch:
  """K batches of (possibly) different lengths -> one [K, B, N] batch.

  Each is right-padded to the longest (or to `padded_to`) with mask 0; with
  `eos`, each string is followed by EOS (`train.make_batch`).
  """
  sizes = {np.shape(s)[0] for s in symbols_list}
  if len(sizes) != 1:
    raise ValueError(f"the runs' batches differ in size: {sorted(sizes)}; "
                     "every run must use the same batch_size")
  longest = max(np.shape(s)[1] for s in symbols_list)
  padded_to = longest if padded_to is None else max(padded_to, longest)
  batches = [train.make_batch(s, padded_to, eos) for s in symbols_list]
  return {key: np.stack([b[key] for b in batches]) for key in batches[0]}


def over_models(fn):
  """fn mapped over a leading model axis K: vmapped, or called once if K = 1.

  With one model the axis is squeezed instead of vmapped, so data-dependent
  `lax.cond`s inside the step (ns_stack's linear α path) stay branches;
  under vmap their predicate is batched and both branches run.
  """

  def mapped(*args):
    if jax.tree.leaves(args)[0].shape[0] != 1:
      return jax.vmap(fn)(*args)
    out = fn(*jax.tree.map(lambda x: x[0], args))
    return jax.tree.map(lambda x: jnp.expand_dims(x, 0), out)

  return mapped


def _eval_models(params_K, batch_K, apply_fn):
  return over_models(functools.partial(train.eval_step, apply_fn=apply_fn))(
      params_K, batch_K)


class Steps(NamedTuple):
  """The vmapped, jitted train and epoch-end steps of one mesh."""
  train: Callable[..., Any]
  end_of_epoch: Callable[..., Any]


def _model_and_batch_specs():
  """shard_map specs: state per model; batch rows per model and device."""
  return (jax.sharding.PartitionSpec(parallel.MODEL_AXIS),
          jax.sharding.PartitionSpec(parallel.MODEL_AXIS, parallel.DATA_AXIS))


@functools.lru_cache(maxsize=None)
def jitted_steps(mesh) -> Steps:
  """The steps for `mesh`, cached: one jit cache per mesh for the process.

  Their caches are shared by every call in one process (tests, notebooks,
  grids) as long as the static fields compare equal, and each compiles once
  per padded length (tests/loop_test.py). The state's output sharding is
  pinned to its input sharding, or a size-1 'model' axis would come back
  replicated and cost one more compilation.
  """
  state_sharding = parallel.model_sharding(mesh)
  # The train step is per-device code (shard_map): each device runs its
  # models' steps on its rows of the batch and the gradients are summed over
  # 'data' once per step. Under plain GSPMD the partitioner kept the
  # backward scans' parameter-gradient carries replicated and all-reduced
  # them at every time step (80 all-reduces per step at n = 80; 2 CPU
  # devices ran the LSTM step 6x slower than one).
  per_device = over_models(functools.partial(train.train_step,
                                             data_axis=parallel.DATA_AXIS))
  model_spec, batch_spec = _model_and_batch_specs()
  # check_vma=False: the stack DPs' scans start from constant (unvarying)
  # carries; the outputs are psum-ed (identical over 'data') by
  # construction.
  train_step = jax.shard_map(per_device, mesh=mesh,
                             in_specs=(model_spec, batch_spec),
                             out_specs=(model_spec, model_spec),
                             check_vma=False)
  return Steps(
      train=jax.jit(train_step, donate_argnums=0,
                    out_shardings=state_sharding),
      end_of_epoch=jax.jit(jax.vmap(train.end_of_epoch), donate_argnums=0,
                           out_shardings=state_sharding))


eval_models = jax.jit(_eval_models, static_argnames="apply_fn")


@functools.lru_cache(maxsize=None)
def jitted_eval(mesh):
  """`eval_models` as per-device code on `mesh`: each device scores its rows.

  Under plain GSPMD the partitioner all-gathered the symbols at every time
  step of the NS-RNN's scan. XLA:CPU's in-process collectives deadlock when
  several such programs are in flight (evaluate_split dispatches a whole
  split before fetching): a 2-CPU-device hardest-CFL run ended twice in
  that all-gather. Scoring is per string, so no collective is needed.
  """
  model_spec, batch_spec = _model_and_batch_specs()

  def eval_models_per_device(params_K, batch_K, apply_fn):
    # check_vma=False: the stack DPs' scans start from constant carries.
    return jax.shard_map(functools.partial(_eval_models, apply_fn=apply_fn),
                         mesh=mesh, in_specs=(model_spec, batch_spec),
                         out_specs=batch_spec, check_vma=False)(
                             params_K, batch_K)

  return jax.jit(eval_models_per_device, static_argnames="apply_fn")


@functools.lru_cache(maxsize=None)
def jitted_margins(mesh):
  """Each model's stack margin on each string of a padded [K, B, N] batch
  (`models.PDAStackLM.stack_margin` with the batch's mask), per device as
  `jitted_eval`: [K, B]."""
  model_spec, batch_spec = _model_and_batch_specs()

  def margins(params, batch, apply_fn):
    return apply_fn({"params": params}, batch["symbols"], batch["mask"],
                    method="stack_margin")

  def margins_per_device(params_K, batch_K, apply_fn):
    return jax.shard_map(
        over_models(functools.partial(margins, apply_fn=apply_fn)),
        mesh=mesh, in_specs=(model_spec, batch_spec), out_specs=batch_spec,
        check_vma=False)(params_K, batch_K)

  return jax.jit(margins_per_device, static_argnames="apply_fn")


# ---------------------------------------------------------------------------
# Evaluation (also used by evaluate.py).
# ---------------------------------------------------------------------------


def evaluate_split(params_K, apply_fn, splits_K: Sequence[data.Split], config,
                   num_lengths_K: Sequence[Optional[int]], mesh,
                   eos: Optional[int] = None,
                   stack_margin: bool = False,
                   guard: Optional["ProgramGuard"] = None
                   ) -> list[list[dict]]:
  """Model and lower-bound sums per batch and model (float64, on the host).

  Args:
    params_K: stacked parameters of the K models.
    apply_fn: the model's apply function.
    splits_K: each model's split (same number of batches and batch size).
    config: for the compile strategy.
    num_lengths_K: N_L added to each string's bound (None: no ln N_L term).
    mesh: the ('model', 'data') mesh the params live on.
    eos: the EOS id (`train.eos_id`) or None; with EOS each string counts
      |w| + 1 tokens (the bound is still -ln p(w|l) [+ ln N_L] per string).
    stack_margin: also each string's stack margin (`jitted_margins`; the
      model must have one: `models.has_stack_margin`).
    guard: a `ProgramGuard` told of each batch's programs before they run.

  Returns:
    Per model, one dict per batch: length, num_strings, model_nll, bound_nll
    (None when the batch has no true log-probs), num_tokens, num_correct;
    with `stack_margin`, stack_margins (float64 [num_strings], nats) and
    string_nlls (each string's −ln p, float64 [num_strings]).
  """
  num = {len(s) for s in splits_K}
  if len(num) != 1:
    raise ValueError(f"the runs' splits differ in number of batches "
                     f"({sorted(num)})")
  (num,) = num
  score = jitted_eval(mesh)
  margins = jitted_margins(mesh) if stack_margin else None
  pending = []
  for j in range(num):
    symbols = [s[j].symbols for s in splits_K]
    longest = max(x.shape[1] for x in symbols)
    if guard is not None:
      guard.before(("eval", stack_margin, longest), pending)
    batch = parallel.put_model_batch(
        stack_batches(symbols, train.padded_length(longest, config), eos),
        mesh)
    sums = score(params_K, batch, apply_fn=apply_fn)
    if margins is not None:
      padded = margin_length(longest, config)
      if padded != train.padded_length(longest, config):
        batch = parallel.put_model_batch(
            stack_batches(symbols, padded, eos), mesh)
      sums = dict(sums, stack_margins=margins(params_K, batch,
                                              apply_fn=apply_fn))
    pending.append(sums)
  sums = parallel.to_host(pending)  # Fetch after dispatching everything.
  results = [[] for _ in splits_K]
  for j in range(num):
    for k, split in enumerate(splits_K):
      b = split[j]
      n = b.symbols.shape[0]
      bound = None
      if b.log_prob is not None:
        bound = float(np.sum(metrics_lib.lower_bound_neg_log_prob(
            b.log_prob, b.length_log_prob, num_lengths_K[k])))
      s = {key: np.asarray(v[k], np.float64)[:n] for key, v in sums[j].items()}
      results[k].append({
          "length": int(b.symbols.shape[1]), "num_strings": int(n),
          "model_nll": float(np.sum(s["nll"])), "bound_nll": bound,
          "num_tokens": float(np.sum(s["num_tokens"])),
          "num_correct": float(np.sum(s["num_correct"]))})
      if stack_margin:
        results[k][-1]["stack_margins"] = s["stack_margins"]
        results[k][-1]["string_nlls"] = s["nll"]
  return results


def margin_length(length: int, config) -> int:
  """The compiled length of a margin batch of `length`: its length bucket
  (`config.length_buckets`) under either compile strategy, else `length`.

  A margin is masked to each string's own length, so padding costs only
  time; bucketing keeps the margin's compiled programs to a few (41
  training lengths of a per_length run would otherwise compile, and hold
  the memory mappings of, 41 more programs: see `many_memory_mappings`).
  """
  bucket = train.length_bucket(length, config)
  return length if bucket is None else bucket


def margin_summary(results: Sequence[dict], dtype) -> dict:
  """The smallest stack margin of one model's `evaluate_split(...,
  stack_margin=True)` dicts and the fraction of strings above
  `rns_stack.exact_margin(dtype)` (their stack values are exact up to
  rounding)."""
  from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top
  margins = np.concatenate([r["stack_margins"] for r in results])
  return {"stack_margin": float(np.min(margins)),
          "stack_exact_fraction": float(np.mean(
              margins > rns_stack.exact_margin(dtype)))}


def summarize(results: Sequence[dict]) -> dict:
  """Perplexities and CE difference of one model's `evaluate_split` dicts."""
  nll = sum(r["model_nll"] for r in results)
  tokens = sum(r["num_tokens"] for r in results)
  out = {"perplexity": metrics_lib.perplexity(nll, tokens),
         "cross_entropy": nll / tokens,
         "accuracy": sum(r["num_correct"] for r in results) / tokens}
  if all(r["bound_nll"] is not None for r in results):
    bound = sum(r["bound_nll"] for r in results)
    out["lower_bound_perplexity"] = metrics_lib.perplexity(bound, tokens)
    out["ce_diff"] = metrics_lib.ce_difference(nll, bound, tokens)
  return out


def _unproven_errors(best_params_K, model, runs, tests, guard
                     ) -> list[dict]:
  """Per run, `evaluate.unproven_errors` of its test strings: those its
  stack margin does not prove exact, scored again in float64 (every
  process computes them; process 0 writes them)."""
  from nsrnn_jax import evaluate  # pylint: disable=g-import-not-at-top
  guard.phase_done()   # The test's programs are done with.
  params_K = parallel.to_host(best_params_K)
  out = []
  for k, run in enumerate(runs):
    config = ml_collections.ConfigDict(run.config.to_dict())
    config.alphabet = list(run.splits.alphabet)
    params = jax.tree.map(lambda x, k=k: x[k], params_K)
    out.append(evaluate.unproven_errors(
        evaluate.Loaded(model, params, config), run.splits.test, tests[k]))
  return out


def test_outputs(results: Sequence[dict], config) -> tuple[dict, dict]:
  """(per-length table, summary) of one model's test `evaluate_split` dicts.

  The summary holds the overall test metrics (prefixed test_) and the mean
  per-length CE difference over the training-length range and beyond it.
  Dicts with stack margins add, per length and overall, the smallest margin
  and the fraction of strings proven exact (`margin_summary`).
  """
  by_length = {}
  for r in results:
    by_length.setdefault(r["length"], []).append(r)
  margins = bool(results) and all("stack_margins" in r for r in results)
  dtype = config.get("dtype", "float32")
  table = {"lengths": [], "ce_diff": [], "perplexity": [],
           "lower_bound_perplexity": [], "num_strings": []}
  if margins:
    table.update(stack_margin=[], stack_exact_fraction=[])
  for length in sorted(by_length):
    s = summarize(by_length[length])
    table["lengths"].append(length)
    table["ce_diff"].append(s.get("ce_diff", float("nan")))
    table["perplexity"].append(s["perplexity"])
    table["lower_bound_perplexity"].append(
        s.get("lower_bound_perplexity", float("nan")))
    table["num_strings"].append(sum(r["num_strings"] for r in by_length[length]))
    if margins:
      for key, v in margin_summary(by_length[length], dtype).items():
        table[key].append(v)
  summary = {f"test_{k}": v for k, v in summarize(results).items()}
  if margins:
    summary.update({f"test_{k}": v
                    for k, v in margin_summary(results, dtype).items()})
    # The certificate (records from before it name none: the factor
    # margin, never above this one).
    from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top
    summary["test_stack_margin_kind"] = rns_stack.MARGIN_KIND
  lengths = np.asarray(table["lengths"])
  diffs = np.asarray(table["ce_diff"])
  inside = lengths <= config.train_max_length
  if inside.any():
    summary["test_ce_diff_in_train_range"] = float(np.mean(diffs[inside]))
  if (~inside).any():
    summary["test_ce_diff_longer"] = float(np.mean(diffs[~inside]))
  return table, summary


def check_splits(splits: data.Splits, config, name: str) -> None:
  """Raises a one-line ValueError for data the loop cannot use."""
  for split in ("train", "valid"):
    if not splits.split(split).batches:
      raise ValueError(f"run {name} has no {split} batches")
  if config.run_test and not splits.test.batches:
    raise ValueError(f"config.run_test is set but run {name} has no test "
                     "strings")


def test_num_lengths(split: data.Split, config) -> Optional[int]:
  """N_L of the per-length test bound (reference-behaviour.md section 6)."""
  return split.num_lengths if config.test_bound_includes_num_lengths else None


# ---------------------------------------------------------------------------
# Output.
# ---------------------------------------------------------------------------


class _Console:
  """Status lines on stderr (process 0), kept apart from the progress bar."""

  def __init__(self, enabled: bool, bar: bool, total: int, initial: int):
    self.enabled = enabled
    self.bar = None
    if enabled and bar:
      import tqdm  # pylint: disable=g-import-not-at-top
      self.bar = tqdm.tqdm(total=total, initial=initial, desc="epochs",
                           unit="epoch", dynamic_ncols=True, leave=False,
                           file=sys.stderr)

  def print(self, line: str) -> None:
    if not self.enabled:
      return
    if self.bar is not None:
      self.bar.write(line, file=sys.stderr)
    else:
      print(line, file=sys.stderr, flush=True)

  def update(self) -> None:
    if self.bar is not None:
      self.bar.update(1)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
      self.bar = None


def _epoch_line(epochs: np.ndarray, records: dict, max_epochs: int,
                num_running: int, seconds: float) -> str:
  """One concise line per epoch (one model: its numbers; K: a summary)."""
  if len(records) == 1:
    (epoch, r), = records.items()
    diff = r.get("valid_ce_diff")
    diff = f"  valid ce_diff {diff:+.4f}" if diff is not None else ""
    margin = r.get("valid_stack_margin")
    margin = (f"  margin {margin:.1f} "
              f"({metrics_lib.percent(r['valid_stack_exact_fraction'])}"
              " exact)" if margin is not None else "")
    return (f"epoch {epoch:3d}/{max_epochs}  loss {r['train_loss']:.4f}{diff}"
            f"  ppl {r['valid_perplexity']:.4f}{margin}"
            f"  lr {r['learning_rate']:.3g}  {seconds:.1f}s")
  key = ("valid_ce_diff" if all("valid_ce_diff" in r for r in records.values())
         else "valid_perplexity")
  values = np.asarray([r[key] for r in records.values()])
  margin = ""
  if all("valid_stack_margin" in r for r in records.values()):
    margin = (f"  margin min "
              f"{min(r['valid_stack_margin'] for r in records.values()):.1f}")
  return (f"epoch {int(np.max(epochs)):3d}/{max_epochs}  {num_running} of "
          f"{len(epochs)} models running  {key} min {np.min(values):.4f} "
          f"median {np.median(values):.4f}{margin}  {seconds:.1f}s")


# ---------------------------------------------------------------------------
# The loop.
# ---------------------------------------------------------------------------


def _initial_state(runs: Sequence[Run], model) -> train.TrainState:
  """Stacked fresh states; one optimizer spec (run 0's), each run's LR."""
  states = []
  for run in runs:
    s = train.create_train_state(runs[0].config,
                                 jax.random.key(run.config.param_seed), model)
    states.append(s.replace(opt_state=train.set_learning_rate(
        s.opt_state, float(run.config.learning_rate))))
  return stack_states(states)


def _results(state_host: dict, k: int) -> dict:
  return {"finished": bool(state_host["stopped"][k]),
          "epochs": int(state_host["epoch"][k]),
          "steps": int(state_host["step"][k]),
          "best_epoch": int(state_host["best_epoch"][k]),
          "best_valid_perplexity": float(state_host["best_metric"][k]),
          "final_learning_rate": float(state_host["lr"][k])}


def run_models(runs: Sequence[Run], model, mesh=None,
               should_stop: Optional[Callable[[], bool]] = None
               ) -> list[dict]:
  """Trains K >= 1 models at once (resuming each from its run directory).

  The run directories must have been checked (`checkpointing.check_workdir`)
  and their config.json written; `runs[0].config` supplies everything shared
  (batch size, schedule, compile strategy, stop_after_epochs, progress_bar).

  Args:
    runs: the K runs (same batch size and number of training batches).
    model: the Flax model shared by all runs.
    mesh: the ('model', 'data') mesh; default: all devices on 'data'.
    should_stop: called after every epoch once its checkpoints are saved;
      returning True ends this invocation there (rerunning resumes).

  Returns:
    Each run's results dict (also written to its results.json once all runs
    have finished): finished, epochs, steps, best_epoch, best valid metrics,
    test metrics.

  Raises:
    FloatingPointError: a training loss or a validation perplexity is not
      finite (names epoch and run).
    ValueError: inconsistent runs, or a checkpoint that cannot be read.
  """
  config = runs[0].config
  num_models = len(runs)
  mesh = parallel.make_mesh() if mesh is None else mesh
  if num_models % int(mesh.shape[parallel.MODEL_AXIS]):
    raise ValueError(
        f"{num_models} models do not divide over the mesh's model axis "
        f"({mesh.shape[parallel.MODEL_AXIS]}); change grid_model_parallel")
  parallel.check_batch_size(int(config.batch_size), mesh)
  num_steps = {len(r.splits.train) for r in runs}
  if len(num_steps) != 1:
    raise ValueError(f"the runs have different numbers of training batches: "
                     f"{sorted(num_steps)}")
  (num_steps,) = num_steps
  main = parallel.is_main_process()
  train.check_state_fits_memory(config, model, num_models, mesh)

  state = _initial_state(runs, model)
  template = jax.tree.map(lambda x: np.asarray(x[0]), state.arrays())
  rngs = [np.random.RandomState(r.config.shuffle_seed) for r in runs]
  orders = [np.arange(num_steps) for _ in runs]
  with contextlib.ExitStack() as locks:
    if main:  # One writer per run directory (a second process is refused).
      for run in runs:
        locks.enter_context(workdir_lock.hold(run.workdir))
    return _run_locked(state, runs, model, mesh, rngs, orders, main,
                       should_stop, template)


def _run_locked(state, runs, model, mesh, rngs, orders, main, should_stop,
                template) -> list[dict]:
  """run_models once the run directories are held: restore, train, close."""
  config = runs[0].config
  num_models = len(runs)
  managers, writers = [], []
  console = None
  try:
    for run in runs:
      managers.append(checkpointing.make_manager(
          checkpointing.checkpoint_dir(run.workdir),
          keep=int(config.checkpoints_to_keep)))
    # No run resumes past the last epoch its metrics log holds completely,
    # so the log of a directory restored from mixed copies gets no hole.
    logged = [metrics_lib.last_complete_epoch(r.workdir) for r in runs]
    state, resumed = _restore(state, managers, template, rngs, orders, mesh,
                              move_aside=main, max_epochs=logged,
                              every=int(config.checkpoint_every_epochs))
    writers = [metrics_lib.MetricWriter(r.workdir, enabled=main,
                                        resume_epoch=e)
               for r, e in zip(runs, resumed)]
    console = _Console(main, bool(config.progress_bar),
                       int(config.max_epochs), max(resumed))
    if any(resumed):
      console.print(
          f"resumed from epoch {resumed[0]} ({runs[0].name})"
          if num_models == 1 else f"resumed {sum(e > 0 for e in resumed)} "
          f"of {num_models} runs from epochs {min(resumed)}-{max(resumed)}")
    return _train(state, runs, model, mesh, managers, writers, console, rngs,
                  orders, main, should_stop)
  finally:
    for manager in managers:
      checkpointing.close(manager)
    for w in writers:
      w.close()
    if console is not None:
      console.close()


def _restore(state, managers, template, rngs, orders, mesh, move_aside,
             max_epochs, every=1):
  """Each run's latest readable checkpoint of an epoch <= max_epochs[k] (or
  its fresh state), stacked.

  A run whose metrics log holds `every` or more epochs must have had a
  checkpoint: finding none (checkpoints/ deleted or emptied) is a ValueError,
  not a silent restart that would overwrite the log.
  """
  arrays_K, resumed = [], []
  for k, manager in enumerate(managers):
    restored = checkpointing.restore_latest(manager, template,
                                            move_aside=move_aside,
                                            max_step=max_epochs[k])
    if restored is None and max_epochs[k] >= every:
      raise ValueError(
          f"{os.path.dirname(str(manager.directory))!r}: metrics.jsonl holds "
          f"epochs 1-{max_epochs[k]} but there is no checkpoint in "
          f"{str(manager.directory)!r}; nothing was changed: restore the "
          "checkpoints, or move the run directory away to start again")
    if restored is None:
      arrays_K.append(jax.tree.map(lambda x: np.asarray(x[k]),  # pylint: disable=cell-var-from-loop
                                   state.arrays()))
      resumed.append(0)
      continue
    epoch, arrays, host = restored
    arrays_K.append(arrays)
    rngs[k].set_state(checkpointing.rng_state_from_json(host["shuffle_rng"]))
    orders[k] = np.asarray(host["order"], np.int64)
    resumed.append(epoch)
  return state.replace(**parallel.shard_models(
      jax.tree.map(lambda *xs: np.stack(xs), *arrays_K), mesh)), resumed


def _train(state, runs, model, mesh, managers, writers, console, rngs, orders,
           main, should_stop) -> list[dict]:
  """The epochs, then the final evaluation (see run_models)."""
  config = runs[0].config
  num_models = len(runs)
  num_steps = len(runs[0].splits.train)
  host = parallel.to_host
  steps = jitted_steps(mesh)
  epochs_this_run = 0
  eos = train.eos_id(config, model)
  # Several CPU devices in one process: wait for each step before the next.
  # With many steps in flight, XLA:CPU's in-process all-reduce deadlocked
  # (the devices' launches of different steps interleaved; jax 0.10.2).
  sync_steps = (jax.default_backend() == "cpu"
                and len(mesh.local_devices) > 1)
  guard = ProgramGuard()
  while True:
    stopped = np.asarray(host(state.stopped))
    if stopped.all():
      break
    start = time.perf_counter()
    for k in np.flatnonzero(~stopped):
      rngs[k].shuffle(orders[k])
    losses = []
    for i in range(num_steps):
      symbols = [r.splits.train[o[i]].symbols for r, o in zip(runs, orders)]
      longest = max(x.shape[1] for x in symbols)
      guard.before(("train", longest), (state, losses))
      batch = stack_batches(symbols, train.padded_length(longest, config),
                            eos)
      state, step_metrics = steps.train(
          state, parallel.put_model_batch(batch, mesh))
      if sync_steps:
        jax.block_until_ready(step_metrics["loss"])
      losses.append(step_metrics["loss"])
    losses_SxK = np.asarray(host(losses), np.float64)
    for k in np.flatnonzero(~stopped):
      bad = np.flatnonzero(~np.isfinite(losses_SxK[:, k]))
      if bad.size:
        raise FloatingPointError(
            f"non-finite training loss ({losses_SxK[bad[0], k]}) in epoch "
            f"{int(host(state.epoch)[k]) + 1}, step {bad[0] + 1} of run "
            f"{runs[k].name} (try a smaller learning rate); its last "
            "checkpoint is kept")
    train_time = time.perf_counter() - start
    stack_margin = bool(config.get("valid_stack_margin", False))
    valid_results = evaluate_split(
        state.params, model.apply, [r.splits.valid for r in runs], config,
        [r.splits.valid.num_lengths for r in runs], mesh, eos, stack_margin,
        guard)
    valid = [summarize(r) for r in valid_results]
    epoch_now = np.asarray(host(state.epoch)) + 1   # (one copy an epoch)
    for k in np.flatnonzero(~stopped):
      metrics_lib.check_valid_perplexity(
          valid[k]["perplexity"], valid[k]["cross_entropy"], "symbol",
          f"epoch {int(epoch_now[k])} of run {runs[k].name}",
          "try a smaller learning rate", "its last checkpoint is kept")
    if stack_margin:
      for v, r in zip(valid, valid_results):
        v.update(margin_summary(r, model.dtype))
    lr_used = np.asarray(host(train.learning_rate(state)))
    ppl = np.asarray([v["perplexity"] for v in valid], np.float32)
    state = steps.end_of_epoch(state, parallel.shard_models(ppl, mesh))
    after = host({"epoch": state.epoch, "best_epoch": state.best_epoch,
                  "lr": train.learning_rate(state),
                  "stopped": state.stopped})
    elapsed = time.perf_counter() - start
    records = {}
    for k in np.flatnonzero(~stopped):
      epoch = int(after["epoch"][k])
      record = {"train_loss": float(np.mean(losses_SxK[:, k])),
                "valid_perplexity": valid[k]["perplexity"],
                "valid_cross_entropy": valid[k]["cross_entropy"],
                "valid_accuracy": valid[k]["accuracy"],
                "learning_rate": float(lr_used[k]),
                "next_learning_rate": float(after["lr"][k]),
                "best_epoch": int(after["best_epoch"][k]),
                "time": elapsed, "train_time": train_time}
      if "ce_diff" in valid[k]:
        record["valid_ce_diff"] = valid[k]["ce_diff"]
        record["valid_lower_bound_perplexity"] = (
            valid[k]["lower_bound_perplexity"])
      if stack_margin:
        record["valid_stack_margin"] = valid[k]["stack_margin"]
        record["valid_stack_exact_fraction"] = (
            valid[k]["stack_exact_fraction"])
      records[k] = (epoch, record)
    epochs_this_run += 1
    leaving = bool(config.stop_after_epochs) and (
        epochs_this_run >= int(config.stop_after_epochs))
    # Save every checkpoint_every_epochs, when a run stops, and before
    # this invocation ends (nothing trained is lost).
    due = [k for k in np.flatnonzero(~stopped) if leaving
           or after["stopped"][k]
           or after["epoch"][k] % int(config.checkpoint_every_epochs) == 0]
    # Logged before the checkpoint is saved: a resume keeps the records up to
    # the restored epoch and drops the rest, so the log always holds every
    # epoch of the state it resumes from. (Logging after the save lost the
    # saved epoch's record when a kill fell between the two.) A kill loses
    # at most the epochs since the last checkpoint.
    for k, (epoch, record) in records.items():
      writers[k].write_scalars(epoch, record)
    _save(managers, due, host(state.arrays()) if due else None,
          after["epoch"], rngs, orders)
    records = {(epoch if num_models == 1 else k): record
               for k, (epoch, record) in records.items()}
    console.update()
    console.print(_epoch_line(after["epoch"], records,
                              int(config.max_epochs),
                              int((~after["stopped"]).sum()), elapsed))
    if not leaving and should_stop is not None and should_stop():
      unsaved = [k for k in np.flatnonzero(~stopped) if k not in due]
      _save(managers, unsaved, host(state.arrays()) if unsaved else None,
            after["epoch"], rngs, orders)
      leaving = True
    if leaving:
      break
  console.close()
  final = host({"stopped": state.stopped, "epoch": state.epoch,
                "step": state.step, "best_epoch": state.best_epoch,
                "best_metric": state.best_metric,
                "lr": train.learning_rate(state)})
  results = [_results(final, k) for k in range(num_models)]
  if not final["stopped"].all():
    console.print(f"stopped after {epochs_this_run} epochs, rerun the same "
                  "command to continue")
    return results
  _finish(state, model, runs, mesh, results, writers, main, guard)
  return results


def _save(managers, ks, arrays, epochs, rngs, orders) -> None:
  """Saves runs `ks` (their slices of the host state `arrays`)."""
  for k in ks:
    checkpointing.save(
        managers[k], int(epochs[k]), jax.tree.map(lambda x: x[k], arrays),  # pylint: disable=cell-var-from-loop
        {"shuffle_rng": checkpointing.rng_state_to_json(rngs[k].get_state()),
         "order": orders[k].tolist(), "epoch": int(epochs[k])})


# The share of the kernel's per-process limit on memory mappings
# (vm.max_map_count) past which a run drops the compiled programs of a
# phase it is done with (`ProgramGuard.phase_done`: training and
# validation, before the test).
MAPPINGS_FRACTION = 0.3


def drop_compiled_programs() -> None:
  """Frees the compiled programs no live object uses any more.

  `jax.clear_caches` drops JAX's references; a finished run's jitted
  functions can still be held by reference cycles (its model, train state
  and closures) until the garbage collector runs, and so can their
  executables: collected first, what is freed does not wait for the
  collector. (A full-suite test worker once kept ~2,100 mappings across
  runs with and without the collection; the test now runs in a fresh
  process, where the count drops either way.)
  """
  gc.collect()
  jax.clear_caches()


def max_map_count() -> Optional[int]:
  """The memory mappings Linux allows one process (vm.max_map_count); None
  where /proc does not tell."""
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return None


def many_memory_mappings(fraction: Optional[float] = None) -> bool:
  """Whether this process holds more than `fraction` (default
  MAPPINGS_FRACTION) of the memory mappings Linux allows it; False where
  /proc does not tell."""
  fraction = MAPPINGS_FRACTION if fraction is None else fraction
  limit = max_map_count()
  try:
    with open("/proc/self/maps") as f:
      count = sum(1 for _ in f)
  except OSError:
    return False
  return limit is not None and count > fraction * limit


# The share of vm.max_map_count past which a run, before it compiles a
# program for a batch shape it has not run since, drops the programs it
# holds (`ProgramGuard`): they come back from the persistent compilation
# cache, or compile again, when next needed.
LIVE_MAPPINGS_FRACTION = 0.75


class ProgramGuard:
  """Keeps a run's compiled programs within the kernel's memory mappings.

  On the CPU every compiled program maps its kernels' code (three mappings
  a kernel), and one process may hold 65,530 mappings: an NS-RNN at Q = S =
  3 on hardest CFL (41 training lengths, as many validation programs, a
  stack sweep in up to 6 time blocks) passed that within its first epoch
  and died in LLVM ("Cannot allocate memory"). One rule, two shares:
  `before(key)` is called before running a program for `key` (e.g. a batch
  length): the first time since the last drop it reads the process's
  mapping count, and past `fraction` (LIVE_MAPPINGS_FRACTION) of the limit
  it waits for `pending` (work in flight) and drops every compiled program
  first. `phase_done()` is called once the programs held are done with
  (training and validation, before the test's lengths): then the lower
  MAPPINGS_FRACTION is enough to drop them, since they would only be
  dropped part-way through the next phase. A drop that lets go of a
  program an earlier drop let go of too (the run's programs do not fit the
  limit, and it reloads them over and over) logs one warning with the
  remedies.
  """

  def __init__(self, fraction: Optional[float] = None):
    self.fraction = LIVE_MAPPINGS_FRACTION if fraction is None else fraction
    self.seen = set()
    self.drops = 0
    self.dropped = set()     # every key a drop has let go
    self.warned = False

  def before(self, key, pending=None) -> None:
    """Called before running a program for `key`; drops them all first if
    `key` is new since the last drop and the process holds too many
    mappings."""
    if key in self.seen:
      return
    if self.seen and many_memory_mappings(self.fraction):
      self.drop(pending)
    self.seen.add(key)

  def phase_done(self, pending=None) -> None:
    """Called when the programs held are done with: drops them (as `drop`)
    if the process holds more than MAPPINGS_FRACTION of its mappings."""
    if many_memory_mappings(MAPPINGS_FRACTION):
      self.drop(pending)

  def drop(self, pending=None) -> None:
    """Waits for `pending`, then drops every compiled program (each key is
    new again)."""
    if pending is not None:
      jax.block_until_ready(pending)
    if self.seen & self.dropped and not self.warned:
      # A program dropped before came back and goes again: the run's
      # programs do not fit, and it will reload them over and over (a
      # hardest-CFL NS-RNN at Q = S = 3 needs ~64,000 mappings; its epochs
      # took 250-330 s, and 73 s once the limit was raised).
      self.warned = True
      limit = max_map_count()
      logging.warning(
          "this run's compiled programs need more memory mappings than the "
          "process may hold (vm.max_map_count = %s), so it drops and "
          "reloads them over and over, which slows its epochs several "
          "times; raise the limit (as root: sysctl -w "
          "vm.max_map_count=%d) or set config.compile_strategy='bucket'",
          limit, max(262144, 4 * (limit or 0)))
    self.dropped |= self.seen
    drop_compiled_programs()
    self.seen.clear()
    self.drops += 1


def _finish(state, model, runs, mesh, results, writers, main, guard):
  """Best-parameter validation and test of every run; results.json files.

  `guard` is the epochs' `ProgramGuard`: it keeps watching the mappings
  through both evaluations (the test's lengths are new programs)."""
  config = runs[0].config
  eos = train.eos_id(config, model)
  stack_margin = bool(config.get("valid_stack_margin", False))
  best_valid = evaluate_split(
      state.best_params, model.apply, [r.splits.valid for r in runs], config,
      [r.splits.valid.num_lengths for r in runs], mesh, eos, stack_margin,
      guard)
  tests = None
  if config.run_test:
    # The train and validation programs are done with (an NS-RNN at Q = S =
    # 3 on hardest CFL held 54,000 mappings after its 41 training lengths,
    # and its test has 61 more); best_valid is on the host already.
    guard.phase_done()
    tests = evaluate_split(
        state.best_params, model.apply, [r.splits.test for r in runs], config,
        [test_num_lengths(r.splits.test, config) for r in runs], mesh, eos,
        stack_margin, guard)
  unproven = [{} for _ in runs]
  if tests is not None and stack_margin:
    unproven = _unproven_errors(state.best_params, model, runs, tests,
                                guard)
  for k, run in enumerate(runs):
    results[k].update({f"best_valid_{key}": v
                       for key, v in summarize(best_valid[k]).items()})
    if stack_margin:
      results[k].update({f"best_valid_{key}": v for key, v in
                         margin_summary(best_valid[k], model.dtype).items()})
    if tests is not None:
      table, summary = test_outputs(tests[k], config)
      results[k].update(summary, **unproven[k])
      text = metrics_lib.write_test_table(run.workdir, table, enabled=main)
      if main and len(runs) == 1:  # The result goes to stdout.
        print(f"Test cross-entropy difference by length ({run.workdir}):\n"
              f"{text}")
    writers[k].write_scalars(results[k]["epochs"], {
        key: v for key, v in results[k].items() if isinstance(v, float)},
                             jsonl=False)
    if main:
      checkpointing.write_json(run.workdir, "results.json", results[k])
