"""Brute-force oracles for the vector stack: explicit PDA runs, float64.

Configurations (state, stack) are enumerated update by update with their
total weight; each stack element is (symbol, vector id), id 0 the bottom
element (vector v_⊥) and id p the element pushed by update p (vector v_p).
Semantics of the bottom fix (rns-vrns-reference.md §1.5): push always,
replace on any top (the element keeps its vector), pop needs height >= 2.
Weights are real (exp of the log-weights), unnormalised. With a window D
(the memory-limited stack, rns-vrns-reference.md §2.1) an element pushed by
update p (⊥: p = 0) may be the top only at times p..p+D−1: a configuration
whose top is older is dropped (its runs die).
"""

import collections

import numpy as np


def configurations(push, repl, pop, start=(0, 0), window=None):
  """Per time 0..U, {(state, ((symbol, vec_id), ...)): weight}.

  Args:
    push, repl: [U, Q, S, Q, S] real weights (q, x, r, y).
    pop: [U, Q, S, Q] real weights (q, x, r).
    start: (state, bottom symbol) of the initial configuration.
    window: None (unlimited) or D >= 1; the vector id is the push time.
  """
  u, q, s = push.shape[:3]
  configs = {(start[0], ((start[1], 0),)): 1.0}
  history = [configs]
  for j in range(1, u + 1):
    new = collections.defaultdict(float)
    for (state, stack), w in configs.items():
      x, vid = stack[-1]
      for r in range(q):
        for y in range(s):
          new[(r, stack + ((y, j),))] += w * push[j - 1, state, x, r, y]
          new[(r, stack[:-1] + ((y, vid),))] += w * repl[j - 1, state, x, r, y]
        if len(stack) >= 2:
          new[(r, stack[:-1])] += w * pop[j - 1, state, x, r]
    if window is not None:
      new = {key: w for key, w in new.items() if j - key[1][-1][1] < window}
    configs = dict(new)
    history.append(configs)
  return history


def vector_readings(push, repl, pop, vectors, bottom_vector,
                    broadcast_bottom=False, window=None):
  """ρ_j [U+1, Q, S, M] and log Σ weights [U+1] by enumeration.

  Args:
    push, repl, pop: real weights as in `configurations`.
    vectors: [U, M] pushed vectors v_1..v_U.
    bottom_vector: [M], v_⊥.
    broadcast_bottom: the authors' code: the numerator also counts, with
      weight 1 each, every start configuration (state t, stack [y]) for runs
      whose top is still the bottom element (rns-vrns-reference.md §3.3).
    window: None or D >= 1 (see `configurations`).
  """
  u, q, s = push.shape[:3]
  m = len(bottom_vector)
  vec = np.concatenate([np.asarray(bottom_vector)[None], vectors], 0)
  genuine = configurations(push, repl, pop, window=window)
  rho = np.zeros((u + 1, q, s, m))
  log_mass = np.zeros(u + 1)
  for j, configs in enumerate(genuine):
    z = sum(configs.values())
    num = np.zeros((q, s, m))
    for (state, stack), w in configs.items():
      y, vid = stack[-1]
      if broadcast_bottom and vid == 0:
        continue  # counted below, from every start configuration
      num[state, y] += w * vec[vid]
    rho[j] = num
    log_mass[j] = np.log(z)
  if broadcast_bottom:
    for t in range(q):
      for y0 in range(s):
        for j, configs in enumerate(configurations(push, repl, pop, (t, y0),
                                                   window)):
          for (state, stack), w in configs.items():
            y, vid = stack[-1]
            if vid == 0:
              rho[j, state, y] += w * vec[0]
  rho /= np.exp(log_mass)[:, None, None, None]
  return rho, log_mass


def state_readings(push, repl, pop):
  """RNS-RNN state readings [U+1, Q, S] (no vectors), by enumeration.

  Enumerates plain (state, symbol stack) configurations, independently of
  `configurations`' vector bookkeeping.
  """
  u, q, s = push.shape[:3]
  configs = {(0, (0,)): 1.0}
  out = np.zeros((u + 1, q, s))
  out[0, 0, 0] = 1.0
  for j in range(1, u + 1):
    new = collections.defaultdict(float)
    for (state, stack), w in configs.items():
      x = stack[-1]
      for r in range(q):
        for y in range(s):
          new[(r, stack + (y,))] += w * push[j - 1, state, x, r, y]
          new[(r, stack[:-1] + (y,))] += w * repl[j - 1, state, x, r, y]
        if len(stack) >= 2:
          new[(r, stack[:-1])] += w * pop[j - 1, state, x, r]
    configs = new
    for (state, stack), w in configs.items():
      out[j, state, stack[-1]] += w
    out[j] /= out[j].sum()
  return out


def worked_example_inputs(num_updates=4, m=3):
  """rns-vrns-reference.md §6: Q = S = 2, logits sin(row·C + col + j).

  Returns log-weights push, repl [U,2,2,2,2], pop [U,2,2,2] (RNS: the logits
  themselves), log vectors [U, m] (log σ(cos(k + j))) and the bottom
  parameter b_⊥[k] = sin(k + 1) (v_⊥ = σ(b_⊥)).
  """
  q = s = 2
  c = 2 * q * s + q
  push = np.zeros((num_updates, q, s, q, s))
  repl = np.zeros((num_updates, q, s, q, s))
  pop = np.zeros((num_updates, q, s, q))
  for j in range(1, num_updates + 1):
    logits = np.sin(np.arange(q * s)[:, None] * c + np.arange(c)[None] + j)
    push[j - 1] = logits[:, :q * s].reshape(q, s, q, s)
    repl[j - 1] = logits[:, q * s:2 * q * s].reshape(q, s, q, s)
    pop[j - 1] = logits[:, 2 * q * s:].reshape(q, s, q)
  k = np.arange(m)
  j = np.arange(1, num_updates + 1)[:, None]
  log_vectors = -np.log1p(np.exp(-np.cos(k[None] + j)))
  bottom_param = np.sin(k + 1.0)
  return push, repl, pop, log_vectors, bottom_param
