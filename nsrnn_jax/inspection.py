"""Inspect a trained NS-RNN on one string: actions, readings, Viterbi run, and
the model's next-symbol distribution beside the true one.

Everything here works on one string at a time and returns plain NumPy arrays
(heatmap-ready, time on the last axis) plus small matplotlib helpers that
return `Figure` objects. The notebook notebooks/inspect_model.ipynb is a thin
driver over these functions.

Time indexing (models.py, reference-behaviour.md section 0). For a string
w_1..w_N the controller runs T = N - 1 steps; step t (1-based) reads w_t and
the reading tau_{t-1}, produces h_t, and update t of the stack uses actions
computed from h_t. Arrays with a T axis have column t - 1 for update t;
readings have N columns, tau_0 (one-hot on the bottom symbol) .. tau_T. The
last update is computed but never read by any logit (models.py docstring).

Action probabilities. For each update t the NS-RNN gives, for every current
PDA state q and stack top x, one distribution over push(r, y), replace(r, y)
and pop(r). Two views are returned by `action_probabilities`:

  * per row: `rows_TxQxSx3` [t, q, x, op] = total probability of op in {push,
    replace, pop} from configuration (q, x), summed over the target (r, y).
    Every row sums to 1. This is what the controller *proposes*.
  * marginal: `marginal_3xT` [op, t] = sum_{q,x} w_t(q, x) rows[t, q, x, op],
    weighted by the forward posterior of the current configuration,
    w_t(q, x) = alpha_{t-1}[q, x] / sum alpha_{t-1} (the normalised forward
    weight of being in state q with x on top just before update t). This is
    the expected action under the stack's own belief. The posterior comes
    from `stack_posteriors`, which replays Lang's algorithm in NumPy float64
    on the traced action probabilities, with the frozen-bottom semantics of
    reference-behaviour.md section 1.5 (so w_1 is one-hot on (0, bottom)).

The RNS- and VRNS-RNN's action weights are unnormalised, so they propose no
probabilities; `run_action_shares` gives the same two views for them as
shares: per row, each operation's share of the weight from (q, x); marginal,
the share of Σα_t of the runs whose update t is the operation (exact under
either bottom and the memory-limited window). Their Viterbi run is the
highest-weight run, and its table prints weights (`ViterbiRun.probabilities`).

True next-symbol distribution. The length-conditioned sampler draws w with
probability G(w) / G(n) among strings of length n, so the exact conditional
is

  p(w_{t+1} = a | w_1..w_t, n) = Z(w_1..w_t a) / Z(w_1..w_t),
  Z(u) = sum_{v : |uv| = n} G(uv).

Z(u) is the inside weight of a string whose first |u| positions are the
known symbols and whose remaining positions are wildcards (emission weight 1
for every terminal): summing the emission of one position over all terminals
is exactly the sum over completions. `true_next_symbol_distribution` runs
the compiled grammar's own inside algorithm (`pcfg.CompiledPCFG.log_inside`,
the one that scores the data) once over all (t, a) pairs, so it is exact,
not sampled. The later papers' non-context-free tasks (`tasks_ncf`) have no
grammar; their strings are uniform given the length, and
`UniformTask.next_symbol_distribution` counts completions instead
(`task_grammar` returns the grammar or the task).

Viterbi run. `viterbi_run` calls `ns_stack.viterbi` (max-product Lang's
algorithm) on the traced actions of one string and replays the best run on
an explicit stack (`ns_stack.replay_run`), giving one `StackOp` per update
with the stack contents after it; `ViterbiRun.table()` prints it.

Shape legend: N string length, T = N - 1 updates (T1 = T + 1 time points),
V vocabulary, Q PDA states, S stack symbols (0 = bottom), B batch of
weighted strings, X grammar nonterminals, L1 = N + 1 span lengths.

Public API: `inspect_string` (everything for one string, as an
`Inspection`), `plot_actions`, `plot_readings`, `plot_next_symbol`, and the
pieces `trace`, `action_probabilities`, `stack_posteriors`, `viterbi_run`,
`rns_viterbi_run` (RNS-RNN: unnormalised weights, either bottom, window),
`run_action_shares` (RNS- and VRNS-RNN actions),
`vector_stack_view`, `vrns_viterbi_run`, `plot_vector_readings` (VRNS-RNN),
`plot_superposition_stack` (JM and Gref: their actions and vector readings),
`true_next_symbol_distribution`, `task_grammar`, `tiny_training_config`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.figure
import numpy as np

from nsrnn_jax import pcfg

OPS = ("push", "replace", "pop")
# The baselines' actions in their traces' order (models.JMLM, GrefLM).
JM_OPS = ("push", "pop", "no-op")
GREF_OPS = ("push strength d", "pop strength u")

# ---------------------------------------------------------------------------
# Exact next-symbol distribution from a PCFG
# ---------------------------------------------------------------------------


def true_next_symbol_distribution(grammar: Any,
                                  symbols: Sequence[int]) -> np.ndarray:
  """Exact p(w_{t+1} = a | w_1..w_t, n) of the length-conditioned sampler.

  Args:
    grammar: the `pcfg.CompiledPCFG` the strings are sampled from, or for
      a non-context-free task its `tasks_ncf.UniformTask` (either from
      `task_grammar(task)`), or the task's name or `languages.get` object
      (`as_grammar`).
    symbols: the string w_1..w_n (ids); n = len(symbols).

  Returns:
    probs_NxV: row t (0-based) is the distribution of w_{t+1} given
    w_1..w_t and the length n; row 0 is the distribution of the first
    symbol. Rows sum to 1. Row t is NaN if w_1..w_t has no completion of
    length n (the prefix is impossible).

  Raises:
    ValueError: for an empty string or ids outside the vocabulary.
  """
  grammar = as_grammar(grammar)
  symbols_N = _check_string(symbols, _num_terminals(grammar))
  if not isinstance(grammar, pcfg.CompiledPCFG):
    return grammar.next_symbol_distribution(symbols_N)
  length, vocab = len(symbols_N), grammar.num_terminals
  # One batch over every (t, a): positions < t carry w, position t carries
  # a, positions > t are wildcards.
  weights_TxVxNxV = np.ones((length, vocab, length, vocab))
  known_NxV = np.eye(vocab)[symbols_N]
  for t in range(length):
    weights_TxVxNxV[t, :, :t] = known_NxV[:t]
    weights_TxVxNxV[t, :, t] = np.eye(vocab)
  log_z_NxV = grammar.log_inside(
      weights_TxVxNxV.reshape(length * vocab, length, vocab)).reshape(
          length, vocab)
  top_N1 = np.max(log_z_NxV, axis=1, keepdims=True)
  with np.errstate(invalid="ignore"):
    weights_NxV = np.exp(log_z_NxV - top_N1)
    probs_NxV = weights_NxV / weights_NxV.sum(axis=1, keepdims=True)
  # A prefix without completions has weight 0 for every a: a NaN row.
  return np.where(np.isfinite(top_N1), probs_NxV, np.nan)


def as_grammar(grammar: Any) -> Any:
  """What `true_next_symbol_distribution` reads, from a task name, a
  `languages.get` task or that already (`task_grammar`'s result).

  Raises:
    TypeError: anything else.
  """
  from nsrnn_jax import languages  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import tasks_ncf  # pylint: disable=g-import-not-at-top
  if isinstance(grammar, str):
    return task_grammar(grammar)
  if isinstance(grammar, languages.Language):
    return grammar.compiled
  if isinstance(grammar, (pcfg.CompiledPCFG, tasks_ncf.UniformTask)):
    return grammar
  raise TypeError("grammar must be a task name, languages.get(task) or "
                  f"task_grammar(task), got {type(grammar).__name__}")


def _num_terminals(grammar: Any) -> int:
  """Vocabulary size of a `task_grammar` result (PCFG or uniform task)."""
  if isinstance(grammar, pcfg.CompiledPCFG):
    return grammar.num_terminals
  return grammar.vocab_size


def _text_ids(text: str | Sequence[str],
              alphabet: Sequence[str] | None) -> tuple[int, ...]:
  """A string's text or symbols -> ids (`pcfg.encode_symbols`); needs the
  alphabet."""
  if alphabet is None:
    raise ValueError("the string is text: pass alphabet= (e.g. "
                     "loaded.config.alphabet), or give symbol ids.")
  return pcfg.encode_symbols(text, alphabet)


def _check_string(symbols: Sequence[int], vocab_size: int) -> np.ndarray:
  """Validates a single string of ids; returns an int64 array [N]."""
  symbols_N = np.asarray(symbols)
  if symbols_N.ndim != 1:
    raise ValueError(f"expected one string (a 1-D sequence of ids), got "
                     f"shape {symbols_N.shape}.")
  if symbols_N.size == 0:
    raise ValueError("the string is empty.")
  if not np.issubdtype(symbols_N.dtype, np.integer):
    raise ValueError(f"symbol ids must be integers, got {symbols_N.dtype}.")
  if symbols_N.min() < 0 or symbols_N.max() >= vocab_size:
    raise ValueError(f"symbol ids must lie in [0, {vocab_size}), got "
                     f"[{symbols_N.min()}, {symbols_N.max()}].")
  return symbols_N.astype(np.int64)


# ---------------------------------------------------------------------------
# Lang's algorithm replayed in NumPy float64 (posteriors and Viterbi)
# ---------------------------------------------------------------------------


def _check_actions(push, repl, pop):
  """Validates one string's action probabilities; returns float64 logs."""
  push_TxQxSxQxS = np.asarray(push, dtype=np.float64)
  repl_TxQxSxQxS = np.asarray(repl, dtype=np.float64)
  pop_TxQxSxQ = np.asarray(pop, dtype=np.float64)
  if push_TxQxSxQxS.ndim != 5:
    raise ValueError(f"push must be [T, Q, S, Q, S] (one string), got shape "
                     f"{push_TxQxSxQxS.shape}.")
  t, q, s = push_TxQxSxQxS.shape[:3]
  if push_TxQxSxQxS.shape != (t, q, s, q, s):
    raise ValueError(f"push shape {push_TxQxSxQxS.shape} is not [T, Q, S, Q, "
                     "S].")
  if repl_TxQxSxQxS.shape != (t, q, s, q, s) or pop_TxQxSxQ.shape != (
      t, q, s, q):
    raise ValueError(
        f"shapes do not agree: push {push_TxQxSxQxS.shape}, repl "
        f"{repl_TxQxSxQxS.shape}, pop {pop_TxQxSxQ.shape} (expected "
        f"[T,Q,S,Q,S], [T,Q,S,Q,S], [T,Q,S,Q]).")
  for name, x in (("push", push_TxQxSxQxS), ("repl", repl_TxQxSxQxS),
                  ("pop", pop_TxQxSxQ)):
    if not np.all(np.isfinite(x)) or np.any(x < 0):
      raise ValueError(f"{name} must hold finite non-negative weights "
                       "(probabilities, not log-probabilities).")
  with np.errstate(divide="ignore"):
    return (np.log(push_TxQxSxQxS), np.log(repl_TxQxSxQxS),
            np.log(pop_TxQxSxQ))


_logsumexp = pcfg.logsumexp  # −inf-safe, NumPy


def _forward_log_alpha(push, repl, pop) -> np.ndarray:
  """Lang's algorithm for one string in the log semiring (float64).

  Frozen-bottom semantics (reference-behaviour.md section 1.5): the initial
  bottom exists only as alpha_0, so update 1 can only push and the symbol on
  the bottom is never popped. Written out in NumPy (rather than calling
  ns_stack, whose public `run` returns only the q-marginalised readings)
  because the action marginal needs alpha per (q, x).

  Args:
    push, repl, pop: action probabilities [T, Q, S, Q, S] / [T, Q, S, Q].

  Returns:
    log_alpha_T1xQxS: ln alpha_t[q, x] for t = 0..T.
  """
  log_push, log_repl, log_pop = _check_actions(push, repl, pop)
  num_t, q, s = log_push.shape[:3]
  # gamma[i, j] = ln gamma[i -> j][q, x, r, y] (-inf outside 0 <= i < j).
  gamma = np.full((num_t + 1, num_t + 1, q, s, q, s), -np.inf)
  alpha = np.full((num_t + 1, q, s), -np.inf)
  alpha[0, 0, 0] = 0.0
  for j in range(1, num_t + 1):
    column = np.full((j, q, s, q, s), -np.inf)
    column[j - 1] = log_push[j - 1]
    if j >= 2:
      # R[i,q,x,r,y] = sum_{s,z} gamma[i->j-1][q,x,s,z] repl[s,z,r,y]
      terms = (gamma[:j - 1, j - 1][..., None, None]
               + log_repl[j - 1][None, None, None])  # i,q,x,s,z,r,y
      column[:j - 1] = _logsumexp(terms, (3, 4))
    if j >= 3:
      # M[k,t,y,r] = sum_{s,z} gamma[k->j-1][t,y,s,z] pop[s,z,r], k >= 1
      m_val = _logsumexp(gamma[1:j - 1, j - 1][..., None]
                         + log_pop[j - 1][None, None, None], (3, 4))
      # P[i,q,x,r,y] = sum_{k,t} gamma[i->k][q,x,t,y] M[k,t,y,r]
      p_terms = (gamma[:j - 2, 1:j - 1][..., None]       # i,k,q,x,t,y,_
                 + m_val[None, :, None, None])           # _,k,_,_,t,y,r
      pop_val = np.swapaxes(_logsumexp(p_terms, (1, 4)), 3, 4)  # i,q,x,r,y
      column[:j - 2] = np.logaddexp(column[:j - 2], pop_val)
    gamma[:j, j] = column
    # alpha[j][r,y] = sum_{i,q,x} alpha[i][q,x] gamma[i->j][q,x,r,y]
    alpha[j] = _logsumexp(alpha[:j, :, :, None, None] + column, (0, 1, 2))
  return alpha


def stack_posteriors(push, repl, pop) -> dict[str, np.ndarray]:
  """Forward weights of the stack for one string, in float64.

  Args:
    push: [T, Q, S, Q, S] push probabilities (e.g. `trace["actions"]["push"]`
      of one batch element).
    repl: [T, Q, S, Q, S] replace probabilities.
    pop: [T, Q, S, Q] pop probabilities.

  Returns:
    {"posterior_T1xQxS": alpha_t normalised over (q, x), t = 0..T;
     "readings_T1xS": tau_t = the posterior summed over q (what the
     controller reads); "log_mass_T1": ln sum alpha_t (below 0: mass lost to
     the frozen bottom)}.
  """
  alpha_T1xQxS = _forward_log_alpha(push, repl, pop)
  log_mass_T1 = _logsumexp(alpha_T1xQxS, (1, 2))
  with np.errstate(invalid="ignore"):
    posterior_T1xQxS = np.exp(alpha_T1xQxS - log_mass_T1[:, None, None])
  return {"posterior_T1xQxS": posterior_T1xQxS,
          "readings_T1xS": posterior_T1xQxS.sum(axis=1),
          "log_mass_T1": log_mass_T1}


@dataclasses.dataclass(frozen=True)
class StackOp:
  """One update of a PDA run.

  Attributes:
    time: update number t (1-based; update t uses actions from h_t).
    op: "push", "replace" or "pop".
    state: PDA state before the update (q).
    top: stack top before the update (x).
    new_state: PDA state after the update (r).
    symbol: pushed / replacing symbol y (None for pop).
    log_weight: ln of this transition's probability.
    stack: stack contents after the update, bottom first (stack[0] = 0 is
      the bottom symbol).
  """
  time: int
  op: str
  state: int
  top: int
  new_state: int
  symbol: int | None
  log_weight: float
  stack: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ViterbiRun:
  """The most probable (highest-weight) PDA run for one string.

  Attributes:
    log_prob: ln of the run's probability (sum of the ops' log_weight); a
      log-weight when the actions are unnormalised (RNS- and VRNS-RNN).
    ops: one StackOp per update t = 1..T, in order.
    probabilities: every (update, state, top) row of the actions the run
      was decoded from sums to 1, so weights are probabilities; False for
      unnormalised actions (the text views then say "weight").
  """
  log_prob: float
  ops: tuple[StackOp, ...]
  probabilities: bool = True

  def summary(self) -> str:
    """One line: the run's probability (or weight, for unnormalised actions)."""
    if self.probabilities:
      return f"run probability {np.exp(self.log_prob):.4g}"
    return (f"run weight {np.exp(self.log_prob):.4g} (unnormalised action "
            "weights: a product of weights, not a probability)")

  def table(self, input_symbols: Sequence[str] | None = None,
            stack_names: Sequence[str] | None = None) -> str:
    """The run as a text table: one line per update with the stack after it.

    Args:
      input_symbols: optional strings of the symbols read: update t is
        computed after reading input symbol t (shown in column "read").
      stack_names: optional names of stack symbols (default "⊥", "1", ...).
    """
    def name(y):
      if stack_names is not None:
        return str(stack_names[y])
      return "⊥" if y == 0 else str(y)
    weight = "p" if self.probabilities else "weight"
    lines = [f"{'t':>3}  {'read':<4} {'operation':<22} {weight:>7}  stack "
             "(bottom → top)"]
    for op in self.ops:
      if op.op == "pop":
        what = f"pop {name(op.top)}"
      elif op.op == "push":
        what = f"push {name(op.symbol)}"
      else:
        what = f"replace {name(op.top)}→{name(op.symbol)}"
      what = f"q{op.state}: {what} → q{op.new_state}"
      read = ""
      if input_symbols is not None and op.time - 1 < len(input_symbols):
        read = str(input_symbols[op.time - 1])
      lines.append(f"{op.time:>3}  {read:<4} {what:<22} "
                   f"{np.exp(op.log_weight):7.4f}  "
                   f"{' '.join(name(y) for y in op.stack)}")
    return "\n".join(lines)


def _viterbi_run(actions, stacks, log_push, log_repl, log_pop) -> ViterbiRun:
  """A decoded run's operations, each with its log-weight and the stack after.

  `actions` are (j, kind, q, r, y) tuples and `stacks` their replay (stack
  contents after each update, as from `ns_stack.replay_run`).
  """
  ops = []
  for j, kind, q, r, y in actions:
    x = stacks[j - 1][-1]
    if kind == "push":
      log_weight, symbol = log_push[j - 1, q, x, r, y], y
    elif kind == "replace":
      log_weight, symbol = log_repl[j - 1, q, x, r, y], y
    else:
      log_weight, symbol = log_pop[j - 1, q, x, r], None
    ops.append(StackOp(int(j), kind, int(q), int(x), int(r),
                       None if symbol is None else int(symbol),
                       float(log_weight), tuple(int(a) for a in stacks[j])))
  # Probabilities iff every row of the actions sums to 1 (NS-RNN, or an
  # RNS-RNN with stack_normalize).
  row_totals = (np.exp(log_push).sum(axis=(3, 4))
                + np.exp(log_repl).sum(axis=(3, 4)) + np.exp(log_pop).sum(3))
  # Re-total in float64 (the stacks may run in float32).
  return ViterbiRun(float(sum(op.log_weight for op in ops)), tuple(ops),
                    bool(np.all(np.abs(row_totals - 1) < 1e-4)))


def viterbi_run(push, repl, pop) -> ViterbiRun:
  """The most probable PDA run of one string, with the stack after each op.

  Uses `ns_stack.viterbi` (max-product Lang's algorithm) and replays the run
  on an explicit stack with `ns_stack.replay_run`, which also checks that
  the run is valid under the frozen-bottom semantics. The run ends in the
  best final configuration (the NS-RNN has no accepting states).

  Args:
    push, repl, pop: action probabilities of one string, as for
      `stack_posteriors`.

  Returns:
    A ViterbiRun with one StackOp per update.

  Raises:
    ValueError: for malformed weights, or if no run has positive weight.
  """
  from nsrnn_jax import ns_stack  # pylint: disable=g-import-not-at-top
  log_push, log_repl, log_pop = _check_actions(push, repl, pop)
  num_t = log_push.shape[0]
  if num_t == 0:
    return ViterbiRun(0.0, ())
  ((actions, log_prob),) = ns_stack.viterbi(log_push[None], log_repl[None],
                                            log_pop[None])
  if not np.isfinite(log_prob) or len(actions) != num_t:
    raise ValueError("no PDA run has positive probability.")
  stacks, _ = ns_stack.replay_run(actions)
  return _viterbi_run(actions, stacks, log_push, log_repl, log_pop)


def _check_log_actions(log_push, log_repl, log_pop):
  """One string's action log-weights as float64, shapes checked."""
  log_push, log_repl, log_pop = (np.asarray(a, np.float64)
                                 for a in (log_push, log_repl, log_pop))
  if log_push.ndim != 5:
    raise ValueError(f"log_push must be [T, Q, S, Q, S] (one string), got "
                     f"shape {log_push.shape}.")
  num_t, q, s = log_push.shape[:3]
  if log_repl.shape != log_push.shape or log_pop.shape != (num_t, q, s, q):
    raise ValueError(f"action shapes do not agree: log_repl / log_pop must "
                     f"be [T, Q, S, Q, S] / [T, Q, S, Q] = {log_push.shape} "
                     f"/ {(num_t, q, s, q)}, got {log_repl.shape} / "
                     f"{log_pop.shape}.")
  return log_push, log_repl, log_pop


def rns_viterbi_run(log_push, log_repl, log_pop, bottom: str = "fixed",
                    window: int | None = None) -> ViterbiRun:
  """The highest-weight PDA run of one string for the RNS-RNN (model 'rns').

  Like `viterbi_run`, but for any finite log-weights (the RNS-RNN's actions
  are unnormalised), either bottom semantics ("fixed": the ICLR 2023 fix,
  "frozen": CoNLL 2020 / ICLR 2022) and the memory-limited stack (window D).
  Uses `rns_stack.viterbi` (max-plus recurrence in float64) and checks the
  run on an explicit stack with `rns_stack.replay_run`. StackOp.log_weight
  is the transition's log-weight; ViterbiRun.log_prob their sum (a log
  weight, not a log probability, when the actions are unnormalised).

  Args:
    log_push, log_repl, log_pop: one string's action log-weights [T, Q, S,
      Q, S], [T, Q, S, Q, S], [T, Q, S, Q] (e.g. a trace's
      `action_log_weights`).
    bottom: "fixed" or "frozen".
    window: None (unlimited) or D >= 1.

  Returns:
    A ViterbiRun with one StackOp per update.

  Raises:
    ValueError: for malformed weights, or if no run has finite weight.
  """
  from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top
  log_push, log_repl, log_pop = _check_log_actions(log_push, log_repl,
                                                   log_pop)
  num_t = log_push.shape[0]
  if num_t == 0:
    return ViterbiRun(0.0, ())
  ((actions, log_weight),) = rns_stack.viterbi(
      log_push[None], log_repl[None], log_pop[None], bottom, window)
  if not np.isfinite(log_weight) or len(actions) != num_t:
    raise ValueError("no PDA run has finite weight.")
  stacks, _ = rns_stack.replay_run(actions, bottom=bottom)
  return _viterbi_run(actions, stacks, log_push, log_repl, log_pop)


# ---------------------------------------------------------------------------
# The vector stack (VRNS-RNN)
# ---------------------------------------------------------------------------


def _check_vector_inputs(log_push, log_repl, log_pop, push_vectors,
                         bottom_vector):
  log_push, log_repl, log_pop = _check_log_actions(log_push, log_repl,
                                                   log_pop)
  num_t = log_push.shape[0]
  vectors = np.asarray(push_vectors, np.float64)
  bottom = np.asarray(bottom_vector, np.float64)
  if bottom.ndim != 1 or vectors.shape != (num_t, bottom.shape[0]):
    raise ValueError(f"push_vectors must be [T={num_t}, M] and bottom_vector "
                     f"[M], got {vectors.shape} and {bottom.shape}.")
  return log_push, log_repl, log_pop, vectors, bottom


def _optional_window(window):
  """None (unlimited) or the window D as limited_stack checks it: 0, 2.7
  or True are refused, not run as unlimited or as 2."""
  if window is None:
    return None
  from nsrnn_jax import limited_stack  # pylint: disable=g-import-not-at-top
  limited_stack.check_window(window)
  return int(window)


def vector_stack_view(log_push, log_repl, log_pop, push_vectors,
                      bottom_vector, broadcast_bottom: bool = False,
                      window: int | None = None) -> dict[str, np.ndarray]:
  """What the VRNS-RNN's stack holds after each update of one string.

  Recomputed exactly in float64 (`vrns_stack.run` for the vector reading,
  `rns_stack.run` with the fixed bottom for the scalar part, which is the
  VRNS's own γ/α recurrence; rns-vrns-reference.md §1.5, §3.2; with a
  window, `limited_vrns.run` and `limited_stack.run`).

  Args:
    log_push, log_repl, log_pop: the action log-weights [T, Q, S, Q, S],
      [T, Q, S, Q, S], [T, Q, S, Q] (a trace's `action_log_weights`).
    push_vectors: [T, M], the vector v_t pushed by update t (in [0, 1]).
    bottom_vector: [M], v_⊥.
    broadcast_bottom: the authors' broadcast bottom vector (the model's
      `broadcast_bottom_vector`).
    window: None (unlimited) or D >= 1 (the memory-limited stack, the
      model's `window`).

  Returns:
    A dict of arrays, time on the first axis, j = 0..T (T1 = T + 1):
      state_top_T1xQxS: p_j(r, y) = α_j[r, y] / Σα_j, the distribution of
        (PDA state, top symbol) under the global run weights.
      readings_T1xQxSxM: ρ_j[r, y, :] = E[𝟙(state = r, top = y) vec(top)],
        the reading the controller gets (flattened (r, y, k) in the model).
      expected_top_T1xM: Σ_{r,y} ρ_j[r, y, :] = E[vec(top)] (with the
        broadcast bottom: plus the phantom start configurations' share).
      log_mass_T1: log Σα_j (log-weights, unnormalised).
      rows_TxQxSx3: per update t (row t − 1) and configuration (q, x), the
        share of push / replace / pop in the total action weight from
        (q, x) -- what the controller proposes.
      marginal_3xT: [op, t − 1] the posterior share, among all runs of t
        updates, of the runs whose update t is op: push and replace from
        α_{t−1}, pop the rest of Σα_t (exact; each column sums to 1).
  """
  import jax  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import vrns_stack  # pylint: disable=g-import-not-at-top
  log_push, log_repl, log_pop, vectors, bottom = _check_vector_inputs(
      log_push, log_repl, log_pop, push_vectors, bottom_vector)
  with np.errstate(divide="ignore"):
    log_v, log_b = np.log(vectors), np.log(bottom)
  acts = (log_push[None], log_repl[None], log_pop[None])
  window = _optional_window(window)
  with jax.enable_x64(True):
    if window is not None:
      from nsrnn_jax import limited_stack  # pylint: disable=g-import-not-at-top
      from nsrnn_jax import limited_vrns  # pylint: disable=g-import-not-at-top
      rho, log_mass, _ = limited_vrns.run(
          *acts, log_v[None], log_b[None], int(window),
          bool(broadcast_bottom))
      log_alpha_hat = limited_stack.run(*acts, int(window), "fixed")[0]
      start = limited_stack.initial_state(1, int(window), *log_push.shape[1:3],
                                          "fixed", log_alpha_hat.dtype)
      log_alpha_hat = np.concatenate(
          [np.asarray(start.a_hat)[:, None], np.asarray(log_alpha_hat)],
          axis=1)
    else:
      rho, log_mass = vrns_stack.run(
          *acts, log_v[None], log_b, broadcast_bottom=bool(broadcast_bottom))
      log_alpha_hat = rns_stack.run(*acts, "fixed")[0]
    rho, log_mass, log_alpha_hat = (np.asarray(a, np.float64)[0]
                                    for a in (rho, log_mass, log_alpha_hat))
  # The scalar part is the RNS stack's with the fixed bottom.
  shares = run_action_shares(log_push, log_repl, log_pop, "fixed", window)
  state_top = np.exp(log_alpha_hat)
  return {"state_top_T1xQxS": state_top, "readings_T1xQxSxM": rho,
          "expected_top_T1xM": rho.sum(axis=(1, 2)), "log_mass_T1": log_mass,
          **shares}


def run_action_shares(log_push, log_repl, log_pop, bottom: str = "fixed",
                      window: int | None = None) -> dict[str, np.ndarray]:
  """What the RNS-RNN's (or VRNS-RNN's) PDA does at each update, exactly.

  For unnormalised action weights the controller gives no "probability of
  push"; two views are:

  * per row: `rows_TxQxSx3` [t − 1, q, x, op] = the share of op in {push,
    replace, pop} in the total action weight from configuration (q, x) at
    update t, summed over the target (r, y): what the controller proposes.
    Each row sums to 1 (rows whose weights are all zero: 0).
  * marginal: `marginal_3xT` [op, t − 1] = the share, in Σα_t (the weight
    of all runs of t updates), of the runs whose update t is op: what the
    stack does under its own semantics. Each column sums to 1 (0 once every
    run died).

  Computed in float64. Without a window, push and replace act on the top of
  every run of t − 1 updates, so their shares are Σ_{q,x} α_{t−1}[q, x]
  times the row's push (replace) weight, over Σα_t (the frozen bottom
  allows no replace of ⊥ at update 1), and pop is the rest. With a window
  D a replaced top can fall out of the window, so each update's shares come
  from Lang's algorithm itself (`limited_stack.run`): Σα_t with update t
  restricted to one operation (the others −inf), over Σα_t; one run of the
  algorithm per update.

  Args:
    log_push, log_repl, log_pop: one string's action log-weights [T, Q, S,
      Q, S], [T, Q, S, Q, S], [T, Q, S, Q] (a trace's `action_log_weights`;
      −inf allowed).
    bottom: "fixed" (ICLR 2023) or "frozen" (CoNLL 2020 / ICLR 2022).
    window: None (unlimited) or D >= 1 (the memory-limited stack).

  Returns:
    {"rows_TxQxSx3", "marginal_3xT"} as float64 arrays.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import limited_stack  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top
  log_push, log_repl, log_pop = _check_log_actions(log_push, log_repl,
                                                   log_pop)
  num_t, q, s = log_push.shape[:3]
  per_op = np.stack([_logsumexp(log_push.reshape(num_t, q, s, -1), -1),
                     _logsumexp(log_repl.reshape(num_t, q, s, -1), -1),
                     _logsumexp(log_pop, -1)], -1)          # [T, Q, S, 3]
  total = _logsumexp(per_op, -1)[..., None]
  with np.errstate(invalid="ignore"):
    rows = np.where(np.isfinite(total), np.exp(per_op - total), 0.0)
  marginal = np.zeros((3, num_t))
  window = _optional_window(window)
  with jax.enable_x64(True):
    if window is not None:
      def log_mass(push, repl, pop):  # log Σα_j, j = 1..T: [B, T]
        return np.asarray(limited_stack.run(push, repl, pop, int(window),
                                            bottom)[1])
      full = log_mass(log_push[None], log_repl[None], log_pop[None])[0]
      for t in np.flatnonzero(np.isfinite(full)):
        # Element op keeps only op's weights at update t.
        push, repl, pop = (np.repeat(a[None], 3, axis=0)
                           for a in (log_push, log_repl, log_pop))
        push[[1, 2], t], repl[[0, 2], t], pop[[0, 1], t] = (-np.inf,) * 3
        marginal[:, t] = np.exp(log_mass(push, repl, pop)[:, t] - full[t])
      return {"rows_TxQxSx3": rows, "marginal_3xT": marginal}
    log_alpha_hat, log_mass = (np.asarray(a, np.float64)[0] for a in
                               rns_stack.run(log_push[None], log_repl[None],
                                             log_pop[None], bottom))
  for t in range(1, num_t + 1):
    with np.errstate(invalid="ignore"):  # −inf − (−inf) once every run died
      shift = log_mass[t - 1] - log_mass[t]
    if not np.isfinite(shift):
      continue  # every run died: no share
    w = np.exp(log_alpha_hat[t - 1])
    for op in (0, 1):
      if op == 1 and t == 1 and bottom == rns_stack.FROZEN:
        continue  # ⊥ alone on the stack: the frozen bottom is never replaced
      marginal[op, t - 1] = np.sum(w * np.exp(per_op[t - 1, :, :, op]
                                              + shift))
    marginal[2, t - 1] = max(0.0, 1.0 - marginal[0, t - 1]
                             - marginal[1, t - 1])
  return {"rows_TxQxSx3": rows, "marginal_3xT": marginal}


def vrns_viterbi_run(log_push, log_repl, log_pop, push_vectors,
                     bottom_vector, window: int | None = None
                     ) -> tuple[ViterbiRun, np.ndarray]:
  """The VRNS-RNN's highest-weight discrete PDA run and its top vectors.

  The vectors do not weight runs (they only ride along), so the best run of
  the vector stack is the RNS-RNN's (fixed bottom, the same `window`;
  `rns_viterbi_run`).
  Replaying it with the elements' vectors (v_t for the element pushed by
  update t, v_⊥ for the bottom; a replace keeps the element's vector) gives
  the vector on top after each update.

  Returns:
    (run, top_vectors_T1xM): the ViterbiRun and, for j = 0..T, the vector of
    the top element after update j along that run.
  """
  log_push, log_repl, log_pop, vectors, bottom = _check_vector_inputs(
      log_push, log_repl, log_pop, push_vectors, bottom_vector)
  run = rns_viterbi_run(log_push, log_repl, log_pop, bottom="fixed",
                        window=window)
  stack = [bottom]
  tops = [bottom]
  for op in run.ops:
    if op.op == "push":
      stack.append(vectors[op.time - 1])
    elif op.op == "pop":
      stack.pop()
    tops.append(stack[-1])
  return run, np.stack(tops)


# ---------------------------------------------------------------------------
# Grammars of the tasks
# ---------------------------------------------------------------------------


def task_grammar(task: str) -> Any:
  """What `true_next_symbol_distribution` needs for a task's strings.

  For a context-free task the compiled grammar its strings are sampled from
  and scored with (`languages.get(task).compiled`, after the authors'
  ε/unary removal); for a non-context-free task (`tasks_ncf.UniformTask`:
  no grammar, uniform strings of each length) the task itself.
  """
  from nsrnn_jax import languages  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import tasks_ncf  # pylint: disable=g-import-not-at-top
  lang = languages.get(task)
  if isinstance(lang, tasks_ncf.UniformTask):
    return lang
  return lang.compiled


# ---------------------------------------------------------------------------
# A tiny training run (notebooks, tests)
# ---------------------------------------------------------------------------


def tiny_training_config(base: Any, task: str = "marked_reversal",
                         model: str = "ns", seed: int = 1, **overrides: Any
                         ) -> Any:
  """A copy of `base` (configs/default.py) shrunk to train in seconds on CPU.

  Strings of length 5-11 (test 5-13), 30 batches of 5, 4 validation
  batches, 4 epochs, a hidden size of 12, every batch padded to length 13
  (one compilation). Enough for the notebooks to show
  every view on a real trained workdir; not a meaningful experiment.

  Args:
    base: the default ConfigDict (`configs.default.get_config()`).
    task: languages task name.
    model: "lstm", "jm", "gref" or "ns".
    seed: used for the data, parameter and shuffle seeds.
    **overrides: further fields to set.

  Returns:
    A new ConfigDict.
  """
  config = base.copy_and_resolve_references()
  fields = dict(
      task=task, model=model, hidden_size=12, batch_size=5,
      num_train_batches=30, num_valid_batches=4, train_min_length=5,
      train_max_length=11, test_min_length=5, test_max_length=13,
      test_strings_per_length=5, max_epochs=4, learning_rate=0.01,
      data_seed=seed, param_seed=seed, shuffle_seed=seed,
      progress_bar=False, stack_embedding_size=4,
      # One padded shape for every batch: a single compilation per step fn.
      compile_strategy="bucket", length_buckets=(13,))
  fields.update(overrides)
  for key, value in fields.items():
    if key not in config:
      raise ValueError(f"the base config has no field {key!r}.")
    config[key] = value
  return config


# ---------------------------------------------------------------------------
# Tracing a trained model on one string
# ---------------------------------------------------------------------------


def action_probabilities(push, repl, pop) -> dict[str, np.ndarray]:
  """Heatmap-ready action probabilities of one string (see module docstring).

  Args:
    push, repl, pop: probabilities [T,Q,S,Q,S], [T,Q,S,Q,S], [T,Q,S,Q].

  Returns:
    {"rows_TxQxSx3": per-(q, x) totals of (push, replace, pop);
     "marginal_3xT": the totals weighted by the forward posterior of (q, x)
     before each update; "posterior_T1xQxS", "readings_T1xS", "log_mass_T1"
     from `stack_posteriors`}.
  """
  post = stack_posteriors(push, repl, pop)
  push = np.asarray(push, np.float64)
  repl = np.asarray(repl, np.float64)
  pop = np.asarray(pop, np.float64)
  rows_TxQxSx3 = np.stack([push.sum(axis=(3, 4)), repl.sum(axis=(3, 4)),
                           pop.sum(axis=3)], axis=-1)
  # Update t acts on the configuration reached after t - 1 updates.
  weights_TxQxS = post["posterior_T1xQxS"][:-1]
  marginal_3xT = np.einsum("tqx,tqxo->ot", weights_TxQxS, rows_TxQxSx3)
  return {"rows_TxQxSx3": rows_TxQxSx3, "marginal_3xT": marginal_3xT, **post}


@dataclasses.dataclass(frozen=True)
class Inspection:
  """What a model does on one string (all NumPy, float64).

  Attributes:
    symbols: the string w_1..w_N (ids).
    alphabet: symbol strings (index = id), or None.
    model_probs_NxV: row t = the model's p(w_{t+1} | w_1..w_t).
    true_probs_NxV: the sampler's exact p(w_{t+1} | w_1..w_t, N), or None.
    readings_SxN: tau_0..tau_{N-1}, the distribution of the stack top
      (NS-RNN: as traced; RNS- and VRNS-RNN: the marginal of their (state,
      top) distribution).
    actions: the stack's actions per update, `rows_TxQxSx3` and
      `marginal_3xT`: `action_probabilities` (NS-RNN: the proposal under
      the posterior of (q, x)) or `run_action_shares` (RNS- and VRNS-RNN:
      the share of the runs of t updates whose update t is the operation).
    viterbi: the most probable (highest-weight) PDA run (NS-, RNS- and
      VRNS-RNN).
    state_readings_QSxN: the RNS-RNN's readings over (state r, top y), row
      r * S + y (model 'rns' only; readings_SxN then holds their marginal
      over the top symbol). For model 'vrns': the distribution of (state,
      top) p_j(r, y) (the VRNS reading is vectors; see vector_view).
    vector_view: model 'vrns' only: `vector_stack_view` of the traced
      actions (time on the first axis), plus `traced_readings_T1xQxSxM`
      (the readings the controller got, as traced, float32) and, for
      strings of length >= 2, `viterbi_top_vectors_T1xM`
      (`vrns_viterbi_run`).
    baseline_actions: models 'jm' and 'gref', strings of length >= 2:
      {"labels": one per row, "values_RxT": the traced actions per update}.
      JM: the (push, pop, no-op) probabilities, three rows per stack
      ("stack k op" with K > 1 stacks); Gref: the push and pop strengths.
    baseline_readings_MxN: models 'jm' and 'gref': the vector readings
      r_0 (= 0) .. r_{N-1} the controller read (JM with K stacks: the K tops
      concatenated, K * M rows).
    stack_margin: the share stack's product margin on the string, nats
      (`models.PDAStackLM.stack_margin`; NS-, RNS- and VRNS-RNN on the
      'shares' table, else None): above `exact_margin` the model's numbers
      are those of exact arithmetic up to rounding.
    exact_margin: `rns_stack.exact_margin` of the model's float type (with
      stack_margin).
  """
  symbols: np.ndarray
  alphabet: tuple[str, ...] | None
  model_probs_NxV: np.ndarray
  true_probs_NxV: np.ndarray | None = None
  readings_SxN: np.ndarray | None = None
  actions: Mapping[str, np.ndarray] | None = None
  viterbi: ViterbiRun | None = None
  state_readings_QSxN: np.ndarray | None = None
  vector_view: Mapping[str, np.ndarray] | None = None
  baseline_actions: Mapping[str, Any] | None = None
  baseline_readings_MxN: np.ndarray | None = None
  stack_margin: float | None = None
  exact_margin: float | None = None

  @property
  def model_nll_N(self) -> np.ndarray:
    """-ln p_model(w_{t+1} | w_1..w_t) per position."""
    return -np.log(self.model_probs_NxV[np.arange(len(self.symbols)),
                                        self.symbols])

  @property
  def true_nll_N(self) -> np.ndarray | None:
    """-ln p_true(w_{t+1} | w_1..w_t, N) per position (None without PCFG)."""
    if self.true_probs_NxV is None:
      return None
    with np.errstate(divide="ignore"):
      return -np.log(self.true_probs_NxV[np.arange(len(self.symbols)),
                                         self.symbols])

  def symbol_names(self) -> list[str]:
    """The string's symbols as text (ids when there is no alphabet)."""
    if self.alphabet is None:
      return [str(int(a)) for a in self.symbols]
    return [self.alphabet[int(a)] for a in self.symbols]

  def summary(self) -> str:
    """One line: -ln p of the string under the model (and the truth)."""
    line = f"-ln p_model(w) = {self.model_nll_N.sum():.4f}"
    if self.true_nll_N is not None:
      true = self.true_nll_N.sum()
      diff = (self.model_nll_N.sum() - true) / len(self.symbols)
      line += (f"   -ln p_true(w | n) = {true:.4f}   difference "
               f"{diff:+.4f} nats/symbol")
    if self.stack_margin is not None:
      line += f"   stack margin {self.stack_margin:.1f} nats " + (
          "(proven exact)" if self.stack_margin > self.exact_margin else
          f"(not proven exact: below {self.exact_margin:.1f}; the 'log' "
          "table cannot flush)")
    return line

  def next_symbol_table(self) -> str:
    """Per position: the symbol and the model's (and true) probabilities."""
    v = self.model_probs_NxV.shape[1]
    names = (list(self.alphabet) if self.alphabet is not None
             else [str(a) for a in range(v)])
    header = "  t  next  " + "  ".join(
        f"{'model ' + a:>8}" + (f"  {'true ' + a:>7}"
                                if self.true_probs_NxV is not None else "")
        for a in names)
    lines = [header]
    for t, symbol in enumerate(self.symbol_names()):
      cells = []
      for a in range(v):
        cell = f"{self.model_probs_NxV[t, a]:8.3f}"
        if self.true_probs_NxV is not None:
          cell += f"  {self.true_probs_NxV[t, a]:7.3f}"
        cells.append(cell)
      lines.append(f"{t + 1:>3}  {symbol:>4}  " + "  ".join(cells))
    return "\n".join(lines)


# Jitted model methods per (model object, method) ((id, method) -> (model,
# fn)); keeping the model alive keeps its id unique. Jitting the whole trace
# is several times faster than dispatching its operations one by one.
_TRACE_FNS: dict[tuple[int, str], tuple[Any, Any]] = {}


def _apply_jitted(model: Any, params: Any, symbols_N: np.ndarray,
                  method: str) -> Any:
  import jax  # pylint: disable=g-import-not-at-top
  key = (id(model), method)
  if key not in _TRACE_FNS or _TRACE_FNS[key][0] is not model:
    _TRACE_FNS[key] = (model, jax.jit(
        lambda p, x: model.apply({"params": p}, x, method=method)))
  out = _TRACE_FNS[key][1](params, symbols_N[None].astype(np.int32))
  return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64)[0], out)


def trace(model: Any, params: Any, symbols: Sequence[int]) -> dict[str, Any]:
  """`model.apply(..., method="trace")` on one string, as NumPy (batch dropped).

  Raises:
    ValueError: for a malformed string or ids outside the vocabulary.
  """
  symbols_N = _check_string(symbols, int(model.vocab_size))
  return _apply_jitted(model, params, symbols_N, "trace")


def inspect_string(model: Any, params: Any, symbols: Sequence[int] | str,
                   grammar: Any = None,
                   alphabet: Sequence[str] | None = None,
                   eos: bool = False) -> Inspection:
  """Traces `model` on one string and gathers everything the notebook shows.

  Args:
    model: a models.py Linen model (any of the four; the stack views need
      the NS-RNN).
    params: its parameters.
    symbols: the string: ids, or with `alphabet` given its text ("01#10" or
      "0 1 # 1 0", `pcfg.text_symbols`) or a list of its symbols.
    grammar: the task for the true next-symbol distribution: its name,
      `languages.get(name)` or `task_grammar(name)` (`as_grammar`); None
      skips it.
    alphabet: symbol strings for labels.
    eos: the model predicts EOS (trained with config.predict_eos): its last
      output id V is EOS, not a symbol of the string. The next-symbol
      distributions then have an EOS column; the true one is 0 there, since
      the string's length is given (EOS after w_N is not shown).

  Returns:
    An Inspection.
  """
  vocab = int(model.vocab_size) - (1 if eos else 0)
  if vocab < 1:
    raise ValueError("eos=True needs a model with an EOS output (vocabulary "
                     "of at least 2).")
  if alphabet is not None and len(alphabet) != vocab:
    raise ValueError(f"alphabet has {len(alphabet)} symbols, the model "
                     f"{vocab}.")
  if isinstance(symbols, str) or (
      isinstance(symbols, (list, tuple)) and symbols
      and all(isinstance(a, str) for a in symbols)):
    symbols = _text_ids(symbols, alphabet)
  symbols_N = _check_string(symbols, vocab)
  if grammar is not None:
    grammar = as_grammar(grammar)
  if grammar is not None and _num_terminals(grammar) != vocab:
    raise ValueError(f"grammar has {_num_terminals(grammar)} terminals but the "
                     f"model's vocabulary has {vocab} symbols.")
  traced = trace(model, params, symbols_N)
  logits_NxV = traced["logits"]
  log_z_N = np.log(np.sum(np.exp(logits_NxV - logits_NxV.max(-1,
                                                             keepdims=True)),
                          axis=-1)) + logits_NxV.max(-1)
  model_probs_NxV = np.exp(logits_NxV - log_z_N[:, None])
  true_probs_NxV = None
  if grammar is not None:
    true_probs_NxV = true_next_symbol_distribution(grammar, symbols_N)
    if eos:
      true_probs_NxV = np.pad(true_probs_NxV, ((0, 0), (0, 1)))
  if eos and alphabet is not None:
    alphabet = (*alphabet, "EOS")
  readings_SxN = actions = viterbi = state_readings = vector_view = None
  baseline_actions = baseline_readings = None
  if "bottom_vector" in traced:
    # VRNS-RNN: vector readings; the scalar part is the RNS stack's (fixed
    # bottom), so its (state, top) distribution and Viterbi run apply.
    acts = traced["action_log_weights"]
    vector_view = vector_stack_view(
        acts["push"], acts["repl"], acts["pop"], traced["push_vectors"],
        traced["bottom_vector"], bool(model.broadcast_bottom_vector),
        window=int(model.window) or None)
    vector_view["traced_readings_T1xQxSxM"] = np.asarray(traced["readings"])
    state_top = vector_view["state_top_T1xQxS"]
    state_readings = state_top.reshape(state_top.shape[0], -1).T
    readings_SxN = state_top.sum(axis=1).T
    if len(symbols_N) > 1:
      actions = {k: vector_view[k] for k in ("rows_TxQxSx3", "marginal_3xT")}
      viterbi, tops = vrns_viterbi_run(
          acts["push"], acts["repl"], acts["pop"], traced["push_vectors"],
          traced["bottom_vector"], window=int(model.window) or None)
      vector_view["viterbi_top_vectors_T1xM"] = tops
  elif "action_log_weights" in traced:
    # RNS-RNN: readings over (state, top); Viterbi under its own semantics.
    acts = traced["action_log_weights"]
    q, s = acts["pop"].shape[1:3]
    state_readings = np.asarray(traced["state_readings"]).T
    readings_SxN = state_readings.reshape(q, s, -1).sum(axis=0)
    if len(symbols_N) > 1:
      actions = run_action_shares(acts["push"], acts["repl"], acts["pop"],
                                  bottom=model.bottom,
                                  window=int(model.window) or None)
      viterbi = rns_viterbi_run(acts["push"], acts["repl"], acts["pop"],
                                bottom=model.bottom,
                                window=int(model.window) or None)
  elif isinstance(traced.get("actions"), Mapping) and "pop" in traced[
      "actions"]:
    acts = traced["actions"]
    readings_SxN = np.asarray(traced["readings"]).T
    if len(symbols_N) > 1:
      actions = action_probabilities(acts["push"], acts["repl"], acts["pop"])
      viterbi = viterbi_run(acts["push"], acts["repl"], acts["pop"])
  elif "push_vectors" in traced:
    # JM or Gref: deterministic superposition / stratification stacks.
    baseline_readings = np.asarray(traced["readings"]).T
    if len(symbols_N) > 1:
      acts = np.asarray(traced["actions"])
      if "strengths" in traced:              # Gref: [T, 2]
        labels, values = list(GREF_OPS), acts.T
      else:                                  # JM: [T, 3] or [T, K, 3]
        per_stack = acts[:, None] if acts.ndim == 2 else acts
        k = per_stack.shape[1]
        labels = [f"stack {j + 1} {op}" if k > 1 else op for j in range(k)
                  for op in JM_OPS]
        values = per_stack.reshape(per_stack.shape[0], -1).T
      baseline_actions = {"labels": labels, "values_RxT": values}
  from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top
  margin = exact = None
  if models.has_stack_margin(model):
    margin = float(_apply_jitted(model, params, symbols_N, "stack_margin"))
    exact = rns_stack.exact_margin(model.dtype)
  return Inspection(symbols_N, None if alphabet is None else tuple(alphabet),
                    model_probs_NxV, true_probs_NxV, readings_SxN, actions,
                    viterbi, state_readings, vector_view, baseline_actions,
                    baseline_readings, margin, exact)


# ---------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------


def _stack_symbol_name(y: int) -> str:
  return "⊥" if y == 0 else str(y)


def _heatmap(fig, ax, values, row_labels, col_labels, title, vmax=1.0,
             vmin=0.0, cmap="viridis"):
  """A [rows, cols] heatmap in [vmin, vmax] with labelled ticks, colorbar."""
  image = ax.imshow(values, aspect="auto", cmap=cmap, vmin=vmin,
                    vmax=vmax, interpolation="nearest")
  ax.set_yticks(range(len(row_labels)), row_labels)
  step = max(1, len(col_labels) // 40)
  ax.set_xticks(range(0, len(col_labels), step), col_labels[::step],
                fontsize=7)
  ax.set_title(title, fontsize=10)
  fig.colorbar(image, ax=ax, fraction=0.03, pad=0.01)


def plot_actions(insp: Inspection) -> matplotlib.figure.Figure:
  """Heatmaps of push/replace/pop per update (`Inspection.actions`).

  Top: the marginal (3 x T): for the NS-RNN the actions' probabilities
  weighted by the posterior of (q, x); for the RNS- and VRNS-RNN the share
  of the runs of t updates whose update t is the operation. Bottom: one row
  per (state q, top x, operation), the operation's share of the action
  weight from (q, x). Column t - 1 is update t, labelled with the
  input symbol w_t that the controller had just read.
  """
  if insp.actions is None:
    raise ValueError("no stack actions: inspect an NS-, RNS- or VRNS-RNN "
                     "on a string of length >= 2.")
  rows_TxQxSx3 = insp.actions["rows_TxQxSx3"]
  num_t, q, s, _ = rows_TxQxSx3.shape
  cols = [f"{t + 1}:{a}" for t, a in enumerate(insp.symbol_names()[:num_t])]
  fig = matplotlib.figure.Figure(
      figsize=(max(6.0, 0.18 * num_t + 2), 2.0 + 0.25 * q * s * 3),
      layout="constrained")
  ax_top, ax_rows = fig.subplots(2, 1, height_ratios=[3, 3 * q * s])
  _heatmap(fig, ax_top, insp.actions["marginal_3xT"], list(OPS), cols,
           "actions, weighted by the stack posterior of (q, x)"
           if insp.state_readings_QSxN is None else
           "share of the runs whose update t is the operation")
  labels = [f"q{qq},{_stack_symbol_name(x)} {op}" for qq in range(q)
            for x in range(s) for op in OPS]
  _heatmap(fig, ax_rows,
           rows_TxQxSx3.reshape(num_t, q * s * 3).T, labels, cols,
           "actions per (state, top)")
  ax_rows.set_xlabel("update t : input symbol w_t")
  return fig


def plot_superposition_stack(insp: Inspection) -> matplotlib.figure.Figure:
  """The JM or Gref stack on one string: its actions and its readings.

  Top: `Inspection.baseline_actions` per update (JM: push / pop / no-op
  probabilities, per stack; Gref: push and pop strengths in [0, 1]), column
  t - 1 for update t, labelled with the input symbol w_t. Bottom: the
  vector readings r_0 .. r_{N-1} (one row per component; a diverging map
  centred on 0, since Gref's pushed vectors are tanh-valued).
  """
  if insp.baseline_actions is None:
    raise ValueError("no JM or Gref stack actions: inspect a 'jm' or 'gref' "
                     "model on a string of length >= 2.")
  values_RxT = insp.baseline_actions["values_RxT"]
  readings_MxN = insp.baseline_readings_MxN
  rows, num_t = values_RxT.shape
  m, n = readings_MxN.shape
  names = insp.symbol_names()
  fig = matplotlib.figure.Figure(
      figsize=(max(6.0, 0.18 * n + 2), 2.0 + 0.25 * (rows + m)),
      layout="constrained")
  ax_actions, ax_readings = fig.subplots(2, 1, height_ratios=[rows + 1, m])
  _heatmap(fig, ax_actions, values_RxT, insp.baseline_actions["labels"],
           [f"{t + 1}:{a}" for t, a in enumerate(names[:num_t])],
           "stack actions per update")
  ax_actions.set_xlabel("update t : input symbol w_t")
  bound = max(float(np.abs(readings_MxN).max()), 1e-12)
  _heatmap(fig, ax_readings, readings_MxN, [str(i) for i in range(m)],
           ["init"] + [f"{t}:{names[t - 1]}" for t in range(1, n)],
           "readings r_t (vector components)", vmax=bound, vmin=-bound,
           cmap="RdBu_r")
  ax_readings.set_xlabel("after update t : input symbol w_t")
  return fig


def plot_readings(insp: Inspection) -> matplotlib.figure.Figure:
  """Heatmap of the readings tau_0..tau_{N-1} (stack symbol x time).

  For the RNS- and VRNS-RNN a second panel shows the (state, top)
  distribution p_t(q, y) (`Inspection.state_readings_QSxN`: the RNS-RNN's
  own reading with ``stack_reading='state'``).
  """
  if insp.readings_SxN is None:
    raise ValueError("no readings: inspect an NS-, RNS- or VRNS-RNN.")
  s, n = insp.readings_SxN.shape
  names = insp.symbol_names()
  cols = ["init"] + [f"{t}:{names[t - 1]}" for t in range(1, n)]
  panels = [(insp.readings_SxN, [_stack_symbol_name(y) for y in range(s)],
             "reading τ_t (distribution of the stack top)")]
  if insp.state_readings_QSxN is not None:
    q = insp.state_readings_QSxN.shape[0] // s
    panels.append((insp.state_readings_QSxN,
                   [f"q{qq},{_stack_symbol_name(y)}" for qq in range(q)
                    for y in range(s)], "p(state, top)"))
  fig = matplotlib.figure.Figure(
      figsize=(max(6.0, 0.18 * n + 2),
               0.6 + sum(0.6 + 0.35 * len(p[1]) for p in panels)),
      layout="constrained")
  axes = fig.subplots(len(panels), 1, squeeze=False,
                      height_ratios=[len(p[1]) + 1 for p in panels])[:, 0]
  for ax, (values, rows, title) in zip(axes, panels):
    _heatmap(fig, ax, values, rows, cols, title)
  axes[-1].set_xlabel("after update t : input symbol w_t")
  return fig


def plot_next_symbol(insp: Inspection) -> matplotlib.figure.Figure:
  """Model vs true next-symbol distributions (V x N heatmaps) and the
  per-position cross-entropies; white dots mark the actual next symbol."""
  v = insp.model_probs_NxV.shape[1]
  n = len(insp.symbols)
  names = insp.symbol_names()
  cols = [f"{t + 1}:{a}" for t, a in enumerate(names)]
  sym_labels = (list(insp.alphabet) if insp.alphabet is not None
                else [str(a) for a in range(v)])
  panels = [(insp.model_probs_NxV, "model p(w_t+1 | w_≤t)")]
  if insp.true_probs_NxV is not None:
    panels.append((np.nan_to_num(insp.true_probs_NxV),
                   "true p(w_t+1 | w_≤t, length)"))
  fig = matplotlib.figure.Figure(
      figsize=(max(6.0, 0.18 * n + 2), 1.6 + (0.3 * v + 0.8) * len(panels)
               + 1.5), layout="constrained")
  axes = fig.subplots(len(panels) + 1, 1)
  for ax, (probs_NxV, title) in zip(axes, panels):
    _heatmap(fig, ax, probs_NxV.T, sym_labels, cols, title)
    ax.scatter(np.arange(n), insp.symbols, s=6, c="white")
  ax = axes[-1]
  ax.plot(np.arange(n), insp.model_nll_N, label="model", color="C3")
  if insp.true_nll_N is not None:
    ax.plot(np.arange(n), insp.true_nll_N, label="true", color="k",
            linestyle="--")
  ax.set_xlim(-0.5, n - 0.5)
  step = max(1, n // 40)
  ax.set_xticks(range(0, n, step), cols[::step], fontsize=7)
  ax.set_ylabel("−ln p (nats)")
  ax.set_xlabel("position t+1 : symbol w_t+1")
  ax.legend(fontsize=8)
  return fig


def plot_vector_readings(insp: Inspection) -> matplotlib.figure.Figure:
  """VRNS-RNN: heatmaps of the expected top vector E[vec(top)] (m x N), the
  (state, top) distribution (Q·S x N) and the full reading ρ (Q·S·m x N,
  rows (q, y, k): what the controller reads)."""
  if insp.vector_view is None:
    raise ValueError("no vector readings: inspect a VRNS-RNN.")
  view = insp.vector_view
  rho = view["readings_T1xQxSxM"]
  n, q, s, m = rho.shape
  names = insp.symbol_names()
  cols = ["init"] + [f"{t}:{names[t - 1]}" for t in range(1, n)]
  top = view["expected_top_T1xM"].T
  full = rho.reshape(n, -1).T
  # Vectors lie in [0, 1]; the broadcast bottom can push readings past 1.
  vmax = max(1.0, float(np.max(full, initial=0.0)), float(np.max(top,
                                                                 initial=0.0)))
  fig = matplotlib.figure.Figure(
      figsize=(max(6.0, 0.18 * n + 2), 2.5 + 0.25 * (m + q * s + q * s * m)),
      layout="constrained")
  axes = fig.subplots(3, 1, height_ratios=[m + 1, q * s + 1, q * s * m + 1])
  _heatmap(fig, axes[0], top, [f"k={k}" for k in range(m)], cols,
           "expected top-of-stack vector E[vec(top)]", vmax=vmax)
  _heatmap(fig, axes[1], insp.state_readings_QSxN,
           [f"q{qq},{_stack_symbol_name(y)}" for qq in range(q)
            for y in range(s)], cols, "p(state, top)")
  _heatmap(fig, axes[2], full,
           [f"q{qq},{_stack_symbol_name(y)},{k}" for qq in range(q)
            for y in range(s) for k in range(m)], cols,
           "reading ρ_t[q, y, k] = E[1(state=q, top=y) vec(top)_k]",
           vmax=vmax)
  axes[2].set_xlabel("after update t : input symbol w_t")
  return fig
