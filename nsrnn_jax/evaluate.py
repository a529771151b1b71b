"""Re-evaluation of a trained workdir (CLI) and a scoring API.

CLI (recomputes the per-length test table with the best parameters, prints
it and writes test_by_length.{json,csv} to --out, default the workdir; works
on any run directory, single run or grid member, and never writes into
checkpoints; an unwritable --out is an error before any work):

  python -m nsrnn_jax.evaluate --workdir=/tmp/nsrnn [--out=/tmp/table]

`--stack_table=log` re-evaluates an NS, RNS or VRNS run on the exact
log-space stack (`log_stack`, `limited_log_stack`, the VRNS's log-space
tables; same parameters, no flush limit) instead of the table it was
trained on.

Scoring API:

  loaded = evaluate.load_model(workdir)          # (model, params, config)
  evaluate.score(loaded, ["0110#0110", list("1#1")])  # ln p_model(w), [B]

Strings are text ("01#10", or symbols separated by whitespace: "0 1 # 1 0",
always so for alphabets with longer symbols such as `dyck_k40`'s "((";
`pcfg.text_symbols`) or sequences of symbols. Without config.predict_eos the
model assigns a length-n string the probability that it is the prefix of a
string (no EOS), so the scores of all strings of one length sum to 1; with it
a score includes ln p(EOS | w), and the scores of all strings sum to 1.

A corpus run (task "corpus", corpus_train.py) is re-evaluated on its
corpus's validation and test streams (perplexity, written to
corpus_eval.json in --out), and `score` takes sentences (space-separated
tokens, or token lists): ln p(tokens, <eos> | <eos>), the sentence read
after a sentence boundary from a fresh state; unknown words are <unk> when
the vocabulary has it.
"""

import os
from typing import Any, NamedTuple, Optional, Sequence, Union

from absl import flags
import jax
import ml_collections
import numpy as np

from nsrnn_jax import checkpointing
from nsrnn_jax import cli
from nsrnn_jax import data
from nsrnn_jax import loop
from nsrnn_jax import metrics as metrics_lib
from nsrnn_jax import parallel
from nsrnn_jax import pcfg
from nsrnn_jax import train


class Loaded(NamedTuple):
  """A trained model restored from a workdir."""
  model: Any
  params: Any
  config: ml_collections.ConfigDict


def load_model(workdir: str, model: Any = None,
               stack_table: Optional[str] = None) -> Loaded:
  """Restores the best-validation parameters of a workdir (read-only).

  Args:
    workdir: a run directory written by train.train_and_evaluate or a grid
      member's lr_<lr>/restart_<r>.
    model: the Flax model to use instead of models.build(config).
    stack_table: run the stack on this table (``config.stack_table``, e.g.
      'log': no flush) instead of the run's own; the parameters are the
      same.

  Returns:
    Loaded(model, params, config): the latest checkpoint's best parameters
    (a run still training moves on between two calls: to compare tables
    on the same parameters, load once and use `on_table`).

  Raises:
    ValueError: missing workdir/config, or no readable checkpoint.
  """
  # JSON turns tuples into lists; ConfigDict accepts either.
  config = ml_collections.ConfigDict(checkpointing.read_config(workdir))
  try:
    # A stored config edited by hand (or damaged) fails here, naming its
    # field, not later as a wrong batch size or silently unused.
    train.validate_config(config, training=False)
  except ValueError as e:
    raise ValueError(f"{os.path.join(workdir, checkpointing.CONFIG_FILE)}: "
                     f"{e}") from None
  if stack_table is not None:   # (models.build names what cannot run it)
    config.stack_table = stack_table
  if model is None:
    from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
    model = models.build(config, vocab_size=config.get("vocab_size"))
  ckpt_dir = checkpointing.checkpoint_dir(workdir)
  if not os.path.isdir(ckpt_dir):
    raise ValueError(f"{workdir!r} has no checkpoints/ directory")
  state = train.create_train_state(config, jax.random.key(0), model)
  manager = checkpointing.make_manager(ckpt_dir, read_only=True)
  try:
    restored = checkpointing.restore_latest(manager, state.arrays())
  finally:
    checkpointing.close(manager)
  if restored is None:
    raise ValueError(f"{ckpt_dir!r} holds no checkpoint")
  _, arrays, _ = restored
  return Loaded(model, arrays["best_params"], config)


def on_table(loaded: Loaded, stack_table: str) -> Loaded:
  """The same run and parameters with its stack on `stack_table` (e.g.
  'log': no flush), as `load_model(..., stack_table=...)` without reading
  the workdir again."""
  from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
  config = ml_collections.ConfigDict(loaded.config.to_dict())
  config.stack_table = stack_table
  return Loaded(models.build(config, vocab_size=config.get("vocab_size")),
                loaded.params, config)


def _stacked(params):
  """One model's parameters as a K = 1 model axis (for loop's evaluation)."""
  return jax.tree.map(lambda x: np.asarray(x)[None], params)


def encode(strings: Sequence[Union[str, Sequence[str]]],
           alphabet: Sequence[str]) -> list[np.ndarray]:
  """Symbol strings / symbol lists -> int32 id arrays.

  A string is text: one symbol per character ("01#10") or symbols separated
  by whitespace ("0 1 # 1 0"; `pcfg.text_symbols`).

  Raises:
    ValueError: an empty string or a symbol outside the alphabet (named).
  """
  out = []
  for k, w in enumerate(strings):
    if not isinstance(w, (str, list, tuple, np.ndarray)):
      raise ValueError(f"string {k} is {w!r}; expected a string of symbols "
                       "or a list of symbols")
    ids = pcfg.encode_symbols(w, alphabet, where=f"the alphabet (string {k})")
    if not ids:
      raise ValueError(f"string {k} is empty; the model scores strings of "
                       "length >= 1")
    out.append(np.asarray(ids, np.int32))
  return out


def _loaded(workdir_or_loaded, what: str) -> Loaded:
  if isinstance(workdir_or_loaded, (str, os.PathLike)):
    loaded = load_model(os.fspath(workdir_or_loaded))
  elif isinstance(workdir_or_loaded, Loaded):
    loaded = workdir_or_loaded
  else:
    raise TypeError(f"{what} takes a workdir path or evaluate.load_model's "
                    f"result, got {type(workdir_or_loaded).__name__}")
  return loaded


def _batches(loaded: Loaded, strings, bucketed: bool = False):
  """(indices, batch) per string length: `train.make_batch` batches.

  With `bucketed`, batches of config.batch_size rows instead, each string
  padded to its length bucket (`loop.margin_length`) with its own mask and
  the last batch of a bucket filled with empty rows (mask 0; their indices
  are -1): one compiled program per bucket rather than per length.
  """
  if isinstance(strings, str):
    raise ValueError("strings must be a list of strings, not one string")
  corpus_run = _is_corpus(loaded.config)
  if corpus_run:
    encoded = _encode_sentences(strings, loaded.config.get("vocabulary"))
  else:
    alphabet = loaded.config.get("alphabet")
    if alphabet is None:
      raise ValueError("the workdir's config.json lacks the alphabet")
    encoded = encode(strings, alphabet)
  eos = train.eos_id(loaded.config, loaded.model)
  if bucketed:
    return len(encoded), _bucketed_batches(loaded.config, encoded, eos,
                                           corpus_run)
  by_length = {}
  for k, ids in enumerate(encoded):
    by_length.setdefault(len(ids), []).append(k)
  batches = []
  for _, ks in sorted(by_length.items()):
    batch = train.make_batch(np.stack([encoded[k] for k in ks]), eos=eos)
    if corpus_run:  # The leading <eos> is context, not a target.
      batch["mask"][:, 0] = 0
    batches.append((ks, batch))
  return len(encoded), batches


def _bucketed_batches(config, encoded, eos, corpus_run):
  """`_batches(..., bucketed=True)`'s batches."""
  by_bucket = {}
  for k, ids in enumerate(encoded):
    by_bucket.setdefault(loop.margin_length(len(ids), config), []).append(k)
  size = int(config.get("batch_size", 10))
  batches = []
  for bucket, ks in sorted(by_bucket.items()):
    for start in range(0, len(ks), size):
      chunk = ks[start:start + size]
      rows = [train.make_batch(encoded[k][None], bucket, eos)
              for k in chunk]
      batch = {key: np.concatenate([r[key] for r in rows]
                                   + [np.zeros_like(rows[0][key])]
                                   * (size - len(chunk)))
               for key in rows[0]}
      if corpus_run:
        batch["mask"][:, 0] = 0
      batches.append((np.asarray(chunk + [-1] * (size - len(chunk))),
                      batch))
  return batches


def score(workdir_or_loaded: Union[str, os.PathLike, Loaded],
          strings: Sequence[Union[str, Sequence[str]]],
          exact: bool = False) -> np.ndarray:
  """Natural-log probabilities ln p_model(w) of strings (float64 [len]).

  Strings of equal length are scored in one batch. For a config with
  predict_eos the score includes ln p_model(EOS | w) (a complete string).

  With `exact`, the strings are scored in float64 with the same
  parameters (any model, rebuilt from the run's config by
  `models.build`); a share-table stack runs on the share table
  where its float64 margin (`stack_margins`, ~−350 nats) proves it exact,
  else on the float64 'log' table: ln p to float64 rounding. In float32 a
  recurrent model can amplify rounding: a trained padded-reversal NS-RNN's
  float32 ln p on its strings of length 120 was off by up to 8e-4 nats on
  the share table and 1.4e-3 on the 'log' table, which cannot flush
  (docs/benchmarks.md, "The exact log-space table").
  """
  loaded = _loaded(workdir_or_loaded, "score")
  if exact:
    return _float64_scores(loaded, strings)
  return _score(loaded, strings)


def _float64_loaded(loaded: Loaded, stack_table: Optional[str] = None
                    ) -> Loaded:
  """The run's model in float64 with its parameters (call under
  `jax.enable_x64`), on `stack_table` if given: the same module with its
  float type (and table) replaced, so a model passed in (`load_model(...,
  model=...)`, training's own) keeps every other field."""
  config = ml_collections.ConfigDict(loaded.config.to_dict())
  config.dtype = "float64"
  fields = {"dtype": np.float64}
  if stack_table is not None:
    config.stack_table = fields["table"] = stack_table
  params = jax.tree.map(lambda a: np.asarray(a, np.float64), loaded.params)
  return Loaded(loaded.model.clone(**fields), params, config)


def _float64_scores(loaded: Loaded, strings, bucketed: bool = False
                    ) -> np.ndarray:
  """`score` in float64: a share-table stack where its margin proves it
  exact, else on the log table (`bucketed`: as `_batches`)."""
  from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
  with jax.enable_x64(True):
    shares = _float64_loaded(loaded)
    scores = _score(shares, strings, bucketed)
    if models.has_stack_margin(shares.model):
      redo = np.flatnonzero(_margins(shares, strings, bucketed)
                            <= exact_margin(shares))
      if redo.size:
        exact = _float64_loaded(loaded, stack_table="log")
        scores[redo] = _score(exact, [strings[k] for k in redo], bucketed)
  return scores


def _kept(ks):
  """The rows of a `_batches` batch that hold strings, and their indices."""
  ks = np.asarray(ks)
  rows = np.flatnonzero(ks >= 0)
  return rows, ks[rows]


def _score(loaded: Loaded, strings, bucketed: bool = False) -> np.ndarray:
  num, batches = _batches(loaded, strings, bucketed)
  scores = np.zeros(num, np.float64)
  params_K = _stacked(loaded.params)
  for ks, batch in batches:
    batch_K = jax.tree.map(lambda x: x[None], batch)
    sums = loop.eval_models(params_K, batch_K, apply_fn=loaded.model.apply)
    rows, ks = _kept(ks)
    scores[ks] = -np.asarray(sums["nll"][0], np.float64)[rows]
  return scores


def stack_margins(workdir_or_loaded: Union[str, os.PathLike, Loaded],
                  strings: Sequence[Union[str, Sequence[str]]]) -> np.ndarray:
  """The share stack's product margin on each string (float64 [len], nats).

  ``models.PDAStackLM.stack_margin`` on the strings as `score` feeds them:
  where a margin is above ``rns_stack.exact_margin`` of the model's float
  type (``exact_margin`` below), the stack's arithmetic is that of exact
  arithmetic up to rounding on that string (no share was flushed); below
  it a share may have been. ``score(..., exact=True)`` scores in float64.

  Raises:
    ValueError: (one line) the run's stack is not a share sweep (lstm,
      jm, gref, 'log', 'scaled', the VRNS-RNN's broadcast bottom).
  """
  return _margins(_loaded(workdir_or_loaded, "stack_margins"), strings)


def _margins(loaded: Loaded, strings, bucketed: bool = False) -> np.ndarray:
  margin_fn = _margin_fn(loaded.model)
  num, batches = _batches(loaded, strings, bucketed)
  out = np.zeros(num, np.float64)
  for ks, batch in batches:
    rows, ks = _kept(ks)
    # Each string's symbols: every position up to its last target (a
    # corpus row's leading <eos> is read but no target).
    mask = (np.maximum.accumulate(batch["mask"][:, ::-1], axis=1)[:, ::-1]
            if bucketed else None)
    out[ks] = np.asarray(margin_fn(loaded.params, batch["symbols"], mask),
                         np.float64)[rows]
  return out


def exact_margin(workdir_or_loaded: Union[str, os.PathLike, Loaded]) -> float:
  """The margin above which a run's share stack is exact (`stack_margins`)."""
  from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top
  return rns_stack.exact_margin(
      _loaded(workdir_or_loaded, "exact_margin").model.dtype)


def _margin_fn(model):
  """jit(params, symbols -> margins), or a one-line ValueError."""
  if not hasattr(model, "stack_margin"):
    raise ValueError(f"stack_margins applies to the share table of ns, rns "
                     f"and vrns, not to {type(model).__name__}")
  # A table or window without a margin raises (one line) when traced.
  return jax.jit(lambda p, x, mask: model.apply({"params": p}, x, mask,
                                                method="stack_margin"))


def unproven_errors(loaded: Loaded, split: data.Split,
                    results: Sequence[dict]) -> dict:
  """How far the run's ln p is from exact on the strings its stack margin
  does not prove exact (at or below `exact_margin`).

  The margin is conservative (a product below the threshold need not flush
  anything that matters), so these strings are scored again in float64
  (as `score(..., exact=True)`, padded to length buckets: a few compiled
  programs), and the summary says by how much the run's own ln p differs
  there. Training with `config.valid_stack_margin` does this at its test.

  Args:
    loaded: the run (`load_model`).
    split: the strings `results` are of (`Split`).
    results: `loop.evaluate_split(..., stack_margin=True)`'s dicts for
      `split`, one per batch.

  Returns:
    {"test_stack_unproven_strings": how many, "test_stack_unproven_max_error":
    the largest |ln p_run − ln p_exact| among them (nats; 0.0 if none)}.
  """
  threshold = exact_margin(loaded)
  alphabet = loaded.config.alphabet
  strings, run_log_probs = [], []
  for batch, result in zip(split, results):
    for i in np.flatnonzero(result["stack_margins"] <= threshold):
      strings.append([alphabet[s] for s in batch.symbols[i]])
      run_log_probs.append(-result["string_nlls"][i])
  error = 0.0
  if strings:
    # Padded to length buckets: a few float64 programs, not one per length
    # (a hardest-CFL test set has 61 lengths).
    exact = _float64_scores(loaded, strings, bucketed=True)
    error = float(np.max(np.abs(np.asarray(run_log_probs) - exact)))
  return {"test_stack_unproven_strings": len(strings),
          "test_stack_unproven_max_error": error}


def _is_corpus(config) -> bool:
  return config.get("task") == "corpus"


def _encode_sentences(sentences, vocabulary) -> list[np.ndarray]:
  """Sentences -> [<eos>, tokens..., <eos>] id arrays (corpus runs)."""
  from nsrnn_jax import corpus  # pylint: disable=g-import-not-at-top
  if vocabulary is None:
    raise ValueError("the workdir's config.json lacks the vocabulary")
  vocab = corpus.Vocabulary(tuple(vocabulary))
  eos, unk = vocab.id(corpus.EOS), vocab.id(corpus.UNK)
  out = []
  for k, w in enumerate(sentences):
    if not isinstance(w, (str, list, tuple)):
      raise ValueError(f"sentence {k} is {w!r}; expected a string of "
                       "space-separated tokens or a list of tokens")
    ids = [eos]
    for t in (w.split() if isinstance(w, str) else list(w)):
      i = vocab.id(t) if isinstance(t, str) else None
      if i is None and unk is None:
        raise ValueError(f"unknown token {t!r} in sentence {k}; the "
                         f"vocabulary has no {corpus.UNK} to map it to")
      ids.append(unk if i is None else i)
    out.append(np.asarray(ids + [eos], np.int32))
  return out


def _reevaluate_corpus(loaded: Loaded, out: str,
                       corpus_dir: Optional[str] = None,
                       stack_margin: bool = False) -> dict:
  """Validation and test perplexity of a corpus run's best parameters, on
  its corpus (`corpus_dir`: a moved copy of it, checked by its digest);
  with `stack_margin` also each split's stack margin (its rows')."""
  from nsrnn_jax import corpus  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import corpus_train  # pylint: disable=g-import-not-at-top
  config = loaded.config
  corpus_dir = corpus_dir or config.corpus_dir
  stored = config.get("corpus_digest")
  if stored is not None and corpus.digest(corpus_dir) != stored:
    raise ValueError(f"the files in {corpus_dir!r} are not the corpus the "
                     "run was trained on (their SHA-256 differs)")
  data_ = corpus.load(corpus_dir)
  if list(data_.vocab.tokens) != list(config.vocabulary):
    raise ValueError(f"the corpus in {corpus_dir!r} has a different "
                     "vocabulary from the one the run was trained on")
  mesh = parallel.make_mesh()
  rows = int(config.get("eval_batch_size", 0)) or int(config.batch_size)
  params = parallel.replicate(jax.tree.map(np.asarray, loaded.params), mesh)
  programs = corpus_train.Programs(loaded.model, mesh, params, rows, rows)
  summary = {}
  for split in ("valid", "test"):
    stream = corpus_train.SplitStream(data_.streams[split], rows,
                                      int(config.bptt_length), mesh)
    result = corpus_train.evaluate(params, programs, stream,
                                   stack_margin=stack_margin)
    for key in ("perplexity", "cross_entropy", "stack_margin",
                "stack_exact_fraction"):
      if key in result:
        summary[f"{split}_{key}"] = result[key]
    if stack_margin:
      summary.update(_unproven_rows(loaded, stream, result, split))
  if parallel.is_main_process():
    os.makedirs(out, exist_ok=True)
    checkpointing.write_json(out, "corpus_eval.json", summary)
  text = (f"{corpus_dir}: valid perplexity "
          f"{summary['valid_perplexity']:.4f}, test perplexity "
          f"{summary['test_perplexity']:.4f} (best parameters)")
  return {"table": None, "summary": summary, "text": text}


def _unproven_rows(loaded: Loaded, stream, result: dict, split: str) -> dict:
  """`unproven_errors` for a corpus split (`corpus_train.SplitStream`): the
  rows whose margin does not prove them exact, their −ln p again in
  float64 (the float64 share window where its margin proves it, else the
  float64 'log' table)."""
  from nsrnn_jax import corpus_train  # pylint: disable=g-import-not-at-top
  bad = np.flatnonzero(result["stack_margins"] <= exact_margin(loaded))
  error = 0.0
  if bad.size:
    rows = stream.num_rows
    with jax.enable_x64(True):
      mesh = parallel.make_mesh()

      def again(run, margin):
        params = parallel.replicate(run.params, mesh)
        return corpus_train.evaluate(
            params, corpus_train.Programs(run.model, mesh, params, rows,
                                          rows), stream, stack_margin=margin)

      exact = _float64_loaded(loaded)
      out = again(exact, True)
      if np.any(out["stack_margins"][bad] <= exact_margin(exact)):
        out = again(_float64_loaded(loaded, stack_table="log"), False)
    error = float(np.max(np.abs(result["row_nlls"][bad]
                                - out["row_nlls"][bad])))
  return {f"{split}_stack_unproven_rows": int(bad.size),
          f"{split}_stack_unproven_max_error": error}


def reevaluate(workdir: str, splits: Optional[data.Splits] = None,
               model: Any = None, out: Optional[str] = None,
               corpus_dir: Optional[str] = None,
               stack_table: Optional[str] = None,
               stack_margin: bool = False) -> dict:
  """Recomputes the per-length test table of a workdir with its best params.

  Args:
    workdir: a trained run directory (never written to unless it is `out`).
    splits: data to use instead of regenerating it from the config.
    model: model to use instead of models.build(config).
    out: directory for test_by_length.{json,csv} (default: the workdir);
      checked for writability before any work.
    corpus_dir: a corpus run's corpus where it lies now (default: where it
      was trained; the files must be the same, by SHA-256).
    stack_table: as for `load_model` (e.g. 'log': the stack that cannot
      flush).
    stack_margin: also check the share stack's exactness on the test
      strings (`stack_margins`; ns / rns / vrns on the 'shares' table):
      the summary gains ``test_stack_margin`` (the smallest, nats) and
      ``test_stack_exact_fraction`` (of strings whose margin is above
      `exact_margin`, where the table is exact up to rounding), and the
      table both per length, as training with valid_stack_margin does,
      and ``test_stack_unproven_strings`` and
      ``test_stack_unproven_max_error`` (`unproven_errors`: the strings
      not proven exact scored again in float64). A corpus run:
      ``{valid,test}_stack_margin``, ``{valid,test}_stack_exact_fraction``,
      ``{valid,test}_stack_unproven_rows`` and
      ``{valid,test}_stack_unproven_max_error`` of the split's rows
      (`corpus_train.evaluate`; the unproven rows' −ln p again in float64).

  Returns:
    {"table": per-length table, "summary": overall test metrics, "text"}.
  """
  out = workdir if out is None else out
  checkpointing.read_config(workdir)  # A clear error before anything else.
  checkpointing.check_writable(out, what="output directory")
  loaded = load_model(workdir, model=model, stack_table=stack_table)
  if stack_margin:
    _margin_fn(loaded.model)  # A model without a margin: one line, now.
  if _is_corpus(loaded.config):
    return _reevaluate_corpus(loaded, out, corpus_dir, stack_margin)
  if corpus_dir:
    raise ValueError("--corpus_dir applies to corpus runs (task 'corpus')")
  if splits is None:
    splits = data.from_config(loaded.config, need_test=True)
  if not splits.test.batches:
    raise ValueError("no test data to evaluate")
  eos = train.eos_id(loaded.config, loaded.model)
  # With stack_margin, a table without a margin ('log') fails as the first
  # batch is traced, before the long evaluation. The guard keeps the
  # compiled programs of many lengths within the process's memory mappings,
  # as in training (`loop.ProgramGuard`).
  results = loop.evaluate_split(
      _stacked(loaded.params), loaded.model.apply, [splits.test],
      loaded.config, [loop.test_num_lengths(splits.test, loaded.config)],
      parallel.make_mesh(), eos, stack_margin, loop.ProgramGuard())[0]
  table, summary = loop.test_outputs(results, loaded.config)
  if stack_margin:
    summary.update(unproven_errors(loaded, splits.test, results))
  main = parallel.is_main_process()
  if main:
    os.makedirs(out, exist_ok=True)
  text = metrics_lib.write_test_table(out, table, enabled=main)
  return {"table": table, "summary": summary, "text": text}


def main(argv):
  """`python -m nsrnn_jax.evaluate`: `reevaluate` of --workdir, its table
  and summary printed (the flags are defined below, when run as a script)."""
  del argv
  workdir = flags.FLAGS.workdir
  if not workdir:
    raise ValueError("--workdir is required")
  result = reevaluate(workdir, out=flags.FLAGS.out,
                      corpus_dir=flags.FLAGS.corpus_dir,
                      stack_table=flags.FLAGS.stack_table,
                      stack_margin=flags.FLAGS.stack_margin)
  print(result["text"])
  for key, value in sorted(result["summary"].items()):
    print(f"{key}: {value:.6f}" if isinstance(value, float)
          else f"{key}: {value}")


if __name__ == "__main__":
  # Defined here, not at import, so that importing this module next to
  # nsrnn_jax.main (which also has --workdir) does not clash.
  flags.DEFINE_string("workdir", None, "Training workdir to re-evaluate.")
  flags.DEFINE_string("out", None, "Directory for test_by_length.{json,csv} "
                      "(default: the workdir).")
  flags.DEFINE_string("corpus_dir", None, "A corpus run's corpus where it "
                      "lies now (default: where it was trained).")
  flags.DEFINE_string("stack_table", None, "Run an NS / RNS / VRNS stack on this "
                      "table instead of the run's own (e.g. 'log': cannot flush).")
  flags.DEFINE_bool("stack_margin", False, "Also report the share stack's "
                    "product margin on the test strings (ns / rns / vrns, 'shares' "
                    "table): the smallest, and the fraction of strings (a "
                    "corpus run: rows of the stream) it proves exact; the "
                    "strings it does not prove are scored again in float64 "
                    "(the largest difference in ln p).")
  cli.run(main)
