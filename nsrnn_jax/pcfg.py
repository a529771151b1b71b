"""PCFGs: normal forms, length tables, exact sampling and inside probabilities.

This module holds everything about PCFGs that the formal-language tasks need
(Appendix C of DuSell & Chiang 2020):

* `PCFG`: a grammar with n-ary rules whose right-hand sides mix terminals
  (`int` ids, the symbol ids of the task's alphabet) and nonterminals (`str`
  names). Rule probabilities are renormalised per left-hand side.
* `remove_epsilon_and_unary_rules`: the authors' transformation (see below).
* `CompiledPCFG`: the transformed grammar binarised into dotted items, with
  the length table T[X, l] (Algorithm 1), exact length-conditioned sampling
  (Algorithm 2) and the exact inside probability G(w) summed over all
  derivations, vectorised over a batch of strings of one length.

Epsilon/unary removal, authors' behaviour (the default)
-------------------------------------------------------
The authors' code repeatedly takes the *first* epsilon rule in rule order
(then, once none is left, the first unary rule) `X -> beta / p`, deletes it,
replaces every rule that has `k` occurrences of `X` on its right-hand side by
its `2**k` variants (each occurrence kept, factor `1 - p`, or replaced by
`beta`, factor `p`), and divides every rule with left-hand side `X` by
`1 - p`. Duplicate rules are kept as separate rules. This preserves the string
distribution of every nonterminal *occurrence*, but the start symbol never
occurs on a right-hand side, so removing a rule whose left-hand side is the
start symbol conditions the top-level distribution on not using that rule:

* Dyck: after removing `S -> T` the grammar is `S -> S T / 1/2`,
  `S -> T T / 1/2`, so a sampled string is never a single top-level bracket
  pair.
* Padded reversal: the top level can no longer be pure padding.
* Unmarked reversal loses only the empty string; marked reversal and the
  hardest CFL are unchanged.

The paper's numbers were produced with this behaviour (sampling *and* the
lower bound use the transformed grammar), so it is the default.
`preserve_start=True` gives the distribution-preserving variant: a fresh start
symbol `S* -> S` is protected from removal and, at the end, its unary rules are
expanded into the (unary-free) rules of their targets, so that G(w) equals the
original grammar's probability of every non-empty string w, renormalised over
non-empty strings.

Binarisation
------------
Every rule `X -> s_1 ... s_k` (k >= 2) becomes `X -> N(s_1) D[s_2..s_k] / p`
with shared suffix items `D[s_i..s_k] -> N(s_i) D[s_{i+1}..s_k] / 1` and
`N(t)` a preterminal `N(t) -> t / 1` for a terminal t. Suffix items are shared
between rules, and identical binary rules are merged by adding their
probabilities; both keep the distribution over strings exactly the same, and
Algorithm 2 on the binarised grammar samples exactly the same string
distribution as on the n-ary grammar (the choice of a composition factorises
into a sequence of binary splits).

Inside chart: spans are processed by length, vectorised over the strings of
a batch, over start positions and over rules (gathers of child chart rows,
one multiply-and-sum over split points, one BLAS matmul to scatter into
left-hand sides). Two exact savings: a rule whose child derives at most
`_BOUNDED_SPAN` symbols is evaluated only on those few split points, and
suffix-anchored symbols (a start symbol that never occurs on a right-hand
side, and the dotted items below it on the right spine) are evaluated only on
the span that ends at the end of the string. Chunks of strings run on up to
two threads (NumPy releases the GIL).

Numerics: the length table is in float64 log space (ln T[X, l]; T leaves
float64's range for long strings, e.g. Dyck's beyond l ≈ 3,400). The inside
chart is float64 linear space with a log-scale per span (each span's entries
divided by their largest), so `ln G(w)` is exact however small G(w) is (a
single scale per length underflowed once ln G(w) - ln G(n) < -744, e.g. for
the hardest CFL's strings of ~520 symbols).
"""

from __future__ import annotations

import bisect
import collections.abc
import concurrent.futures
import dataclasses
import itertools
import math
import os
from typing import Hashable, Sequence, Union

import numpy as np

# A right-hand-side symbol: an `int` is a terminal id, a `str` a nonterminal.
Symbol = Union[int, str]

# Removal of epsilon/unary rules must terminate; a grammar like X -> X X | eps
# regenerates its own epsilon rule forever, which this bound turns into an
# error instead of a hang.
_MAX_REMOVALS = 1_000

# Rules whose child can only derive strings of at most this many symbols are
# evaluated over that few split points in the inside chart instead of all.
_BOUNDED_SPAN = 4

# Inside charts are computed for chunks of strings holding about this many
# floats per chart (n * n * chunk * M), to stay within cache-friendly memory.
_CHART_FLOATS = 4_000_000

# Threads for the inside computation over chunks of strings (at most 2 by
# default; NSRNN_INSIDE_THREADS overrides).
_NUM_THREADS = int(os.environ.get("NSRNN_INSIDE_THREADS",
                                  min(2, os.cpu_count() or 1)))


def is_terminal(symbol: Symbol) -> bool:
  """Whether a right-hand-side symbol is a terminal id (an int)."""
  return isinstance(symbol, (int, np.integer))


@dataclasses.dataclass(frozen=True)
class Rule:
  """A weighted production `lhs -> rhs / prob`.

  Attributes:
    lhs: the left-hand-side nonterminal.
    rhs: right-hand side; `int` entries are terminal ids, `str` nonterminals.
      The empty tuple is an epsilon rule.
    prob: the rule probability (after renormalisation per left-hand side).
  """
  lhs: str
  rhs: tuple[Symbol, ...]
  prob: float


class PCFG:
  """A probabilistic context-free grammar with n-ary rules.

  Rule probabilities are renormalised per left-hand side at construction;
  duplicate rules are allowed and kept as separate rules.

  Attributes:
    start: the start nonterminal.
    rules: tuple of `Rule`, in the given order (the order matters for the
      authors' epsilon/unary removal, which always takes the first such rule).
    num_terminals: terminal ids are `0 .. num_terminals - 1`.
    nonterminals: tuple of nonterminal names in order of first appearance
      (start symbol first).
  """

  def __init__(self, start: str, rules: Sequence[tuple[str, Sequence[Symbol],
                                                        float] | Rule],
               num_terminals: int, normalize: bool = True):
    """Builds a grammar.

    Args:
      start: the start nonterminal (must have at least one rule).
      rules: `Rule`s or `(lhs, rhs, weight)` triples; weights must be
        non-negative and finite; zero-weight rules are dropped.
      num_terminals: size of the terminal alphabet.
      normalize: renormalise the weights per left-hand side.

    Raises:
      ValueError: on a malformed rule, a terminal id outside the alphabet, a
        nonterminal without rules, or a start symbol without rules.
    """
    if (isinstance(num_terminals, bool)
        or not isinstance(num_terminals, (int, np.integer))
        or num_terminals < 1):
      raise ValueError(f"num_terminals must be an integer >= 1, got "
                       f"{num_terminals!r}")
    if not isinstance(start, str):
      raise ValueError(f"the start symbol must be a str, got {start!r}")
    if isinstance(rules, (str, bytes)) or not isinstance(
        rules, collections.abc.Iterable):
      raise ValueError("rules must be a sequence of Rules or (lhs, rhs, "
                       f"weight) triples, got {rules!r}")
    parsed = []
    for rule in rules:
      if isinstance(rule, Rule):
        lhs, rhs, weight = rule.lhs, rule.rhs, rule.prob
      elif isinstance(rule, (tuple, list)) and len(rule) == 3:
        lhs, rhs, weight = rule
      else:
        raise ValueError(f"rule {rule!r} is not a Rule or an (lhs, rhs, "
                         "weight) triple")
      if not isinstance(lhs, str):
        raise ValueError(f"rule left-hand side must be a str, got {lhs!r}")
      if isinstance(rhs, (str, bytes)) or not isinstance(
          rhs, collections.abc.Sequence):
        # A str would be read as one nonterminal per character.
        raise ValueError(f"the right-hand side of a rule for {lhs!r} must be "
                         f"a sequence of symbols, got {rhs!r}")
      for s in rhs:
        if isinstance(s, bool):
          raise ValueError(f"bad symbol {s!r} in rule {lhs} -> {rhs}")
      rhs = tuple(int(s) if is_terminal(s) else s for s in rhs)
      for s in rhs:
        if is_terminal(s):
          if not 0 <= s < num_terminals:
            raise ValueError(f"terminal id {s} in rule {lhs} -> {rhs} is "
                             f"outside the alphabet [0, {num_terminals})")
        elif not isinstance(s, str):
          raise ValueError(f"bad symbol {s!r} in rule {lhs} -> {rhs}")
      if isinstance(weight, bool) or not isinstance(
          weight, (int, float, np.integer, np.floating)):
        raise ValueError(f"rule {lhs} -> {rhs} has a weight that is not a "
                         f"number: {weight!r}")
      weight = float(weight)
      if not (weight >= 0 and math.isfinite(weight)):
        raise ValueError(f"rule {lhs} -> {rhs} has invalid weight {weight}")
      if weight > 0:
        parsed.append((lhs, rhs, weight))
    totals = {}
    for lhs, _, weight in parsed:
      totals[lhs] = totals.get(lhs, 0.0) + weight
    if start not in totals:
      raise ValueError(f"start symbol {start!r} has no rules")
    for lhs, rhs, _ in parsed:
      for s in rhs:
        if isinstance(s, str) and s not in totals:
          raise ValueError(f"nonterminal {s!r} (in {lhs} -> {rhs}) has no "
                           "rules")
    self.start = start
    self.num_terminals = int(num_terminals)
    self.rules = tuple(
        Rule(lhs, rhs, weight / totals[lhs] if normalize else weight)
        for lhs, rhs, weight in parsed)
    names = [start]
    for rule in self.rules:
      for s in (rule.lhs,) + rule.rhs:
        if isinstance(s, str) and s not in names:
          names.append(s)
    self.nonterminals = tuple(names)

  def rules_for(self, lhs: str) -> list[Rule]:
    """The rules with left-hand side `lhs`, in order."""
    return [r for r in self.rules if r.lhs == lhs]

  def has_epsilon_or_unary_rules(self) -> bool:
    """Whether any rule is `X -> eps` or `X -> Y` (Y a nonterminal)."""
    return any(_is_epsilon(r.rhs) or _is_unary(r.rhs) for r in self.rules)

  def __repr__(self) -> str:
    lines = [f"PCFG(start={self.start!r}, num_terminals={self.num_terminals})"]
    for r in self.rules:
      rhs = " ".join(str(s) for s in r.rhs) or "eps"
      lines.append(f"  {r.lhs} -> {rhs} / {r.prob:.6g}")
    return "\n".join(lines)


def mean_to_continue_prob(mean: float) -> float:
  """f(mu) = 1 - 1/(mu + 1): continue probability with mean `mu` repeats."""
  if mean < 0:
    raise ValueError(f"mean must be >= 0, got {mean}")
  return 1.0 - 1.0 / (mean + 1.0)


def _is_epsilon(rhs) -> bool:
  return len(rhs) == 0


def _is_unary(rhs) -> bool:
  return len(rhs) == 1 and isinstance(rhs[0], str)


def _remove_rule(rules: list[list], index: int) -> list[list]:
  """One step of the authors' removal: delete rules[index] and compensate."""
  x, beta, p = rules[index]
  new_rules = []
  for i, (lhs, rhs, q) in enumerate(rules):
    if i == index:
      continue
    positions = [j for j, s in enumerate(rhs) if s == x]
    if not positions:
      variants = [(lhs, rhs, q)]
    else:
      variants = []
      # Each occurrence of X is either kept (1 - p) or replaced by beta (p).
      for choice in itertools.product((False, True), repeat=len(positions)):
        new_rhs, weight, chosen = [], q, dict(zip(positions, choice))
        for j, s in enumerate(rhs):
          if j in chosen and chosen[j]:
            new_rhs.extend(beta)
            weight *= p
          else:
            new_rhs.append(s)
            if j in chosen:
              weight *= 1.0 - p
        variants.append((lhs, tuple(new_rhs), weight))
    for lhs_v, rhs_v, w in variants:
      if positions and lhs_v == x and rhs_v == beta:
        # X -> beta came back (e.g. X -> X X | eps): removal cannot finish.
        raise ValueError(f"removing {x} -> {beta or 'eps'} regenerates it "
                         f"(via {lhs} -> {rhs}); the grammar has a "
                         "self-regenerating epsilon/unary cycle")
      if lhs_v == x:
        # X's remaining rules now describe X conditioned on not using the
        # removed rule at its top; p == 1 leaves X with nothing (weight 0).
        w = w / (1.0 - p) if p < 1.0 else 0.0
      if w > 0:
        new_rules.append([lhs_v, rhs_v, w])
  return new_rules


def remove_epsilon_and_unary_rules(grammar: PCFG, *,
                                   preserve_start: bool = False,
                                   remove_unary: bool = True) -> PCFG:
  """Removes epsilon and unary rules as the authors' code does.

  See the module docstring for the exact procedure and its effect at the
  start symbol.

  Args:
    grammar: any PCFG.
    preserve_start: if False (default) reproduce the authors' behaviour,
      which conditions the top-level distribution on not using removed start
      rules. If True, keep the distribution over non-empty strings exactly.
    remove_unary: if False, stop after the epsilon phase (for inspection; the
      result may still have unary rules).

  Returns:
    An equivalent PCFG without epsilon or unary rules (same rule order
    convention: variants replace their rule in place).

  Raises:
    ValueError: if the removal does not terminate (e.g. `X -> X X | eps`) or
      the grammar generates no non-empty string.
  """
  rules = [[r.lhs, r.rhs, r.prob] for r in grammar.rules]
  start = grammar.start
  protected = None
  if preserve_start:
    protected = start + "*"
    while protected in grammar.nonterminals:
      protected += "*"
    rules.insert(0, [protected, (start,), 1.0])
    start = protected
  for predicate in (_is_epsilon, _is_unary) if remove_unary else (
      _is_epsilon,):
    for _ in range(_MAX_REMOVALS):
      index = next((i for i, (lhs, rhs, _) in enumerate(rules)
                    if predicate(rhs) and lhs != protected), None)
      if index is None:
        break
      rules = _remove_rule(rules, index)
    else:
      raise ValueError("epsilon/unary removal did not terminate after "
                       f"{_MAX_REMOVALS} steps (self-regenerating rules?)")
  if protected is not None:
    # Expand the protected start's unary rules S* -> Y / q into S* -> beta /
    # q * r for each (now unary-free) rule Y -> beta / r; drop S* -> eps.
    others = [r for r in rules if r[0] != protected]
    top = []
    for lhs, rhs, q in rules:
      if lhs != protected or _is_epsilon(rhs):
        continue
      if _is_unary(rhs) and remove_unary:
        top.extend([protected, r_rhs, q * r_p]
                   for r_lhs, r_rhs, r_p in others if r_lhs == rhs[0])
      else:
        top.append([protected, rhs, q])
    rules = top + others
  if not any(lhs == start for lhs, _, _ in rules):
    raise ValueError("grammar generates no non-empty string")
  # Nonterminals that lost all their rules (they only derived eps) can still
  # sit in zero-weight variants; those were dropped, so every RHS nonterminal
  # has rules. Keep the probabilities as computed (they are already normalised
  # per LHS up to rounding) and renormalise for exactness of the sums.
  return PCFG(start, [tuple(r) for r in rules], grammar.num_terminals)


def _rhs_key(s: Symbol) -> Hashable:
  return ("t", s) if is_terminal(s) else s


def check_symbols_BxN(symbols_BxN, num_terminals: int) -> np.ndarray:
  """Validates a [B, N] array of symbol ids in [0, num_terminals), N >= 1.

  Returns it as int64; one-line ValueErrors otherwise. Shared by every
  task's batch scorer (`CompiledPCFG`, `tasks_ncf.UniformTask`).
  """
  arr = np.asarray(symbols_BxN)
  if arr.ndim != 2:
    raise ValueError(f"expected a [B, N] array of symbol ids, got shape "
                     f"{arr.shape}")
  if arr.shape[1] < 1:
    raise ValueError("strings must have length >= 1")
  if arr.size and not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"symbol ids must be integers, got dtype {arr.dtype}")
  if arr.size and (arr.min() < 0 or arr.max() >= num_terminals):
    bad = arr[(arr < 0) | (arr >= num_terminals)][0]
    raise ValueError(f"symbol id {bad} is outside the alphabet "
                     f"[0, {num_terminals})")
  return arr.astype(np.int64)


def as_generator(rng) -> np.random.Generator:
  """`rng` itself if a numpy Generator, else a Generator seeded with it.

  A sampler called with a seed (`lang.sample(40, 0)`) draws what
  `lang.sample(40, np.random.default_rng(0))` draws.

  Raises:
    TypeError: `rng` is neither a Generator nor an integer seed >= 0.
  """
  if isinstance(rng, np.random.Generator):
    return rng
  if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool) \
      and rng >= 0:
    return np.random.default_rng(int(rng))
  raise TypeError(f"rng must be a numpy Generator (np.random.default_rng("
                  f"seed)) or an integer seed >= 0, got {rng!r}")


def check_batch_size(batch_size) -> int:
  """`batch_size` as an int (ValueError unless an integer >= 0)."""
  if isinstance(batch_size, bool) or not isinstance(
      batch_size, (int, np.integer)) or batch_size < 0:
    raise ValueError(f"batch_size must be an integer >= 0, got "
                     f"{batch_size!r}")
  return int(batch_size)


def text_symbols(text: str, alphabet: Sequence[str]) -> list[str]:
  """The symbols of a string written as text, for `alphabet`.

  One symbol per character ("([])"), or symbols separated by whitespace
  ("( [ ] )", the data files' format): split on whitespace where the text
  has any, and always where a symbol is longer than one character (e.g.
  "12 7 # 7 12" in `marked_reversal_k200`). Symbols are not checked here.
  """
  multicharacter = any(len(a) != 1 for a in alphabet)
  if multicharacter or any(c.isspace() for c in text):
    return text.split()
  return list(text)


def describe_alphabet(alphabet: Sequence[str]) -> str:
  """The alphabet for an error message, abbreviated past 12 symbols."""
  if len(alphabet) <= 12:
    return str(tuple(alphabet))
  return (f"of {len(alphabet)} symbols: {', '.join(alphabet[:5])}, ..., "
          f"{', '.join(alphabet[-3:])}")


def encode_symbols(text: str | Sequence[str], alphabet: Sequence[str],
                   where: str = "the alphabet") -> tuple[int, ...]:
  """Ids of a string given as text (`text_symbols`) or a list of symbols.

  Raises:
    ValueError: naming the symbols not in `alphabet` (`where` names it).
  """
  index = {a: i for i, a in enumerate(alphabet)}
  tokens = (text_symbols(text, alphabet) if isinstance(text, str)
            else list(text))
  # isinstance first: an unhashable item (a nested list) is unknown too.
  unknown = [t for t in tokens if not isinstance(t, str) or t not in index]
  if unknown:
    raise ValueError(f"symbols {unknown!r} are not in {where} "
                     f"{describe_alphabet(alphabet)}")
  return tuple(index[t] for t in tokens)


class SymbolCodec:
  """Text <-> symbol ids for a task with `name`, `alphabet`, `vocab_size`.

  A mixin shared by `languages.Language` and `tasks_ncf.UniformTask`.
  """

  name: str
  alphabet: tuple[str, ...]
  vocab_size: int

  def encode(self, text: str | Sequence[str]) -> tuple[int, ...]:
    """Symbol ids of a string: a list of symbols (["(", "[", ...]) or its
    text ("([])" or "( [ ] )"; see `text_symbols`)."""
    return encode_symbols(text, self.alphabet, f"the {self.name} alphabet")

  def decode(self, symbols: Sequence[int]) -> str:
    """The symbols of the ids as text that `encode` reads back: concatenated,
    or separated by spaces where a symbol is longer than one character."""
    sep = " " if any(len(a) != 1 for a in self.alphabet) else ""
    return sep.join(self.alphabet[i] for i in self._check(symbols))

  def _check(self, symbols) -> tuple[int, ...]:
    """Symbol ids validated; a str is text, encoded (`encode`) first."""
    if isinstance(symbols, str):
      return self.encode(symbols)
    arr = np.asarray(symbols)
    if arr.ndim != 1:
      raise ValueError(f"expected a 1-D sequence of ids, got shape "
                       f"{arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"symbol ids must be integers, got {arr.dtype}")
    bad = [int(s) for s in arr if not 0 <= s < self.vocab_size]
    if bad:
      raise ValueError(f"symbol id {bad[0]} is outside the {self.name} "
                       f"alphabet (ids 0..{self.vocab_size - 1})")
    return tuple(int(s) for s in arr)


class CompiledPCFG:
  """An epsilon/unary-free PCFG, binarised, with length table, sampler, inside.

  Internal nonterminals are indexed `0 .. M-1`; the grammar's own
  nonterminals come first, in `PCFG.nonterminals` order (so the start symbol
  is index 0), then preterminals and shared suffix items.
  """

  def __init__(self, grammar: PCFG):
    """Compiles a grammar.

    Args:
      grammar: a PCFG without epsilon or unary rules (apply
        `remove_epsilon_and_unary_rules` first).

    Raises:
      ValueError: if the grammar has epsilon or unary rules.
    """
    if grammar.has_epsilon_or_unary_rules():
      raise ValueError("CompiledPCFG needs a grammar without epsilon or unary "
                       "rules; call remove_epsilon_and_unary_rules first")
    self.grammar = grammar
    self.num_terminals = grammar.num_terminals
    index: dict[Hashable, int] = {}

    def nt(key):
      if key not in index:
        index[key] = len(index)
      return index[key]

    for name in grammar.nonterminals:
      nt(name)
    lexical: dict[tuple[int, int], float] = {}
    binary: dict[tuple[int, int, int], float] = {}

    def symbol_nt(s):
      if is_terminal(s):
        pre = nt(("t", s))
        lexical[(pre, s)] = 1.0
        return pre
      return nt(s)

    def suffix_nt(suffix):
      # Shared dotted item for a suffix of >= 2 symbols (probability 1).
      if len(suffix) == 1:
        return symbol_nt(suffix[0])
      key = ("d", tuple(_rhs_key(s) for s in suffix))
      if key not in index:
        idx = nt(key)
        binary[(idx, symbol_nt(suffix[0]), suffix_nt(suffix[1:]))] = 1.0
      return index[key]

    for rule in grammar.rules:
      lhs = index[rule.lhs]
      if len(rule.rhs) == 1:
        key = (lhs, rule.rhs[0])
        lexical[key] = lexical.get(key, 0.0) + rule.prob
      else:
        key = (lhs, symbol_nt(rule.rhs[0]), suffix_nt(rule.rhs[1:]))
        binary[key] = binary.get(key, 0.0) + rule.prob
    self.num_nonterminals = len(index)
    self.names = [None] * len(index)
    for key, i in index.items():
      self.names[i] = key
    lex = sorted(lexical.items())
    self.lex_lhs = np.array([k[0] for k, _ in lex], dtype=np.int64)
    self.lex_term = np.array([k[1] for k, _ in lex], dtype=np.int64)
    self.lex_prob = np.array([v for _, v in lex], dtype=np.float64)
    bins = sorted(binary.items())
    self.bin_lhs = np.array([k[0] for k, _ in bins], dtype=np.int64)
    self.bin_left = np.array([k[1] for k, _ in bins], dtype=np.int64)
    self.bin_right = np.array([k[2] for k, _ in bins], dtype=np.int64)
    self.bin_prob = np.array([v for _, v in bins], dtype=np.float64)
    # lexical emission matrix [M, V] (probability of X -> t).
    self._emit_MxV = np.zeros((self.num_nonterminals, self.num_terminals))
    np.add.at(self._emit_MxV, (self.lex_lhs, self.lex_term), self.lex_prob)
    # ln T[X, l], l = 0..(computed so far); −inf where X derives no string
    # of length l (column 0: no epsilon rules).
    self._log_table = np.full((self.num_nonterminals, 1), -np.inf)
    self._sample_cache: dict[tuple[int, int], tuple] = {}
    self._lex_cache: dict[int, tuple] = {}
    self._compute_span_bounds()

  # ---------------------------------------------------------------------------
  # Length table (Algorithm 1)
  # ---------------------------------------------------------------------------

  def log_length_table(self, max_length: int) -> np.ndarray:
    """ln T[X, l] for all internal nonterminals X and l = 0..max_length.

    Computed in log space (a max-shifted sum over split points per rule),
    so it is exact to float64 rounding at any length: T itself leaves
    float64's range (e.g. Dyck's T[S, l] < 1e-308 beyond l ≈ 3,400, where a
    linear-space table said no string of that length existed).

    Args:
      max_length: largest length needed (>= 0).

    Returns:
      float64 array [M, max_length + 1], −inf where X derives no string of
      length l; column 0 is −inf (no epsilon rules); rows
      `0 .. len(grammar.nonterminals)-1` are the grammar's nonterminals.
    """
    if max_length < 0:
      raise ValueError(f"max_length must be >= 0, got {max_length}")
    have = self._log_table.shape[1] - 1
    if max_length > have:
      new = max(max_length, 2 * have)
      table = np.full((self.num_nonterminals, new + 1), -np.inf)
      table[:, :have + 1] = self._log_table
      with np.errstate(divide="ignore"):
        log_bin_prob = np.log(self.bin_prob)
        if have < 1:
          table[:, 1] = np.log(self._emit_MxV.sum(axis=1))
      for length in range(max(2, have + 1), new + 1):
        # ln Σ_k T[left, k] T[right, l−k] over split points k = 1..l−1,
        # per rule, shifted by the rule's largest term.
        terms = (table[self.bin_left, 1:length]
                 + table[self.bin_right, length - 1:0:-1])
        per_rule = logsumexp(terms, axis=1) + log_bin_prob
        table[:, length] = _logsumexp_groups(per_rule, self.bin_lhs,
                                             self.num_nonterminals)
      self._log_table = table
    return self._log_table[:, :max_length + 1]

  def length_table_work(self, max_length: int) -> int:
    """Terms `log_length_table(max_length)` has yet to sum: one per (binary
    rule, length l, split point k < l) for the lengths not computed yet,
    ~R·n²/2. About 10^8 a second on one core (hardest CFL, R = 87:
    n = 8,000 in ~40 s), so lengths of 10^5 and more take hours."""
    have = self._log_table.shape[1] - 1
    if max_length <= have:
      return 0
    return len(self.bin_prob) * (max_length * (max_length - 1)
                                 - have * (have - 1)) // 2

  def length_table(self, max_length: int) -> np.ndarray:
    """T[X, l] = exp(`log_length_table`): linear probabilities, which
    underflow to 0 for long enough lengths (use the log table there)."""
    return np.exp(self.log_length_table(max_length))

  def length_log_prob(self, length: int, symbol: int = 0) -> float:
    """ln T[X, length] (default X: start); −inf if it derives no string of
    that length. Exact at any length (`log_length_table`)."""
    if length < 0:
      raise ValueError(f"length must be >= 0, got {length}")
    return float(self.log_length_table(length)[symbol, length])

  def length_prob(self, length: int, symbol: int = 0) -> float:
    """T[X, length]: probability that X (default: start) derives that length
    (0.0 below float64's range: `length_log_prob` is exact there)."""
    return math.exp(self.length_log_prob(length, symbol))

  def valid_lengths(self, min_length: int, max_length: int) -> list[int]:
    """Sorted lengths l in [min_length, max_length] with T[start, l] > 0."""
    _check_interval(min_length, max_length)
    table = self.log_length_table(max_length)
    return [l for l in range(min_length, max_length + 1)
            if table[0, l] > -np.inf]

  # ---------------------------------------------------------------------------
  # Sampling (Algorithm 2)
  # ---------------------------------------------------------------------------

  def _choices(self, symbol: int, length: int) -> tuple:
    """Cumulative weights and (left, right, k) targets for (X, l), cached."""
    key = (symbol, length)
    if key not in self._sample_cache:
      table = self.log_length_table(length)
      rules = np.flatnonzero(self.bin_lhs == symbol)
      ks = np.arange(1, length)
      with np.errstate(divide="ignore"):
        log_weights = (np.log(self.bin_prob[rules, None])
                       + table[self.bin_left[rules]][:, ks]
                       + table[self.bin_right[rules]][:, length - ks])
      # Relative weights (the cumulative sum is searched with a scaled
      # uniform), shifted by the largest: no underflow at any length.
      top = np.max(log_weights) if log_weights.size else -np.inf
      weights = (np.exp(log_weights - top) if top > -np.inf
                 else np.zeros_like(log_weights))
      flat = weights.reshape(-1)
      keep = np.flatnonzero(flat > 0)
      cum = np.cumsum(flat[keep]).tolist()
      r_idx, k_idx = np.divmod(keep, len(ks))
      targets = list(zip(self.bin_left[rules[r_idx]].tolist(),
                         self.bin_right[rules[r_idx]].tolist(),
                         ks[k_idx].tolist()))
      self._sample_cache[key] = (cum, targets)
    return self._sample_cache[key]

  def _lex_choices(self, symbol: int) -> tuple:
    if symbol not in self._lex_cache:
      probs = self._emit_MxV[symbol]
      terms = np.flatnonzero(probs > 0)
      self._lex_cache[symbol] = (np.cumsum(probs[terms]).tolist(),
                                 terms.tolist())
    return self._lex_cache[symbol]

  def check_sample_length(self, length) -> int:
    """`length` as an int (ValueError unless the grammar has strings of
    that length)."""
    length = _check_length(length)
    if self.length_log_prob(length) == -np.inf:
      raise ValueError(f"the grammar generates no string of length {length}")
    return length

  def sample(self, length: int, rng: np.random.Generator) -> tuple[int, ...]:
    """Samples a string of exactly `length` symbols from G(w) / G(length).

    Uses one `rng.random(2 * length)` draw per string (one uniform per tree
    node, consumed in pre-order), so the stream is deterministic in the seed.

    Args:
      length: the string length; must satisfy T[start, length] > 0.
      rng: a numpy Generator, or an integer seed (`as_generator`).

    Returns:
      A tuple of terminal ids.

    Raises:
      ValueError: if no string of that length exists.
    """
    length = self.check_sample_length(length)
    uniforms = as_generator(rng).random(2 * length).tolist()
    out, stack, pos = [], [(0, length)], 0
    while stack:
      symbol, span = stack.pop()
      u = uniforms[pos]
      pos += 1
      if span == 1:
        cum, terms = self._lex_choices(symbol)
        i = min(bisect.bisect_right(cum, u * cum[-1]), len(cum) - 1)
        out.append(terms[i])
      else:
        cum, targets = self._choices(symbol, span)
        i = min(bisect.bisect_right(cum, u * cum[-1]), len(cum) - 1)
        left, right, k = targets[i]
        stack.append((right, span - k))
        stack.append((left, k))
    return tuple(out)

  # ---------------------------------------------------------------------------
  # Inside probabilities
  # ---------------------------------------------------------------------------

  def _compute_span_bounds(self):
    """Min/max derivable length per nonterminal; classifies binary rules."""
    m = self.num_nonterminals
    min_len = np.full(m, np.inf)
    min_len[np.unique(self.lex_lhs)] = 1
    for _ in range(m + 1):
      cand = np.full(m, np.inf)
      np.minimum.at(cand, self.bin_lhs,
                    min_len[self.bin_left] + min_len[self.bin_right])
      new = np.minimum(min_len, cand)
      if np.array_equal(new, min_len):
        break
      min_len = new
    # Max length: iterate the relaxation M + 2 rounds (exact for symbols that
    # reach no cycle); anything still growing then lies on or reaches a cycle
    # and is unbounded. Rules that can never fire only overestimate, which is
    # safe (fewer rules get the bounded-split shortcut).
    max_len = np.where(np.isin(np.arange(m), self.lex_lhs), 1.0, 0.0)
    for _ in range(m + 2):
      cand = np.zeros(m)
      np.maximum.at(cand, self.bin_lhs,
                    max_len[self.bin_left] + max_len[self.bin_right])
      new = np.maximum(max_len, cand)
      if np.array_equal(new, max_len):
        break
      max_len = new
    cand = np.zeros(m)
    np.maximum.at(cand, self.bin_lhs,
                  max_len[self.bin_left] + max_len[self.bin_right])
    grows = cand > max_len
    # Propagate unboundedness to everything that can reach a growing symbol.
    unbounded = grows.copy()
    for _ in range(m + 1):
      prop = np.zeros(m, dtype=bool)
      np.logical_or.at(prop, self.bin_lhs,
                       unbounded[self.bin_left] | unbounded[self.bin_right])
      new_u = unbounded | prop
      if np.array_equal(new_u, unbounded):
        break
      unbounded = new_u
    max_len[unbounded] = np.inf
    self.min_span, self.max_span = min_len, max_len
    left_max = max_len[self.bin_left]
    right_max = max_len[self.bin_right]
    # Suffix-anchored symbols: the start symbol when it never occurs on a
    # right-hand side, and every symbol that only occurs as the right child
    # of an anchored symbol. Their spans always end at the string's end, so
    # the chart computes them for that one span per length only.
    anchored = np.zeros(m, dtype=bool)
    anchored[0] = not (np.isin(0, self.bin_left) or np.isin(0, self.bin_right))
    if anchored[0]:
      for _ in range(m):
        new = anchored.copy()
        for x in range(1, m):
          as_right = self.bin_right == x
          new[x] = (not np.any(self.bin_left == x) and np.any(as_right)
                    and np.all(anchored[self.bin_lhs[as_right]]))
        new[0] = True
        if np.array_equal(new, anchored):
          break
        anchored = new
    self._anchored_rule = anchored[self.bin_lhs]
    self._groups = []
    self._rule_class = np.where(
        left_max <= _BOUNDED_SPAN, 0, np.where(right_max <= _BOUNDED_SPAN, 1,
                                               2))

  def _rule_groups(self) -> list:
    """(class, anchored, rule indices, [M, R] scatter matrix) per rule group.

    Anchored rules (see `_compute_span_bounds`) are only evaluated on the
    span that ends at the end of the string.
    """
    if not self._groups:
      for cls in range(3):
        for anchored in (False, True):
          mask = (self._rule_class == cls) & (self._anchored_rule == anchored)
          rules = np.flatnonzero(mask)
          if not len(rules):
            continue
          to_lhs = np.zeros((self.num_nonterminals, len(rules)))
          to_lhs[self.bin_lhs[rules], np.arange(len(rules))] = self.bin_prob[
              rules]
          self._groups.append((cls, anchored, rules, to_lhs))
    return self._groups

  def _scaled_inside(self, weights_BxNxV: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Inside weight of the start symbol on the whole string, as
    (mantissa [B], log-scale [B]): ln = ln mantissa + log-scale.

    Position i emits terminal a with weight weights[b, i, a] (one-hot rows:
    the string itself; all-ones rows: any symbol). Every span keeps its own
    log-scale (its entries divided by their largest), so no entry leaves
    float64's range however improbable the string (a single scale per
    length underflowed once −ln p(w | n) passed ~744: the hardest CFL's
    strings from ~520 symbols on).
    """
    b, n, _ = weights_BxNxV.shape
    m = self.num_nonterminals
    # chart_by_start[l, b, X, i]: inside of span (i, i+l) over its scale
    # scale_by_start[l, b, i]; chart_by_end[l, b, X, j] / scale_by_end[l, b,
    # j]: the same span indexed by its end j = i+l, so that the right
    # children of all split points are one slice.
    chart_by_start = np.zeros((n + 1, b, m, n))
    chart_by_end = np.zeros((n + 1, b, m, n + 1))
    scale_by_start = np.full((n + 1, b, n), -np.inf)
    scale_by_end = np.full((n + 1, b, n + 1), -np.inf)

    def normalised(out_BxMxS, base_BxS):
      # A span no nonterminal derives gets scale −inf: a finite one would
      # be arbitrary and could outweigh the real splits of a longer span.
      top_BxS = out_BxMxS.max(axis=1)
      nonzero = top_BxS > 0
      out_BxMxS /= np.where(nonzero, top_BxS, 1.0)[:, None, :]
      return np.where(nonzero, base_BxS + np.log(np.where(nonzero, top_BxS,
                                                           1.0)), -np.inf)

    emit_BxMxN = np.einsum("mv,bnv->bmn", self._emit_MxV, weights_BxNxV)
    scale_BxN = normalised(emit_BxMxN, np.zeros((b, n)))
    chart_by_start[1], scale_by_start[1] = emit_BxMxN, scale_BxN
    chart_by_end[1, :, :, 1:], scale_by_end[1, :, 1:] = emit_BxMxN, scale_BxN
    for length in range(2, n + 1):
      starts = n - length + 1
      # Split point k = 1..l−1 joins span (i, i+k) and (i+k, i+l): their
      # scales' sum relative to the largest over k, per (string, start).
      pair_KxBxS = (scale_by_start[1:length, :, :starts]
                    + scale_by_end[length - 1:0:-1, :, length:])
      base_BxS = pair_KxBxS.max(axis=0)
      base_BxS = np.where(base_BxS > -np.inf, base_BxS, 0.0)
      factor_KxBxS = np.exp(pair_KxBxS - base_BxS)
      out_BxMxS = np.zeros((b, m, starts))
      for cls, anchored, rules, to_lhs_MxR in self._rule_groups():
        if cls == 0:    # left child short: splits k = 1..min(bound, l-1)
          k_lo, k_hi = 1, min(_BOUNDED_SPAN, length - 1)
        elif cls == 1:  # right child short: splits k = max(1, l-bound)..l-1
          k_lo, k_hi = max(1, length - _BOUNDED_SPAN), length - 1
        else:
          k_lo, k_hi = 1, length - 1
        if k_lo > k_hi:
          continue
        # Anchored rules: only the span ending at n (start n - l).
        s_lo = starts - 1 if anchored else 0
        # left[k] = span (i, i+k); right[k] = span (i+k, i+l), by its end.
        left_KxBxRxS = chart_by_start[k_lo:k_hi + 1, :, self.bin_left[rules],
                                      s_lo:starts]
        right_KxBxRxS = chart_by_end[length - k_lo:length - k_hi - 1:-1, :,
                                     self.bin_right[rules], length + s_lo:]
        left_KxBxRxS *= right_KxBxRxS
        left_KxBxRxS *= factor_KxBxS[k_lo - 1:k_hi, :, None, s_lo:]
        out_BxMxS[:, :, s_lo:] += to_lhs_MxR @ left_KxBxRxS.sum(axis=0)
      scale_BxS = normalised(out_BxMxS, base_BxS)
      chart_by_start[length, :, :, :starts] = out_BxMxS
      chart_by_end[length, :, :, length:] = out_BxMxS
      scale_by_start[length, :, :starts] = scale_BxS
      scale_by_end[length, :, length:] = scale_BxS
    return chart_by_start[n, :, 0, 0], scale_by_start[n, :, 0]

  def log_prob_batch(self, symbols_BxN) -> np.ndarray:
    """ln G(w) for a batch of strings of one length, summing all derivations.

    Args:
      symbols_BxN: integer array [B, N] of terminal ids, N >= 1.

    Returns:
      float64 [B]: ln G(w), -inf for strings outside the language.

    Raises:
      ValueError: on a bad shape or an id outside the alphabet.
    """
    symbols_BxN = self._check_symbols(symbols_BxN)
    return self.log_inside(np.eye(self.num_terminals)[symbols_BxN])

  def log_inside(self, weights_BxNxV) -> np.ndarray:
    """ln sum_w G(w) prod_i weights[b, i, w_i] over the strings w of length N.

    One-hot rows give ln G(w) (`log_prob_batch`); an all-ones row sums over
    every symbol at that position, so a prefix followed by all-ones rows
    gives the total weight of its completions (inspection.py uses this for
    exact next-symbol distributions).

    Args:
      weights_BxNxV: non-negative float64 emission weights [B, N, V], N >= 1.

    Returns:
      float64 [B] (-inf where the weight is 0).
    """
    weights_BxNxV = np.asarray(weights_BxNxV, np.float64)
    if weights_BxNxV.ndim != 3 or weights_BxNxV.shape[2:] != (
        self.num_terminals,) or weights_BxNxV.shape[1] < 1:
      raise ValueError(f"weights must be [B, N >= 1, {self.num_terminals}], "
                       f"got shape {weights_BxNxV.shape}")
    b, n, _ = weights_BxNxV.shape
    if b == 0:
      return np.zeros(0)
    if self.length_log_prob(n) == -np.inf:
      return np.full(b, -np.inf)
    # Chunks of strings keep the two charts (n^2 * chunk * M floats) small.
    chunk = max(1, _CHART_FLOATS // (n * n * self.num_nonterminals))
    pieces = [weights_BxNxV[i:i + chunk] for i in range(0, b, chunk)]
    if len(pieces) > 1 and _NUM_THREADS > 1:
      # NumPy releases the GIL in its kernels, so chunks run in parallel.
      with concurrent.futures.ThreadPoolExecutor(_NUM_THREADS) as pool:
        parts = list(pool.map(self._scaled_inside, pieces))
    else:
      parts = [self._scaled_inside(x) for x in pieces]
    mantissa = np.concatenate([p[0] for p in parts])
    log_scale = np.concatenate([p[1] for p in parts])
    with np.errstate(divide="ignore"):
      return np.log(mantissa) + log_scale

  def log_prob(self, symbols: Sequence[int]) -> float:
    """ln G(w) of one string (-inf outside the language; 0-length: -inf)."""
    arr = np.asarray(symbols)
    if arr.ndim != 1:
      raise ValueError(f"expected a 1-D sequence of symbol ids, got shape "
                       f"{arr.shape}")
    if arr.size == 0:
      return -math.inf
    return float(self.log_prob_batch(arr[None])[0])

  def _check_symbols(self, symbols_BxN) -> np.ndarray:
    return check_symbols_BxN(symbols_BxN, self.num_terminals)


def logsumexp(x: np.ndarray, axis) -> np.ndarray:
  """ln Σ exp(x) over `axis` (int or tuple) in NumPy, −inf where every term
  is −inf (no NaN from −inf − (−inf))."""
  peak = np.max(x, axis=axis, keepdims=True)
  peak = np.where(np.isfinite(peak), peak, 0.0)
  with np.errstate(divide="ignore"):
    out = np.log(np.sum(np.exp(x - peak), axis=axis, keepdims=True)) + peak
  return np.squeeze(out, axis=axis)


def _logsumexp_groups(x_R: np.ndarray, group_R: np.ndarray,
                      num_groups: int) -> np.ndarray:
  """ln Σ_{r in group g} exp(x[r]) for g = 0..num_groups−1 (−inf if none)."""
  top = np.full(num_groups, -np.inf)
  np.maximum.at(top, group_R, x_R)
  shift = np.where(top > -np.inf, top, 0.0)
  total = np.bincount(group_R, np.exp(x_R - shift[group_R]),
                      minlength=num_groups)
  with np.errstate(divide="ignore"):
    return np.log(total) + shift


def _check_length(length) -> int:
  if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
    raise ValueError(f"length must be an int, got {length!r}")
  if length < 1:
    raise ValueError(f"length must be >= 1, got {length}")
  return int(length)


def _check_interval(min_length, max_length) -> None:
  for name, value in (("min_length", min_length), ("max_length", max_length)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise ValueError(f"{name} must be an int, got {value!r}")
    if value < 0:
      raise ValueError(f"{name} must be >= 0, got {value}")
  if min_length > max_length:
    raise ValueError(f"min_length ({min_length}) > max_length ({max_length})")
