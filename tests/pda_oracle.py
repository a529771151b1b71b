"""Brute-force reference for the nondeterministic stack: explicit PDA runs.

This module is the untuned oracle that `ns_stack` is tested against. It knows
nothing about γ tables: it simulates the pushdown automaton with explicit
stacks (tuples of symbol ids, bottom first) under the frozen-bottom semantics
of the authors' code (reference-behaviour.md §1.5):

* the run starts in state 0 with the stack ``(0,)`` (⊥ = symbol 0);
* push y:     any height; weight push[j, q, x, r, y];
* replace x→y: only if the height is > 1 (⊥ is never replaced);
* pop x:      only if the height is > 2 (the symbol on ⊥ is never popped).

Updates are numbered j = 1..T; array index j−1 holds update j's weights.
Weights are given as log-weights (−inf allowed) for one batch element:
push, repl ``[T, Q, S, Q, S]`` (q, x, r, y) and pop ``[T, Q, S, Q]`` (q, x, r).

Two enumerators are provided:

* `configurations` merges runs that reach the same explicit configuration
  (state, whole stack) — still explicit stacks, but polynomially many
  configurations per step instead of exponentially many runs;
* `enumerate_runs` lists every single run with its action sequence (only for
  tiny cases), used for the Viterbi check.
"""

import math

import numpy as np

PUSH = "push"
REPLACE = "replace"
POP = "pop"


def _successors(stack, state, push_j, repl_j, pop_j):
  """Yields (action, new_state, new_stack, log_weight) for one update.

  `action` is (kind, from_state, to_state, symbol): the pushed symbol, the
  replacing symbol, or the popped symbol.
  """
  x = stack[-1]
  num_states, num_symbols = push_j.shape[2], push_j.shape[3]
  for r in range(num_states):
    for y in range(num_symbols):
      w = push_j[state, x, r, y]
      if w > -math.inf:
        yield (PUSH, state, r, y), r, stack + (y,), float(w)
  if len(stack) > 1:
    for r in range(num_states):
      for y in range(num_symbols):
        w = repl_j[state, x, r, y]
        if w > -math.inf:
          yield (REPLACE, state, r, y), r, stack[:-1] + (y,), float(w)
  if len(stack) > 2:
    for r in range(num_states):
      w = pop_j[state, x, r]
      if w > -math.inf:
        yield (POP, state, r, x), r, stack[:-1], float(w)


def _logaddexp(a, b):
  return float(np.logaddexp(a, b))


def configurations(push, repl, pop, semiring="log"):
  """Weights of all explicit configurations after each update.

  Args:
    push: log-weights [T, Q, S, Q, S].
    repl: log-weights [T, Q, S, Q, S].
    pop: log-weights [T, Q, S, Q].
    semiring: "log" (sum of run weights) or "max" (best run weight).

  Returns:
    A list of T+1 dicts {(state, stack_tuple): log_weight}.
  """
  push, repl, pop = (np.asarray(a, np.float64) for a in (push, repl, pop))
  combine = _logaddexp if semiring == "log" else max
  current = {(0, (0,)): 0.0}
  history = [current]
  for j in range(push.shape[0]):
    nxt = {}
    for (state, stack), lw in current.items():
      for _, r, new_stack, w in _successors(stack, state, push[j], repl[j],
                                             pop[j]):
        key = (r, new_stack)
        value = lw + w
        nxt[key] = combine(nxt[key], value) if key in nxt else value
    current = nxt
    history.append(current)
  return history


def alpha(push, repl, pop, semiring="log"):
  """log α_j[r, y] for j = 0..T: total (or best) weight ending in r with top y.

  Returns:
    float64 array [T+1, Q, S] of log-weights (−inf where no run exists).
  """
  push = np.asarray(push)
  num_states, num_symbols = push.shape[1], push.shape[2]
  history = configurations(push, repl, pop, semiring)
  out = np.full((len(history), num_states, num_symbols), -np.inf)
  for j, configs in enumerate(history):
    for (state, stack), lw in configs.items():
      y = stack[-1]
      if semiring == "log":
        out[j, state, y] = np.logaddexp(out[j, state, y], lw)
      else:
        out[j, state, y] = max(out[j, state, y], lw)
  return out


def readings_and_log_mass(push, repl, pop):
  """Stack readings τ_j(y) and ln Σ α_j, j = 0..T, from explicit runs.

  Returns:
    (readings [T+1, S], log_mass [T+1]) as float64 arrays. A step with no
    surviving run has log_mass −inf and an all-zero reading.
  """
  log_alpha = alpha(push, repl, pop)
  per_symbol = np.logaddexp.reduce(log_alpha, axis=1)
  log_mass = np.logaddexp.reduce(per_symbol, axis=1)
  readings = np.zeros_like(per_symbol)
  alive = np.isfinite(log_mass)
  readings[alive] = np.exp(per_symbol[alive] - log_mass[alive, None])
  return readings, log_mass


def enumerate_runs(push, repl, pop):
  """Every run of T updates, as (actions, log_weight, stacks).

  `actions` is a list of (step, kind, from_state, to_state, symbol) with step
  1..T; `stacks` lists the stack after each update (T+1 tuples). Exponential:
  only for tiny T.
  """
  push, repl, pop = (np.asarray(a, np.float64) for a in (push, repl, pop))
  runs = [([], 0.0, 0, [(0,)])]
  for j in range(push.shape[0]):
    nxt = []
    for actions, lw, state, stacks in runs:
      for action, r, new_stack, w in _successors(stacks[-1], state, push[j],
                                                 repl[j], pop[j]):
        nxt.append((actions + [(j + 1,) + action], lw + w, r,
                    stacks + [new_stack]))
    runs = nxt
  return [(actions, lw, stacks) for actions, lw, _, stacks in runs]
