"""The paper's training protocol: config, train state, pure steps, entry point.

`train_and_evaluate(config, workdir)` is the single entry point of the CLI
(`python -m nsrnn_jax.main`), the tests and the notebooks; the epoch loop
itself is `loop.run_models` (a single run is its K = 1 case, a grid its
K > 1 case). The protocol is reference-behaviour.md sections 4 and 6:

* loss = per-token cross-entropy summed over the positions of a string, mean
  over the strings of the batch (this scale matters for clipping);
* Adam (beta 0.9/0.999, eps 1e-8), global-norm clipping at 5;
* PyTorch ReduceLROnPlateau on validation perplexity (factor 0.9, patience 5,
  relative threshold 1e-4: the LR decays on the 6th bad epoch, then the
  counter resets);
* early stopping on the 11th epoch without a strict improvement; at most
  `max_epochs` epochs; the best-validation parameters are used for the test;
* batches are built once and only their order is shuffled every epoch
  (`numpy.random.RandomState(shuffle_seed).shuffle`, in place, as the
  authors' code does).

Everything that changes per step or per epoch is a pure function of a
`TrainState` pytree and a batch {"symbols": int32[B, N], "mask": f32[B, N]},
so the steps can be jitted over a device mesh and vmapped over a model axis K
(`end_of_epoch` is written in jnp, and a stopped state no longer changes).

Compilation across lengths (`config.compile_strategy`): "per_length" lets
jax.jit keep one executable per distinct string length; "bucket" pads each
batch to the next boundary of `config.length_buckets` with a zero mask. All
models are causal, so padding never changes the masked loss.
"""

import dataclasses
import json
import sys
from typing import Any, Callable, Optional

import flax
import jax
import jax.numpy as jnp
from jax import lax
import ml_collections
import numpy as np
import optax

from nsrnn_jax import checkpointing
from nsrnn_jax import data
from nsrnn_jax import languages
from nsrnn_jax import ns_stack
from nsrnn_jax import parallel

PyTree = Any
Batch = dict  # {"symbols": int32[B, N], "mask": float32[B, N]}

MODELS = ("lstm", "jm", "gref", "ns", "rns", "vrns")
# config.optimizer: Adam (the formal-language protocol) or plain SGD (PTB).
OPTIMIZERS = ("adam", "sgd")
COMPILE_STRATEGIES = ("per_length", "bucket")
DTYPES = ("float32", "float64")


# ---------------------------------------------------------------------------
# Config validation.
# ---------------------------------------------------------------------------


MODELS = ("lstm", "jm", "gref", "ns", "rns", "vrns")
# config.optimizer: Adam (the formal-language protocol) or plain SGD (PTB).
OPTIMIZERS = ("adam", "sgd")
# The corpus fields (configs/default.py, "Corpus language modelling") and
# their defaults, which every other task keeps.
CORPUS_FIELD_DEFAULTS = {"corpus_dir": "", "bptt_length": 35,
                         "eval_batch_size": 0, "init_scale": 0.0}


def validate_config(config: ml_collections.ConfigDict,
                    training: bool = True) -> None:
  """Checks a config; raises a one-line ValueError naming the bad field.

  `training`: also what only training needs of this host: the batch splits
  over its devices and the corpus directory is there (a stored run read
  for evaluation batches on its own, and may be given a moved corpus)."""

  def fail(field, message):
    raise ValueError(f"config.{field} {message}")

  def need(field):
    if field not in config:
      fail(field, "is missing (start from configs/default.py)")
    return config[field]

  task = need("task")
  # languages.get is the single source of truth for task names: it accepts
  # the listed tasks and every `<family>_k<K>` (K >= 2) of tasks_ncf.
  if not isinstance(task, str):
    fail("task", f"must be a task name string (got {task!r})")
  # "corpus": a text corpus as one stream (corpus_train.py), no PCFG.
  is_corpus = task == "corpus"
  if not is_corpus:
    try:
      languages.get(task)
    except ValueError as e:
      fail("task", f"is invalid: {' '.join(str(e).split())}; or 'corpus' "
           "with config.corpus_dir")
  if not is_corpus:
    # Set for a formal-language run, they would be ignored.
    for field, default in CORPUS_FIELD_DEFAULTS.items():
      if field in config and config[field] != default:
        fail(field, f"is {config[field]!r} but applies to task 'corpus' "
             f"only (task {task!r}); leave it at {default!r}")
  model = need("model")
  if model not in MODELS:
    fail("model", f"is {model!r}; expected one of {', '.join(MODELS)}")
  from nsrnn_jax import vrns_model  # pylint: disable=g-import-not-at-top
  vrns_model.validate_config(config)
  # Optional: configs stored before the field existed mean the same model.
  from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
  table = config.get("stack_table", models.DEFAULT_NS_TABLE)
  if table not in models.NS_TABLES:
    fail("stack_table", f"is {table!r}; expected one of "
         f"{', '.join(models.NS_TABLES)}")
  if not models.can_run_table(model, table):
    fail("stack_table", f"is {table!r}, which model {model!r} cannot run;"
         f" leave it at {models.DEFAULT_NS_TABLE!r}"
         + (" or use 'log'" if model in ("rns", "vrns") else ""))
  margin = config.get("valid_stack_margin", False)
  if not isinstance(margin, (bool, np.bool_)):
    fail("valid_stack_margin", f"must be True or False (got {margin!r})")
  if margin and (model not in ("ns", "rns", "vrns") or table != "shares"
                 or (model == "vrns" and config.get("broadcast_bottom_vector",
                                                    False))):
    fail("valid_stack_margin", "applies to the 'shares' table of ns, rns "
         f"and vrns (the run-consistent VRNS bottom), not to model {model!r}"
         f", table {table!r}")
  action_init = config.get("ns_action_init", "uniform")
  if action_init not in models.NS_ACTION_INITS:
    fail("ns_action_init", f"is {action_init!r}; expected one of "
         f"{', '.join(models.NS_ACTION_INITS)}")
  if action_init != "uniform" and model != "ns":
    fail("ns_action_init", f"applies to model 'ns' only (model is {model!r})")
  chunk = config.get("stack_batch_chunk", 0)
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
    fail("stack_batch_chunk", f"is {chunk!r}; expected 0 (automatic) or a "
         "positive integer")
  unroll = config.get("scan_unroll", 0)
  if isinstance(unroll, bool) or not isinstance(unroll, (int, np.integer)) \
      or unroll < 0:
    fail("scan_unroll", f"must be 0 (automatic) or a positive integer (got "
         f"{unroll!r})")
  if unroll > 1 and (model == "vrns" or (
      model == "rns" and config.get("stack_window", 0))):
    fail("scan_unroll", f"must be 1 for model {model!r}"
         f"{' with a window' if model == 'rns' else ''} (got {unroll})")
  for field in ("hidden_size", "num_states", "num_stack_symbols",
                "stack_embedding_size", "batch_size", "num_train_batches",
                "num_valid_batches", "max_epochs", "test_strings_per_length",
                "checkpoint_every_epochs"):
    value = need(field)
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
      fail(field, f"must be an integer (got {value!r})")
    if value < 1:
      fail(field, f"must be >= 1 (got {value})")
  def real(field):
    value = need(field)
    if isinstance(value, bool) or not isinstance(value, (int, float,
                                                         np.number)):
      fail(field, f"must be a number (got {value!r})")
    return value

  for field in ("learning_rate", "clip_norm", "adam_eps"):
    value = real(field)
    if not 0 < value < float("inf"):
      fail(field, f"must be finite and > 0 (got {value})")
  for field in ("adam_b1", "adam_b2"):
    value = real(field)
    if not 0 <= value < 1:
      fail(field, f"must be in [0, 1) (got {value})")
  if not 0 < real("lr_decay_factor") <= 1:
    fail("lr_decay_factor", f"must be in (0, 1] (got {config.lr_decay_factor})")
  if not 0 <= real("lr_decay_threshold") < float("inf"):
    fail("lr_decay_threshold",
         f"must be finite and >= 0 (got {config.lr_decay_threshold})")
  for field in ("lr_decay_patience", "early_stopping_patience",
                "stop_after_epochs", "data_seed", "param_seed",
                "shuffle_seed", "test_seed"):
    value = need(field)
    if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
        or value < 0):
      fail(field, f"must be a non-negative integer (got {value!r})")
    # NumPy's RandomState (shuffling) takes seeds below 2**32; JAX's keys
    # take the same range without wrapping.
    if field.endswith("_seed") and value >= 2 ** 32:
      fail(field, f"must be < 2**32 (got {value})")
  if need("checkpoints_to_keep") < 2:
    fail("checkpoints_to_keep", "must be >= 2 so that the last good "
         f"checkpoint survives a failed save (got {config.checkpoints_to_keep})")
  for prefix in () if is_corpus else ("train", "test"):
    lo, hi = need(f"{prefix}_min_length"), need(f"{prefix}_max_length")
    if lo < 2:
      fail(f"{prefix}_min_length", f"must be >= 2 (got {lo})")
    if lo > hi:
      fail(f"{prefix}_min_length", f"({lo}) is greater than "
           f"config.{prefix}_max_length ({hi})")
    too_long = languages.length_out_of_reach(task, hi)
    if too_long:
      # The exact length table is O(n²): refused here rather than a
      # silent wait of hours (or years) before the first output line.
      fail(f"{prefix}_max_length", f"is {hi:,}: {too_long}")
    if (prefix == "train" or need("run_test")) and not languages.get(
        task).valid_lengths(lo, hi):
      fail(f"{prefix}_min_length", f"and config.{prefix}_max_length give "
           f"[{lo}, {hi}], which holds no string of {task}")
  strategy = need("compile_strategy")
  if strategy not in COMPILE_STRATEGIES:
    fail("compile_strategy", f"is {strategy!r}; expected one of "
         f"{', '.join(COMPILE_STRATEGIES)}")
  if strategy == "bucket" and not is_corpus:
    buckets = list(need("length_buckets"))
    if not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool)
               for b in buckets):
      fail("length_buckets", f"must be integer lengths (got {buckets})")
    if not buckets or sorted(set(buckets)) != buckets or buckets[0] < 2:
      fail("length_buckets", f"must be increasing lengths >= 2 (got {buckets})")
    longest = max(config.train_max_length, config.test_max_length)
    if buckets[-1] < longest:
      fail("length_buckets", f"must reach the longest string ({longest}); "
           f"largest bucket is {buckets[-1]}")
  from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top
  rns_stack.validate_stack_config(config)
  models.check_stack_variant_supported(
      model, config.get("stack_window", 0), config.get("truncation_length", 0),
      config.get("stack_bottom", rns_stack.FIXED), prefix="config.")
  if not isinstance(config.get("predict_eos", False), (bool, np.bool_)):
    fail("predict_eos", f"must be a bool (got {config.predict_eos!r})")
  # Optional (configs stored before they existed: one stack, learned push).
  num_stacks = config.get("jm_num_stacks", 1)
  push_hidden = config.get("jm_push_hidden_state", False)
  if (isinstance(num_stacks, bool)
      or not isinstance(num_stacks, (int, np.integer)) or num_stacks < 1):
    fail("jm_num_stacks", f"must be an integer >= 1 (got {num_stacks!r})")
  if not isinstance(push_hidden, (bool, np.bool_)):
    fail("jm_push_hidden_state", f"must be a bool (got {push_hidden!r})")
  if model != "jm" and (num_stacks != 1 or push_hidden):
    fail("jm_num_stacks" if num_stacks != 1 else "jm_push_hidden_state",
         f"applies to model 'jm' only (model is {model!r}); leave it at its "
         "default")
  if model == "jm" and push_hidden and (
      num_stacks * config.stack_embedding_size != config.hidden_size):
    fail("jm_push_hidden_state", "pushes the hidden state, so jm_num_stacks "
         "* stack_embedding_size must equal hidden_size (got "
         f"{num_stacks} * {config.stack_embedding_size} != "
         f"{config.hidden_size})")
  dtype = need("dtype")
  if dtype not in DTYPES:
    fail("dtype", f"is {dtype!r}; expected one of {', '.join(DTYPES)}")
  precision = need("matmul_precision")
  if precision not in ns_stack.MATMUL_PRECISIONS:
    fail("matmul_precision", f"is {precision!r}; expected one of "
         f"{', '.join(ns_stack.MATMUL_PRECISIONS)}")
  if dtype == "float64" and not jax.config.jax_enable_x64:
    fail("dtype", "is float64 but jax_enable_x64 is off (set JAX_ENABLE_X64=1)")
  lookup = config.get("input_lookup", False)
  if not isinstance(lookup, (bool, np.bool_)):
    fail("input_lookup", f"must be a bool (got {lookup!r})")
  if lookup and model not in models.INPUT_LOOKUP_MODELS:
    fail("input_lookup", f"applies to models "
         f"{', '.join(models.INPUT_LOOKUP_MODELS)} (model is {model!r})")
  optimizer = config.get("optimizer", "adam")
  if optimizer not in OPTIMIZERS:
    fail("optimizer", f"is {optimizer!r}; expected one of "
         f"{', '.join(OPTIMIZERS)}")
  if is_corpus:
    from nsrnn_jax import corpus_train  # pylint: disable=g-import-not-at-top
    corpus_train.validate_config(config, files=training)
  num_devices = jax.device_count()
  if training and config.batch_size % num_devices:
    fail("batch_size", f"({config.batch_size}) is not divisible by the number "
         f"of devices ({num_devices})")


# ---------------------------------------------------------------------------
# Train state and the epoch-end schedule.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Epoch-end constants (static: shared by every model of a vmapped K axis).

  Attributes:
    decay_factor: LR multiplier on a plateau (PyTorch `factor`).
    decay_patience: bad epochs tolerated before a decay (PyTorch `patience`).
    decay_threshold: relative improvement threshold (PyTorch `threshold`,
      mode "rel": improvement iff metric < best * (1 - threshold)).
    stop_patience: early stopping patience (stop when bad epochs > it).
    max_epochs: the state stops after this many epochs.
  """
  decay_factor: float = 0.9
  decay_patience: int = 5
  decay_threshold: float = 1e-4
  stop_patience: int = 10
  max_epochs: int = 200


@flax.struct.dataclass
class TrainState:
  """Everything that evolves during training, as one pytree.

  Attributes:
    params: model parameters.
    opt_state: optax state of `tx` (holds the current learning rate).
    step: optimizer steps taken (int32 scalar).
    epoch: epochs completed (int32 scalar).
    best_params: parameters of the best validation epoch so far.
    best_metric: best (lowest) validation perplexity, strict improvement.
    best_epoch: epoch (1-based) of best_metric; 0 before the first.
    bad_epochs: epochs since the last strict improvement (early stopping).
    plateau_best: best metric of the plateau detector (threshold-relative).
    plateau_bad_epochs: bad epochs of the plateau detector.
    stopped: training finished (early stop or max_epochs); steps are no-ops.
    apply_fn: the model's apply function (static).
    optimizer: hashable description of the optax transformation (static;
      a spec rather than the transformation itself so that two states built
      from the same config have equal tree structures and share jit caches).
    schedule: epoch-end constants (static).
  """
  params: PyTree
  opt_state: PyTree
  step: jax.Array
  epoch: jax.Array
  best_params: PyTree
  best_metric: jax.Array
  best_epoch: jax.Array
  bad_epochs: jax.Array
  plateau_best: jax.Array
  plateau_bad_epochs: jax.Array
  stopped: jax.Array
  apply_fn: Callable[..., Any] = flax.struct.field(pytree_node=False)
  optimizer: "OptimizerSpec" = flax.struct.field(pytree_node=False)
  schedule: Schedule = flax.struct.field(pytree_node=False)

  @property
  def tx(self) -> optax.GradientTransformation:
    """The optax transformation (rebuilt from the hashable spec)."""
    return self.optimizer.make()

  def arrays(self) -> dict:
    """The array fields (what is checkpointed), as a dict."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.metadata.get("pytree_node", True)}


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """Clip by global norm, then Adam (or SGD); the LR is an injected
  hyperparameter.

  Attributes:
    learning_rate: initial learning rate (the current one lives in the
      optimizer state, so it can differ per vmapped model and decay).
    clip_norm: global L2 norm threshold.
    b1, b2, eps: Adam constants.
    name: "adam" or "sgd" (plain SGD: PTB, rns-vrns-reference.md §4.4).
  """
  learning_rate: float
  clip_norm: float = 5.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  name: str = "adam"

  def make(self) -> optax.GradientTransformation:
    """The optimizer: gradient clipping by global norm, then Adam or SGD,
    its learning rate a hyperparameter (`optax.inject_hyperparams`)."""
    def chain(learning_rate):
      if self.name == "sgd":
        step = optax.sgd(learning_rate)
      else:
        step = optax.adam(learning_rate, b1=self.b1, b2=self.b2, eps=self.eps)
      return optax.chain(optax.clip_by_global_norm(self.clip_norm), step)
    return optax.inject_hyperparams(chain)(learning_rate=self.learning_rate)


def make_optimizer(config) -> OptimizerSpec:
  """The optimizer spec of a config (call .make() for the optax object)."""
  return OptimizerSpec(learning_rate=float(config.learning_rate),
                       clip_norm=float(config.clip_norm),
                       b1=float(config.adam_b1), b2=float(config.adam_b2),
                       eps=float(config.adam_eps),
                       name=str(config.get("optimizer", "adam")))


def learning_rate(state: TrainState) -> jax.Array:
  """The current learning rate stored in the optimizer state."""
  return state.opt_state.hyperparams["learning_rate"]


def set_learning_rate(opt_state, lr):
  """The optimizer state with its (injected) learning rate replaced."""
  lr = jnp.asarray(lr, opt_state.hyperparams["learning_rate"].dtype)
  hyperparams = dict(opt_state.hyperparams)
  hyperparams["learning_rate"] = lr
  return opt_state._replace(hyperparams=hyperparams)


def schedule_from_config(config) -> Schedule:
  """The plateau decay and early stopping of a config (`Schedule`)."""
  return Schedule(decay_factor=float(config.lr_decay_factor),
                  decay_patience=int(config.lr_decay_patience),
                  decay_threshold=float(config.lr_decay_threshold),
                  stop_patience=int(config.early_stopping_patience),
                  max_epochs=int(config.max_epochs))


def build_model(config):
  """models.build(config) (imported lazily so this module loads without it)."""
  from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
  return models.build(config)


def create_train_state(config, rng: jax.Array, model=None) -> TrainState:
  """Initialises parameters and optimizer state.

  Args:
    config: a validated config.
    rng: PRNG key for the parameters (from config.param_seed).
    model: the Flax model; default `models.build(config)`.

  Returns:
    A fresh TrainState (epoch 0, not stopped).
  """
  model = build_model(config) if model is None else model
  if hasattr(type(model), "declare_params"):
    # This package's models: the parameters without a forward pass (the
    # same values as model.init(rng, symbols), tested; a forward traced
    # eagerly took seconds for the windowed stacks).
    params = model.init(rng, method="declare_params")["params"]
  else:
    # Any other Flax LM: 4 symbols give a stack at least two updates.
    params = model.init(rng, jnp.zeros((1, 4), jnp.int32))["params"]
  spec = make_optimizer(config)
  zero = jnp.zeros((), jnp.int32)
  inf = jnp.asarray(jnp.inf, jnp.float32)
  return TrainState(
      params=params, opt_state=spec.make().init(params), step=zero, epoch=zero,
      best_params=params, best_metric=inf, best_epoch=zero, bad_epochs=zero,
      plateau_best=inf, plateau_bad_epochs=zero,
      stopped=jnp.zeros((), jnp.bool_), apply_fn=model.apply, optimizer=spec,
      schedule=schedule_from_config(config))


def check_state_fits_memory(config, model, num_models: int = 1,
                            mesh=None) -> None:
  """Refuses a run whose training state alone outgrows a device's memory.

  Counts, without allocating (`jax.eval_shape`), what each model keeps
  across steps (parameters, best parameters, Adam's two moments) plus one
  gradient, for the models one device holds (`num_models` over the mesh's
  model axis; on CPU all local devices share the host's memory). Activations
  (the stack's table) come on top, so passing is no promise; failing is
  certain. Without this a huge `hidden_size` on CPU ran until the operating
  system killed the process (or another one), with no message.

  Raises:
    ValueError: one line with the bytes needed and the bytes the device has.
  """
  mesh = parallel.make_mesh() if mesh is None else mesh
  abstract = jax.eval_shape(
      lambda key: create_train_state(config, key, model), jax.random.key(0))
  def nbytes(tree):
    return sum(int(np.prod(x.shape, dtype=np.int64)) * x.dtype.itemsize
               for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))
  num_params = sum(int(np.prod(x.shape, dtype=np.int64))
                   for x in jax.tree.leaves(abstract.params))
  per_model = nbytes(abstract.arrays()) + nbytes(abstract.params)
  local = [d for d in mesh.devices.flat
           if d.process_index == jax.process_index()] or jax.local_devices()
  model_axis = int(mesh.shape[parallel.MODEL_AXIS])
  need = per_model * -(-int(num_models) // model_axis)
  where = f"one {local[0].platform.upper()} device"
  if local[0].platform == "cpu":
    need *= len(local)
    where = "this host"
  have = parallel.device_memory_bytes(local[0])
  if have and need > have:
    models = "" if num_models == 1 else f" for {num_models} models"
    raise ValueError(
        f"the model has {num_params:,} parameters: its training state (with "
        f"Adam's moments and a gradient){models} needs {need / 2**30:,.1f} "
        f"GiB, more than the {have / 2**30:,.1f} GiB of {where}; use a "
        "smaller hidden_size or stack size")


def _where_tree(pred, on_true, on_false):
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def end_of_epoch(state: TrainState, valid_metric: jax.Array) -> TrainState:
  """Epoch-end bookkeeping on the validation metric (lower is better).

  PyTorch semantics: ReduceLROnPlateau(mode="min", threshold_mode="rel") and
  the authors' early stopping (strict `<`, stop when bad epochs > patience).
  A state that has already stopped is returned unchanged, so a vmapped model
  axis can keep running while single models are done.

  Args:
    state: the state after the epoch's training steps.
    valid_metric: scalar validation perplexity of this epoch.

  Returns:
    The updated state (epoch + 1, counters, LR, best params, stopped flag).
  """
  s = state.schedule
  metric = jnp.asarray(valid_metric, jnp.float32)
  # A NaN metric counts as no improvement (comparisons are False).
  epoch = state.epoch + 1
  improved = metric < state.best_metric
  best_metric = jnp.where(improved, metric, state.best_metric)
  best_epoch = jnp.where(improved, epoch, state.best_epoch)
  best_params = _where_tree(improved, state.params, state.best_params)
  bad_epochs = jnp.where(improved, 0, state.bad_epochs + 1)

  plateau_improved = metric < state.plateau_best * (1.0 - s.decay_threshold)
  plateau_best = jnp.where(plateau_improved, metric, state.plateau_best)
  plateau_bad = jnp.where(plateau_improved, 0, state.plateau_bad_epochs + 1)
  decay = plateau_bad > s.decay_patience
  old_lr = learning_rate(state)
  new_lr = old_lr * s.decay_factor
  # PyTorch skips updates smaller than eps=1e-8.
  decay_lr = decay & (old_lr - new_lr > 1e-8)
  lr = jnp.where(decay_lr, new_lr, old_lr)
  plateau_bad = jnp.where(decay, 0, plateau_bad)

  stopped = (bad_epochs > s.stop_patience) | (epoch >= s.max_epochs)
  new_state = state.replace(
      epoch=epoch, best_params=best_params, best_metric=best_metric,
      best_epoch=best_epoch, bad_epochs=bad_epochs, plateau_best=plateau_best,
      plateau_bad_epochs=plateau_bad,
      opt_state=set_learning_rate(state.opt_state, lr.astype(old_lr.dtype)),
      stopped=stopped)
  return _where_tree(state.stopped, state, new_state)


# ---------------------------------------------------------------------------
# Loss, train step, eval step.
# ---------------------------------------------------------------------------


def per_string_nll(logits_BxNxV, symbols_BxN, mask_BxN):
  """-ln p_model(w) per string [B]: masked sum of token CE, in float32
  (float64 for a float64 model: its loss and `evaluate.score(...,
  exact=True)`)."""
  ce_BxN = optax.softmax_cross_entropy_with_integer_labels(
      logits_BxNxV.astype(jnp.promote_types(logits_BxNxV.dtype,
                                            jnp.float32)), symbols_BxN)
  return jnp.sum(ce_BxN * mask_BxN, axis=1)


def _nll_sum_and_count(params, apply_fn, batch: Batch):
  """(Σ per-string NLL, number of real strings) of a batch (or a shard)."""
  symbols_BxN, mask_BxN = batch["symbols"], batch["mask"]
  logits_BxNxV = apply_fn({"params": params}, symbols_BxN)
  nll_B = per_string_nll(logits_BxNxV, symbols_BxN, mask_BxN)
  # Every real string has length >= 1, so mask[:, 0] marks real rows; padded
  # rows (if a sharded batch ever needs them) do not dilute the mean.
  return jnp.sum(nll_B), jnp.sum(mask_BxN[:, 0])


def loss_fn(params, apply_fn, batch: Batch):
  """Sum over positions, mean over the (real) strings of the batch."""
  nll_sum, num_strings = _nll_sum_and_count(params, apply_fn, batch)
  return nll_sum / jnp.maximum(num_strings, 1.0)


def train_step(state: TrainState, batch: Batch,
               data_axis: Optional[str] = None):
  """One Adam step on one batch; a no-op once `state.stopped`.

  Args:
    state: the train state (one model).
    batch: the whole batch, or with `data_axis` this device's shard of it.
    data_axis: name of the mesh axis the batch is split over when called
      per device (inside `jax.shard_map`, see loop.jitted_steps): the loss
      is the global mean over strings and the gradients are summed over the
      axis once, after the backward pass, so every device applies the same
      update. None: the plain single-program step.

  Returns:
    (new_state, metrics) with metrics {"loss", "grad_norm"} (scalars).
  """
  if data_axis is None:
    loss, grads = jax.value_and_grad(loss_fn)(state.params, state.apply_fn,
                                              batch)
  else:
    num_strings = jnp.maximum(
        lax.psum(jnp.sum(batch["mask"][:, 0]), data_axis), 1.0)

    def shard_loss(params):
      # This shard's share of the global mean; the shares sum to the loss.
      return _nll_sum_and_count(params, state.apply_fn, batch)[0] / (
          num_strings)

    loss, grads = jax.value_and_grad(shard_loss)(state.params)
    loss, grads = lax.psum((loss, grads), data_axis)
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  new_state = state.replace(params=params, opt_state=opt_state,
                            step=state.step + 1)
  new_state = _where_tree(state.stopped, state, new_state)
  return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}


def eval_step(params, batch: Batch, *, apply_fn):
  """Per-string sums for evaluation (bind apply_fn with functools.partial).

  Returns:
    {"nll": -ln p_model(w) [B], "num_tokens": [B], "num_correct": [B]}.
  """
  symbols_BxN, mask_BxN = batch["symbols"], batch["mask"]
  logits_BxNxV = apply_fn({"params": params}, symbols_BxN)
  nll_B = per_string_nll(logits_BxNxV, symbols_BxN, mask_BxN)
  correct_BxN = (jnp.argmax(logits_BxNxV, axis=-1) == symbols_BxN)
  return {"nll": nll_B, "num_tokens": jnp.sum(mask_BxN, axis=1),
          "num_correct": jnp.sum(correct_BxN * mask_BxN, axis=1)}


# ---------------------------------------------------------------------------
# Batches: padding to the compiled length.
# ---------------------------------------------------------------------------


def length_bucket(length: int, config) -> Optional[int]:
  """The smallest of `config.length_buckets` that holds `length` (None if
  none does)."""
  for bound in config.get("length_buckets", ()):
    if length <= bound:
      return int(bound)
  return None


def padded_length(length: int, config) -> int:
  """The compiled length of a batch of `length` under compile_strategy."""
  if config.compile_strategy == "per_length":
    return length
  bucket = length_bucket(length, config)
  if bucket is not None:
    return bucket
  raise ValueError(f"length {length} exceeds the largest of "
                   f"config.length_buckets {tuple(config.length_buckets)}")


def make_batch(symbols_BxN: np.ndarray, padded_to: Optional[int] = None,
               eos: Optional[int] = None) -> Batch:
  """{"symbols", "mask"} for strings of one length, zero-padded on the right.

  With `eos` (an id, see `eos_id`), every string is followed by that symbol
  and the batch is one position longer (`padded_to` + 1): the model then
  reads w_1..w_n and predicts w_1..w_n, EOS, n + 1 masked targets.
  """
  symbols_BxN = np.asarray(symbols_BxN, np.int32)
  num, length = symbols_BxN.shape
  padded_to = length if padded_to is None else padded_to
  extra = 0 if eos is None else 1
  symbols = np.zeros((num, padded_to + extra), np.int32)
  symbols[:, :length] = symbols_BxN
  if eos is not None:
    symbols[:, length] = eos
  mask = np.zeros((num, padded_to + extra), np.float32)
  mask[:, :length + extra] = 1.0
  return {"symbols": symbols, "mask": mask}


def eos_id(config, model) -> Optional[int]:
  """The EOS id (the model's last output, V) if config.predict_eos, else None.

  `models.build` gives a predict_eos model V + 1 outputs (and V + 1 input
  slots, the ICLR 2022 layout: the EOS input slot is never set).
  """
  try:
    predict = config.get("predict_eos", False)
  except AttributeError:
    predict = getattr(config, "predict_eos", False)
  return int(model.vocab_size) - 1 if predict else None


# ---------------------------------------------------------------------------
# Entry point.
# ---------------------------------------------------------------------------


def config_to_json(config: ml_collections.ConfigDict) -> dict:
  """The config as plain JSON values (what config.json stores)."""
  return json.loads(config.to_json_best_effort())


# The old name of data.from_config (the splits of a config).
load_splits = data.from_config


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       splits: Optional[data.Splits] = None,
                       model: Any = None,
                       should_stop: Optional[Callable[[], bool]] = None
                       ) -> dict:
  """Trains with the paper's protocol (resuming from `workdir`) and tests.

  Before anything is written, the config is validated and the workdir
  checked (`checkpointing.check_workdir`): a file, an unwritable directory or
  a stored config that differs in a field that changes the run is a
  one-line ValueError.

  Args:
    config: see configs/default.py.
    workdir: output directory (README "Outputs": config.json, metrics.jsonl,
      TensorBoard events, checkpoints/, test_by_length.{json,csv},
      results.json). Rerunning on the same workdir resumes from its latest
      readable checkpoint.
    splits: data to use instead of `data.from_config(config)`.
    model: Flax model to use instead of `models.build(config)`.
    should_stop: called after every epoch (once its checkpoint is saved);
      returning True ends this invocation there, like `stop_after_epochs`
      (a time budget; rerunning resumes).

  Returns:
    The results dict (also saved as results.json when training finished):
    finished, epochs, best_epoch, best valid metrics, test metrics.
  """
  if config.get("task") == "corpus":
    if splits is not None or model is not None:
      raise ValueError("task 'corpus' reads its data from config.corpus_dir "
                       "and builds its own model")
    from nsrnn_jax import corpus_train  # pylint: disable=g-import-not-at-top
    return corpus_train.train_and_evaluate(config, workdir,
                                           should_stop=should_stop)
  from nsrnn_jax import loop  # pylint: disable=g-import-not-at-top
  validate_config(config)
  config_json = config_to_json(config)
  checkpointing.check_workdir(workdir, config_json)
  if splits is None:
    splits = data.from_config(config, need_test=bool(config.run_test))
  loop.check_splits(splits, config, workdir)
  # The alphabet lets evaluate.py rebuild and score the model without data.
  config_json.update(alphabet=list(splits.alphabet),
                     vocab_size=len(splits.alphabet))
  model = build_model(config) if model is None else model
  if parallel.is_main_process():
    # The first line of a run (after the checks, so errors stay one line).
    runtime = parallel.describe_runtime(config.matmul_precision)
    if config.model in ("ns", "rns", "vrns"):
      from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
      runtime += (f"; {config.model.upper()} stack table "
                  f"{config.get('stack_table', models.DEFAULT_NS_TABLE)}")
    print(runtime, file=sys.stderr, flush=True)
    checkpointing.write_config(workdir, config_json)
  (results,) = loop.run_models([loop.Run(config, workdir, splits, workdir)],
                               model, should_stop=should_stop)
  return results
