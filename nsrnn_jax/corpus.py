"""Word-level corpora for language modelling as one stream (PTB style).

The later papers' natural-language experiment (rns-vrns-reference.md §4.4)
trains on the Mikolov Penn Treebank: three text files, one sentence per line,
tokens separated by spaces, rare words already replaced by ``<unk>``. Each
line is followed by ``<eos>`` and the lines are concatenated into one token
stream per split.

* Vocabulary: the tokens of the training file in order of first appearance
  (``<eos>`` included); the same files give the same ids. A validation or
  test token outside it becomes ``<unk>`` if the vocabulary has one, and is
  a one-line ValueError (file, line, token) otherwise.
* Rows: a stream of N tokens has N − 1 prediction targets (the first token
  is never predicted). They are split into B contiguous rows of
  L = ⌈(N − 1) / B⌉ targets each: row r reads tokens rL .. rL + L − 1 and
  predicts tokens rL + 1 .. rL + L, so every target is predicted exactly once
  and no token is dropped; the last row is padded with mask 0.
* Chunks: training and evaluation walk the rows left to right in chunks of
  T (BPTT length) positions, carrying each row's model state from one chunk
  to the next (`models.LanguageModel.stream`); the last chunk is padded to T
  with mask 0 so one program serves every chunk.

Shape legend: B rows (batch), L positions per row, T chunk length.

CLI (a small synthetic corpus from one of the formal languages, for trying
the pipeline without PTB; sentences of uniformly drawn lengths):

  python -m nsrnn_jax.corpus --task=dyck --out=/tmp/dyck_corpus
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Iterator, Optional, Sequence

import numpy as np

SPLITS = ("train", "valid", "test")
META_FILE = "meta.json"
LOWER_BOUND_KEY = "lower_bound_cross_entropy"
EOS = "<eos>"
UNK = "<unk>"
# File names tried per split, in order: plain, then Mikolov's PTB names.
_FILE_NAMES = ("{split}.txt", "ptb.{split}.txt")


def split_path(corpus_dir: str, split: str) -> str:
  """The file of `split` in `corpus_dir` (``train.txt`` or ``ptb.train.txt``).

  Raises:
    ValueError: (one line) the directory or the split's file is missing.
  """
  if not os.path.isdir(corpus_dir):
    raise ValueError(f"corpus directory {corpus_dir!r} does not exist")
  names = [n.format(split=split) for n in _FILE_NAMES]
  for name in names:
    path = os.path.join(corpus_dir, name)
    if os.path.isfile(path):
      return path
  raise ValueError(f"corpus directory {corpus_dir!r} has no {split} file "
                   f"(expected {' or '.join(names)})")


def digest(corpus_dir: str) -> str:
  """SHA-256 of the three split files' bytes (in split order)."""
  h = hashlib.sha256()
  for split in SPLITS:
    with open(split_path(corpus_dir, split), "rb") as f:
      for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
    h.update(b"\0")
  return h.hexdigest()


def read_tokens(path: str) -> Iterator[tuple[int, list[str]]]:
  """Yields (line number, tokens + [<eos>]) for every line of a file.

  Raises:
    ValueError: the file is not UTF-8 text (named).
  """
  with open(path, encoding="utf-8") as f:
    try:
      for number, line in enumerate(f, start=1):
        yield number, line.split() + [EOS]
    except UnicodeDecodeError as e:
      # (Decoded in blocks: the line it is on is not known here.)
      raise ValueError(f"{path} is not UTF-8 text ({e.reason})") from None


@dataclasses.dataclass(frozen=True)
class Vocabulary:
  """Token <-> id, from the training file (first-appearance order)."""
  tokens: tuple[str, ...]

  def __post_init__(self):
    object.__setattr__(self, "_ids",
                       {t: i for i, t in enumerate(self.tokens)})

  def __len__(self) -> int:
    return len(self.tokens)

  def id(self, token: str) -> Optional[int]:
    """The id of `token`, or None."""
    return self._ids.get(token)  # pytype: disable=attribute-error

  @classmethod
  def from_file(cls, path: str) -> "Vocabulary":
    """The tokens of a file (`read_tokens`: with <eos>), in order of first
    appearance."""
    seen = {}
    for _, tokens in read_tokens(path):
      for t in tokens:
        seen.setdefault(t, len(seen))
    return cls(tuple(seen))


def encode_file(path: str, vocab: Vocabulary) -> np.ndarray:
  """A file as one int32 id stream (each line followed by <eos>).

  Raises:
    ValueError: (one line) a token outside the vocabulary, when it has no
      <unk> to map it to.
  """
  unk = vocab.id(UNK)
  ids = []
  for number, tokens in read_tokens(path):
    for t in tokens:
      i = vocab.id(t)
      if i is None:
        if unk is None:
          raise ValueError(
              f"{path}:{number}: token {t!r} is not in the training "
              f"vocabulary, which has no {UNK} to map it to")
        i = unk
      ids.append(i)
  return np.asarray(ids, np.int32)


@dataclasses.dataclass(frozen=True)
class Rows:
  """A split's stream as B contiguous rows (module docstring).

  Attributes:
    inputs: int32 [B, L], the token read at each position.
    targets: int32 [B, L], the next token (0 where padded).
    mask: float32 [B, L], 1 for real targets.
  """
  inputs: np.ndarray
  targets: np.ndarray
  mask: np.ndarray

  @property
  def num_targets(self) -> int:
    """Targets over all rows (padding left out)."""
    return int(self.mask.sum())

  def num_chunks(self, chunk_length: int) -> int:
    """Chunks of `chunk_length` tokens that cover a row (the last padded)."""
    return -(-self.inputs.shape[1] // chunk_length)

  def chunk(self, index: int, chunk_length: int) -> dict:
    """Chunk `index` {"inputs", "targets", "mask"} [B, T], padded to T."""
    lo = index * chunk_length
    out = {}
    for key in ("inputs", "targets", "mask"):
      a = getattr(self, key)[:, lo:lo + chunk_length]
      pad = chunk_length - a.shape[1]
      out[key] = np.pad(a, ((0, 0), (0, pad))) if pad else a
    return out


def make_rows(stream: np.ndarray, num_rows: int) -> Rows:
  """Splits a token stream into `num_rows` contiguous rows (module docstring).

  Raises:
    ValueError: (one line) fewer targets than rows.
  """
  stream = np.asarray(stream, np.int32)
  num_targets = stream.shape[0] - 1
  if num_rows < 1 or num_targets < num_rows:
    raise ValueError(f"a stream of {stream.shape[0]} tokens has "
                     f"{max(num_targets, 0)} targets, fewer than the "
                     f"{num_rows} rows asked for")
  length = -(-num_targets // num_rows)
  inputs = np.zeros((num_rows, length), np.int32)
  targets = np.zeros((num_rows, length), np.int32)
  mask = np.zeros((num_rows, length), np.float32)
  for r in range(num_rows):
    lo, hi = r * length, min((r + 1) * length, num_targets)
    n = max(hi - lo, 0)
    inputs[r, :n] = stream[lo:hi]
    targets[r, :n] = stream[lo + 1:hi + 1]
    mask[r, :n] = 1
  return Rows(inputs, targets, mask)


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A corpus's vocabulary and the id stream of each split."""
  vocab: Vocabulary
  streams: dict

  def rows(self, split: str, num_rows: int) -> Rows:
    """A split's stream in `num_rows` rows (`make_rows`)."""
    return make_rows(self.streams[split], num_rows)


def load(corpus_dir: str, splits: Sequence[str] = SPLITS) -> Corpus:
  """Reads `splits` of a corpus directory (the vocabulary from train).

  Raises:
    ValueError: (one line) a missing file, an empty training file, or an
      unknown validation/test token without <unk>.
  """
  vocab = Vocabulary.from_file(split_path(corpus_dir, "train"))
  streams = {}
  for split in splits:
    path = split_path(corpus_dir, split)
    streams[split] = encode_file(path, vocab)
    if streams[split].shape[0] < 2:
      raise ValueError(f"{path} holds {streams[split].shape[0]} token(s); a "
                       "split needs at least 2")
  return Corpus(vocab, streams)


def lower_bound(corpus_dir: str) -> Optional[dict]:
  """{split: nats per target} of a synthetic corpus (`write_synthetic`), or
  None for a corpus without one (a real text corpus)."""
  path = os.path.join(corpus_dir, META_FILE)
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      bounds = json.load(f)[LOWER_BOUND_KEY]
    return {split: float(bounds[split]) for split in SPLITS}
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{path} is unreadable or has no {LOWER_BOUND_KEY} "
                     f"for every split ({type(e).__name__}: {e})") from None


def write_synthetic(out_dir: str, task: str, num_sentences=(2000, 200, 200),
                    min_length: int = 4, max_length: int = 20,
                    seed: int = 1) -> None:
  """Writes train/valid/test.txt of sentences sampled from a formal language.

  Each split draws its sentences' lengths uniformly from the valid lengths
  in [min_length, max_length] and samples each exactly given its length
  (`languages.Language.sample`); symbols are written as tokens.

  meta.json records, per split, the cross-entropy of the true distribution
  on the split's stream: Σ over sentences of −ln((1/N_L)·G(w)/G(|w|)),
  divided by the number of targets (tokens − 1, <eos> included). No model
  can do better in expectation: it is −ln p of the whole stream, so it
  includes the first token, never predicted (at most ln|Σ| nats, < 1e-3
  per target for a split of 2000 tokens), and a model that starts a row in
  mid-sentence knows less than the true distribution does.
  """
  from nsrnn_jax import languages  # pylint: disable=g-import-not-at-top
  for split, count in zip(SPLITS, num_sentences):
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
      raise ValueError(f"the {split} split needs >= 1 sentence (got "
                       f"{count!r})")
  lang = languages.get(task)
  lengths = lang.valid_lengths(min_length, max_length)
  if not lengths:
    raise ValueError(f"[{min_length}, {max_length}] holds no string of "
                     f"{task}")
  rng = np.random.default_rng(seed)
  os.makedirs(out_dir, exist_ok=True)
  bounds = {}
  for split, count in zip(SPLITS, num_sentences):
    nll, num_tokens = 0.0, 0
    with open(os.path.join(out_dir, f"{split}.txt"), "w",
              encoding="utf-8") as f:
      for _ in range(count):
        length = int(rng.choice(lengths))
        symbols = lang.sample(length, rng)
        f.write(" ".join(lang.alphabet[s] for s in symbols) + "\n")
        # −ln of (1 / N_L) · G(w) / G(|w|): the length, then the string.
        nll += math.log(len(lengths)) - (
            lang.log_prob(symbols) - lang.length_log_prob(length))
        num_tokens += length + 1  # + <eos>
    bounds[split] = nll / (num_tokens - 1)
  with open(os.path.join(out_dir, META_FILE), "w", encoding="utf-8") as f:
    json.dump({"task": task, "num_sentences": list(num_sentences),
               "min_length": min_length, "max_length": max_length,
               "seed": seed, LOWER_BOUND_KEY: bounds}, f, indent=2,
              sort_keys=True)


def main(argv: Sequence[str]) -> None:
  """CLI: write a synthetic corpus (module docstring)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  del argv
  f = flags.FLAGS
  write_synthetic(f.out, f.task, (f.train_sentences, f.eval_sentences,
                                  f.eval_sentences),
                  f.min_length, f.max_length, f.seed)
  print(f"wrote {f.out}/{{train,valid,test}}.txt")


if __name__ == "__main__":
  from absl import flags as _flags  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  _flags.DEFINE_string("task", "dyck", "Formal language (languages.TASKS).")
  _flags.DEFINE_string("out", None, "Output directory.")
  _flags.DEFINE_integer("train_sentences", 2000, "Training sentences.")
  _flags.DEFINE_integer("eval_sentences", 200,
                        "Validation and test sentences (each).")
  _flags.DEFINE_integer("min_length", 4, "Shortest sentence (symbols).")
  _flags.DEFINE_integer("max_length", 20, "Longest sentence (symbols).")
  _flags.DEFINE_integer("seed", 1, "Sampling seed.")
  _flags.mark_flags_as_required(["out"])
  cli.run(main)
