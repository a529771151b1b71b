"""Corpus language modelling: one token stream, truncated BPTT (PTB protocol).

The later papers' natural-language experiment (rns-vrns-reference.md §2.2,
§4.4): a corpus (`corpus.load`) is one token stream per split, cut into B
contiguous rows and walked left to right in chunks of T = bptt_length
tokens. Each chunk is one optimizer step; the model's state (LSTM h, c and
the windowed stack's Γ, A and ζ) is carried from one chunk to the next by
value only, reset at every epoch start and whenever evaluation starts. Only
models with a fixed-size state can do this (`models.LanguageModel.stream`):
lstm, and rns / vrns with stack_window >= 1.

Why a second loop next to `loop.run_models` (the formal-language loop):
there, a batch is a set of independent strings of one length, shuffled
every epoch, and a K axis trains many models at once; here the batches are
consecutive chunks of the same rows that must run in order, with a carry
between steps, the loss is the mean over tokens, and there is no exact
lower bound. What the two share lives elsewhere and is reused: the train
state and epoch-end schedule (`train.TrainState`, `train.end_of_epoch`:
PyTorch's ReduceLROnPlateau and the early stopping), the workdir checks and
lock, Orbax checkpoints that never lose the last good one, the metrics
writer and the console.

Per epoch: train on every chunk, evaluate validation perplexity (carry
reset), then `end_of_epoch` (PTB: LR ÷ 1.5 after each epoch without
improvement, stop after 2), one JSON line and one console line, and a
checkpoint. At the end the best epoch's parameters are evaluated on
validation and test; results.json holds the perplexities.

Data parallel: rows are split over the mesh's 'data' axis (a jitted step
over sharded arrays; XLA inserts the reductions), each process building only
its rows, so a pod runs it as `jax.distributed` processes like the
formal-language loop.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nsrnn_jax import checkpointing
from nsrnn_jax import corpus as corpus_lib
from nsrnn_jax import metrics as metrics_lib
from nsrnn_jax import parallel
from nsrnn_jax import train
from nsrnn_jax import workdir_lock

# config.task of a corpus run.
TASK = "corpus"
# Models that can carry their state across chunks (others need a window).
STREAM_MODELS = ("lstm", "rns", "vrns")


def validate_config(config, files: bool = True) -> None:
  """The corpus-specific fields (train.validate_config calls this);
  `files`: also that config.corpus_dir holds the corpus's files."""

  def fail(field, message):
    raise ValueError(f"config.{field} {message}")

  corpus_dir = config.get("corpus_dir", "")
  if not isinstance(corpus_dir, str) or not corpus_dir:
    fail("corpus_dir", "must name a directory with train/valid/test.txt "
         "for task 'corpus' (python -m nsrnn_jax.corpus writes a small one)")
  if files and not os.path.isdir(corpus_dir):
    fail("corpus_dir", f"{corpus_dir!r} is not a directory")
  for split in corpus_lib.SPLITS if files else ():  # Before a run starts.
    try:
      corpus_lib.split_path(corpus_dir, split)
    except ValueError as e:
      fail("corpus_dir", f"is unusable: {e}")
  model = config.model
  if model not in STREAM_MODELS or (model != "lstm"
                                    and not config.get("stack_window", 0)):
    fail("model", f"is {model!r}{' without a window' if model in STREAM_MODELS else ''}"
         ": a corpus is one stream, so the model must carry a fixed-size "
         "state across chunks: lstm, or rns / vrns with stack_window >= 1")
  if config.get("truncation_length", 0):
    fail("truncation_length", "must be 0 for task 'corpus' (the stream is "
         "cut by bptt_length)")
  value = config.get("bptt_length", None)
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
      or value < 1:
    fail("bptt_length", f"must be an integer >= 1 (got {value!r})")
  value = config.get("eval_batch_size", 0)
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
      or value < 0:
    fail("eval_batch_size", f"must be 0 (= batch_size) or >= 1 (got "
         f"{value!r})")
  scale = config.get("init_scale", 0.0)
  if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
      or not 0 <= scale < float("inf"):
    fail("init_scale", f"must be 0 (the models' own initialisers) or a "
         f"finite scale > 0 (got {scale!r})")
  if config.get("predict_eos", False):
    fail("predict_eos", "must be False for task 'corpus' (the stream has "
         "its own <eos> tokens)")
  num_devices = jax.device_count()
  for field in ("batch_size", "eval_batch_size"):
    rows = int(config.get(field, 0)) or int(config.batch_size)
    if rows % num_devices:
      fail(field, f"({rows}) is not divisible by the number of devices "
           f"({num_devices})")


def create_train_state(config, model, rng: jax.Array) -> train.TrainState:
  """`train.create_train_state`; with init_scale > 0 every parameter
  ~ U[−s, s] (PTB) instead of the models' own initialisers."""
  state = train.create_train_state(config, rng, model)
  scale = float(config.get("init_scale", 0.0))
  if scale <= 0:
    return state
  leaves, tree = jax.tree.flatten(state.params)
  keys = jax.random.split(jax.random.fold_in(rng, 1), len(leaves))
  params = jax.tree.unflatten(tree, [
      jax.random.uniform(k, x.shape, x.dtype, -scale, scale)
      for k, x in zip(keys, leaves)])
  return state.replace(params=params, best_params=params,
                       opt_state=state.tx.init(params))


def _chunk_nll(params, apply_fn, batch, carry):
  """(Σ token NLL, number of targets, next carry) of one chunk."""
  logits_BxTxV, carry = apply_fn({"params": params}, batch["inputs"], carry,
                                 method="stream")
  return (jnp.sum(_row_nlls(logits_BxTxV, batch)), jnp.sum(batch["mask"]),
          carry)


def train_chunk(state: train.TrainState, batch, carry):
  """One optimizer step on one chunk (loss: mean NLL over its tokens).

  Returns:
    (state, carry for the next chunk, Σ NLL, number of targets).
  """
  def loss(params):
    nll, count, new_carry = _chunk_nll(params, state.apply_fn, batch, carry)
    return nll / jnp.maximum(count, 1.0), (nll, count, new_carry)

  (_, (nll, count, carry)), grads = jax.value_and_grad(loss, has_aux=True)(
      state.params)
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
  state = state.replace(params=optax.apply_updates(state.params, updates),
                        opt_state=opt_state, step=state.step + 1)
  return state, carry, nll, count


def _row_nlls(logits_BxTxV, batch):
  """Each row's Σ token NLL [B] (float32, float64 for a float64 model)."""
  logits = logits_BxTxV.astype(jnp.promote_types(logits_BxTxV.dtype,
                                                 jnp.float32))
  ce_BxT = optax.softmax_cross_entropy_with_integer_labels(logits,
                                                           batch["targets"])
  return jnp.sum(ce_BxT * batch["mask"], axis=1)


def eval_chunk(params, batch, carry, *, apply_fn):
  """(carry, each row's Σ NLL [B], number of targets) of one chunk, no
  update."""
  logits_BxTxV, carry = apply_fn({"params": params}, batch["inputs"], carry,
                                 method="stream")
  return carry, _row_nlls(logits_BxTxV, batch), jnp.sum(batch["mask"])


def eval_chunk_margin(params, batch, carry, *, apply_fn):
  """`eval_chunk` plus the stack's product margin of the chunk, per row [B]
  (the model's ``stream_with_margin``: a row's padding left out)."""
  logits_BxTxV, carry, margin_B = apply_fn(
      {"params": params}, batch["inputs"], carry, batch["mask"],
      method="stream_with_margin")
  return (carry, _row_nlls(logits_BxTxV, batch), jnp.sum(batch["mask"]),
          margin_B)


class SplitStream:
  """A split's stream as rows on the mesh (`corpus.make_rows`).

  `chunk(i)` gives chunk i of every row as global arrays split over the
  mesh's 'data' axis, each process building only its own rows.

  Attributes:
    rows: the whole split's `corpus.Rows` (every process holds them).
    chunk_length, num_chunks, num_rows: T, ⌈L / T⌉, B.
  """

  def __init__(self, stream: np.ndarray, num_rows: int, chunk_length: int,
               mesh):
    self.rows = corpus_lib.make_rows(stream, num_rows)
    self.chunk_length = chunk_length
    self.num_chunks = self.rows.num_chunks(chunk_length)
    self.num_rows = num_rows
    self._mesh = mesh
    self._mine = parallel.process_slice(num_rows, mesh)

  def chunk(self, index: int):
    """Chunk `index` of this process's rows, placed on the mesh's 'data'
    axis (a global batch of all processes' rows)."""
    local = {k: v[self._mine] for k, v in
             self.rows.chunk(index, self.chunk_length).items()}
    return parallel.shard_batch(local, self._mesh)


def _carry_shardings(model, params, batch: int, mesh):
  """Per leaf of the stream carry: rows over 'data' ([B, ...]), scalars
  replicated."""
  shapes = jax.eval_shape(
      lambda p: model.apply({"params": p}, batch,
                            method="initial_stream_state"), params)
  return jax.tree.map(
      lambda s: NamedSharding(mesh, P(parallel.DATA_AXIS) if s.ndim
                              else P()), shapes)


class Programs:
  """The jitted programs of one run (each compiled once per chunk shape).

  Attributes:
    initial: {rows: params -> the stream's start carry, sharded like the
      rows}, for the training and the evaluation row counts.
    train: `train_chunk` (the carry donated).
    eval: `eval_chunk` with the model bound.
    eval_margin: `eval_chunk_margin` with the model bound.
    end_of_epoch: `train.end_of_epoch`.
  """

  def __init__(self, model, mesh, params, train_rows: int, eval_rows: int):
    self.initial = {}
    for rows in {train_rows, eval_rows}:
      shardings = _carry_shardings(model, params, rows, mesh)
      self.initial[rows] = jax.jit(
          functools.partial(
              lambda p, rows: model.apply({"params": p}, rows,
                                          method="initial_stream_state"),
              rows=rows), out_shardings=shardings)
    self.train = jax.jit(train_chunk, donate_argnums=(2,))
    self.end_of_epoch = jax.jit(train.end_of_epoch)
    self.eval = jax.jit(functools.partial(eval_chunk, apply_fn=model.apply))
    self.eval_margin = jax.jit(functools.partial(eval_chunk_margin,
                                                 apply_fn=model.apply))
    self.dtype = model.dtype


def evaluate(params, programs: Programs, split: SplitStream,
             progress: bool = False, desc: str = "eval",
             stack_margin: bool = False) -> dict:
  """Perplexity of a split from a fresh carry: {"cross_entropy" (nats per
  token), "perplexity", "num_targets", "row_nlls" (each row's −ln p,
  float64 [B])}.

  With `stack_margin` also "stack_margins", each row's product margin of
  the share stack ([B] nats; the rows of `corpus.make_rows`),
  "stack_margin", their minimum, and "stack_exact_fraction", the fraction
  of rows above `rns_stack.exact_margin`: their stack values, and so their
  logits, are those of exact arithmetic up to rounding.
  """
  carry = programs.initial[split.num_rows](params)
  nlls, margin_B = [], None
  for i in _progress(range(split.num_chunks), progress, desc):
    if stack_margin:
      carry, nll_B, _, chunk_B = programs.eval_margin(params, split.chunk(i),
                                                      carry)
      # A running minimum per row, on the device.
      margin_B = (chunk_B if margin_B is None
                  else jnp.minimum(margin_B, chunk_B))
    else:
      carry, nll_B, _ = programs.eval(params, split.chunk(i), carry)
    nlls.append(nll_B)
  # Each row's chunks summed in float64 on the host.
  row_nlls = np.sum(np.asarray(parallel.to_host(nlls), np.float64), axis=0)
  total = float(np.sum(row_nlls))
  n = split.rows.num_targets
  out = {"cross_entropy": total / n,
         "perplexity": float(metrics_lib.perplexity(total, n)),
         "num_targets": n, "row_nlls": row_nlls}
  if stack_margin:
    from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top
    rows = np.asarray(parallel.to_host(margin_B))
    out["stack_margins"] = rows
    out["stack_margin"] = float(np.min(rows))
    out["stack_exact_fraction"] = float(np.mean(
        rows > rns_stack.exact_margin(programs.dtype)))
  return out


def _progress(iterable, enabled: bool, desc: str):
  if not enabled:
    return iterable
  import tqdm  # pylint: disable=g-import-not-at-top
  return tqdm.tqdm(iterable, desc=desc, unit="chunk", leave=False,
                   dynamic_ncols=True, file=sys.stderr)


def train_and_evaluate(config, workdir: str,
                       should_stop: Optional[Callable[[], bool]] = None
                       ) -> dict:
  """Trains on a corpus (resuming from `workdir`), then tests.

  Args:
    config: a config with task 'corpus' (configs/ptb_*.py, quick_corpus.py).
    workdir: output directory: config.json (with the vocabulary),
      metrics.jsonl, TensorBoard events, checkpoints/, results.json.
      Rerunning on the same workdir resumes from the latest readable
      checkpoint.
    should_stop: called after every epoch (once its checkpoint is saved);
      True ends this invocation there (rerunning resumes).

  Returns:
    The results dict: finished, epochs, steps, best_epoch, best validation
    and (once finished) test perplexity and cross-entropy.
  """
  from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
  train.validate_config(config)
  config_json = train.config_to_json(config)
  checkpointing.check_workdir(workdir, config_json)
  data = corpus_lib.load(config.corpus_dir)
  bound = corpus_lib.lower_bound(config.corpus_dir)
  vocab = data.vocab
  config_json.update(vocab_size=len(vocab), vocabulary=list(vocab.tokens),
                     corpus_digest=corpus_lib.digest(config.corpus_dir))
  # Again with the corpus's digest and vocabulary: a resumed run whose
  # corpus changed under it would otherwise go on with other data (a moved
  # copy of the same files resumes).
  checkpointing.check_workdir(workdir, config_json)
  model = models.build(config, vocab_size=len(vocab))
  mesh = parallel.make_mesh()
  train_rows = int(config.batch_size)
  eval_rows = int(config.get("eval_batch_size", 0)) or train_rows
  length = int(config.bptt_length)
  splits = {}
  for split, rows in (("train", train_rows), ("valid", eval_rows),
                      ("test", eval_rows)):
    try:
      splits[split] = SplitStream(data.streams[split], rows, length, mesh)
    except ValueError as e:
      raise ValueError(f"{split} split of {config.corpus_dir!r}: {e}") from None
  main = parallel.is_main_process()
  if main:
    print(f"{parallel.describe_runtime(config.matmul_precision)}; corpus "
          f"{config.corpus_dir} ({len(vocab)} tokens in the vocabulary, "
          f"{splits['train'].rows.num_targets} training targets in "
          f"{splits['train'].num_chunks} chunks of {train_rows} x {length})",
          file=sys.stderr, flush=True)
    checkpointing.write_config(workdir, config_json)

  state = create_train_state(config, model,
                             jax.random.key(int(config.param_seed)))
  template = jax.tree.map(np.asarray, state.arrays())
  with contextlib.ExitStack() as stack:
    if main:
      stack.enter_context(workdir_lock.hold(workdir))
    manager = checkpointing.make_manager(
        checkpointing.checkpoint_dir(workdir),
        keep=int(config.checkpoints_to_keep))
    stack.callback(checkpointing.close, manager)
    logged = metrics_lib.last_complete_epoch(workdir)
    restored = checkpointing.restore_latest(manager, template,
                                            move_aside=main, max_step=logged)
    resumed = 0
    # Every epoch is saved, so a logged epoch without a checkpoint means
    # the checkpoints were lost: refuse rather than overwrite the log.
    if restored is None and logged >= 1:
      raise ValueError(
          f"{workdir!r}: metrics.jsonl holds epochs 1-{logged} but there is "
          "no checkpoint; nothing was changed: restore the checkpoints, or "
          "move the run directory away to start again")
    if restored is not None:
      resumed, arrays, _ = restored
      state = state.replace(**arrays)
    state = state.replace(**parallel.replicate(
        jax.tree.map(np.asarray, state.arrays()), mesh))
    writer = metrics_lib.MetricWriter(workdir, enabled=main,
                                      resume_epoch=resumed)
    stack.callback(writer.close)
    if resumed and main:
      print(f"resumed from epoch {resumed}", file=sys.stderr, flush=True)
    programs = Programs(model, mesh, state.params, train_rows, eval_rows)
    return _train(state, config, programs, splits, manager, writer, main,
                  should_stop, workdir, bound)


def _train(state, config, programs, splits, manager, writer, main,
           should_stop, workdir, bound) -> dict:
  """The epochs, then the best parameters' validation and test."""
  host = parallel.to_host
  bar = bool(config.progress_bar) and main
  stack_margin = bool(config.get("valid_stack_margin", False))
  train_split = splits["train"]
  epochs_this_run = 0
  while not bool(host(state.stopped)):
    start = time.perf_counter()
    epoch = int(host(state.epoch)) + 1
    carry = programs.initial[train_split.num_rows](state.params)
    nlls = []
    for i in _progress(range(train_split.num_chunks), bar, f"epoch {epoch}"):
      state, carry, nll, _ = programs.train(state, train_split.chunk(i),
                                            carry)
      nlls.append(nll)
    nlls = np.asarray(host(nlls), np.float64)
    bad = np.flatnonzero(~np.isfinite(nlls))
    if bad.size:
      raise FloatingPointError(
          f"non-finite training loss in epoch {epoch}, chunk {bad[0] + 1} "
          "(try a smaller learning rate or clip_norm); the last checkpoint "
          "is kept")
    train_time = time.perf_counter() - start
    train_ce = float(nlls.sum()) / train_split.rows.num_targets
    valid = evaluate(state.params, programs, splits["valid"], bar, "valid",
                     stack_margin)
    metrics_lib.check_valid_perplexity(
        valid["perplexity"], valid["cross_entropy"], "token", f"epoch {epoch}",
        "try a smaller learning rate or clip_norm",
        "the last checkpoint is kept")
    lr_used = float(host(train.learning_rate(state)))
    state = programs.end_of_epoch(state, jnp.float32(valid["perplexity"]))
    after = host({"best_epoch": state.best_epoch,
                  "lr": train.learning_rate(state)})
    elapsed = time.perf_counter() - start
    record = {"train_loss": train_ce,
              "train_perplexity": float(np.exp(train_ce)),
              "valid_perplexity": valid["perplexity"],
              "valid_cross_entropy": valid["cross_entropy"],
              "learning_rate": lr_used,
              "next_learning_rate": float(after["lr"]),
              "best_epoch": int(after["best_epoch"]),
              "time": elapsed, "train_time": train_time,
              "train_tokens_per_second":
                  train_split.rows.num_targets / max(train_time, 1e-9)}
    diff = ""
    if bound is not None:
      record["valid_ce_diff"] = valid["cross_entropy"] - bound["valid"]
      diff = f"  valid ce_diff {record['valid_ce_diff']:+.4f}"
    if stack_margin:
      record["valid_stack_margin"] = valid["stack_margin"]
      record["valid_stack_exact_fraction"] = valid["stack_exact_fraction"]
      diff += (f"  margin {valid['stack_margin']:.1f} "
               f"({metrics_lib.percent(valid['stack_exact_fraction'])} exact)")
    writer.write_scalars(epoch, record)
    # Logged before the save (see loop._train): a resume never finds a
    # checkpoint ahead of the log.
    checkpointing.save(manager, epoch, host(state.arrays()), {"epoch": epoch})
    epochs_this_run += 1
    if main:
      print(f"epoch {epoch:3d}/{config.max_epochs}  train ppl "
            f"{record['train_perplexity']:.2f}  valid ppl "
            f"{valid['perplexity']:.2f}{diff}  lr {lr_used:.3g}  {elapsed:.1f}s",
            file=sys.stderr, flush=True)
    leaving = bool(config.stop_after_epochs) and (
        epochs_this_run >= int(config.stop_after_epochs))
    if leaving or (should_stop is not None and should_stop()):
      break
  final = host({"stopped": state.stopped, "epoch": state.epoch,
                "step": state.step, "best_epoch": state.best_epoch,
                "best_metric": state.best_metric})
  results = {"finished": bool(final["stopped"]),
             "epochs": int(final["epoch"]), "steps": int(final["step"]),
             "best_epoch": int(final["best_epoch"]),
             "best_valid_perplexity": float(final["best_metric"])}
  if not results["finished"]:
    if main:
      print(f"stopped after {epochs_this_run} epochs, rerun the same command "
            "to continue", file=sys.stderr, flush=True)
    return results
  for split in ("valid", "test"):
    out = evaluate(state.best_params, programs, splits[split], bar, split,
                   stack_margin)
    prefix = "best_valid" if split == "valid" else "test"
    for key in ("perplexity", "cross_entropy", "stack_margin",
                "stack_exact_fraction"):
      if key in out:
        results[f"{prefix}_{key}"] = out[key]
  if bound is not None:
    results["best_valid_ce_diff"] = (results["best_valid_cross_entropy"]
                                     - bound["valid"])
    results["test_ce_diff"] = results["test_cross_entropy"] - bound["test"]
  writer.write_scalars(results["epochs"], {
      k: v for k, v in results.items() if isinstance(v, float)}, jsonl=False)
  if main:
    checkpointing.write_json(workdir, "results.json", results)
    diff = ("" if bound is None else
            f", ce_diff {results['test_ce_diff']:+.4f} nats/token over the "
            "true distribution")
    print(f"test perplexity {results['test_perplexity']:.3f}{diff} (best "
          f"epoch {results['best_epoch']}, valid "
          f"{results['best_valid_perplexity']:.3f})")
  return results
