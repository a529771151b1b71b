"""Tests for nsrnn_jax.pcfg: transforms, length table, sampler, inside.

Oracles are untuned: a memoised sum over all derivations of the n-ary grammar
(written independently of the binarised chart), exact toy-grammar values and
a chi-square test of the sampler.
"""

import functools
import itertools
import math
import sys

import numpy as np
import pytest
from scipy import stats

from nsrnn_jax import languages
from nsrnn_jax import pcfg


def naive_inside(grammar, symbol, w):
  """Sum over all derivations of `symbol` =>* w, for n-ary rules with eps.

  Direct recursion over (symbol sequence, substring); needs a grammar without
  cycles X =>+ X (true for every grammar used here).
  """
  w = tuple(int(s) for s in w)
  # Recursion depth grows with |w| times the rule length.
  sys.setrecursionlimit(max(sys.getrecursionlimit(), 20_000))
  min_len = {nt: math.inf for nt in grammar.nonterminals}
  for _ in range(len(min_len) + 1):
    for r in grammar.rules:
      total = sum(1 if pcfg.is_terminal(s) else min_len[s] for s in r.rhs)
      min_len[r.lhs] = min(min_len[r.lhs], total)

  def seq_min(seq):
    return sum(1 if pcfg.is_terminal(s) else min_len[s] for s in seq)

  @functools.lru_cache(maxsize=None)
  def g(x, i, j):
    return sum(r.prob * f(r.rhs, i, j) for r in grammar.rules if r.lhs == x)

  @functools.lru_cache(maxsize=None)
  def f(seq, i, j):
    if not seq:
      return 1.0 if i == j else 0.0
    if seq_min(seq) > j - i:
      return 0.0
    head, rest = seq[0], seq[1:]
    if pcfg.is_terminal(head):
      return f(rest, i + 1, j) if i < j and w[i] == head else 0.0
    rest_min = seq_min(rest)
    return sum(g(head, i, k) * f(rest, k, j)
               for k in range(i + min_len[head], j - rest_min + 1))

  return g(symbol, 0, len(w))


TOY_A = pcfg.PCFG("S", [("S", (0,), 1.0)], num_terminals=1)
TOY_SS = pcfg.PCFG("S", [("S", ("S", "S"), 0.5), ("S", (0,), 0.5)],
                   num_terminals=1)


def test_toy_single_terminal():
  table = pcfg.CompiledPCFG(TOY_A).length_table(2)
  np.testing.assert_array_equal(table[0], [0.0, 1.0, 0.0])
  assert pcfg.CompiledPCFG(TOY_A).log_prob([0]) == 0.0
  assert pcfg.CompiledPCFG(TOY_A).log_prob([0, 0]) == -math.inf


def test_toy_binary_grammar():
  compiled = pcfg.CompiledPCFG(TOY_SS)
  table = compiled.length_table(3)
  # The table is kept in log space: exact to a few ulps.
  assert math.isclose(table[0, 1], 0.5, rel_tol=1e-15)
  assert math.isclose(table[0, 2], 0.125, rel_tol=1e-15)
  assert math.isclose(table[0, 3], 2 * 0.5 * 0.5**4, rel_tol=1e-15)
  assert math.isclose(math.exp(compiled.log_prob([0, 0, 0])),
                      2 * 0.5 * 0.5**4, rel_tol=1e-14)


def test_rules_renormalised_per_lhs():
  g = pcfg.PCFG("S", [("S", (0, "S"), 3.0), ("S", (0,), 1.0)], 1)
  assert [r.prob for r in g.rules] == [0.75, 0.25]


def test_bad_grammars_raise():
  with pytest.raises(ValueError, match="outside the alphabet"):
    pcfg.PCFG("S", [("S", (3,), 1.0)], num_terminals=2)
  with pytest.raises(ValueError, match="has no rules"):
    pcfg.PCFG("S", [("S", ("X",), 1.0)], num_terminals=2)
  with pytest.raises(ValueError, match="start symbol"):
    pcfg.PCFG("S", [("X", (0,), 1.0)], num_terminals=2)
  with pytest.raises(ValueError, match="invalid weight"):
    pcfg.PCFG("S", [("S", (0,), -1.0)], num_terminals=2)
  eps = pcfg.PCFG("S", [("S", (0, "S"), 0.5), ("S", (), 0.5)], 1)
  with pytest.raises(ValueError, match="epsilon or unary"):
    pcfg.CompiledPCFG(eps)
  loop = pcfg.PCFG("S", [("S", (0,), 0.3), ("S", ("X", "X"), 0.7),
                         ("X", ("X", "X"), 0.5), ("X", (), 0.5)], 1)
  with pytest.raises(ValueError, match="regenerates"):
    pcfg.remove_epsilon_and_unary_rules(loop)


def test_improbable_long_strings_score_exactly():
  """S -> a S | a over 8 terminals, every rule 1/16: G(w) = 16^-n for each
  of the 8^n strings of length n. At n = 380, G(w)/G(n) = 8^-380 = e^-790
  is below float64's range: one chart scale per length gave -inf (so did
  the hardest CFL's strings from ~520 symbols); a scale per span is exact."""
  g = pcfg.CompiledPCFG(pcfg.PCFG(
      "S", [("S", (a, "S"), 1.0) for a in range(8)]
      + [("S", (a,), 1.0) for a in range(8)], 8))
  w = np.random.default_rng(0).integers(0, 8, (2, 380))
  np.testing.assert_allclose(g.log_prob_batch(w), 380 * math.log(1 / 16),
                             rtol=1e-13)
  # A string outside the language still scores -inf (here: a terminal id
  # the rules cannot end with, from a grammar whose last symbol must be 0).
  ends_in_0 = pcfg.CompiledPCFG(pcfg.PCFG(
      "S", [("S", (a, "S"), 1.0) for a in range(8)] + [("S", (0,), 1.0)], 8))
  assert ends_in_0.log_prob(np.full(380, 1)) == -math.inf
  assert math.isclose(ends_in_0.log_prob(np.r_[np.full(379, 1), 0]),
                      380 * math.log(1 / 9), rel_tol=1e-13)


@pytest.mark.parametrize("start, rules, num_terminals, match", [
    # A float or str alphabet size: 2.5 built a grammar of 2 terminals.
    ("S", [("S", (0,), 1.0)], 2.5, "num_terminals must be an integer"),
    ("S", [("S", (0,), 1.0)], "2", "num_terminals must be an integer"),
    (0, [("S", (0,), 1.0)], 2, "start symbol must be a str"),
    ("S", None, 2, "rules must be a sequence"),
    ("S", [("S", (0,))], 2, r"is not a Rule or an \(lhs, rhs, weight\)"),
    # A str right-hand side was read as one nonterminal per character.
    ("S", [("S", "ab", 1.0)], 2, "must be a sequence of symbols"),
    ("S", [("S", 0, 1.0)], 2, "must be a sequence of symbols"),
    # True was terminal 1.
    ("S", [("S", (True,), 1.0)], 2, "bad symbol True"),
    ("S", [("S", (0,), "x")], 2, "weight that is not a number"),
    ("S", [("S", (0,), True)], 2, "weight that is not a number"),
])
def test_malformed_definitions_raise_at_construction(start, rules,
                                                     num_terminals, match):
  with pytest.raises(ValueError, match=match):
    pcfg.PCFG(start, rules, num_terminals)


def test_bad_inputs_raise():
  compiled = pcfg.CompiledPCFG(TOY_SS)
  with pytest.raises(ValueError, match="outside the alphabet"):
    compiled.log_prob_batch(np.array([[0, 1]]))
  with pytest.raises(ValueError, match="outside the alphabet"):
    compiled.log_prob_batch(np.array([[-1, 0]]))
  with pytest.raises(ValueError, match=r"\[B, N\]"):
    compiled.log_prob_batch(np.array([0, 0]))
  with pytest.raises(ValueError, match="length must be >= 1"):
    compiled.sample(0, np.random.default_rng(0))
  with pytest.raises(ValueError, match="min_length"):
    compiled.valid_lengths(5, 3)
  with pytest.raises(ValueError, match=">= 0"):
    compiled.valid_lengths(-1, 3)
  even = pcfg.CompiledPCFG(pcfg.PCFG("S", [("S", (0, "S", 0), 0.5),
                                           ("S", (0, 0), 0.5)], 1))
  with pytest.raises(ValueError, match="no string of length 3"):
    even.sample(3, np.random.default_rng(0))


# A small ambiguous grammar with eps and unary rules at and below the start.
MIXED = pcfg.PCFG("S", [
    ("S", ("S", "A"), 0.3), ("S", ("A",), 0.3), ("S", (1, "B", 1), 0.2),
    ("S", (), 0.2), ("A", (0,), 0.5), ("A", ("A", 0, "A"), 0.2),
    ("A", ("C",), 0.3), ("C", (1, "B"), 0.6), ("C", (0, "C"), 0.4),
    ("B", (1, "B"), 0.4), ("B", (), 0.6)], 2)


def _all_strings(length, vocab):
  return np.array(list(itertools.product(range(vocab), repeat=length)),
                  dtype=np.int64).reshape(-1, length)


@pytest.mark.parametrize("preserve_start", [False, True])
def test_inside_matches_naive_sum_over_derivations(preserve_start):
  normal = pcfg.remove_epsilon_and_unary_rules(MIXED,
                                               preserve_start=preserve_start)
  assert not normal.has_epsilon_or_unary_rules()
  compiled = pcfg.CompiledPCFG(normal)
  for length in range(1, 7):
    strings = _all_strings(length, 2)
    got = np.exp(compiled.log_prob_batch(strings))
    want_normal = [naive_inside(normal, normal.start, w) for w in strings]
    np.testing.assert_allclose(got, want_normal, rtol=1e-12, atol=0)
    # Length table = the sum over all strings of that length.
    assert math.isclose(compiled.length_prob(length), sum(want_normal),
                        rel_tol=1e-12)
    if preserve_start:
      # Distribution-preserving: the original probability, renormalised over
      # non-empty strings.
      p_eps = naive_inside(MIXED, "S", ())
      want = [naive_inside(MIXED, "S", w) / (1 - p_eps) for w in strings]
      np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


def test_authors_removal_conditions_top_level():
  # Authors' behaviour: removing S -> eps creates the top-level variant
  # S -> A (inner S empty), and removing the unary S -> A rules at the start
  # drops it too, so the top level is conditioned on "S -> S A with a
  # non-empty S, or S -> 1 B 1" (mass 0.3 * (1 - 0.2) + 0.2 = 0.44).
  normal = pcfg.remove_epsilon_and_unary_rules(MIXED)
  compiled = pcfg.CompiledPCFG(normal)
  for length in range(1, 6):
    strings = _all_strings(length, 2)
    got = np.exp(compiled.log_prob_batch(strings))
    want = []
    for w in strings:
      w = tuple(int(s) for s in w)
      total = sum(0.3 * naive_inside(MIXED, "S", w[:k])
                  * naive_inside(MIXED, "A", w[k:]) for k in range(1, length))
      if length >= 2 and w[0] == 1 and w[-1] == 1:
        total += 0.2 * naive_inside(MIXED, "B", w[1:-1])
      want.append(total / 0.44)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


def test_sampler_chi_square():
  normal = pcfg.remove_epsilon_and_unary_rules(MIXED)
  compiled = pcfg.CompiledPCFG(normal)
  length, num = 5, 20_000
  rng = np.random.default_rng(123)
  counts = {}
  for _ in range(num):
    w = compiled.sample(length, rng)
    assert len(w) == length
    counts[w] = counts.get(w, 0) + 1
  strings = _all_strings(length, 2)
  probs = np.exp(compiled.log_prob_batch(strings)) / compiled.length_prob(
      length)
  assert math.isclose(probs.sum(), 1.0, rel_tol=1e-12)
  observed = np.array([counts.pop(tuple(w), 0) for w in strings])
  assert not counts, "sampled strings outside the support"
  keep = probs > 0
  assert np.all(observed[~keep] == 0)
  result = stats.chisquare(observed[keep], num * probs[keep])
  assert result.pvalue > 1e-4
  # Total variation against a bound from the sample size: E[TV] <=
  # 0.5 * sum sqrt(p (1-p) / N); allow 3x.
  tv = 0.5 * np.abs(observed / num - probs).sum()
  assert tv < 3 * 0.5 * np.sqrt(probs * (1 - probs) / num).sum()


def test_sampler_is_deterministic_in_seed():
  compiled = pcfg.CompiledPCFG(pcfg.remove_epsilon_and_unary_rules(MIXED))
  a = [compiled.sample(9, np.random.default_rng(5)) for _ in range(3)]
  b = [compiled.sample(9, np.random.default_rng(5)) for _ in range(3)]
  assert a == b


def test_tiny_probabilities_do_not_underflow():
  # G(w) ~ 1e-250: the per-symbol scaling keeps the chart representable.
  g = pcfg.PCFG("S", [("S", (0, "S"), 0.001), ("S", (1, "S"), 0.999),
                      ("S", (0,), 1.0)], 2)
  compiled = pcfg.CompiledPCFG(pcfg.remove_epsilon_and_unary_rules(g))
  w = [0] * 84
  want = 83 * math.log(0.001 / 2.0) + math.log(0.5)
  # Weights are renormalised: S -> 0S /.0005, 1S /.4995, 0 /.5.
  assert math.isclose(compiled.log_prob(w), want, rel_tol=1e-12)


def test_log_inside_of_wildcards_is_the_length_weight():
  # All-ones rows sum over every string of length n: ln G(n); one-hot rows
  # are ln G(w); a prefix plus wildcards is the sum over its completions.
  lang = languages.get("dyck")
  g = lang.compiled
  v = g.num_terminals
  for n in lang.valid_lengths(2, 8):
    np.testing.assert_allclose(g.log_inside(np.ones((1, n, v))),
                               [math.log(g.length_prob(n))], rtol=1e-12)
  n = lang.valid_lengths(2, 8)[0]
  strings = np.array(list(itertools.product(range(v), repeat=n)))
  weights = np.ones((1, n, v))
  weights[0, 0] = np.eye(v)[strings[0, 0]]
  want = np.log(np.sum(np.exp(g.log_prob_batch(
      strings[strings[:, 0] == strings[0, 0]]))))
  np.testing.assert_allclose(g.log_inside(weights), [want], rtol=1e-12)
