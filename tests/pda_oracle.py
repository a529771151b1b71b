"""Brute-force reference for the nondeterministic stack: explicit PDA runs.

This module is the untuned oracle that `ns_stack` is tested against. It knows
nothing about γ tables: it simulates the pushdown automaton with explicit
stacks (tuples of symbol ids, bottom first) under the frozen-bottom semantics
of the authors' code (reference-behaviour.md §1.5):

* the run starts in state 0 with the stack ``(0,)`` (⊥ = symbol 0);
* push y:     any height; weight push[j, q, x, r, y];
* replace x→y: only if the height is > 1 (⊥ is never replaced);
* pop x:      only if the height is > 2 (the symbol on ⊥ is never popped).

``bottom="fixed"`` gives the ICLR 2023 bottom fix instead (rns-vrns-reference.md
§1.5): replace is allowed on any top including ⊥, pop needs height ≥ 2.
``window=D`` gives the memory-limited stack (§2.1): an element pushed by update
p (⊥: p = 0) may be the top only at times p..p+D−1; a run whose top is older
dies. Stacks then hold (symbol, push time) pairs internally. Weights may be any
finite log-weights (unnormalised, huge) or −inf.

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


def _successors(stack, state, push_j, repl_j, pop_j, bottom="frozen",
                times=None, j=None):
  """Yields (action, new_state, new_stack, log_weight) for one update.

  `action` is (kind, from_state, to_state, symbol): the pushed symbol, the
  replacing symbol, or the popped symbol. With `times` (push time of each
  element, for a window) and the update number `j`, yields 5-tuples whose
  last entry is the new tuple of push times.
  """
  if bottom not in ("frozen", "fixed"):
    raise ValueError(f"bottom must be frozen or fixed, got {bottom!r}")
  min_repl, min_pop = (2, 3) if bottom == "frozen" else (1, 2)
  out = _successors_with_times(stack, state, push_j, repl_j, pop_j, min_repl,
                               min_pop, times, j)
  if times is None:
    for action, r, new_stack, w, _ in out:
      yield action, r, new_stack, w
  else:
    yield from out


def _successors_with_times(stack, state, push_j, repl_j, pop_j, min_repl,
                           min_pop, times, j):
  x = stack[-1]
  num_states, num_symbols = push_j.shape[2], push_j.shape[3]
  for r in range(num_states):
    for y in range(num_symbols):
      w = push_j[state, x, r, y]
      if w > -math.inf:
        yield ((PUSH, state, r, y), r, stack + (y,), float(w),
               None if times is None else times + (j,))
  if len(stack) >= min_repl:
    for r in range(num_states):
      for y in range(num_symbols):
        w = repl_j[state, x, r, y]
        if w > -math.inf:
          yield ((REPLACE, state, r, y), r, stack[:-1] + (y,), float(w),
                 times)
  if len(stack) >= min_pop:
    for r in range(num_states):
      w = pop_j[state, x, r]
      if w > -math.inf:
        yield ((POP, state, r, x), r, stack[:-1], float(w),
               None if times is None else times[:-1])


def _logaddexp(a, b):
  return float(np.logaddexp(a, b))


def configurations(push, repl, pop, semiring="log", bottom="frozen",
                   window=None):
  """Weights of all explicit configurations after each update.

  Args:
    push: log-weights [T, Q, S, Q, S].
    repl: log-weights [T, Q, S, Q, S].
    pop: log-weights [T, Q, S, Q].
    semiring: "log" (sum of run weights) or "max" (best run weight).
    bottom: "frozen" (CoNLL 2020 / ICLR 2022) or "fixed" (ICLR 2023).
    window: None (unlimited) or D >= 1 (memory-limited stack).

  Returns:
    A list of T+1 dicts {(state, stack_tuple): log_weight} (with a window the
    key is (state, stack_tuple, push_times_tuple)).
  """
  push, repl, pop = (np.asarray(a, np.float64) for a in (push, repl, pop))
  combine = _logaddexp if semiring == "log" else max
  if window is not None and window < 1:
    raise ValueError(f"window must be >= 1, got {window}")
  current = ({(0, (0,)): 0.0} if window is None
             else {(0, (0,), (0,)): 0.0})
  history = [current]
  for j in range(push.shape[0]):
    nxt = {}
    for key0, lw in current.items():
      state, stack = key0[0], key0[1]
      times = key0[2] if window is not None else None
      for succ in _successors(stack, state, push[j], repl[j], pop[j], bottom,
                              times, j + 1):
        if window is None:
          _, r, new_stack, w = succ
          key = (r, new_stack)
        else:
          _, r, new_stack, w, new_times = succ
          if j + 1 > new_times[-1] + window - 1:
            continue  # the top is older than the window: the run dies
          key = (r, new_stack, new_times)
        value = lw + w
        nxt[key] = combine(nxt[key], value) if key in nxt else value
    current = nxt
    history.append(current)
  return history


def alpha(push, repl, pop, semiring="log", bottom="frozen", window=None):
  """log α_j[r, y] for j = 0..T: total (or best) weight ending in r with top y.

  Returns:
    float64 array [T+1, Q, S] of log-weights (−inf where no run exists).
  """
  push = np.asarray(push)
  num_states, num_symbols = push.shape[1], push.shape[2]
  history = configurations(push, repl, pop, semiring, bottom, window)
  out = np.full((len(history), num_states, num_symbols), -np.inf)
  for j, configs in enumerate(history):
    for key, lw in configs.items():
      state, stack = key[0], key[1]
      y = stack[-1]
      if semiring == "log":
        out[j, state, y] = np.logaddexp(out[j, state, y], lw)
      else:
        out[j, state, y] = max(out[j, state, y], lw)
  return out


def readings_and_log_mass(push, repl, pop, bottom="frozen", window=None):
  """Stack readings τ_j(y) and ln Σ α_j, j = 0..T, from explicit runs.

  Returns:
    (readings [T+1, S], log_mass [T+1]) as float64 arrays. A step with no
    surviving run has log_mass −inf and an all-zero reading.
  """
  log_alpha = alpha(push, repl, pop, bottom=bottom, window=window)
  per_symbol = np.logaddexp.reduce(log_alpha, axis=1)
  log_mass = np.logaddexp.reduce(per_symbol, axis=1)
  readings = np.zeros_like(per_symbol)
  alive = np.isfinite(log_mass)
  readings[alive] = np.exp(per_symbol[alive] - log_mass[alive, None])
  return readings, log_mass


def state_readings(push, repl, pop, bottom="frozen", window=None):
  """State readings ρ_j[r·S + y] = α_j[r,y] / Σα_j (RNS-RNN), j = 0..T.

  Returns:
    (readings [T+1, Q·S], log_alpha [T+1, Q, S]) as float64 arrays.
  """
  log_alpha = alpha(push, repl, pop, bottom=bottom, window=window)
  flat = log_alpha.reshape(len(log_alpha), -1)
  log_mass = np.logaddexp.reduce(flat, axis=1)
  readings = np.zeros_like(flat)
  alive = np.isfinite(log_mass)
  readings[alive] = np.exp(flat[alive] - log_mass[alive, None])
  return readings, log_alpha


def enumerate_runs(push, repl, pop, bottom="frozen"):
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
                                                 repl[j], pop[j], bottom):
        nxt.append((actions + [(j + 1,) + action], lw + w, r,
                    stacks + [new_stack]))
    runs = nxt
  return [(actions, lw, stacks) for actions, lw, _, stacks in runs]
