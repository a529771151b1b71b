"""Tests for nsrnn_jax.tasks_ncf: the later papers' tasks, by brute force."""

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from nsrnn_jax import data
from nsrnn_jax import languages
from nsrnn_jax import tasks_ncf


def _definition(base, u, k):
  """The task's string for content u, written out from the paper's table."""
  u = list(u)
  if base == "count_3":
    n = len(u)
    return [0] * n + [1] * n + [2] * n
  rev = u[::-1]
  return {
      "marked_copy": u + [k] + u,
      "unmarked_copy": u + u,
      "unmarked_copy_different_alphabets": u + [a + k for a in u],
      "marked_reverse_and_copy": u + [k] + rev + [k] + u,
      "unmarked_reverse_and_copy": u + rev + u,
      "count_and_copy": u + [k] * len(u) + u,
  }[base]


def _all_strings(length, vocab):
  return np.array(list(itertools.product(range(vocab), repeat=length)),
                  dtype=np.int64).reshape(-1, length)


# (task name, base, k): the paper's binary tasks plus a few K = 3 variants.
UNIFORM = [(t, t, 2) for t in tasks_ncf.NCF_TASKS] + [
    ("marked_copy_k3", "marked_copy", 3),
    ("unmarked_copy_different_alphabets_k3",
     "unmarked_copy_different_alphabets", 3),
    ("marked_reverse_and_copy_k3", "marked_reverse_and_copy", 3),
    ("count_and_copy_k3", "count_and_copy", 3)]


@pytest.mark.parametrize("name,base,k", UNIFORM)
def test_uniform_task_matches_enumeration(name, base, k):
  lang = languages.get(name)
  assert lang.alphabet_size == k
  # The language, written out from its definition for every content string.
  members = {}
  for n in range(1, 5):
    contents = [()] if base == "count_3" else itertools.product(range(k),
                                                                 repeat=n)
    for u in contents:
      w = tuple(_definition(base, u if base != "count_3" else range(n), k))
      members.setdefault(len(w), set()).add(w)
  for length in range(1, 9):
    if lang.vocab_size ** length > 70_000:
      break
    strings = _all_strings(length, lang.vocab_size)
    logp = lang.log_prob_batch(strings)
    inside = {tuple(w) for w, x in zip(strings.tolist(), logp) if x > -np.inf}
    assert inside == members.get(length, set()), length
    g_len = lang.length_log_prob(length)
    assert (length in lang.valid_lengths(1, 8)) == bool(inside)
    if inside:
      # Sum over all strings of the length = G(l); uniform given the length.
      assert math.isclose(np.exp(logp).sum(), math.exp(g_len), rel_tol=1e-12)
      finite = logp[logp > -np.inf]
      np.testing.assert_allclose(finite - g_len, -math.log(len(inside)),
                                 rtol=1e-12, atol=1e-12)
    else:
      assert g_len == -math.inf
  # G is a distribution over all strings: the length masses sum to 1.
  total = sum(math.exp(lang.length_log_prob(l))
              for l in lang.valid_lengths(1, 3000))
  assert math.isclose(total, 1.0, rel_tol=1e-9)


@pytest.mark.parametrize("name", ["marked_copy", "count_and_copy",
                                  "unmarked_copy_different_alphabets_k3"])
def test_uniform_sampler_is_uniform(name):
  lang = languages.get(name)
  length = lang.valid_lengths(6, 12)[0]
  rng = np.random.default_rng(5)
  batch = lang.sample_batch(length, 6000, rng)
  assert batch.dtype == np.int32 and batch.shape == (6000, length)
  logp = lang.log_prob_batch(batch)
  assert np.all(logp > -np.inf), "sampled a string outside the language"
  num = round(math.exp(lang.length_log_prob(length) - logp[0]))
  _, counts = np.unique(batch, axis=0, return_counts=True)
  assert len(counts) <= num
  observed = np.append(counts, np.zeros(num - len(counts)))
  assert stats.chisquare(observed).pvalue > 1e-4
  # sample() is sample_batch(length, 1).
  assert lang.sample(length, np.random.default_rng(1)) == tuple(
      lang.sample_batch(length, 1, np.random.default_rng(1))[0])


def test_paper_length_counts_and_count_3():
  counts = {name: (len(languages.get(name).valid_lengths(40, 80)),
                   len(languages.get(name).valid_lengths(40, 100)))
            for name in tasks_ncf.NCF_TASKS}
  assert counts == {
      "count_3": (13, 20), "marked_copy": (20, 30), "unmarked_copy": (21, 31),
      "unmarked_copy_different_alphabets": (21, 31),
      "marked_reverse_and_copy": (14, 20),
      "unmarked_reverse_and_copy": (13, 20), "count_and_copy": (13, 20)}
  lang = languages.get("count_3")
  assert lang.alphabet == ("a", "b", "c")
  w = lang.sample(42, np.random.default_rng(0))
  assert lang.decode(w) == "a" * 14 + "b" * 14 + "c" * 14
  assert lang.log_prob(w) == lang.length_log_prob(42)
  assert lang.log_prob(lang.encode("a" * 14 + "b" * 13 + "c" * 15)) == -np.inf
  assert languages.get("marked_copy").alphabet == ("0", "1", "#")
  assert languages.get("unmarked_copy_different_alphabets").alphabet == (
      "0", "1", "2", "3")


def test_splits_and_lower_bound():
  # The validation bound is n ln 2 + ln N_L per string, n = content length.
  small = dict(train_batches=4, valid_batches=3, batch_size=5,
               train_min_length=10, train_max_length=20, test_per_length=4,
               test_min_length=10, test_max_length=26)
  splits = data.make_splits("marked_reverse_and_copy", seed=2, **small)
  lang = languages.get("marked_reverse_and_copy")
  assert splits.valid.num_lengths == len(lang.valid_lengths(10, 20)) == 4
  assert [b.length for b in splits.test] == lang.valid_lengths(10, 26)
  for split in (splits.valid, splits.test):
    for batch, bound in zip(split, split.lower_bounds()):
      n = (batch.length - 2) // 3
      np.testing.assert_allclose(
          bound, n * math.log(2) + math.log(split.num_lengths), rtol=1e-12)
      for w in batch.symbols.tolist():
        assert w == _definition("marked_reverse_and_copy", w[:n], 2)


CAPACITY = [("marked_reversal_k3", 7), ("unmarked_reversal_k3", 8),
            ("dyck_k3", 6)]


@pytest.mark.parametrize("name,max_length", CAPACITY)
def test_capacity_fast_scorer_equals_generic_inside(name, max_length):
  lang = languages.get(name)
  for length in range(1, max_length + 1):
    strings = _all_strings(length, lang.vocab_size)
    fast = lang.log_prob_batch(strings)
    generic = lang.language.log_prob_batch(strings)
    np.testing.assert_array_equal(fast == -np.inf, generic == -np.inf)
    finite = generic > -np.inf
    np.testing.assert_allclose(fast[finite], generic[finite], rtol=1e-12)
    want = math.exp(lang.length_log_prob(length)) if finite.any() else 0.0
    assert math.isclose(np.exp(fast).sum(), want, rel_tol=1e-10)


@pytest.mark.parametrize("family", tasks_ncf.CAPACITY_FAMILIES)
def test_capacity_k2_is_the_paper_task(family):
  ours, paper = languages.get(f"{family}_k2"), languages.get(family)
  assert ours.alphabet == paper.alphabet
  rng = np.random.default_rng(3)
  length = paper.valid_lengths(20, 30)[0]
  batch = paper.sample_batch(length, 20, rng)
  np.testing.assert_allclose(ours.log_prob_batch(batch),
                             paper.log_prob_batch(batch), rtol=1e-12)
  assert math.isclose(ours.length_log_prob(length),
                      paper.length_log_prob(length), rel_tol=1e-12)
  # Same grammar and the same sampler: the same strings from one seed.
  np.testing.assert_array_equal(
      ours.sample_batch(length, 5, np.random.default_rng(9)),
      paper.sample_batch(length, 5, np.random.default_rng(9)))


def test_capacity_sampler_matches_distribution():
  lang = languages.get("dyck_k3")
  length, num = 6, 20_000
  batch = lang.sample_batch(length, num, np.random.default_rng(8))
  seen, counts = np.unique(batch, axis=0, return_counts=True)
  probs = np.exp(lang.log_prob_batch(seen) - lang.length_log_prob(length))
  assert np.all(probs > 0)
  big = num * probs >= 5
  obs = np.append(counts[big], num - counts[big].sum())
  exp = np.append(num * probs[big], num * (1 - probs[big].sum()))
  assert stats.chisquare(obs, exp).pvalue > 1e-4


def test_large_alphabets():
  lang = languages.get("dyck_k200")
  assert lang.vocab_size == 400 and lang.alphabet[:4] == ("(", ")", "[", "]")
  assert lang.alphabet[8:10] == ("((", "))")
  rng = np.random.default_rng(0)
  batch = lang.sample_batch(40, 3, rng)
  logp = lang.log_prob_batch(batch)
  assert np.all(np.isfinite(logp))
  # Independently of the grammar: id 2k opens bracket type k, 2k + 1 closes
  # it, and every sampled string is balanced and properly nested.
  for row in batch:
    stack = []
    for w in row:
      if w % 2 == 0:
        stack.append(w)
      else:
        assert stack and stack.pop() == w - 1, row
    assert not stack, row
  bad = batch.copy()
  bad[:, -1] = (bad[:, -1] + 2) % 400  # closes with another type
  assert np.all(lang.log_prob_batch(bad) == -np.inf)
  marked = languages.get("marked_reversal_k200")
  assert marked.vocab_size == 201 and marked.alphabet[-1] == "#"
  w = marked.sample(41, rng)
  assert math.isclose(marked.log_prob(w) - marked.length_log_prob(41),
                      -20 * math.log(200), rel_tol=1e-12)


@pytest.mark.parametrize("name,message", [
    ("dyck_k1", "alphabet size must be >= 2 (got 1)"),
    ("marked_reversal_k0", "alphabet size must be >= 2 (got 0)"),
    ("unmarked_copy_k1", "alphabet size must be >= 2 (got 1)"),
    ("count_3_k4", "count_3 has no alphabet size"),
    ("copy", "valid tasks are: marked_reversal"),
])
def test_bad_task_names_give_one_line_errors(name, message):
  with pytest.raises(ValueError) as info:
    languages.get(name)
  assert message in str(info.value) and "\n" not in str(info.value)


def test_bad_parameters_give_one_line_errors():
  for call in (lambda: tasks_ncf.UniformTask("x", "marked_copy", 1),
               lambda: tasks_ncf.dyck_grammar(1),
               lambda: tasks_ncf.marked_reversal_grammar(-3)):
    with pytest.raises(ValueError, match="alphabet size must be >= 2"):
      call()
  lang = languages.get("marked_copy")
  with pytest.raises(ValueError, match="no string of length 40"):
    lang.sample(40, np.random.default_rng(0))
  with pytest.raises(ValueError, match="outside the alphabet"):
    lang.log_prob_batch(np.array([[0, 3, 0]]))
  assert lang.log_prob(lang.encode("0#1")) == -np.inf
  assert lang.log_prob(lang.encode("###")) == -np.inf  # # is not content
  with pytest.raises(ValueError, match="not context-free"):
    lang.normal_grammar  # pylint: disable=pointless-statement


def test_registry():
  assert set(tasks_ncf.TASKS) <= set(languages.ALL_TASKS)
  assert languages.ALL_TASKS[:5] == languages.TASKS
  assert all(tasks_ncf.is_task(t) for t in tasks_ncf.TASKS)
  assert not tasks_ncf.is_task("dyck") and not tasks_ncf.is_task("foo_k3")
  assert "dyck_k40" in languages.ALL_TASKS and "dyck_k7" not in (
      languages.ALL_TASKS)
  assert languages.get("dyck_k7").vocab_size == 14

