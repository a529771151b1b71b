"""Re-evaluation of a trained workdir (CLI) and a scoring API.

CLI (recomputes the per-length test table with the best parameters and
rewrites test_by_length.{json,csv}; prints the table):

  python -m nsrnn_jax.evaluate --workdir=/tmp/nsrnn

Scoring API:

  loaded = evaluate.load_model(workdir)          # (model, params, config)
  evaluate.score(loaded, ["0110#0110", list("1#1")])  # ln p_model(w), [B]

Strings are symbol strings (split into characters; every alphabet in this
package has one-character symbols) or sequences of symbols. The model assigns
a length-n string the probability that it is the prefix of a string (no EOS),
so scores of all strings of one length sum to 1.
"""

import json
import os
import sys
from typing import Any, NamedTuple, Sequence, Union

from absl import app
from absl import flags
import jax
import ml_collections
import numpy as np

from nsrnn_jax import checkpointing
from nsrnn_jax import train


class Loaded(NamedTuple):
  """A trained model restored from a workdir."""
  model: Any
  params: Any
  config: ml_collections.ConfigDict


def _read_config(workdir: str) -> ml_collections.ConfigDict:
  if not os.path.isdir(workdir):
    raise ValueError(f"workdir {workdir!r} does not exist")
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"{workdir!r} is not a training workdir: no config.json")
  try:
    with open(path) as f:
      fields = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{path} is unreadable: {e}") from e
  # JSON turns tuples into lists; ConfigDict accepts either.
  return ml_collections.ConfigDict(fields)


def load_model(workdir: str, model: Any = None) -> Loaded:
  """Restores the best-validation parameters of a workdir.

  Args:
    workdir: a directory written by train.train_and_evaluate.
    model: the Flax model to use instead of models.build(config).

  Returns:
    Loaded(model, params, config).

  Raises:
    ValueError: missing workdir/config, or no readable checkpoint.
  """
  config = _read_config(workdir)
  if model is None:
    from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
    model = models.build(config, vocab_size=config.get("vocab_size"))
  ckpt_dir = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(ckpt_dir):
    raise ValueError(f"{workdir!r} has no checkpoints/ directory")
  state = train.create_train_state(config, jax.random.key(0), model)
  manager = checkpointing.make_manager(ckpt_dir, keep=2)
  try:
    restored = checkpointing.restore_latest(manager, state.arrays())
  finally:
    checkpointing.close(manager)
  if restored is None:
    raise ValueError(f"{ckpt_dir!r} holds no readable checkpoint")
  _, arrays, _ = restored
  return Loaded(model, arrays["best_params"], config)


def encode(strings: Sequence[Union[str, Sequence[str]]],
           alphabet: Sequence[str]) -> list[np.ndarray]:
  """Symbol strings / symbol lists -> int32 id arrays.

  Raises:
    ValueError: an empty string or a symbol outside the alphabet (named).
  """
  index = {s: i for i, s in enumerate(alphabet)}
  out = []
  for k, w in enumerate(strings):
    symbols = list(w)
    if not symbols:
      raise ValueError(f"string {k} is empty; the model scores strings of "
                       "length >= 1")
    ids = []
    for s in symbols:
      if not isinstance(s, str) or s not in index:
        raise ValueError(f"unknown symbol {s!r} in string {k}; the alphabet "
                         f"is {list(alphabet)}")
      ids.append(index[s])
    out.append(np.asarray(ids, np.int32))
  return out


def score(workdir_or_loaded: Union[str, Loaded],
          strings: Sequence[Union[str, Sequence[str]]]) -> np.ndarray:
  """Natural-log probabilities ln p_model(w) of strings (float64 [len]).

  Strings of equal length are scored in one batch.
  """
  loaded = (load_model(workdir_or_loaded)
            if isinstance(workdir_or_loaded, str) else workdir_or_loaded)
  if isinstance(strings, str):
    raise ValueError("strings must be a list of strings, not one string")
  alphabet = loaded.config.get("alphabet")
  if alphabet is None:
    raise ValueError("the workdir's config.json lacks the alphabet")
  encoded = encode(strings, alphabet)
  scores = np.zeros(len(encoded), np.float64)
  by_length = {}
  for k, ids in enumerate(encoded):
    by_length.setdefault(len(ids), []).append(k)
  for _, ks in sorted(by_length.items()):
    symbols = np.stack([encoded[k] for k in ks])
    sums = _eval_fn(loaded.model)(loaded.params, train.make_batch(symbols))
    scores[ks] = -np.asarray(sums["nll"], np.float64)
  return scores


def _eval_fn(model):
  return train._make_eval_fn(model.apply)  # pylint: disable=protected-access


def reevaluate(workdir: str, splits: train.Splits = None,
               model: Any = None) -> dict:
  """Recomputes and rewrites the per-length test table of a workdir.

  Args:
    workdir: a trained workdir.
    splits: data to use instead of regenerating it from the config.
    model: model to use instead of models.build(config).

  Returns:
    {"table": per-length table, "summary": overall test metrics, "text"}.
  """
  loaded = load_model(workdir, model=model)
  if splits is None:
    splits = train.load_splits(loaded.config, need_test=True)
  if not splits.test:
    raise ValueError("no test data to evaluate")
  table, summary, text = train.run_test(
      _eval_fn(loaded.model), loaded.params, splits, loaded.config, workdir,
      write=jax.process_index() == 0)
  return {"table": table, "summary": summary, "text": text}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  workdir = flags.FLAGS.workdir
  if not workdir:
    raise app.UsageError("--workdir is required")
  try:
    result = reevaluate(workdir)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(result["text"])
  for key, value in sorted(result["summary"].items()):
    print(f"{key}: {value:.6f}")


if __name__ == "__main__":
  # Defined here, not at import, so that importing this module next to
  # nsrnn_jax.main (which also has --workdir) does not clash.
  flags.DEFINE_string("workdir", None, "Training workdir to re-evaluate.")
  app.run(main)
