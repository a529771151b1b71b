"""Tests for nsrnn_jax.corpus (word corpora as one token stream).

Oracles: the files' own text (every token, read back through the ids, in
order), and a brute-force walk over the rows that counts how often each
target of the stream is predicted (exactly once) and checks each
(input, target) pair is a pair of neighbours of the stream.
"""

import os

import numpy as np
import pytest

from nsrnn_jax import corpus
from nsrnn_jax import languages


def _write(directory, **splits):
  os.makedirs(directory, exist_ok=True)
  for name, text in splits.items():
    with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
      f.write(text)
  return str(directory)


def test_vocabulary_and_streams_read_back_the_text(tmp_path):
  d = _write(tmp_path, **{"train.txt": "a b <unk>\nc a\n",
                          "valid.txt": "a zz\n", "test.txt": "b\n\nc\n"})
  c = corpus.load(d)
  assert c.vocab.tokens == ("a", "b", "<unk>", "<eos>", "c")
  words = lambda split: [c.vocab.tokens[i] for i in c.streams[split]]
  assert words("train") == ["a", "b", "<unk>", "<eos>", "c", "a", "<eos>"]
  # An unknown word maps to <unk>; an empty line is one <eos>.
  assert words("valid") == ["a", "<unk>", "<eos>"]
  assert words("test") == ["b", "<eos>", "<eos>", "c", "<eos>"]


def test_mikolov_file_names(tmp_path):
  d = _write(tmp_path, **{f"ptb.{s}.txt": "x y\n" for s in corpus.SPLITS})
  assert corpus.load(d).streams["test"].tolist() == [0, 1, 2]


def test_unknown_token_without_unk_is_a_one_line_error(tmp_path):
  d = _write(tmp_path, **{"train.txt": "a b\n", "valid.txt": "a\nb q\n",
                          "test.txt": "a\n"})
  with pytest.raises(ValueError, match=r"valid.txt:2: token 'q' is not in"):
    corpus.load(d)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
  d = _write(tmp_path, **{"train.txt": "a b\n", "valid.txt": "a\n",
                          "test.txt": "a\n"})
  with open(os.path.join(d, "test.txt"), "wb") as f:
    f.write(b"a b\nc \xb1\xff\n")
  with pytest.raises(ValueError, match=r"test.txt is not UTF-8 text "
                     r"\(invalid start byte\)"):
    corpus.load(d)


@pytest.mark.parametrize("files, message", [
    ({}, "has no train file"),
    ({"train.txt": "a\n", "valid.txt": "a\n"}, "has no test file"),
])
def test_missing_files(tmp_path, files, message):
  d = _write(tmp_path, **files)
  with pytest.raises(ValueError, match=message):
    corpus.load(d)
  with pytest.raises(ValueError, match="does not exist"):
    corpus.load(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("n, rows", [(2, 1), (11, 3), (13, 4), (100, 7),
                                     (9, 8), (10, 4)])
def test_rows_predict_every_target_once(n, rows):
  stream = np.random.default_rng(n).permutation(1000)[:n].astype(np.int32)
  r = corpus.make_rows(stream, rows)
  position = {int(t): i for i, t in enumerate(stream)}  # distinct tokens
  seen = np.zeros(n, int)
  for b in range(rows):
    for t in range(r.inputs.shape[1]):
      if r.mask[b, t]:
        i = position[int(r.inputs[b, t])]
        assert int(r.targets[b, t]) == stream[i + 1]
        seen[i + 1] += 1
      else:  # Padding comes only at the end of a row.
        assert not r.mask[b, t:].any()
  np.testing.assert_array_equal(seen, [0] + [1] * (n - 1))
  assert r.num_targets == n - 1
  # Rows are contiguous: row b + 1 starts where row b stopped.
  for b in range(rows - 1):
    if r.mask[b + 1, 0]:
      last = position[int(r.targets[b, -1])]
      assert position[int(r.inputs[b + 1, 0])] == last


def test_chunks_cover_the_rows_and_pad_with_mask_zero():
  r = corpus.make_rows(np.arange(30, dtype=np.int32), 3)  # L = 10
  chunks = [r.chunk(i, 4) for i in range(r.num_chunks(4))]
  assert len(chunks) == 3
  for key in ("inputs", "targets", "mask"):
    joined = np.concatenate([c[key] for c in chunks], axis=1)
    np.testing.assert_array_equal(joined[:, :10], getattr(r, key))
    assert not joined[:, 10:].any()


def test_too_few_targets_for_the_rows():
  with pytest.raises(ValueError, match="fewer than the 5 rows"):
    corpus.make_rows(np.arange(5, dtype=np.int32), 5)


def test_synthetic_corpus_holds_strings_of_the_language(tmp_path):
  corpus.write_synthetic(str(tmp_path), "dyck", (30, 5, 5), 4, 10, seed=3)
  lang = languages.get("dyck")
  ids = {a: i for i, a in enumerate(lang.alphabet)}
  with open(tmp_path / "train.txt", encoding="utf-8") as f:
    lines = f.read().splitlines()
  assert len(lines) == 30
  for line in lines:
    symbols = [ids[w] for w in line.split()]
    assert 4 <= len(symbols) <= 10
    assert np.isfinite(lang.log_prob(symbols))
    # Independently of the grammar: the brackets are balanced and nested.
    stack = []
    for w in line.split():
      if w in "([":
        stack.append(w)
      else:
        assert stack and stack.pop() + w in ("()", "[]"), line
    assert not stack, line
  c = corpus.load(str(tmp_path))
  assert set(c.vocab.tokens) == set(lang.alphabet) | {corpus.EOS}


def test_synthetic_corpus_refuses_empty_splits(tmp_path):
  with pytest.raises(ValueError, match="valid split needs >= 1 sentence"):
    corpus.write_synthetic(str(tmp_path), "dyck", (5, 0, 5))
  assert not os.listdir(tmp_path)
