"""Tests for nsrnn_jax.languages: the five tasks against brute-force oracles."""

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from nsrnn_jax import languages
from nsrnn_jax import pcfg

try:  # tests/ as a package (rootdir on sys.path) or as a plain directory.
  from tests import pcfg_test  # pylint: disable=g-import-not-at-top
except ImportError:
  import pcfg_test  # pylint: disable=g-import-not-at-top

# Small lengths at which every string is enumerated (V**l strings).
BRUTE_LENGTHS = {
    "marked_reversal": range(1, 10),
    "unmarked_reversal": range(1, 11),
    "padded_reversal": range(1, 11),
    "dyck": range(1, 9),
    "hardest_cfl": range(1, 7),
}


def _all_strings(length, vocab):
  return np.array(list(itertools.product(range(vocab), repeat=length)),
                  dtype=np.int64).reshape(-1, length)


@pytest.mark.parametrize("task", languages.TASKS)
def test_length_table_is_sum_over_all_strings(task):
  lang = languages.get(task)
  for length in BRUTE_LENGTHS[task]:
    strings = _all_strings(length, lang.vocab_size)
    total = sum(np.exp(lang.log_prob_batch(chunk)).sum()
                for chunk in np.array_split(strings, max(1, len(strings)
                                                         // 4000)))
    want = math.exp(lang.length_log_prob(length)) if total > 0 else 0.0
    assert math.isclose(total, want, rel_tol=1e-10, abs_tol=1e-300), length


@pytest.mark.parametrize("task", languages.TASKS)
def test_inside_matches_naive_derivation_sum(task):
  lang = languages.get(task)
  rng = np.random.default_rng(7)
  lengths = lang.valid_lengths(1, 9)[:4]
  for length in lengths:
    # Sampled strings (in the language) and random strings (mostly not).
    strings = [lang.sample(length, rng) for _ in range(3)]
    strings += [tuple(rng.integers(lang.vocab_size, size=length))
                for _ in range(2)]
    for w in strings:
      want = pcfg_test.naive_inside(lang.normal_grammar,
                                    lang.normal_grammar.start, w)
      got = lang.log_prob(w)
      if want == 0:
        assert got == -math.inf
      else:
        assert math.isclose(got, math.log(want), rel_tol=1e-12)


@pytest.mark.parametrize("task", languages.TASKS)
def test_preserving_variant_matches_original_grammar(task):
  lang = languages.get(task, preserve_start=True)
  p_eps = pcfg_test.naive_inside(lang.grammar, lang.grammar.start, ())
  rng = np.random.default_rng(3)
  for length in lang.valid_lengths(1, 8)[:3]:
    for _ in range(3):
      w = lang.sample(length, rng)
      want = pcfg_test.naive_inside(lang.grammar, lang.grammar.start, w)
      assert math.isclose(math.exp(lang.log_prob(w)), want / (1 - p_eps),
                          rel_tol=1e-12)


def test_dyck_transformed_rules_match_reference():
  rules = {(r.lhs, r.rhs): r.prob for r in languages.get("dyck").normal_grammar
           .rules}
  expected = {("S", ("S", "T")): 0.5, ("S", ("T", "T")): 0.5,
              ("T", (0, "S", 1)): 0.24375, ("T", (0, "T", 1)): 0.24375,
              ("T", (0, 1)): 0.0125, ("T", (2, "S", 3)): 0.24375,
              ("T", (2, "T", 3)): 0.24375, ("T", (2, 3)): 0.0125}
  assert rules.keys() == expected.keys()
  for key, prob in expected.items():
    assert math.isclose(rules[key], prob, rel_tol=1e-12), key


def test_hardest_cfl_rule_counts_match_reference():
  grammar = languages.hardest_cfl_grammar()
  eps_free = pcfg.remove_epsilon_and_unary_rules(grammar, remove_unary=False)
  assert len(eps_free.rules) == 39
  assert len(languages.get("hardest_cfl").normal_grammar.rules) == 58


def _is_single_group(w):
  depth = 0
  for i, s in enumerate(w):
    depth += 1 if s in (0, 2) else -1
    if depth == 0 and i < len(w) - 1:
      return False
  return True


def test_dyck_never_single_top_level_group():
  rng = np.random.default_rng(0)
  authors = languages.get("dyck")
  samples = [authors.sample(40, rng) for _ in range(300)]
  assert not any(_is_single_group(w) for w in samples)
  # The distribution-preserving variant gives about half single groups.
  preserving = languages.get("dyck", preserve_start=True)
  singles = sum(_is_single_group(preserving.sample(40, rng))
                for _ in range(300))
  # Exact fraction of single groups at length 40 in the original grammar:
  # the authors' G(40) is P(top rule S -> S T, length 40) / (1/2).
  p_single = 1 - 0.5 * math.exp(authors.length_log_prob(40)
                                - preserving.length_log_prob(40))
  assert 0.5 < p_single < 0.95
  assert abs(singles - 300 * p_single) < 4 * math.sqrt(
      300 * p_single * (1 - p_single))
  w = authors.encode("(" * 20 + ")" * 20)
  assert authors.log_prob(w) == -math.inf
  assert preserving.log_prob(w) > -math.inf


def test_padded_reversal_top_level_never_pure_padding():
  rng = np.random.default_rng(1)
  lang = languages.get("padded_reversal")
  w = (0,) * 12
  # Only derivations starting with S -> 0 S 0 remain: ln G(w) is finite but
  # smaller than in the preserving grammar, which adds pure padding.
  preserving = languages.get("padded_reversal", preserve_start=True)
  assert lang.log_prob(w) < preserving.log_prob(w)
  for _ in range(50):
    s = lang.sample(12, rng)
    assert s == s[::-1]


def test_marked_reversal_closed_form():
  lang = languages.get("marked_reversal")
  rng = np.random.default_rng(2)
  f = pcfg.mean_to_continue_prob(60)
  for length in (1, 3, 9, 41, 99):
    want_len = (1 - f) * f ** ((length - 1) // 2)
    assert math.isclose(lang.length_log_prob(length), math.log(want_len),
                        rel_tol=1e-12)
    batch = lang.sample_batch(length, 5, rng)
    assert np.all(batch[:, length // 2] == 2)
    np.testing.assert_array_equal(batch, batch[:, ::-1])
    cond = lang.log_prob_batch(batch) - lang.length_log_prob(length)
    np.testing.assert_allclose(cond, -(length - 1) / 2 * math.log(2),
                               rtol=1e-12)
  assert lang.length_log_prob(40) == -math.inf


def test_length_table_is_exact_beyond_float64_range():
  """T[S, 2m] = 0.999 * 0.001^(m-1) for S -> a S b / 0.001 | a b / 0.999:
  below 1e-308 from m = 104 on. A linear-space table said no string of
  that length existed (Dyck's T[S, l] leaves float64's range at l ≈ 3,400,
  which the paper's lengths never reach)."""
  g = pcfg.CompiledPCFG(pcfg.PCFG("S", [
      ("S", ("A", "X"), 0.001), ("X", ("S", "B"), 1.0),
      ("S", ("A", "B"), 0.999), ("A", (0,), 1.0), ("B", (1,), 1.0)], 2))
  for m in (1, 2, 50, 104, 200):
    want = math.log(0.999) + (m - 1) * math.log(0.001)
    assert math.isclose(g.length_log_prob(2 * m), want, rel_tol=1e-12)
  assert g.length_log_prob(399) == -math.inf
  assert g.length_prob(400) == 0.0  # underflows; the log is exact
  assert g.valid_lengths(395, 400) == [396, 398, 400]
  assert g.sample(400, 0) == (0,) * 200 + (1,) * 200
  # The one string of its length: G(w) = T[S, 400] (the inside chart's
  # scale comes from the length table; it was -inf).
  assert math.isclose(g.log_prob((0,) * 200 + (1,) * 200),
                      g.length_log_prob(400), rel_tol=1e-12)
  # Dyck past its float64 range: every even length is there.
  assert languages.get("dyck").valid_lengths(3591, 3600) == list(
      range(3592, 3601, 2))


@pytest.mark.parametrize("task,lo,hi,count", [
    ("marked_reversal", 40, 80, 20), ("unmarked_reversal", 40, 80, 21),
    ("padded_reversal", 40, 80, 41), ("dyck", 40, 80, 21),
    ("hardest_cfl", 40, 80, 41), ("marked_reversal", 40, 100, 30),
    ("unmarked_reversal", 40, 100, 31), ("padded_reversal", 40, 100, 61),
    ("dyck", 40, 100, 31), ("hardest_cfl", 40, 100, 61)])
def test_valid_length_counts(task, lo, hi, count):
  lengths = languages.get(task).valid_lengths(lo, hi)
  assert len(lengths) == count
  assert lengths == sorted(lengths)
  if task == "marked_reversal":
    assert all(l % 2 == 1 for l in lengths)
  if task in ("unmarked_reversal", "dyck"):
    assert all(l % 2 == 0 for l in lengths)


@pytest.mark.parametrize("task,length", [("dyck", 8), ("padded_reversal", 7),
                                         ("hardest_cfl", 9)])
def test_sampler_matches_conditional_distribution(task, length):
  lang = languages.get(task)
  num = 20_000
  rng = np.random.default_rng(11)
  counts = {}
  for _ in range(num):
    w = lang.sample(length, rng)
    counts[w] = counts.get(w, 0) + 1
  seen = np.array(sorted(counts), dtype=np.int64)
  observed = np.array([counts[tuple(w)] for w in seen])
  probs = np.exp(lang.log_prob_batch(seen) - lang.length_log_prob(length))
  assert np.all(probs > 0), "sampled a string outside the language"
  # Chi-square over cells with expected count >= 5; everything else
  # (including never-sampled strings, mass 1 - sum(probs)) pooled.
  big = num * probs >= 5
  rest = 1.0 - probs[big].sum()
  assert rest > -1e-12
  obs, exp = observed[big], num * probs[big]
  if num * rest > 1e-6:  # no pooled cell when every string is a big cell
    obs = np.append(obs, num - observed[big].sum())
    exp = np.append(exp, num * rest)
  else:
    assert observed[big].sum() == num
  assert stats.chisquare(obs, exp * (num / exp.sum())).pvalue > 1e-4
  # Total variation on the seen strings plus the unseen mass, against a
  # bound from the sample size (E[TV] <= 0.5 sum sqrt(p (1-p) / N); 3x).
  tv = 0.5 * (np.abs(observed / num - probs).sum() + (1 - probs.sum()))
  assert tv < 3 * 0.5 * np.sqrt(probs * (1 - probs) / num).sum() + 0.01


def test_alphabets_and_ids():
  assert languages.get("marked_reversal").alphabet == ("0", "1", "#")
  assert languages.get("unmarked_reversal").alphabet == ("0", "1")
  assert languages.get("padded_reversal").alphabet == ("0", "1")
  assert languages.get("dyck").alphabet == ("(", ")", "[", "]")
  assert languages.get("hardest_cfl").alphabet == ("(", ")", "[", "]", ",",
                                                   ";", "$")
  dyck = languages.get("dyck")
  assert dyck.encode("([])") == (0, 2, 3, 1)
  assert dyck.decode((0, 2, 3, 1)) == "([])"
  assert languages.TASKS == ("marked_reversal", "unmarked_reversal",
                             "padded_reversal", "dyck", "hardest_cfl")


def test_text_forms_encode_alike_and_log_prob_reads_text():
  dyck = languages.get("dyck")
  ids = (0, 1, 2, 3)
  assert dyck.encode("()[]") == dyck.encode("( ) [ ]") == ids
  assert dyck.log_prob("()[]") == dyck.log_prob(ids) > -np.inf
  assert dyck.log_prob("( ] [ )") == -np.inf
  # Symbols longer than a character: text is whitespace-separated both ways.
  k = languages.get("marked_reversal_k200")
  w = k.encode("12 7 # 7 12")
  assert [k.alphabet[i] for i in w] == ["12", "7", "#", "7", "12"]
  assert k.decode(w) == "12 7 # 7 12" and k.encode(k.decode(w)) == w
  assert k.log_prob("12 7 # 7 12") == k.log_prob(w) > -np.inf
  assert k.log_prob("12 7 # 7 11") == -np.inf
  with pytest.raises(ValueError) as e:
    k.encode("12 x")
  assert "['x']" in str(e.value) and "201 symbols" in str(e.value)
  assert len(str(e.value)) < 200


def test_errors():
  with pytest.raises(ValueError, match="valid tasks are: marked_reversal"):
    languages.get("dyk")
  dyck = languages.get("dyck")
  with pytest.raises(ValueError, match="outside the dyck alphabet"):
    dyck.log_prob([0, 4])
  with pytest.raises(ValueError, match="outside the dyck alphabet"):
    dyck.log_prob([-1, 1])
  with pytest.raises(ValueError, match="outside the alphabet"):
    dyck.log_prob_batch(np.array([[0, 7]]))
  with pytest.raises(ValueError, match="min_length"):
    dyck.valid_lengths(80, 40)
  with pytest.raises(ValueError, match=">= 0"):
    dyck.valid_lengths(-2, 40)
  with pytest.raises(ValueError, match="length must be >= 1"):
    dyck.sample(-3, np.random.default_rng(0))
  with pytest.raises(ValueError, match="no string of length 41"):
    dyck.sample(41, np.random.default_rng(0))
  with pytest.raises(ValueError, match="not in the dyck alphabet"):
    dyck.encode("(x)")


@pytest.mark.parametrize("task,length", [("hardest_cfl", 45),
                                         ("padded_reversal", 41),
                                         ("dyck", 40)])
def test_inside_long_strings_match_naive_sum(task, length):
  # Long enough that the chart's bounded-split and anchored-span shortcuts
  # (and the per-symbol scaling) all take effect.
  lang = languages.get(task)
  rng = np.random.default_rng(4)
  batch = lang.sample_batch(length, 2, rng)
  got = lang.log_prob_batch(batch)
  for w, value in zip(batch, got):
    want = pcfg_test.naive_inside(lang.normal_grammar,
                                  lang.normal_grammar.start, w)
    assert math.isclose(value, math.log(want), rel_tol=1e-11)
  # A single swapped symbol usually leaves the language; both must agree.
  bad = batch[0].copy()
  bad[[0, -1]] = bad[[-1, 0]]
  want = pcfg_test.naive_inside(lang.normal_grammar,
                                lang.normal_grammar.start, bad)
  if want == 0:
    assert lang.log_prob(bad) == -math.inf
  else:
    assert math.isclose(lang.log_prob(bad), math.log(want), rel_tol=1e-11)


@pytest.mark.parametrize("task", ["dyck", "marked_copy"])
def test_samplers_take_a_seed_and_refuse_what_is_no_rng(task):
  lang = languages.get(task)
  n = 6 if task == "dyck" else 5
  # A seed draws what a Generator of that seed draws (one stream a batch).
  assert lang.sample(n, 3) == lang.sample(n, np.random.default_rng(3))
  np.testing.assert_array_equal(lang.sample_batch(n, 4, 7),
                                lang.sample_batch(n, 4,
                                                  np.random.default_rng(7)))
  for rng in (None, -1, 1.5, True, "0"):
    with pytest.raises(TypeError, match="rng must be a numpy Generator"):
      lang.sample(n, rng)
  for size in (2.5, -1, True):
    with pytest.raises(ValueError, match="batch_size must be an integer"):
      lang.sample_batch(n, size, 0)


def test_a_task_name_that_is_no_string_is_a_type_error():
  for bad in (None, 5, ["dyck"]):
    with pytest.raises(TypeError, match="task name must be a string"):
      languages.get(bad)
  with pytest.raises(TypeError, match="preserve_start must be a bool"):
    languages.get("dyck", preserve_start="no")  # a truthy string
