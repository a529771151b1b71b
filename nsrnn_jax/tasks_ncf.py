"""The later papers' tasks: non-context-free copies and large alphabets.

DuSell & Chiang (ICLR 2023) test stack RNNs on two new groups of tasks
(rns-vrns-reference.md §4.3); both are `languages.get(...)` tasks:

Non-context-free tasks (`UniformTask`). A content string u of n symbols is
drawn uniformly from the k^n strings over {0, .., k-1} (k = 2 in the paper)
and laid out as

=====================================  =============  ==================
task                                   string         length
=====================================  =============  ==================
count_3                                a^n b^n c^n    3n (no content)
marked_copy                            u # u          2n + 1
unmarked_copy                          u u            2n
unmarked_copy_different_alphabets      u u'           2n  (u' = u + k)
marked_reverse_and_copy                u # u^R # u    3n + 2
unmarked_reverse_and_copy              u u^R u        3n
count_and_copy                         u #^n u        3n
=====================================  =============  ==================

The marker # is symbol id k; u' maps symbol i to k + i (0->2, 1->3 for
k = 2). Given its length, every string of the language is equally likely,
so -ln p(w | l) = n ln k (0 for count_3): that is all the training protocol
uses (lengths are drawn uniformly from the valid ones, and the lower bound is
-ln p(w|l) + ln N_L). To make G a proper distribution over all strings (the
interface `languages.Language` has: G(w), G(l) = sum of G over strings of
length l), the content length is geometric, P(n) = (1 - p) p^(n-1) for
n >= 1 with p = 1 - 1/mean_content_length (mean 20 by default, so typical
strings are ~60 symbols long like the context-free tasks'); G(w) =
P(n) k^-n. The choice of P never changes a sample, a bound or a curve.

Alphabet-size (capacity) tasks. `marked_reversal_k<K>`,
`unmarked_reversal_k<K>` and `dyck_k<K>` are the PCFGs of
`nsrnn_jax.languages` with K reversal symbols (S -> a S a with f(60)/K each)
or K bracket types (each T rule split K ways), built and scored by
`languages.Language` exactly like the paper's five tasks (the authors'
epsilon/unary removal included). K = 2 gives the paper's grammars. Symbol
names follow the authors' code: `0 .. K-1` (and `#`) for reversal; Dyck
brackets `( ) [ ] { } < >`, then doubled `(( )) [[ ..`, tripled, and so on.
The paper's sizes K in {2, 40, 80, 120, 160, 200} are listed in `TASKS`;
any K >= 2 works with `languages.get`.

Every content task above also accepts `_k<K>` (K content symbols), e.g.
`marked_reverse_and_copy_k3`; count_3 does not.

Usage:

  lang = languages.get("count_and_copy")   # or tasks_ncf.get(...)
  lang.valid_lengths(40, 80)                # [42, 45, ..., 78]
  w = lang.sample(42, np.random.default_rng(0))
  lang.log_prob(w) - lang.length_log_prob(42)   # = -14 ln 2
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Optional, Sequence

import numpy as np

from nsrnn_jax import pcfg

# The paper's alphabet sizes of the capacity study (§4.3).
CAPACITY_SIZES = (2, 40, 80, 120, 160, 200)

NCF_TASKS = ("count_3", "marked_copy", "unmarked_copy",
             "unmarked_copy_different_alphabets", "marked_reverse_and_copy",
             "unmarked_reverse_and_copy", "count_and_copy")
CAPACITY_FAMILIES = ("marked_reversal", "unmarked_reversal", "dyck")
# Every concrete name this module registers in `languages` (any other K >= 2
# also works through `get`).
TASKS = NCF_TASKS + tuple(f"{family}_k{k}" for family in CAPACITY_FAMILIES
                          for k in CAPACITY_SIZES)

_BRACKETS = "()[]{}<>"
_SIZED = re.compile(r"^(?P<base>[a-z0-9_]+?)_k(?P<k>-?\d+)$")


@dataclasses.dataclass(frozen=True)
class _Layout:
  """How a content string u (length n) becomes a string of the task."""
  sections: int            # copies of (a function of) u in the string
  markers: int             # number of # markers (fixed, not counting #^n)
  has_content: bool        # False for count_3 (one string per length)
  marked: bool             # whether the alphabet has the marker # (id k)
  doubled: bool            # whether the alphabet has 2k content symbols
  build: Callable[[np.ndarray, int], np.ndarray]  # (u_BxN, k) -> strings


def _marker(u, k):
  return np.full((u.shape[0], 1), k, dtype=u.dtype)


_LAYOUTS = {
    "count_3": _Layout(3, 0, False, False, False, lambda u, k: np.concatenate(
        [np.full_like(u, 0), np.full_like(u, 1), np.full_like(u, 2)], 1)),
    "marked_copy": _Layout(2, 1, True, True, False, lambda u, k: np.concatenate(
        [u, _marker(u, k), u], 1)),
    "unmarked_copy": _Layout(2, 0, True, False, False,
                             lambda u, k: np.concatenate([u, u], 1)),
    "unmarked_copy_different_alphabets": _Layout(
        2, 0, True, False, True,
        lambda u, k: np.concatenate([u, u + k], 1)),
    "marked_reverse_and_copy": _Layout(
        3, 2, True, True, False, lambda u, k: np.concatenate(
            [u, _marker(u, k), u[:, ::-1], _marker(u, k), u], 1)),
    "unmarked_reverse_and_copy": _Layout(
        3, 0, True, False, False,
        lambda u, k: np.concatenate([u, u[:, ::-1], u], 1)),
    "count_and_copy": _Layout(3, 0, True, True, False,
                              lambda u, k: np.concatenate(
                                  [u, np.full_like(u, k), u], 1)),
}


def _check_alphabet_size(name: str, k) -> int:
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
    raise ValueError(f"task {name!r}: alphabet size must be an int, got {k!r}")
  if k < 2:
    raise ValueError(f"task {name!r}: alphabet size must be >= 2 (got {k})")
  return int(k)


class UniformTask(pcfg.SymbolCodec):
  """A non-context-free task: uniform strings of each valid length.

  Same interface as `languages.Language` (minus the grammar attributes):
  `valid_lengths`, `sample`, `sample_batch`, `log_prob`, `log_prob_batch`,
  `length_log_prob`, `encode`, `decode`.

  Attributes:
    name: task name.
    alphabet: tuple of symbol strings (index = id).
    vocab_size: len(alphabet).
    alphabet_size: k, the number of content symbols.
    mean_content_length: mean of the geometric content-length distribution.
  """

  def __init__(self, name: str, base: str, alphabet_size: int = 2,
               mean_content_length: float = 20.0):
    """Builds the task.

    Args:
      name: task name (reported in errors and data files).
      base: one of `NCF_TASKS`.
      alphabet_size: k >= 2 content symbols.
      mean_content_length: mean content length n (> 1) of G's length
        distribution (never affects samples or bounds; module docstring).

    Raises:
      ValueError: unknown base, k < 2 or a mean <= 1.
    """
    if base not in _LAYOUTS:
      raise ValueError(f"unknown non-context-free task {base!r}; valid: "
                       f"{', '.join(NCF_TASKS)}")
    k = _check_alphabet_size(name, alphabet_size)
    if not mean_content_length > 1:
      raise ValueError(f"task {name!r}: mean_content_length must be > 1 "
                       f"(got {mean_content_length})")
    self.name = name
    self.base = base
    self.alphabet_size = k
    self.mean_content_length = float(mean_content_length)
    self._layout = _LAYOUTS[base]
    if base == "count_3":
      self.alphabet = ("a", "b", "c")
    else:
      count = 2 * k if self._layout.doubled else k
      self.alphabet = tuple(str(i) for i in range(count)) + (
          ("#",) if self._layout.marked else ())
    self.vocab_size = len(self.alphabet)
    # Geometric content length: P(n) = (1 - p) p^(n-1), n >= 1.
    self._continue = 1.0 - 1.0 / self.mean_content_length

  @property
  def normal_grammar(self):
    """Not available: these languages are not context-free."""
    raise ValueError(f"task {self.name!r} is not context-free and has no "
                     "grammar (its exact next-symbol distribution: "
                     "next_symbol_distribution)")

  # -- lengths ----------------------------------------------------------------

  def content_length(self, length: int) -> Optional[int]:
    """n for a string length, or None if no string has that length."""
    n, r = divmod(int(length) - self._layout.markers, self._layout.sections)
    return n if r == 0 and n >= 1 else None

  def valid_lengths(self, min_length: int, max_length: int) -> list[int]:
    """Sorted lengths l in [min_length, max_length] with G(l) > 0."""
    pcfg._check_interval(min_length, max_length)  # pylint: disable=protected-access
    return [l for l in range(min_length, max_length + 1)
            if self.content_length(l) is not None]

  def length_log_prob(self, length: int) -> float:
    """ln G(length) = ln P(n); -inf if no string has that length."""
    length = pcfg._check_length(length)  # pylint: disable=protected-access
    n = self.content_length(length)
    if n is None:
      return -math.inf
    return math.log1p(-self._continue) + (n - 1) * math.log(self._continue)

  def _log_num_strings(self, n: int) -> float:
    return n * math.log(self.alphabet_size) if self._layout.has_content else 0.

  # -- sampling -----------------------------------------------------------------

  def _content_length_or_raise(self, length) -> int:
    length = pcfg._check_length(length)  # pylint: disable=protected-access
    n = self.content_length(length)
    if n is None:
      raise ValueError(f"{self.name} has no string of length {length}")
    return n

  def sample_batch(self, length: int, batch_size: int,
                   rng: np.random.Generator) -> np.ndarray:
    """`batch_size` uniform strings of one length as int32 [B, N].

    One `rng.integers(k, size=(B, n))` draw per batch (none for count_3).
    """
    n = self._content_length_or_raise(length)
    batch_size = pcfg.check_batch_size(batch_size)
    if self._layout.has_content:
      u = pcfg.as_generator(rng).integers(self.alphabet_size,
                                          size=(batch_size, n))
    else:
      u = np.zeros((batch_size, n), dtype=np.int64)
    return self._layout.build(u.astype(np.int32), self.alphabet_size)

  def sample(self, length: int, rng: np.random.Generator) -> tuple[int, ...]:
    """One string of exactly `length` symbols, uniform given the length."""
    return tuple(int(s) for s in self.sample_batch(length, 1, rng)[0])

  # -- scoring ------------------------------------------------------------------

  def log_prob_batch(self, symbols_BxN) -> np.ndarray:
    """ln G(w) (float64 [B]) for strings of one length; -inf outside."""
    arr = pcfg.check_symbols_BxN(symbols_BxN, self.vocab_size)
    b, length = arr.shape
    n = self.content_length(length)
    if n is None:
      return np.full(b, -np.inf)
    arr = arr.astype(np.int64)
    # A string is in the language iff rebuilding it from its first n symbols
    # gives it back (the first section is u itself, or a^n for count_3).
    u = arr[:, :n]
    ok = np.all(self._layout.build(u, self.alphabet_size) == arr, axis=1)
    if self._layout.has_content:
      ok &= np.all(u < self.alphabet_size, axis=1)
    value = self.length_log_prob(length) - self._log_num_strings(n)
    return np.where(ok, value, -np.inf)

  def log_prob(self, symbols: Sequence[int] | str) -> float:
    """ln G(w) of one string (-inf outside the language); `symbols` are ids
    or the string's text (see `encode`)."""
    arr = np.asarray(self._check(symbols))
    if arr.size == 0:
      return -math.inf
    return float(self.log_prob_batch(arr[None])[0])

  def next_symbol_distribution(self, symbols: Sequence[int]) -> np.ndarray:
    """Exact p(w_{t+1} = a | w_1..w_t, N) given the length N = len(symbols).

    Strings of one length are uniform, so this counts completions: the first
    n symbols are the content u (any of the k^n; a^n for count_3), and the
    rest is determined by u. While u is read the next symbol is uniform
    over the k content symbols; after it, it is the one symbol the layout
    puts there.

    Returns:
      probs_NxV (float64): row t is the distribution of w_{t+1} given
      w_1..w_t; a row is NaN where w_1..w_t is the prefix of no string of
      length N (every row, if N is not a valid length).
    """
    arr = np.asarray(self._check(symbols), np.int64)
    length, k = arr.size, self.alphabet_size
    probs_NxV = np.full((length, self.vocab_size), np.nan)
    n = self.content_length(length) if length else None
    if n is None:
      return probs_NxV
    # The string of length N built from w's content (a non-content symbol
    # there becomes 0, so that position differs from w: no string has
    # that prefix).
    u = (np.where(arr[:n] < k, arr[:n], 0) if self._layout.has_content
         else np.zeros(n, np.int64))
    full = self._layout.build(u[None], k)[0]
    # prefix_ok[t]: w_1..w_t is the prefix of a string of length N.
    prefix_ok = np.concatenate([[True], np.cumprod(full == arr) > 0])
    for t in np.flatnonzero(prefix_ok[:length]):
      probs_NxV[t] = 0.0
      if self._layout.has_content and t < n:
        probs_NxV[t, :k] = 1.0 / k  # any content symbol continues u
      else:
        probs_NxV[t, full[t]] = 1.0
    return probs_NxV

  # -- text (encode / decode come from pcfg.SymbolCodec) --------------------

  def __repr__(self) -> str:
    return f"UniformTask({self.name!r}, alphabet={self.alphabet})"


# ---------------------------------------------------------------------------
# Capacity PCFGs (K symbols / bracket types).
# ---------------------------------------------------------------------------


def marked_reversal_grammar(alphabet_size: int,
                            mean_length: float = 60) -> pcfg.PCFG:
  """S -> a S a (f(mu)/K each, a < K) | # (1 - f(mu)); # is id K."""
  k = _check_alphabet_size("marked_reversal", alphabet_size)
  p = pcfg.mean_to_continue_prob(mean_length)
  rules = [("S", (a, "S", a), p / k) for a in range(k)]
  rules.append(("S", (k,), 1 - p))
  return pcfg.PCFG("S", rules, num_terminals=k + 1)


def unmarked_reversal_grammar(alphabet_size: int,
                              mean_length: float = 60) -> pcfg.PCFG:
  """S -> a S a (f(mu)/K each, a < K) | eps (1 - f(mu))."""
  k = _check_alphabet_size("unmarked_reversal", alphabet_size)
  p = pcfg.mean_to_continue_prob(mean_length)
  rules = [("S", (a, "S", a), p / k) for a in range(k)]
  rules.append(("S", (), 1 - p))
  return pcfg.PCFG("S", rules, num_terminals=k)


def dyck_grammar(bracket_types: int, mean_bracket_splits: float = 1,
                 mean_nesting_depth: float = 40) -> pcfg.PCFG:
  """S -> S T | T; T -> (_i S )_i | (_i )_i for K types, nesting f(mu_n-1)."""
  k = _check_alphabet_size("dyck", bracket_types)
  return _dyck_grammar(k, mean_bracket_splits, mean_nesting_depth)


def _dyck_grammar(k, mean_bracket_splits=1, mean_nesting_depth=40):
  s = pcfg.mean_to_continue_prob(mean_bracket_splits)
  t = pcfg.mean_to_continue_prob(mean_nesting_depth - 1)
  rules = [("S", ("S", "T"), s), ("S", ("T",), 1 - s)]
  for i in range(k):
    rules += [("T", (2 * i, "S", 2 * i + 1), t / k),
              ("T", (2 * i, 2 * i + 1), (1 - t) / k)]
  return pcfg.PCFG("S", rules, num_terminals=2 * k)


def dyck_alphabet(bracket_types: int) -> tuple[str, ...]:
  """( ) [ ] { } < > (( )) [[ ]] ...: id 2i opens and 2i+1 closes type i."""
  return tuple(_BRACKETS[i % len(_BRACKETS)] * (i // len(_BRACKETS) + 1)
               for i in range(2 * bracket_types))


class CapacityTask:
  """A capacity PCFG task with a fast exact scorer for large alphabets.

  Sampling, the length table and every grammar attribute come from the
  wrapped `languages.Language` (attribute access is forwarded). The generic
  inside algorithm costs O(K) per chart cell (~100 s per 100 strings of
  length 100 at K = 200), so `log_prob_batch` uses two exact identities of
  these grammars instead (tested against the generic inside for small K):

  * reversal: each of the n reversed symbols is chosen uniformly from K with
    the same rule weight, so G(w) = G(|w|) K^-n for w in the language;
  * Dyck: every T rule emits one bracket pair and carries a factor 1/K for
    its type, also after epsilon/unary removal, so G_K(w) = G_1(shape(w))
    K^-(|w|/2) when the types match, where shape(w) forgets the types and
    G_1 is the one-type grammar with the same parameters.

  Attributes:
    language: the wrapped `languages.Language`.
    family: marked_reversal, unmarked_reversal or dyck.
    alphabet_size: K.
  """

  def __init__(self, language, family: str, alphabet_size: int,
               shape_language=None):
    self.language = language
    self.family = family
    self.alphabet_size = alphabet_size
    self._shape = shape_language

  def __getattr__(self, name):
    # Only called for attributes not found on the wrapper itself.
    return getattr(self.__dict__["language"], name)

  def log_prob_batch(self, symbols_BxN) -> np.ndarray:
    """ln G(w) (float64 [B]) for strings of one length; -inf outside."""
    arr = self.language.compiled._check_symbols(symbols_BxN)  # pylint: disable=protected-access
    b, length = arr.shape
    k = self.alphabet_size
    if b == 0:
      return np.zeros(0)
    if self.family == "dyck":
      if length % 2:
        return np.full(b, -np.inf)
      shape = arr % 2  # 0 opens, 1 closes
      out = self._shape.log_prob_batch(shape) - length // 2 * math.log(k)
      return np.where(_brackets_match(arr), out, -np.inf)
    g_len = self.language.length_log_prob(length)
    if g_len == -math.inf:
      return np.full(b, -np.inf)
    if self.family == "marked_reversal":
      n = (length - 1) // 2
      ok = (arr[:, n] == k) & np.all(arr[:, :n] < k, axis=1)
    else:
      n = length // 2
      ok = np.ones(b, dtype=bool)
    ok &= np.all(arr == arr[:, ::-1], axis=1)
    return np.where(ok, g_len - n * math.log(k), -np.inf)

  def log_prob(self, symbols: Sequence[int] | str) -> float:
    """ln G(w) of one string (-inf outside the language); `symbols` are ids
    or the string's text (see `encode`)."""
    arr = np.asarray(self.language._check(symbols))  # pylint: disable=protected-access
    if arr.size == 0:
      return -math.inf
    return float(self.log_prob_batch(arr[None])[0])

  def __repr__(self) -> str:
    return f"CapacityTask({self.language.name!r}, K={self.alphabet_size})"


def _brackets_match(arr_BxN: np.ndarray) -> np.ndarray:
  """Per string: every closing bracket closes an open one of its own type."""
  ok = np.ones(arr_BxN.shape[0], dtype=bool)
  for row, w in enumerate(arr_BxN.tolist()):
    stack = []
    for s in w:
      if s % 2 == 0:
        stack.append(s + 1)
      elif not stack or stack.pop() != s:
        ok[row] = False
        break
    else:
      ok[row] = not stack
  return ok


def _capacity_spec(family: str, k: int):
  if family == "marked_reversal":
    return (tuple(str(i) for i in range(k)) + ("#",),
            marked_reversal_grammar(k))
  if family == "unmarked_reversal":
    return tuple(str(i) for i in range(k)), unmarked_reversal_grammar(k)
  return dyck_alphabet(k), dyck_grammar(k)


def is_task(name: str) -> bool:
  """Whether `get(name)` recognises the name (its parameters may be bad)."""
  if name in NCF_TASKS:
    return True
  match = _SIZED.match(name)
  return bool(match) and (match["base"] in CAPACITY_FAMILIES
                          or match["base"] in NCF_TASKS)


def get(name: str, *, preserve_start: bool = False):
  """The task called `name`, or None if this module does not define it.

  Args:
    name: a name of `TASKS`, or `<family>_k<K>` for any K (see the module
      docstring).
    preserve_start: for the capacity PCFGs, the distribution-preserving
      epsilon/unary removal (`languages.Language`); ignored otherwise.

  Returns:
    A `UniformTask`, a `CapacityTask` (a `languages.Language` with a fast
    scorer), or None for an unknown name.

  Raises:
    ValueError: a recognised name with bad parameters (K < 2; a size on
      count_3).
  """
  if name in NCF_TASKS:
    return UniformTask(name, name)
  match = _SIZED.match(name)
  if not match:
    return None
  base, k = match["base"], int(match["k"])
  if base == "count_3":
    raise ValueError(f"task {name!r}: count_3 has no alphabet size (it is "
                     "a^n b^n c^n)")
  if base in NCF_TASKS:
    return UniformTask(name, base, alphabet_size=k)
  if base in CAPACITY_FAMILIES:
    from nsrnn_jax import languages  # pylint: disable=g-import-not-at-top
    k = _check_alphabet_size(name, k)
    alphabet, grammar = _capacity_spec(base, k)
    language = languages.Language(name, alphabet, grammar,
                                  preserve_start=preserve_start)
    shape = None
    if base == "dyck":
      shape = languages.Language(f"{name}_shape", ("(", ")"),
                                 _dyck_grammar(1),
                                 preserve_start=preserve_start)
    return CapacityTask(language, base, k, shape)
  return None
