"""Tests for nsrnn_jax.data: split protocol, lower bounds, file format, CLI."""

import filecmp
import math
import os
import re
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from nsrnn_jax import data
from nsrnn_jax import languages

SMALL = dict(train_batches=6, valid_batches=3, batch_size=4,
             train_min_length=6, train_max_length=12, test_per_length=5,
             test_min_length=6, test_max_length=14)


def test_make_splits_protocol():
  splits = data.make_splits("dyck", seed=3, **SMALL)
  lang = languages.get("dyck")
  valid_lengths = lang.valid_lengths(6, 12)
  assert len(splits.train) == 6 and len(splits.valid) == 3
  assert splits.train.num_lengths == splits.valid.num_lengths == 4
  assert splits.test.num_lengths == 5
  for batch in list(splits.train) + list(splits.valid):
    assert batch.symbols.dtype == np.int32
    assert batch.symbols.shape[0] == 4 and batch.length in valid_lengths
  assert [b.length for b in splits.test] == lang.valid_lengths(6, 14)
  assert all(len(b) == 5 for b in splits.test)
  assert splits.train[0].log_prob is None
  # Reproduce the generator by hand: one rng, train then valid continuing.
  rng = np.random.default_rng(3)
  for batch in list(splits.train) + list(splits.valid):
    length = valid_lengths[int(rng.integers(len(valid_lengths)))]
    expected = [lang.sample(length, rng) for _ in range(4)]
    np.testing.assert_array_equal(batch.symbols, expected)
  test_rng = np.random.default_rng(0)
  for batch in splits.test:
    expected = [lang.sample(batch.length, test_rng) for _ in range(5)]
    np.testing.assert_array_equal(batch.symbols, expected)


def test_log_probs_and_lower_bounds():
  splits = data.make_splits("marked_reversal", seed=1, **SMALL)
  f = 1 - 1 / 61
  for split in (splits.valid, splits.test):
    for batch, bound in zip(split, split.lower_bounds()):
      n = batch.length
      assert batch.log_prob.dtype == np.float64
      # Closed form: G(w) = (1-f) (f/2)^((n-1)/2); G(n) = (1-f) f^((n-1)/2).
      np.testing.assert_allclose(
          batch.log_prob, math.log(1 - f) + (n - 1) / 2 * math.log(f / 2),
          rtol=1e-12)
      assert math.isclose(batch.length_log_prob,
                          math.log(1 - f) + (n - 1) / 2 * math.log(f),
                          rel_tol=1e-12)
      np.testing.assert_allclose(
          bound, (n - 1) / 2 * math.log(2) + math.log(split.num_lengths),
          rtol=1e-12)
  total = sum(b.sum() for b in splits.valid.lower_bounds())
  assert math.isclose(splits.valid.lower_bound_cross_entropy(),
                      total / splits.valid.num_symbols, rel_tol=1e-12)
  with pytest.raises(ValueError, match="no log_prob"):
    data.lower_bound(splits.train[0], 3)


def test_write_read_roundtrip_and_byte_identical(tmp_path):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  data.write_splits(data.make_splits("hardest_cfl", seed=5, **SMALL), a)
  data.write_splits(data.make_splits("hardest_cfl", seed=5, **SMALL), b)
  names = ["meta.json", "train.tsv", "valid.tsv", "test.tsv"]
  match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
  assert match == names and not mismatch and not errors
  other = str(tmp_path / "c")
  data.write_splits(data.make_splits("hardest_cfl", seed=6, **SMALL), other)
  assert not filecmp.cmp(os.path.join(a, "train.tsv"),
                         os.path.join(other, "train.tsv"), shallow=False)
  original = data.make_splits("hardest_cfl", seed=5, **SMALL)
  back = data.read_splits(a)
  assert back.task == "hardest_cfl" and back.seed == 5
  assert back.alphabet == languages.get("hardest_cfl").alphabet
  for name in data.SPLITS:
    s1, s2 = original.split(name), back.split(name)
    assert s1.num_lengths == s2.num_lengths and len(s1) == len(s2)
    for x, y in zip(s1, s2):
      np.testing.assert_array_equal(x.symbols, y.symbols)
      if x.log_prob is None:
        assert y.log_prob is None
      else:
        # repr round-trips float64 exactly.
        np.testing.assert_array_equal(x.log_prob, y.log_prob)
        assert x.length_log_prob == y.length_log_prob
  with open(os.path.join(a, "valid.tsv")) as f:
    header, first = f.readline(), f.readline()
  assert header.startswith("batch\tlength\tstring")
  fields = first.rstrip("\n").split("\t")
  assert int(fields[1]) == len(fields[2].split(" "))
  assert math.isclose(float(fields[5]),
                      -float(fields[3]) + float(fields[4])
                      + math.log(back.valid.num_lengths), rel_tol=1e-12)


def test_bad_arguments():
  with pytest.raises(ValueError, match="valid tasks are"):
    data.make_splits("nope", seed=0)
  with pytest.raises(ValueError, match="min_length"):
    data.make_splits("dyck", seed=0, **dict(SMALL, train_min_length=20))
  with pytest.raises(ValueError, match="must be >= 0"):
    data.make_splits("dyck", seed=0, **dict(SMALL, train_batches=-1))
  with pytest.raises(ValueError, match="must be >= 0"):
    data.make_splits("dyck", seed=0, **dict(SMALL, test_min_length=-4))
  with pytest.raises(ValueError, match="no string with length"):
    data.make_splits("marked_reversal", seed=0,
                     **dict(SMALL, train_min_length=10, train_max_length=10))
  # Marked reversal has odd lengths only: [4, 4] holds none.
  with pytest.raises(ValueError, match="no string with length in the test "
                     r"interval \[4, 4\]"):
    data.make_splits("marked_reversal", seed=0,
                     **dict(SMALL, test_min_length=4, test_max_length=4))
  with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
    data.make_splits("dyck", seed=0, **dict(SMALL, batch_size=0))
  # (Not ">= 0": 0 is refused too where there are batches.)
  with pytest.raises(ValueError, match="batch_size must be >= 1, got -3"):
    data.make_splits("dyck", seed=0, **dict(SMALL, batch_size=-3))
  # No validation batches: no bound to report, and no division by zero.
  assert data.make_splits("dyck", seed=0, **dict(
      SMALL, valid_batches=0)).valid.num_strings == 0


def test_counts_must_be_whole_numbers():
  """A count of 2.7 is refused, not truncated to 2; N_L = 2.5 gave a
  lower bound off by ln(2.5/2) silently."""
  batch = data.Batch(np.zeros((1, 2), np.int32), np.zeros(1), 0.0)
  assert data.lower_bound(batch, 2)[0] == pytest.approx(math.log(2))
  for bad in (2.5, True, "2"):
    with pytest.raises(ValueError, match="num_lengths must be an integer"):
      data.lower_bound(batch, bad)
  config = ml_collections.ConfigDict(dict(
      task="dyck", data_seed=1, test_seed=0, num_train_batches=2.7,
      num_valid_batches=1, batch_size=2, train_min_length=40,
      train_max_length=80, test_strings_per_length=0, test_min_length=40,
      test_max_length=100))
  with pytest.raises(ValueError, match=r"config.num_train_batches must be an "
                     r"integer, got 2.7"):
    data.from_config(config, need_test=False)
  # A whole float (a config read back from JSON) is that count.
  config.num_train_batches = 2.0
  assert len(data.from_config(config, need_test=False).train.batches) == 2


def test_read_rejects_bad_directory(tmp_path):
  with pytest.raises(ValueError, match="no meta.json"):
    data.read_splits(str(tmp_path))
  out = str(tmp_path / "d")
  data.write_splits(data.make_splits("dyck", seed=1, **SMALL), out)
  path = os.path.join(out, "valid.tsv")
  with open(path) as f:
    lines = f.readlines()
  fields = lines[1].split("\t")
  fields[2] = "x" + fields[2][1:]
  lines[1] = "\t".join(fields)
  with open(path, "w") as f:
    f.writelines(lines)
  with pytest.raises(ValueError, match="not in alphabet"):
    data.read_splits(out)


def test_read_names_the_file_and_line_of_a_corrupt_field(tmp_path):
  out = str(tmp_path / "d")
  data.write_splits(data.make_splits("dyck", seed=1, **SMALL), out)
  path = os.path.join(out, "valid.tsv")
  with open(path) as f:
    good = f.readlines()

  def corrupt(line):
    with open(path, "w") as f:
      f.writelines(good[:2] + [line] + good[3:])

  fields = good[2].split("\t")
  corrupt("\t".join(["x"] + fields[1:]))
  with pytest.raises(ValueError, match=f"{re.escape(path)}:3: the batch and "
                     "length fields must be integers"):
    data.read_splits(out)
  # A string of another length in the batch of line 2 (same batch id).
  other = good[-1].split("\t")
  corrupt("\t".join(fields[:1] + other[1:]))
  assert other[1] != fields[1]
  with pytest.raises(ValueError, match=f"{re.escape(path)}:3: batch "
                     f"{fields[0]} mixes lengths"):
    data.read_splits(out)
  with open(path, "w") as f:
    f.writelines(good)
  meta = os.path.join(out, "meta.json")
  for text, message in [("[1]", "is not a JSON object"), ("{", "is not JSON"),
                        ('{"format": 1}', "lacks task, alphabet")]:
    with open(meta, "w") as f:
      f.write(text)
    with pytest.raises(ValueError, match=message):
      data.read_splits(out)


def test_cli(tmp_path):
  out = str(tmp_path / "cli")
  args = [sys.executable, "-m", "nsrnn_jax.data", "--task=unmarked_reversal",
          f"--out={out}", "--seed=2", "--train_batches=3",
          "--valid_batches=2", "--batch_size=2", "--train_min_length=4",
          "--train_max_length=8", "--test_per_length=2",
          "--test_min_length=4", "--test_max_length=8"]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  subprocess.run(args, check=True, cwd=root, capture_output=True)
  splits = data.read_splits(out)
  assert len(splits.train) == 3 and len(splits.valid) == 2
  assert [b.length for b in splits.test] == [4, 6, 8]
  expected = data.make_splits(
      "unmarked_reversal", seed=2, train_batches=3, valid_batches=2,
      batch_size=2, train_min_length=4, train_max_length=8,
      test_per_length=2, test_min_length=4, test_max_length=8)
  for x, y in zip(splits.valid, expected.valid):
    np.testing.assert_array_equal(x.symbols, y.symbols)
  bad = subprocess.run(args[:3] + ["--task=bogus", f"--out={out}"], cwd=root,
                       capture_output=True, text=True)
  assert bad.returncode != 0 and "hardest_cfl" in bad.stderr


def test_cli_accepts_every_task_languages_accepts(tmp_path):
  # dyck_k7 is not listed in languages.ALL_TASKS but languages.get builds it.
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  base = [sys.executable, "-m", "nsrnn_jax.data", "--train_batches=2",
          "--valid_batches=1", "--batch_size=2", "--train_min_length=4",
          "--train_max_length=6", "--test_per_length=1",
          "--test_min_length=4", "--test_max_length=6"]
  out = str(tmp_path / "k7")
  subprocess.run(base + ["--task=dyck_k7", f"--out={out}"], check=True,
                 cwd=root, capture_output=True)
  assert data.read_splits(out).alphabet[-2:] == ("{{", "}}")
  bad = subprocess.run(base + ["--task=dyck_k1", f"--out={tmp_path / 'k1'}"],
                       cwd=root, capture_output=True, text=True)
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines() == [
      "error: task 'dyck_k1': alphabet size must be >= 2 (got 1)"]


def test_write_splits_refuses_ids_outside_the_alphabet(tmp_path):
  splits = data.make_splits("hardest_cfl", seed=5, **SMALL)
  for bad in (-1, len(splits.alphabet)):
    splits.test[0].symbols[0, 0] = bad
    with pytest.raises(ValueError, match=r"test batch 0 holds symbol ids "
                       r"outside \[0, "):
      data.write_splits(splits, str(tmp_path / f"out{bad}"))
  assert not os.listdir(tmp_path)  # refused before anything is written
