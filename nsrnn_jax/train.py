"""Training and evaluation with the paper's protocol.

`train_and_evaluate(config, workdir)` is the single entry point of the CLI
(`python -m nsrnn_jax.main`), the tests and the notebooks. The protocol is
reference-behaviour.md sections 4 and 6:

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
import functools
import json
import os
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from absl import logging
import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from nsrnn_jax import checkpointing
from nsrnn_jax import metrics as metrics_lib

PyTree = Any
Batch = dict  # {"symbols": int32[B, N], "mask": float32[B, N]}

MODELS = ("lstm", "jm", "gref", "ns", "vrns")
# Used only if nsrnn_jax.languages cannot be imported (its TASKS wins).
_FALLBACK_TASKS = ("marked_reversal", "unmarked_reversal", "padded_reversal",
                   "dyck", "hardest_cfl")
COMPILE_STRATEGIES = ("per_length", "bucket")
DTYPES = ("float32", "float64")


# ---------------------------------------------------------------------------
# Config validation.
# ---------------------------------------------------------------------------


def _tasks() -> Sequence[str]:
  try:
    from nsrnn_jax import languages  # pylint: disable=g-import-not-at-top
    return tuple(languages.ALL_TASKS)
  except ImportError:
    return _FALLBACK_TASKS


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Checks a config; raises a one-line ValueError naming the bad field."""

  def fail(field, message):
    raise ValueError(f"config.{field} {message}")

  def need(field):
    if field not in config:
      fail(field, "is missing (start from configs/default.py)")
    return config[field]

  task = need("task")
  if task not in _tasks():
    fail("task", f"is {task!r}; expected one of {', '.join(_tasks())}")
  model = need("model")
  if model not in MODELS:
    fail("model", f"is {model!r}; expected one of {', '.join(MODELS)}")
  if model == "vrns":
    from nsrnn_jax import vrns_model  # pylint: disable=g-import-not-at-top
    vrns_model.validate_config(config)
  for field in ("hidden_size", "num_states", "num_stack_symbols",
                "stack_embedding_size", "batch_size", "num_train_batches",
                "num_valid_batches", "max_epochs", "test_strings_per_length",
                "checkpoint_every_epochs"):
    value = need(field)
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
      fail(field, f"must be an integer (got {value!r})")
    if value < 1:
      fail(field, f"must be >= 1 (got {value})")
  for field in ("learning_rate", "clip_norm", "adam_eps"):
    value = need(field)
    if not value > 0:
      fail(field, f"must be > 0 (got {value})")
  for field in ("adam_b1", "adam_b2"):
    value = need(field)
    if not 0 <= value < 1:
      fail(field, f"must be in [0, 1) (got {value})")
  if not 0 < need("lr_decay_factor") <= 1:
    fail("lr_decay_factor", f"must be in (0, 1] (got {config.lr_decay_factor})")
  if need("lr_decay_threshold") < 0:
    fail("lr_decay_threshold", f"must be >= 0 (got {config.lr_decay_threshold})")
  for field in ("lr_decay_patience", "early_stopping_patience",
                "stop_after_epochs", "data_seed", "param_seed",
                "shuffle_seed", "test_seed"):
    value = need(field)
    if not isinstance(value, (int, np.integer)) or value < 0:
      fail(field, f"must be a non-negative integer (got {value!r})")
  if need("checkpoints_to_keep") < 2:
    fail("checkpoints_to_keep", "must be >= 2 so that the last good "
         f"checkpoint survives a failed save (got {config.checkpoints_to_keep})")
  for prefix in ("train", "test"):
    lo, hi = need(f"{prefix}_min_length"), need(f"{prefix}_max_length")
    if lo < 2:
      fail(f"{prefix}_min_length", f"must be >= 2 (got {lo})")
    if lo > hi:
      fail(f"{prefix}_min_length", f"({lo}) is greater than "
           f"config.{prefix}_max_length ({hi})")
  strategy = need("compile_strategy")
  if strategy not in COMPILE_STRATEGIES:
    fail("compile_strategy", f"is {strategy!r}; expected one of "
         f"{', '.join(COMPILE_STRATEGIES)}")
  if strategy == "bucket":
    buckets = list(need("length_buckets"))
    if not buckets or sorted(set(buckets)) != buckets or buckets[0] < 2:
      fail("length_buckets", f"must be increasing lengths >= 2 (got {buckets})")
    longest = max(config.train_max_length, config.test_max_length)
    if buckets[-1] < longest:
      fail("length_buckets", f"must reach the longest string ({longest}); "
           f"largest bucket is {buckets[-1]}")
  dtype = need("dtype")
  if dtype not in DTYPES:
    fail("dtype", f"is {dtype!r}; expected one of {', '.join(DTYPES)}")
  if dtype == "float64" and not jax.config.jax_enable_x64:
    fail("dtype", "is float64 but jax_enable_x64 is off (set JAX_ENABLE_X64=1)")
  num_devices = jax.device_count()
  if config.batch_size % num_devices:
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
  """Clip by global norm, then Adam; the LR is an injected hyperparameter.

  Attributes:
    learning_rate: initial learning rate (the current one lives in the
      optimizer state, so it can differ per vmapped model and decay).
    clip_norm: global L2 norm threshold.
    b1, b2, eps: Adam constants.
  """
  learning_rate: float
  clip_norm: float = 5.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8

  def make(self) -> optax.GradientTransformation:
    def chain(learning_rate):
      return optax.chain(
          optax.clip_by_global_norm(self.clip_norm),
          optax.adam(learning_rate, b1=self.b1, b2=self.b2, eps=self.eps))
    return optax.inject_hyperparams(chain)(learning_rate=self.learning_rate)


def make_optimizer(config) -> OptimizerSpec:
  """The optimizer spec of a config (call .make() for the optax object)."""
  return OptimizerSpec(learning_rate=float(config.learning_rate),
                       clip_norm=float(config.clip_norm),
                       b1=float(config.adam_b1), b2=float(config.adam_b2),
                       eps=float(config.adam_eps))


def learning_rate(state: TrainState) -> jax.Array:
  """The current learning rate stored in the optimizer state."""
  return state.opt_state.hyperparams["learning_rate"]


def _set_learning_rate(opt_state, lr):
  hyperparams = dict(opt_state.hyperparams)
  hyperparams["learning_rate"] = lr
  return opt_state._replace(hyperparams=hyperparams)


def schedule_from_config(config) -> Schedule:
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
  # Parameter shapes do not depend on the length; 4 symbols give the NS-RNN
  # at least two stack updates to trace through.
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
      opt_state=_set_learning_rate(state.opt_state, lr.astype(old_lr.dtype)),
      stopped=stopped)
  return _where_tree(state.stopped, state, new_state)


# ---------------------------------------------------------------------------
# Loss, train step, eval step.
# ---------------------------------------------------------------------------


def per_string_nll(logits_BxNxV, symbols_BxN, mask_BxN):
  """-ln p_model(w) per string (float32 [B]): masked sum of token CE."""
  ce_BxN = optax.softmax_cross_entropy_with_integer_labels(
      logits_BxNxV.astype(jnp.float32), symbols_BxN)
  return jnp.sum(ce_BxN * mask_BxN, axis=1)


def loss_fn(params, apply_fn, batch: Batch):
  """Sum over positions, mean over the (real) strings of the batch."""
  symbols_BxN, mask_BxN = batch["symbols"], batch["mask"]
  logits_BxNxV = apply_fn({"params": params}, symbols_BxN)
  nll_B = per_string_nll(logits_BxNxV, symbols_BxN, mask_BxN)
  # Every real string has length >= 1, so mask[:, 0] marks real rows; padded
  # rows (if a sharded batch ever needs them) do not dilute the mean.
  num_strings = jnp.maximum(jnp.sum(mask_BxN[:, 0]), 1.0)
  return jnp.sum(nll_B) / num_strings


def train_step(state: TrainState, batch: Batch):
  """One Adam step on one batch; a no-op once `state.stopped`.

  Returns:
    (new_state, metrics) with metrics {"loss", "grad_norm"} (scalars).
  """
  loss, grads = jax.value_and_grad(loss_fn)(state.params, state.apply_fn,
                                            batch)
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
# Data: splits from nsrnn_jax.data, padding/buckets.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class EvalBatch:
  """One evaluation batch of strings of one length with their true log-probs."""
  symbols: np.ndarray  # int32 [B, N]
  log_prob: Optional[np.ndarray]  # ln G(w), float64 [B]
  length_log_prob: Optional[float]  # ln G(N)


@dataclasses.dataclass
class Splits:
  """Host-side data of one run.

  Attributes:
    train: training batches (int32 [B, N] each).
    valid: validation batches.
    test: test batches (one per length), or [] when not needed.
    valid_num_lengths: N_L of the validation interval.
    test_num_lengths: N_L of the test interval.
    alphabet: symbol strings, index = id.
  """
  train: list
  valid: list
  test: list
  valid_num_lengths: int
  test_num_lengths: int
  alphabet: tuple


def _field(obj, name, default=None):
  if isinstance(obj, Mapping):
    return obj.get(name, default)
  return getattr(obj, name, default)


def _to_eval_batches(split) -> list:
  batches = _field(split, "batches", split)
  out = []
  for b in batches:
    if isinstance(b, np.ndarray):
      out.append(EvalBatch(np.asarray(b, np.int32), None, None))
    else:
      lp = _field(b, "log_prob")
      llp = _field(b, "length_log_prob")
      out.append(EvalBatch(
          np.asarray(_field(b, "symbols"), np.int32),
          None if lp is None else np.asarray(lp, np.float64),
          None if llp is None else float(np.asarray(llp).reshape(-1)[0])))
  return out


def load_splits(config, need_test: bool = True) -> Splits:
  """Builds (deterministically) the train/valid/test data of a config."""
  from nsrnn_jax import data  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import languages  # pylint: disable=g-import-not-at-top
  lang = languages.get(config.task)
  raw = data.make_splits(
      config.task, seed=int(config.data_seed), test_seed=int(config.test_seed),
      train_batches=int(config.num_train_batches),
      valid_batches=int(config.num_valid_batches),
      batch_size=int(config.batch_size),
      train_min_length=int(config.train_min_length),
      train_max_length=int(config.train_max_length),
      # No test strings are sampled (or parsed) when the test is not needed.
      test_per_length=int(config.test_strings_per_length) if need_test else 0,
      test_min_length=int(config.test_min_length),
      test_max_length=int(config.test_max_length))
  train = [b.symbols for b in _to_eval_batches(_field(raw, "train"))]
  valid_split = _field(raw, "valid")
  test_split = _field(raw, "test") if need_test else None
  return Splits(
      train=train, valid=_to_eval_batches(valid_split),
      test=_to_eval_batches(test_split) if test_split is not None else [],
      valid_num_lengths=int(_field(valid_split, "num_lengths")),
      test_num_lengths=(int(_field(test_split, "num_lengths"))
                        if test_split is not None else 0),
      alphabet=tuple(lang.alphabet))


def padded_length(length: int, config) -> int:
  """The compiled length of a batch of `length` under compile_strategy."""
  if config.compile_strategy == "per_length":
    return length
  for bound in config.length_buckets:
    if length <= bound:
      return int(bound)
  raise ValueError(f"length {length} exceeds the largest of "
                   f"config.length_buckets {tuple(config.length_buckets)}")


def make_batch(symbols_BxN: np.ndarray, padded_to: Optional[int] = None
               ) -> Batch:
  """{"symbols", "mask"} for strings of one length, zero-padded on the right."""
  symbols_BxN = np.asarray(symbols_BxN, np.int32)
  num, length = symbols_BxN.shape
  padded_to = length if padded_to is None else padded_to
  symbols = np.zeros((num, padded_to), np.int32)
  symbols[:, :length] = symbols_BxN
  mask = np.zeros((num, padded_to), np.float32)
  mask[:, :length] = 1.0
  return {"symbols": symbols, "mask": mask}


class Placement:
  """Where batches and the state live: the default device, or a mesh.

  With more than one device the batch is sharded over the mesh's 'data' axis
  (each process builds the whole batch deterministically and contributes its
  rows) and the state is replicated; XLA inserts the gradient all-reduce.
  Evaluation batches whose size does not divide the data axis are padded
  with masked rows, which contribute nothing.
  """

  def __init__(self, mesh=None):
    self.mesh = mesh

  @classmethod
  def from_devices(cls) -> "Placement":
    """A mesh over all devices if there are several, else the default."""
    if jax.device_count() == 1:
      return cls(None)
    from nsrnn_jax import parallel  # pylint: disable=g-import-not-at-top
    return cls(parallel.make_mesh())

  @property
  def num_data(self) -> int:
    if self.mesh is None:
      return 1
    from nsrnn_jax import parallel  # pylint: disable=g-import-not-at-top
    return parallel.data_axis_size(self.mesh)

  def batch(self, batch: Batch) -> Batch:
    """Puts a host batch on the device(s), padding rows if needed."""
    if self.mesh is None:
      return jax.device_put(batch)
    from nsrnn_jax import parallel  # pylint: disable=g-import-not-at-top
    num = batch["symbols"].shape[0]
    extra = -num % self.num_data
    if extra:
      batch = {k: np.concatenate([v, np.zeros((extra,) + v.shape[1:],
                                              v.dtype)]) for k, v in
               batch.items()}
    rows = parallel.process_slice(num + extra, self.mesh)
    return parallel.shard_batch({k: v[rows] for k, v in batch.items()},
                                self.mesh)

  def state(self, tree):
    """Replicates a pytree (state or params) on every device."""
    if self.mesh is None:
      return tree
    from nsrnn_jax import parallel  # pylint: disable=g-import-not-at-top
    return parallel.replicate(tree, self.mesh)

  def host(self, tree):
    """Fetches a pytree of (possibly global) arrays as numpy."""
    if self.mesh is None:
      return jax.tree.map(np.asarray, jax.device_get(tree))
    from nsrnn_jax import parallel  # pylint: disable=g-import-not-at-top
    return parallel.to_host(tree)


# ---------------------------------------------------------------------------
# Evaluation of a split.
# ---------------------------------------------------------------------------


def evaluate_batches(eval_fn, params, batches: Sequence[EvalBatch], config,
                     num_lengths: Optional[int],
                     placement: Optional[Placement] = None) -> list[dict]:
  """Model and lower-bound sums per batch (float64, on the host).

  Args:
    eval_fn: jitted `eval_step` with apply_fn bound: (params, batch) -> sums.
    params: parameters to evaluate.
    batches: evaluation batches (with log_prob / length_log_prob).
    config: for the compile strategy.
    num_lengths: N_L added to each string's bound (0/None: no ln N_L term).
    placement: device placement (default: the default device).

  Returns:
    One dict per batch: length, num_strings, model_nll, bound_nll (None when
    the batch has no true log-probs), num_tokens, num_correct.
  """
  placement = Placement() if placement is None else placement
  outs = []
  for b in batches:
    length = b.symbols.shape[1]
    batch = make_batch(b.symbols, padded_length(length, config))
    outs.append((b, eval_fn(params, placement.batch(batch))))
  results = []
  for b, sums in outs:  # Fetch after dispatching everything.
    sums = jax.tree.map(lambda x: np.asarray(x, np.float64),
                        placement.host(sums))
    bound = None
    if b.log_prob is not None:
      bound = float(np.sum(metrics_lib.lower_bound_neg_log_prob(
          b.log_prob, b.length_log_prob, num_lengths)))
    results.append({
        "length": int(b.symbols.shape[1]),
        "num_strings": int(b.symbols.shape[0]),
        "model_nll": float(np.sum(sums["nll"])),
        "bound_nll": bound,
        "num_tokens": float(np.sum(sums["num_tokens"])),
        "num_correct": float(np.sum(sums["num_correct"])),
    })
  return results


def summarize(results: Sequence[dict]) -> dict:
  """Perplexities and CE difference of a list of `evaluate_batches` dicts."""
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


def test_table(results: Sequence[dict]) -> dict:
  """Per-length test table (columns as lists, sorted by length)."""
  by_length = {}
  for r in results:
    by_length.setdefault(r["length"], []).append(r)
  table = {"lengths": [], "ce_diff": [], "perplexity": [],
           "lower_bound_perplexity": [], "num_strings": []}
  for length in sorted(by_length):
    s = summarize(by_length[length])
    table["lengths"].append(length)
    table["ce_diff"].append(s.get("ce_diff", float("nan")))
    table["perplexity"].append(s["perplexity"])
    table["lower_bound_perplexity"].append(
        s.get("lower_bound_perplexity", float("nan")))
    table["num_strings"].append(sum(r["num_strings"] for r in by_length[length]))
  return table


def run_test(eval_fn, params, splits: Splits, config, workdir: str,
             write: bool = True, placement: Optional[Placement] = None
             ) -> tuple[dict, dict, str]:
  """Evaluates `params` on the test set; writes test_by_length.{json,csv}.

  The per-length lower bound includes ln N_L,test iff
  config.test_bound_includes_num_lengths (reference-behaviour.md section 6).

  Returns:
    (table, summary, text) where summary holds the overall test metrics and the mean
    per-length CE difference over the training-length range and beyond it.
  """
  num_lengths = (splits.test_num_lengths
                 if config.test_bound_includes_num_lengths else None)
  results = evaluate_batches(eval_fn, params, splits.test, config, num_lengths,
                             placement)
  table = test_table(results)
  overall = summarize(results)
  summary = {f"test_{k}": v for k, v in overall.items()}
  lengths = np.asarray(table["lengths"])
  diffs = np.asarray(table["ce_diff"])
  inside = lengths <= config.train_max_length
  if inside.any():
    summary["test_ce_diff_in_train_range"] = float(np.mean(diffs[inside]))
  if (~inside).any():
    summary["test_ce_diff_longer"] = float(np.mean(diffs[~inside]))
  text = metrics_lib.write_test_table(workdir, table, enabled=write)
  return table, summary, text


# ---------------------------------------------------------------------------
# Main loop.
# ---------------------------------------------------------------------------


def _is_main_process() -> bool:
  return jax.process_index() == 0


def _config_to_json(config) -> dict:
  return json.loads(config.to_json_best_effort())


# Module-level jitted steps: their caches are shared by every call of
# train_and_evaluate in one process (tests, notebooks, grids) as long as the
# static fields (model, optimizer spec, schedule) compare equal.
_jit_train_step = jax.jit(train_step)
_jit_end_of_epoch = jax.jit(end_of_epoch)
_jit_eval_step = jax.jit(eval_step, static_argnames="apply_fn")


def _make_eval_fn(apply_fn):
  return functools.partial(_jit_eval_step, apply_fn=apply_fn)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       splits: Optional[Splits] = None,
                       model: Any = None,
                       should_stop: Optional[Callable[[], bool]] = None
                       ) -> dict:
  """Trains with the paper's protocol (resuming from `workdir`) and tests.

  Args:
    config: see configs/default.py; validated first.
    workdir: output directory (config.json, metrics.jsonl, TensorBoard
      events, checkpoints/, test_by_length.{json,csv}, results.json).
      Rerunning on the same workdir resumes from its latest good checkpoint.
    splits: data to use instead of `load_splits(config)` (tests/notebooks).
    model: Flax model to use instead of `models.build(config)`.
    should_stop: called after every epoch (once its checkpoint is saved);
      returning True ends this invocation there, like `stop_after_epochs`
      (a time budget; rerunning resumes).

  Returns:
    The results dict (also saved as results.json when training finished):
    epochs, best_epoch, best valid metrics, test metrics, "finished".
  """
  validate_config(config)
  main = _is_main_process()
  os.makedirs(workdir, exist_ok=True)
  if splits is None:
    splits = load_splits(config, need_test=bool(config.run_test))
  # The resolved config also records the alphabet, so that evaluate.py can
  # rebuild and score the model without the data modules.
  config_json = _config_to_json(config)
  config_json["alphabet"] = list(splits.alphabet)
  config_json["vocab_size"] = len(splits.alphabet)
  if main:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(config_json, f, indent=1, sort_keys=True)
  model = build_model(config) if model is None else model

  placement = Placement.from_devices()
  state = placement.state(
      create_train_state(config, jax.random.key(config.param_seed), model))
  shuffle_rng = np.random.RandomState(config.shuffle_seed)
  order = np.arange(len(splits.train))
  manager = checkpointing.make_manager(
      os.path.join(workdir, "checkpoints"),
      keep=int(config.checkpoints_to_keep))
  restored = checkpointing.restore_latest(manager, state.arrays())
  if restored is not None:
    step, arrays, host = restored
    state = state.replace(**arrays)
    shuffle_rng.set_state(checkpointing.rng_state_from_json(host["shuffle_rng"]))
    order = np.asarray(host["order"], np.int64)
    logging.info("Resumed from checkpoint at epoch %d.", step)

  train_fn = _jit_train_step
  eval_fn = _make_eval_fn(model.apply)
  end_fn = _jit_end_of_epoch
  # Built and placed once: batches never change, only their order does.
  train_batches = [placement.batch(make_batch(s, padded_length(s.shape[1],
                                                               config)))
                   for s in splits.train]
  host = placement.host

  epochs_this_run = 0
  results = {}
  progress = None
  with metrics_lib.MetricWriter(workdir, enabled=main) as writer:
    if main and config.progress_bar:
      import tqdm  # pylint: disable=g-import-not-at-top
      progress = tqdm.tqdm(total=int(config.max_epochs),
                           initial=int(host(state.epoch)), desc="epochs",
                           unit="epoch", dynamic_ncols=True)
    while not bool(host(state.stopped)):
      start = time.perf_counter()
      shuffle_rng.shuffle(order)
      losses = []
      for i in order:
        state, step_metrics = train_fn(state, train_batches[i])
        losses.append(step_metrics["loss"])
      losses = np.asarray(host(losses), np.float64)
      epoch = int(host(state.epoch)) + 1
      if not np.all(np.isfinite(losses)):
        bad = int(np.argmax(~np.isfinite(losses)))
        metrics_lib.check_finite(losses[bad], f"training loss in epoch {epoch},"
                                 f" step {bad + 1}")
      train_time = time.perf_counter() - start
      valid = summarize(evaluate_batches(eval_fn, state.params, splits.valid,
                                         config, splits.valid_num_lengths,
                                         placement))
      lr_used = float(host(learning_rate(state)))
      state = end_fn(state, valid["perplexity"])
      record = {
          "train_loss": float(np.mean(losses)),
          "valid_perplexity": valid["perplexity"],
          "valid_cross_entropy": valid["cross_entropy"],
          "valid_accuracy": valid["accuracy"],
          "learning_rate": lr_used,
          "next_learning_rate": float(host(learning_rate(state))),
          "best_epoch": int(host(state.best_epoch)),
          "time": time.perf_counter() - start,
          "train_time": train_time,
      }
      if "ce_diff" in valid:
        record["valid_ce_diff"] = valid["ce_diff"]
        record["valid_lower_bound_perplexity"] = valid["lower_bound_perplexity"]
      writer.write_scalars(epoch, record)
      if epoch % config.checkpoint_every_epochs == 0 or bool(
          host(state.stopped)):
        checkpointing.save(manager, epoch, state.arrays(), {
            "shuffle_rng": checkpointing.rng_state_to_json(
                shuffle_rng.get_state()),
            "order": order.tolist(), "epoch": epoch})
      if progress is not None:
        progress.update(1)
        progress.set_postfix(loss=f"{record['train_loss']:.3f}",
                             ppl=f"{valid['perplexity']:.4f}")
      epochs_this_run += 1
      if config.stop_after_epochs and epochs_this_run >= config.stop_after_epochs:
        break
      if should_stop is not None and should_stop():
        break
    if progress is not None:
      progress.close()
    checkpointing.close(manager)

    scalars = host({"stopped": state.stopped, "epoch": state.epoch,
                    "step": state.step, "best_epoch": state.best_epoch,
                    "best_metric": state.best_metric,
                    "lr": learning_rate(state)})
    results = {
        "finished": bool(scalars["stopped"]),
        "epochs": int(scalars["epoch"]),
        "steps": int(scalars["step"]),
        "best_epoch": int(scalars["best_epoch"]),
        "best_valid_perplexity": float(scalars["best_metric"]),
        "final_learning_rate": float(scalars["lr"]),
    }
    if not results["finished"]:
      logging.info("Stopped after %d epochs this run (stop_after_epochs); "
                   "rerun to resume.", epochs_this_run)
      return results
    best_valid = summarize(evaluate_batches(
        eval_fn, state.best_params, splits.valid, config,
        splits.valid_num_lengths, placement))
    results.update({f"best_valid_{k}": v for k, v in best_valid.items()})
    if config.run_test and splits.test:
      _, summary, text = run_test(eval_fn, state.best_params, splits, config,
                                  workdir, write=main, placement=placement)
      results.update(summary)
      if main:
        print(f"Test cross-entropy difference by length ({workdir}):\n{text}")
    writer.write_scalars(results["epochs"], {
        k: v for k, v in results.items() if isinstance(v, float)},
                         jsonl=False)
  if main:
    with open(os.path.join(workdir, "results.json"), "w") as f:
      json.dump(results, f, indent=1, sort_keys=True)
  return results
