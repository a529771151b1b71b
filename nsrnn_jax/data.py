"""The paper's dataset splits, their on-disk format and a CLI.

Protocol (reference-behaviour.md §5.3, every size a parameter):

* train: `train_batches` (1000) batches of `batch_size` (10) strings; for each
  batch one length is drawn uniformly from the valid lengths in
  [train_min_length, train_max_length] ([40, 80]), then that many strings of
  that length are sampled.
* valid: `valid_batches` (100) batches the same way, from the *same* generator
  continuing after the training set.
* test: a separate generator seeded with `test_seed` (0, shared by every run);
  for every valid length in [test_min_length, test_max_length] ([40, 100]) in
  increasing order, one batch of `test_per_length` (100) strings.

Generators are `numpy.random.default_rng(seed)`; the whole split is a pure
function of the arguments. Validation and test batches carry `log_prob`
(ln G(w), float64 [B]) and `length_log_prob` (ln G(N)); each split carries
`num_lengths` (N_L, the number of valid lengths of its interval). The lower
bound of a string is `-ln p_sample(w) = -log_prob + length_log_prob + ln N_L`.
For the per-length test curves, the authors' released code omits ln N_L while
the paper's figures include it (reference-behaviour.md §6):
`lower_bound(batch, num_lengths=1)` gives the code's variant.

On-disk format (`write_splits`/`read_splits`), a directory with:

* `meta.json`: {"format": "nsrnn_jax.data/1", "task", "alphabet", "seed",
  "test_seed", "preserve_start", and per split {"num_lengths", "min_length",
  "max_length", "num_batches", "num_strings"}}; keys sorted, 2-space indent.
* `train.tsv`, `valid.tsv`, `test.tsv`: a header line, then one line per
  string, tab-separated:
  `batch  length  string  log_prob  length_log_prob  lower_bound`
  where `string` is the terminals joined by single spaces (e.g. `( [ ] )`),
  and the three floats are written with `repr` (shortest round-trip form, so
  reading gives back the exact float64) or `nan` for training strings (whose
  log-probabilities are not computed by default). `batch` numbers the batches
  from 0; strings of one batch are consecutive.

The same arguments give byte-identical files.

CLI:

  python -m nsrnn_jax.data --task=dyck --out=data/dyck --seed=1
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Iterator, Optional, Sequence

import numpy as np

from nsrnn_jax import languages

FORMAT = "nsrnn_jax.data/1"
SPLITS = ("train", "valid", "test")
_HEADER = "batch\tlength\tstring\tlog_prob\tlength_log_prob\tlower_bound"


@dataclasses.dataclass
class Batch:
  """Strings of one length.

  Attributes:
    symbols: int32 [B, N] symbol ids.
    log_prob: float64 [B], ln G(w) (None when not computed, e.g. training).
    length_log_prob: ln G(N) (None when not computed).
  """
  symbols: np.ndarray
  log_prob: Optional[np.ndarray] = None
  length_log_prob: Optional[float] = None

  @property
  def length(self) -> int:
    """The string length N."""
    return int(self.symbols.shape[1])

  def __len__(self) -> int:
    return int(self.symbols.shape[0])

  @property
  def shape(self) -> tuple[int, int]:
    """(B, N), the shape of `symbols`."""
    return self.symbols.shape

  def __array__(self, dtype=None, copy=None):
    """`np.asarray(batch)` gives the [B, N] symbols (architecture.md)."""
    del copy  # a fresh array is returned only when dtype changes.
    return self.symbols if dtype is None else self.symbols.astype(dtype)


@dataclasses.dataclass
class Split:
  """A list of batches plus the length interval they were drawn from.

  Iterating, indexing and `len()` act on the batches.

  Attributes:
    batches: list of `Batch`.
    num_lengths: N_L, the number of valid lengths in [min_length, max_length].
    min_length: lower end of the length interval.
    max_length: upper end of the length interval.
  """
  batches: list[Batch]
  num_lengths: int
  min_length: int
  max_length: int

  def __iter__(self) -> Iterator[Batch]:
    return iter(self.batches)

  def __len__(self) -> int:
    return len(self.batches)

  def __getitem__(self, index) -> Batch:
    return self.batches[index]

  @property
  def num_strings(self) -> int:
    """Total number of strings."""
    return sum(len(b) for b in self.batches)

  @property
  def num_symbols(self) -> int:
    """Total number of symbols."""
    return sum(b.symbols.size for b in self.batches)

  def lower_bounds(self) -> list[np.ndarray]:
    """Per batch, float64 [B] of -ln p_sample(w) (see `lower_bound`)."""
    return [lower_bound(b, self.num_lengths) for b in self.batches]

  def lower_bound_cross_entropy(self) -> float:
    """Sum of -ln p_sample(w) over the split divided by its symbol count."""
    total = sum(float(x.sum()) for x in self.lower_bounds())
    return total / self.num_symbols


@dataclasses.dataclass
class Splits:
  """The three splits of one task.

  Attributes:
    task: task name.
    alphabet: terminal strings (index = id).
    seed: seed of the train/valid generator.
    test_seed: seed of the test generator.
    preserve_start: whether the distribution-preserving grammar was used.
    train, valid, test: the `Split`s.
  """
  task: str
  alphabet: tuple[str, ...]
  seed: int
  test_seed: int
  preserve_start: bool
  train: Split
  valid: Split
  test: Split

  def split(self, name: str) -> Split:
    """The split called `name` ('train', 'valid' or 'test')."""
    if name not in SPLITS:
      raise ValueError(f"unknown split {name!r}; valid: {SPLITS}")
    return getattr(self, name)


def lower_bound(batch: Batch, num_lengths: int) -> np.ndarray:
  """-ln p_sample(w) = -ln G(w) + ln G(N) + ln N_L per string, float64 [B].

  Raises:
    ValueError: if the batch has no log-probabilities or N_L is not an
      integer >= 1.
  """
  if batch.log_prob is None or batch.length_log_prob is None:
    raise ValueError("batch has no log_prob/length_log_prob; build it with "
                     "scoring enabled")
  if (isinstance(num_lengths, bool)
      or not isinstance(num_lengths, (int, np.integer)) or num_lengths < 1):
    raise ValueError(f"num_lengths must be an integer >= 1, got "
                     f"{num_lengths!r}")
  return -batch.log_prob + batch.length_log_prob + math.log(num_lengths)


def _scored(lang: languages.Language, symbols: np.ndarray) -> Batch:
  return Batch(symbols, lang.log_prob_batch(symbols),
               lang.length_log_prob(symbols.shape[1]))


def _check_sizes(minimum: int = 0, **sizes) -> None:
  """One-line ValueError unless every size is an int >= `minimum`."""
  for name, value in sizes.items():
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
      raise ValueError(f"{name} must be >= {minimum}, got {value}")


def make_splits(task: str, *, seed: int, test_seed: int = 0,
                train_batches: int = 1000, valid_batches: int = 100,
                batch_size: int = 10, train_min_length: int = 40,
                train_max_length: int = 80, test_per_length: int = 100,
                test_min_length: int = 40, test_max_length: int = 100,
                score_train: bool = False, preserve_start: bool = False,
                progress=None) -> Splits:
  """Builds the train/valid/test splits of a task in memory.

  Args:
    task: one of `languages.ALL_TASKS`.
    seed: seed of the train/valid generator.
    test_seed: seed of the test generator (0 in the paper).
    train_batches: number of training batches.
    valid_batches: number of validation batches.
    batch_size: strings per train/valid batch.
    train_min_length: lower end of the train/valid length interval.
    train_max_length: upper end of the train/valid length interval.
    test_per_length: strings per test length (one batch per length).
    test_min_length: lower end of the test length interval.
    test_max_length: upper end of the test length interval.
    score_train: also compute log_prob/length_log_prob for training batches.
    preserve_start: distribution-preserving grammar variant (not the paper's).
    progress: optional callable `progress(n)` called after every n batches
      (e.g. a tqdm bar's `update`).

  Returns:
    A `Splits`.

  Raises:
    ValueError: unknown task, negative sizes, bad length intervals, or an
      interval without valid lengths.
  """
  lang = languages.get(task, preserve_start=preserve_start)
  _check_sizes(seed=seed, test_seed=test_seed, train_batches=train_batches,
               valid_batches=valid_batches, test_per_length=test_per_length)
  # Any batch needs a string; without batches the size is not used.
  _check_sizes(minimum=1 if train_batches or valid_batches else 0,
               batch_size=batch_size)
  train_lengths = lang.valid_lengths(train_min_length, train_max_length)
  test_lengths = lang.valid_lengths(test_min_length, test_max_length)
  if not train_lengths and (train_batches or valid_batches):
    raise ValueError(f"{task} has no string with length in "
                     f"[{train_min_length}, {train_max_length}]")
  if not test_lengths and test_per_length:
    raise ValueError(f"{task} has no string with length in the test "
                     f"interval [{test_min_length}, {test_max_length}]")
  tick = progress or (lambda n: None)

  rng = np.random.default_rng(seed)

  def draw(num_batches, score):
    batches = []
    for _ in range(num_batches):
      length = train_lengths[int(rng.integers(len(train_lengths)))]
      symbols = lang.sample_batch(length, batch_size, rng)
      batches.append(_scored(lang, symbols) if score else Batch(symbols))
      tick(1)
    return batches

  train = Split(draw(train_batches, score_train), len(train_lengths),
                train_min_length, train_max_length)
  valid = Split(draw(valid_batches, True), len(train_lengths),
                train_min_length, train_max_length)
  test_rng = np.random.default_rng(test_seed)
  test_batches = []
  for length in test_lengths:
    test_batches.append(
        _scored(lang, lang.sample_batch(length, test_per_length, test_rng)))
    tick(1)
  test = Split(test_batches, len(test_lengths), test_min_length,
               test_max_length)
  return Splits(task, lang.alphabet, seed, test_seed, preserve_start, train,
                valid, test)


def from_config(config, need_test: bool = True) -> Splits:
  """The splits of a training config (configs/default.py fields).

  Args:
    config: task, seeds, batch counts and sizes, length intervals.
    need_test: sample (and score) the test split; when False it is empty.
  """
  def count(field):
    return _whole_number(f"config.{field}", getattr(config, field))

  splits = make_splits(
      config.task, seed=count("data_seed"), test_seed=count("test_seed"),
      train_batches=count("num_train_batches"),
      valid_batches=count("num_valid_batches"),
      batch_size=count("batch_size"),
      train_min_length=count("train_min_length"),
      train_max_length=count("train_max_length"),
      test_per_length=count("test_strings_per_length") if need_test else 0,
      test_min_length=count("test_min_length"),
      test_max_length=count("test_max_length"))
  if need_test:
    return splits
  return dataclasses.replace(splits, test=Split(
      [], 0, count("test_min_length"), count("test_max_length")))


def _whole_number(name: str, value) -> int:
  """An int, or a float with no fractional part (a JSON 2.0) as an int;
  ValueError for 2.7, a bool, a string (truncating would change the data)."""
  if isinstance(value, (float, np.floating)) and float(value).is_integer():
    return int(value)
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"{name} must be an integer, got {value!r}")
  return int(value)


def _format_float(x) -> str:
  return "nan" if x is None else repr(float(x))


def write_splits(splits: Splits, out_dir: str) -> None:
  """Writes `meta.json` and `{train,valid,test}.tsv` under `out_dir`.

  See the module docstring for the format. Existing files are overwritten.

  Raises:
    ValueError: a batch holds a symbol id outside the alphabet (before
      anything is written; a -1 would be written as the last symbol).
  """
  for name in SPLITS:
    for index, batch in enumerate(splits.split(name)):
      ids = np.asarray(batch.symbols)
      if ids.size and (ids.min() < 0 or ids.max() >= len(splits.alphabet)):
        raise ValueError(f"{name} batch {index} holds symbol ids outside "
                         f"[0, {len(splits.alphabet)}): "
                         f"[{ids.min()}, {ids.max()}]")
  os.makedirs(out_dir, exist_ok=True)
  meta = {
      "format": FORMAT,
      "task": splits.task,
      "alphabet": list(splits.alphabet),
      "seed": int(splits.seed),
      "test_seed": int(splits.test_seed),
      "preserve_start": bool(splits.preserve_start),
  }
  for name in SPLITS:
    split = splits.split(name)
    meta[name] = {
        "num_lengths": int(split.num_lengths),
        "min_length": int(split.min_length),
        "max_length": int(split.max_length),
        "num_batches": len(split),
        "num_strings": split.num_strings,
    }
    lines = [_HEADER]
    for index, batch in enumerate(split):
      scored = batch.log_prob is not None
      bounds = lower_bound(batch, split.num_lengths) if scored else None
      for row in range(len(batch)):
        text = " ".join(splits.alphabet[s] for s in batch.symbols[row])
        fields = [str(index), str(batch.length), text]
        if scored:
          fields += [_format_float(batch.log_prob[row]),
                     _format_float(batch.length_log_prob),
                     _format_float(bounds[row])]
        else:
          fields += ["nan"] * 3
        lines.append("\t".join(fields))
    with open(os.path.join(out_dir, f"{name}.tsv"), "w",
              encoding="utf-8", newline="\n") as f:
      f.write("\n".join(lines) + "\n")
  with open(os.path.join(out_dir, "meta.json"), "w", encoding="utf-8",
            newline="\n") as f:
    f.write(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def read_splits(out_dir: str) -> Splits:
  """Reads a directory written by `write_splits`.

  Raises:
    ValueError: on a missing file, an unknown format or a malformed line.
  """
  meta_path = os.path.join(out_dir, "meta.json")
  if not os.path.exists(meta_path):
    raise ValueError(f"{out_dir!r} has no meta.json (not a dataset directory)")
  try:
    with open(meta_path, encoding="utf-8") as f:
      meta = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{meta_path} is not JSON: {e}") from None
  if not isinstance(meta, dict):
    raise ValueError(f"{meta_path} is not a JSON object")
  missing = [k for k in ("format", "task", "alphabet", "seed", "test_seed",
                         "preserve_start", *SPLITS) if k not in meta]
  if missing:
    raise ValueError(f"{meta_path} lacks {', '.join(missing)}")
  if meta.get("format") != FORMAT:
    raise ValueError(f"{meta_path}: unknown format {meta.get('format')!r}, "
                     f"expected {FORMAT!r}")
  alphabet = tuple(meta["alphabet"])
  index = {a: i for i, a in enumerate(alphabet)}
  splits = {}
  for name in SPLITS:
    path = os.path.join(out_dir, f"{name}.tsv")
    if not os.path.exists(path):
      raise ValueError(f"missing split file {path}")
    rows: dict[int, list] = {}
    with open(path, encoding="utf-8") as f:
      header = f.readline().rstrip("\n")
      if header != _HEADER:
        raise ValueError(f"{path}: bad header {header!r}")
      for line_no, line in enumerate(f, start=2):
        fields = line.rstrip("\n").split("\t")
        if len(fields) != 6:
          raise ValueError(f"{path}:{line_no}: expected 6 tab-separated "
                           f"fields, got {len(fields)}")
        try:
          symbols = [index[t] for t in fields[2].split(" ")] if fields[2] \
              else []
        except KeyError as e:
          raise ValueError(f"{path}:{line_no}: symbol {e.args[0]!r} not in "
                           f"alphabet {alphabet}") from None
        try:
          batch, length = int(fields[0]), int(fields[1])
          log_prob, length_log_prob = float(fields[3]), float(fields[4])
        except ValueError:
          raise ValueError(f"{path}:{line_no}: the batch and length fields "
                           "must be integers, the log-probabilities "
                           "numbers") from None
        if len(symbols) != length:
          raise ValueError(f"{path}:{line_no}: length field {fields[1]} does "
                           f"not match the string ({len(symbols)} symbols)")
        if rows.get(batch) and len(rows[batch][0][0]) != length:
          raise ValueError(f"{path}:{line_no}: batch {batch} mixes lengths "
                           f"{len(rows[batch][0][0])} and {length}")
        rows.setdefault(batch, []).append(
            (symbols, log_prob, length_log_prob))
    batches = []
    for b in sorted(rows):
      symbols = np.array([r[0] for r in rows[b]], dtype=np.int32)
      log_prob = np.array([r[1] for r in rows[b]], dtype=np.float64)
      if np.all(np.isnan(log_prob)):
        batches.append(Batch(symbols))
      else:
        batches.append(Batch(symbols, log_prob, rows[b][0][2]))
    info = meta[name]
    splits[name] = Split(batches, info["num_lengths"], info["min_length"],
                         info["max_length"])
  return Splits(meta["task"], alphabet, meta["seed"], meta["test_seed"],
                meta["preserve_start"], **splits)


def _main(argv: Sequence[str]) -> None:
  """CLI entry point (absl)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  import tqdm  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import checkpointing  # pylint: disable=g-import-not-at-top
  del argv
  f = flags.FLAGS
  checkpointing.check_writable(f.out, what="--out")
  for flag in ("train_max_length", "test_max_length"):
    too_long = languages.length_out_of_reach(f.task, f[flag].value)
    if too_long:
      raise ValueError(f"--{flag} is {f[flag].value:,}: {too_long}")
  total = f.train_batches + f.valid_batches + len(
      languages.get(f.task).valid_lengths(f.test_min_length,
                                          f.test_max_length))
  # The bar opens at the first batch drawn, after make_splits has checked
  # its arguments: a bad one is then the only line on stderr.
  bar = None

  def progress(n):
    nonlocal bar
    if bar is None:
      bar = tqdm.tqdm(total=total, desc=f"{f.task} batches")
    bar.update(n)

  try:
    splits = make_splits(
        f.task, seed=f.seed, test_seed=f.test_seed,
        train_batches=f.train_batches, valid_batches=f.valid_batches,
        batch_size=f.batch_size, train_min_length=f.train_min_length,
        train_max_length=f.train_max_length,
        test_per_length=f.test_per_length, test_min_length=f.test_min_length,
        test_max_length=f.test_max_length, preserve_start=f.preserve_start,
        progress=progress)
  finally:
    if bar is not None:
      bar.close()
  write_splits(splits, f.out)
  for name in SPLITS:
    split = splits.split(name)
    msg = f"{name}: {len(split)} batches, {split.num_strings} strings"
    if name != "train" and split.num_strings:
      msg += (f", lower-bound cross-entropy "
              f"{split.lower_bound_cross_entropy():.5f} nats/symbol")
    print(msg)
  print(f"wrote {f.out}")


def _define_flags() -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  # Any name languages.get accepts (incl. every <family>_k<K>); a bad one is
  # its one-line ValueError.
  flags.DEFINE_string("task", None, "Task name (languages.get).")
  flags.DEFINE_string("out", None, "Output directory.")
  flags.DEFINE_integer("seed", 1, "Seed of the train/valid generator.")
  flags.DEFINE_integer("test_seed", 0, "Seed of the test generator.")
  flags.DEFINE_integer("train_batches", 1000, "Training batches.")
  flags.DEFINE_integer("valid_batches", 100, "Validation batches.")
  flags.DEFINE_integer("batch_size", 10, "Strings per train/valid batch.")
  flags.DEFINE_integer("train_min_length", 40, "Min train/valid length.")
  flags.DEFINE_integer("train_max_length", 80, "Max train/valid length.")
  flags.DEFINE_integer("test_per_length", 100, "Test strings per length.")
  flags.DEFINE_integer("test_min_length", 40, "Min test length.")
  flags.DEFINE_integer("test_max_length", 100, "Max test length.")
  flags.DEFINE_bool("preserve_start", False,
                    "Distribution-preserving grammar (not the paper's).")
  flags.mark_flags_as_required(["task", "out"])


if __name__ == "__main__":
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  _define_flags()
  cli.run(_main)
