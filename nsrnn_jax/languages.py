"""The paper's five formal-language tasks (section 5.1, Appendices B and C).

Each task is a PCFG with the parameters the authors' code used
(`shared/docs/reference-behaviour.md` §5.1), with f(mu) = 1 - 1/(mu + 1):

=================  =======================  ==================================
task               alphabet (id order)      parameters
=================  =======================  ==================================
marked_reversal    0 1 #                    mu = 60
unmarked_reversal  0 1                      mu = 60
padded_reversal    0 1                      mu_c = 60, mu_p = 30
dyck               ( ) [ ]                  mu_s = 1, nesting f(mu_n - 1), 40
hardest_cfl        ( ) [ ] , ; $            c=u=f(.5), v=f(1), q=.25,
                                            s=f(1.5), t=f(3)
=================  =======================  ==================================

Dyck uses f(mu_n - 1) = f(39) for nesting, as the authors' code does (the
paper writes f(mu_n)). Before sampling, epsilon and unary rules are removed
with the authors' transformation (see `nsrnn_jax.pcfg`), which by default
changes the top-level Dyck and padded-reversal distributions exactly as in
the paper's experiments; `get(name, preserve_start=True)` gives the
distribution-preserving variant.

Usage:

  lang = languages.get("dyck")
  lang.valid_lengths(40, 80)          # [40, 42, ..., 80]
  w = lang.sample(40, np.random.default_rng(0))
  lang.log_prob(w), lang.length_log_prob(40)
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import numpy as np

from nsrnn_jax import pcfg
from nsrnn_jax import tasks_ncf

TASKS = ("marked_reversal", "unmarked_reversal", "padded_reversal", "dyck",
         "hardest_cfl")
# The CoNLL 2020 tasks plus the later papers' tasks (`nsrnn_jax.tasks_ncf`:
# non-context-free tasks, alphabet-size variants `<family>_k<K>`).
ALL_TASKS = TASKS + tasks_ncf.TASKS

_f = pcfg.mean_to_continue_prob


def marked_reversal_grammar(mean_length: float = 60) -> pcfg.PCFG:
  """S -> 0S0 | 1S1 (f(mu)/2 each) | # (1 - f(mu)); # is id 2."""
  p = _f(mean_length)
  return pcfg.PCFG("S", [("S", (0, "S", 0), p / 2), ("S", (1, "S", 1), p / 2),
                         ("S", (2,), 1 - p)], num_terminals=3)


def unmarked_reversal_grammar(mean_length: float = 60) -> pcfg.PCFG:
  """S -> 0S0 | 1S1 (f(mu)/2 each) | eps (1 - f(mu))."""
  p = _f(mean_length)
  return pcfg.PCFG("S", [("S", (0, "S", 0), p / 2), ("S", (1, "S", 1), p / 2),
                         ("S", (), 1 - p)], num_terminals=2)


def padded_reversal_grammar(mean_content_length: float = 60,
                            mean_padding_length: float = 30) -> pcfg.PCFG:
  """S -> aSa (f(mu_c)/2) | T_a ((1-f(mu_c))/2); T_a -> a T_a | eps."""
  p, q = _f(mean_content_length), _f(mean_padding_length)
  rules = [("S", (0, "S", 0), p / 2), ("S", (1, "S", 1), p / 2),
           ("S", ("T0",), (1 - p) / 2), ("S", ("T1",), (1 - p) / 2)]
  for a in (0, 1):
    rules += [(f"T{a}", (a, f"T{a}"), q), (f"T{a}", (), 1 - q)]
  return pcfg.PCFG("S", rules, num_terminals=2)


def dyck_grammar(mean_bracket_splits: float = 1,
                 mean_nesting_depth: float = 40) -> pcfg.PCFG:
  """S -> S T | T; T -> (S) | [S] | () | [] with nesting f(mu_n - 1)."""
  s, t = _f(mean_bracket_splits), _f(mean_nesting_depth - 1)
  rules = [("S", ("S", "T"), s), ("S", ("T",), 1 - s)]
  for left, right in ((0, 1), (2, 3)):
    rules += [("T", (left, "S", right), t / 2), ("T", (left, right),
                                                 (1 - t) / 2)]
  return pcfg.PCFG("S", rules, num_terminals=4)


def hardest_cfl_grammar(mean_num_commas: float = 0.5,
                        mean_short_filler_length: float = 0.5,
                        mean_long_filler_length: float = 2,
                        semicolon_probability: float = 0.25,
                        mean_bracket_splits: float = 1.5,
                        mean_nesting_depth: float = 3) -> pcfg.PCFG:
  """Greibach's hardest CFL exactly as in Appendix B (start symbol S')."""
  lp, rp, lb, rb, comma, semi, dollar = range(7)
  c = _f(mean_num_commas)
  u = _f(mean_short_filler_length)
  v = _f(mean_long_filler_length - 1)
  q = semicolon_probability
  s = _f(mean_bracket_splits)
  t = _f(mean_nesting_depth)
  rules = [
      ("S'", ("R", dollar, "Q", "S", "L", semi), 1),
      ("L", ("L'", comma, "U"), 1),
      ("L'", (comma, "V", "L'"), c),
      ("L'", (), 1 - c),
      ("R", ("U", comma, "R'"), 1),
      ("R'", ("R'", "V", comma), c),
      ("R'", (), 1 - c),
      ("U", ("W", "U"), u),
      ("U", (), 1 - u),
      ("V", ("W", "V"), v),
      ("V", ("W",), 1 - v),
  ]
  rules += [("W", (x,), 0.2) for x in (lp, rp, lb, rb, dollar)]
  rules += [
      ("Q", ("L", semi, "R"), q),
      ("Q", (), 1 - q),
      ("S", ("S", "Q", "T"), s),
      ("S", ("T",), 1 - s),
      ("T", (lp, "Q", "S", "Q", rp), t / 2),
      ("T", (lb, "Q", "S", "Q", rb), t / 2),
      ("T", (lp, "Q", rp), (1 - t) / 2),
      ("T", (lb, "Q", rb), (1 - t) / 2),
  ]
  return pcfg.PCFG("S'", rules, num_terminals=7)


_SPECS: dict[str, tuple[tuple[str, ...], Callable[[], pcfg.PCFG]]] = {
    "marked_reversal": (("0", "1", "#"), marked_reversal_grammar),
    "unmarked_reversal": (("0", "1"), unmarked_reversal_grammar),
    "padded_reversal": (("0", "1"), padded_reversal_grammar),
    "dyck": (("(", ")", "[", "]"), dyck_grammar),
    "hardest_cfl": (("(", ")", "[", "]", ",", ";", "$"), hardest_cfl_grammar),
}


class Language(pcfg.SymbolCodec):
  """A formal-language task: a transformed PCFG with sampling and scoring.

  `encode` / `decode` come from `pcfg.SymbolCodec`.

  Attributes:
    name: the task name (one of `TASKS`).
    alphabet: tuple of terminal strings; index = symbol id.
    vocab_size: len(alphabet).
    grammar: the original PCFG (with epsilon/unary rules).
    normal_grammar: the epsilon/unary-free PCFG actually sampled and scored.
    compiled: the `pcfg.CompiledPCFG` of `normal_grammar`.
  """

  def __init__(self, name: str, alphabet: Sequence[str], grammar: pcfg.PCFG,
               *, preserve_start: bool = False):
    """Builds a language from an (untransformed) PCFG.

    Args:
      name: task name.
      alphabet: terminal strings in id order; must match the grammar.
      grammar: the PCFG as written in the paper.
      preserve_start: use the distribution-preserving removal variant instead
        of the authors' behaviour.
    """
    if len(alphabet) != grammar.num_terminals:
      raise ValueError(f"alphabet has {len(alphabet)} symbols but the grammar "
                       f"has {grammar.num_terminals} terminals")
    self.name = name
    self.alphabet = tuple(alphabet)
    self.vocab_size = len(self.alphabet)
    self.grammar = grammar
    self.normal_grammar = pcfg.remove_epsilon_and_unary_rules(
        grammar, preserve_start=preserve_start)
    self.compiled = pcfg.CompiledPCFG(self.normal_grammar)

  def valid_lengths(self, min_length: int, max_length: int) -> list[int]:
    """Sorted lengths l in [min_length, max_length] with G(l) > 0."""
    return self.compiled.valid_lengths(min_length, max_length)

  def sample(self, length: int, rng: np.random.Generator) -> tuple[int, ...]:
    """A string of exactly `length` symbol ids, drawn from G(w)/G(length).

    `rng`: a numpy Generator or an integer seed (`pcfg.as_generator`)."""
    return self.compiled.sample(length, rng)

  def sample_batch(self, length: int, batch_size: int,
                   rng: np.random.Generator) -> np.ndarray:
    """`batch_size` independent samples of one length as int32 [B, N].

    `rng`: a numpy Generator or an integer seed (`pcfg.as_generator`).
    """
    batch_size = pcfg.check_batch_size(batch_size)
    length = self.compiled.check_sample_length(length)  # Also for B = 0.
    rng = pcfg.as_generator(rng)  # One stream for the whole batch.
    out = np.zeros((batch_size, length), dtype=np.int32)
    for i in range(batch_size):
      out[i] = self.sample(length, rng)
    return out

  def log_prob(self, symbols: Sequence[int] | str) -> float:
    """ln G(w), exact (all derivations); -inf outside the language.

    `symbols`: ids, or the text of the string ("([])", see `encode`).
    """
    return self.compiled.log_prob(self._check(symbols))

  def log_prob_batch(self, symbols_BxN) -> np.ndarray:
    """Vectorised ln G(w) (float64 [B]) for strings of one length."""
    return self.compiled.log_prob_batch(symbols_BxN)

  def length_log_prob(self, length: int) -> float:
    """ln G(length) = ln T[S, length] (-inf if no string has that length)."""
    length = pcfg._check_length(length)  # pylint: disable=protected-access
    return self.compiled.length_log_prob(length)

  def __repr__(self) -> str:
    return f"Language({self.name!r}, alphabet={self.alphabet})"


# The most terms of an exact length table a command may ask for
# (`pcfg.CompiledPCFG.length_table_work`; 30-50 minutes on one core at the
# 0.7-0.8·10^8 terms a second measured for Dyck and the hardest CFL): string
# lengths up to ~68,000 for the hardest CFL, ~180,000 for Dyck.
MAX_LENGTH_TABLE_WORK = 2 * 10 ** 11


def length_out_of_reach(task: str, max_length: int) -> str | None:
  """Why lengths up to `max_length` of `task` are out of reach, or None.

  A PCFG task's exact length table is O(n²) (`length_table_work`): past
  `MAX_LENGTH_TABLE_WORK` terms the commands refuse (with this reason)
  instead of computing, silently, for hours or years. The other tasks
  count their strings in closed form: never out of reach.
  """
  compiled = getattr(get(task), "compiled", None)
  if compiled is None:
    return None
  work = compiled.length_table_work(int(max_length))
  if work <= MAX_LENGTH_TABLE_WORK:
    return None
  # The longest n with n(n−1) <= pairs = 2·limit / R (from an empty
  # table), i.e. (2n−1)² <= 4·pairs + 1.
  pairs = 2 * MAX_LENGTH_TABLE_WORK // len(compiled.bin_prob)
  longest = (math.isqrt(4 * pairs + 1) + 1) // 2
  return (f"the exact length table of {task} up to it sums ~{work:.1e} "
          "terms (O(n²); ~10^8 a second on one core); lengths up to "
          f"{longest:,} are supported")


def get(name: str, *, preserve_start: bool = False) -> Language:
  """The task called `name` (cached; tables grow lazily).

  Args:
    name: one of `ALL_TASKS` (or `<family>_k<K>`, see `tasks_ncf`).
    preserve_start: distribution-preserving epsilon/unary removal instead of
      the authors' (default) behaviour.

  Returns:
    A `Language`, or a `tasks_ncf.UniformTask` (same interface) for the
    non-context-free tasks.

  Raises:
    ValueError: for an unknown name (the message lists the valid tasks) or
      bad task parameters (e.g. an alphabet size < 2).
  """
  if not isinstance(name, str):  # (before the cache: a list is unhashable)
    raise TypeError(f"the task name must be a string, got {name!r}")
  if not isinstance(preserve_start, (bool, np.bool_)):
    raise TypeError(f"preserve_start must be a bool, got {preserve_start!r}")
  return _get(name, bool(preserve_start))


@functools.lru_cache(maxsize=None)
def _get(name: str, preserve_start: bool) -> Language:
  if name not in _SPECS:
    later = tasks_ncf.get(name, preserve_start=preserve_start)
    if later is not None:
      return later
    raise ValueError(f"unknown task {name!r}; valid tasks are: "
                     f"{', '.join(ALL_TASKS)} (and <family>_k<K> for any "
                     "K >= 2, see nsrnn_jax.tasks_ncf)")
  alphabet, make_grammar = _SPECS[name]
  return Language(name, alphabet, make_grammar(),
                  preserve_start=preserve_start)
