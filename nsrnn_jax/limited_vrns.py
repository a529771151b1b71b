"""The memory-limited vector stack (window D; VRNS-RNN), run incrementally.

rns-vrns-reference.md §2 and §3.4: the vector stack of `vrns_stack` (bottom
fix, run-consistent or broadcast bottom vector) restricted to the runs in
which an element is on top only during the D time steps after its push
(⊥ counts as pushed at update 0, so it can be the top only at times
0..D−1). γ[i→j] and ζ[i→j] are kept for j−D ≤ i ≤ j−1 only; with
D ≥ T + 1 this is the unlimited stack. Cost per update, independent of
the position in the stream: with shares (below) O(B·D²·Q²·S·(Q·S + M))
(pop) + O(B·D·Q²·S²·(Q·S + M)) (replace) and a state of
O(B·D²·Q·S·(Q·S + M)); in log space O(B·D²·Q³·S²·M) + O(B·D·Q³·S³·M)
and O(B·D²·Q²·S²·M). Long streams run in linear time.

Recurrences (real semiring), with α_{−1} = e_{0,⊥} and γ|ζ[−1→0] the
bottom element (γ one-hot at (0,⊥ → 0,⊥), ζ = γ ⊗ v_⊥, or v_⊥ at every
(0,⊥ → r,y) with the broadcast bottom), update j computes column j for the
rows i = j−D..j−1:

  γ[j−1→j] = P_j,  ζ[j−1→j] = P_j ⊗ v_j                          (push)
  γ|ζ[i→j] = Σ_{s,z} γ|ζ[i→j−1] R_j                                (replace)
           + Σ_{k=i+1}^{j−2} Σ_t γ|ζ[i→k][·→t,y] γ′_j[k][t,y,r]    (pop)
  γ′_j[k][t,y,r] = Σ_{s,z} γ[k→j−1][t,y→s,z] O_j[s,z,r]
  α_j = Σ_{i=j−D}^{j−1} α_i γ[i→j],   η_j = Σ_{i=j−D}^{j−1} α_i ζ[i→j]
  ρ_j = η_j / Σ_{r,y} α_j

The bottom element is row −1 of the window (not a separate bottom row as
in `vrns_stack`): it leaves the window after update D−1, which is when the
limit stops ⊥ from being the top.

Two representations, the same function (tested against each other, the
unlimited `vrns_stack` and brute-force PDA enumeration):
* Shares (`VectorShareState`; the run-consistent bottom, the default):
  `limited_stack`'s ring of posterior shares H_{i,k} = α_i γ[i→k] / α_k
  (`rns_stack`: exact up to its flush limit) plus vector shares
  Z_{i,k}[q,x,t,y,:] = α_i[q,x] ζ[i→k][q,x,t,y,:] / α_k[t,y] / e^σ, the
  shares times the expected vector of the top element. Z follows H's
  recurrence row by row with H's kernels (its push row is H's times
  v_j / e^σ), so any linear map of its rows commutes with the update: the
  table keeps, per column k and cutoff time a of the window,
  R_k^a = Σ_{i ≥ a, q, x} Z_{i,k} (Q·S times smaller than Z; dropping
  the oldest row is dropping the oldest cutoff). An update is then two
  pop matmuls and two replace mixes (`rns_stack.update(..., vectors=)`),
  and ρ_j[r,y,:] = α̂_j[r,y] e^σ R_j^{j−D}[r,y,:]. The scale σ [B, M] is
  max(0, every log v so far): stored values are ≤ 1 whatever the vectors
  (the VRNS's are sigmoids, so σ stays 0; a larger one rescales the table
  once). Contributions below ~1e-35 e^σ (float32) flush.
* Log space (`VectorWindowState`; needed by the broadcast bottom, whose
  ζ[−1→0] sits on configurations that α_0 gives weight zero, where shares
  are undefined): γ|ζ kept as log-weights with a guarded log-sum-exp per
  sum, the window shifted by one time per update. The PTB train step
  runs 8.9-11× slower on it (benchmarks/corpus_step.py).
Both keep α normalised (log α̂ and log Σα apart), so log weights do not
grow along a long stream.

Training (truncated BPTT) uses `limited_stack.run_chunks`: chunks of
``truncation_length`` controller steps, values carried across chunk
boundaries and gradients stopped there; the chunk's last update is made
in the next chunk from the detached controller carry (the ICLR 2023
boundary, which the model uses: the VRNS has the bottom fix). The first
chunk starts from the bottom element with its gradient (a learned v_⊥
trains). Within a chunk the gradient is autodiff of the scan: memory
O(L) states.

Shape legend: B batch, T updates, D window, Q states, S stack symbols
(0 = ⊥), M vector size, C = 1 + M (component 0 the scalar weight, 1..M the
vector weight).
"""

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from nsrnn_jax import limited_stack
from nsrnn_jax import ns_stack
from nsrnn_jax import rns_stack
from nsrnn_jax import vrns_stack
from nsrnn_jax.ns_stack import check_precision
from nsrnn_jax.ns_stack import safe_log as _safe_log

Array = jax.Array

__all__ = ["VectorShareState", "VectorWindowState", "initial_state", "step",
           "reading", "run", "run_coupled", "coupled_parts", "share_margin",
           "with_minima", "margin_step"]

_lse = vrns_stack._lse  # pylint: disable=protected-access
_check_window = limited_stack.check_window


class VectorShareState(NamedTuple):
  """The carried stack state before update j, as shares (a pytree).

  Attributes:
    g: shares H on times j−D..j−1, [B, Y, D (column), T, D (row), Q, X],
      a ring as in `limited_stack.WindowState`.
    gv: vector shares R_k^a / e^σ, [B, Y, D (column k), T, D (cutoff a),
      M], the same ring on both time axes.
    a_hat: normalised log α̂_{j−1}, [B, Q, S].
    log_mass: log Σα_{j−1}, [B].
    head: the slot of time j−1, int32 [] (D − 1 before update 1).
    scale: σ [B, M], max(0, log v_⊥, every log v_j pushed so far); a
      constant for differentiation.
  """
  g: Array
  gv: Array
  a_hat: Array
  log_mass: Array
  head: Array
  scale: Array


class VectorWindowState(NamedTuple):
  """The carried stack state before update j (a pytree).

  Attributes:
    table: log γ|ζ [B, D (row), D (column), Q, S, Q, S, C]; row a and
      column c stand for times j−D+a and j−D+c (entries with a ≥ c are
      −inf).
    alpha: log α̂ of times j−D..j−1 [B, D, Q, S], divided by Σα_{j−1}.
    log_mass: log Σα_{j−1} [B].
  """
  table: Array
  alpha: Array
  log_mass: Array


def initial_state(log_bottom_vector_BxM, window, num_states, num_symbols,
                  broadcast_bottom=False, log_space=False):
  """The state before update 1: α_0 = α_{−1} = e_{0,⊥} and the bottom
  element γ|ζ[−1→0] (time −1 → 0; absent for D = 1).

  Args:
    log_bottom_vector_BxM: log v_⊥ [B, M] (−inf entries allowed).
    window: D ≥ 1.
    num_states, num_symbols: Q, S.
    broadcast_bottom: v_⊥ at every (0,⊥ → r,y) as the authors' code
      (rns-vrns-reference.md §3.3) instead of at (0,⊥ → 0,⊥) only.
    log_space: the log-space representation also for the run-consistent
      bottom (the reference the shares are tested and timed against).

  Returns:
    A `VectorShareState`, or with `broadcast_bottom` or `log_space` a
    `VectorWindowState`.
  """
  _check_window(window)
  log_bottom_vector_BxM = vrns_stack.check_log_bottom_vector(
      log_bottom_vector_BxM)
  num_states, num_symbols = ns_stack.check_sizes(
      num_states=num_states, num_symbols=num_symbols)
  if broadcast_bottom or log_space:
    return _initial_log_space(log_bottom_vector_BxM, window, num_states,
                              num_symbols, broadcast_bottom)
  log_v = log_bottom_vector_BxM
  b, m = log_v.shape
  d, dt = window, log_v.dtype
  g = rns_stack.initial_table(b, d, num_states, num_symbols, rns_stack.FIXED,
                              corner=d - 1, dtype=dt)
  scale = lax.stop_gradient(jnp.maximum(log_v, 0))
  gv = jnp.zeros(g.shape[:5] + (m,), dt)
  if d >= 2:
    # Z_{−1,0}[0,⊥→0,⊥] = v_⊥ (α_{−1} = α_0 = e_{0,⊥}): in column 0 at
    # every cutoff ≤ −1 (times 1−D..−1, slots 0..D−2).
    gv = gv.at[:, 0, d - 1, 0, :d - 1].set(
        jnp.exp(log_v - scale)[:, None])
  a_hat = jnp.full((b, num_states, num_symbols), -jnp.inf,
                   dt).at[:, 0, 0].set(0)
  return VectorShareState(g, gv, a_hat, jnp.zeros((b,), dt),
                          jnp.asarray(d - 1, jnp.int32), scale)


def _initial_log_space(log_bottom_vector_BxM, window, num_states,
                       num_symbols, broadcast_bottom) -> VectorWindowState:
  """`initial_state` of the log-space stack."""
  log_v = jnp.asarray(log_bottom_vector_BxM)
  b, m = log_v.shape
  d, q, s = window, num_states, num_symbols
  dt = log_v.dtype
  ninf = -jnp.inf
  table = jnp.full((b, d, d, q, s, q, s, 1 + m), ninf, dt)
  alpha = jnp.full((b, d, q, s), ninf, dt).at[:, d - 1, 0, 0].set(0)
  if d >= 2:
    # γ|ζ[−1→0][0,⊥→r,y] is the start configuration's α_0 | η_0.
    table = table.at[:, d - 2, d - 1, 0, 0].set(
        vrns_stack.bottom_element(log_v, q, s, broadcast_bottom))
    alpha = alpha.at[:, d - 2, 0, 0].set(0)
  return VectorWindowState(table, alpha, jnp.zeros((b,), dt))


def initial_reading(log_bottom_vector_BxM, num_states, num_symbols,
                    broadcast_bottom=False) -> Array:
  """ρ_0 [B, Q, S, M]: e_{0,⊥} ⊗ v_⊥, or v_⊥ everywhere (broadcast)."""
  return jnp.exp(vrns_stack.bottom_element(
      log_bottom_vector_BxM, num_states, num_symbols, broadcast_bottom)[..., 1:])


def step(state, push_BxQxSxQxS, repl_BxQxSxQxS, pop_BxQxSxQ, log_vector_BxM,
         precision="highest"):
  """Update j; returns (next state, ρ_j [B, Q, S, M], log Σα_j [B]).

  `state` is a `VectorShareState` or a `VectorWindowState` (log space);
  `precision` names the matmul precision of the share update's
  contractions (`ns_stack.MATMUL_PRECISIONS`).
  """
  if isinstance(state, VectorWindowState):
    return _step_log_space(state, push_BxQxSxQxS, repl_BxQxSxQxS,
                           pop_BxQxSxQ, log_vector_BxM)
  return _share_step(state, push_BxQxSxQxS, repl_BxQxSxQxS, pop_BxQxSxQ,
                     log_vector_BxM, precision)


def _share_step(state: VectorShareState, push_BxQxSxQxS, repl_BxQxSxQxS,
                pop_BxQxSxQ, log_vector_BxM, precision, lows=None):
  """`step` on shares. With `lows` (the tables' (g, gv)
  `limited_stack.suffix_minima`, a margin sweep's: `margin_step`) also the
  update's product margin [B] (`rns_stack.update`'s) and the next state's
  minima, last."""
  margin = lows is not None
  # σ grows to cover the new vector; the vector table is rescaled only then
  # (never for the VRNS's sigmoid vectors).
  scale = jnp.maximum(state.scale, lax.stop_gradient(log_vector_BxM))
  grow = scale > state.scale
  rescale = lambda t: t * jnp.exp(state.scale - scale)[
      :, None, None, None, None, :]
  any_grow = jnp.any(grow)
  gv = lax.cond(any_grow, rescale, lambda t: t, state.gv)
  if margin:
    # The rescale's products gv · e^(σ_old − σ) (none where σ stays); a
    # rescaled table's minima are taken again (its rows scale unevenly).
    # Read inside the cond: a read outside made XLA copy both gv and its
    # minima each update (the minima still are: 1/M of gv's size).
    shrink = jnp.min(jnp.where(grow, state.scale - scale, jnp.inf), axis=1)
    start = state.head

    def grown(low):
      least = limited_stack.log_minima(
          limited_stack.read_minima(low, start)).min(axis=(1, 2, 3))
      return (limited_stack.suffix_minima(gv, start),
              0.5 * (least + shrink))

    low_v, rescaled = lax.cond(
        any_grow, grown, lambda l: (l, jnp.full_like(shrink, jnp.inf)),
        lows[1])
    lows = (lows[0], low_v)
    reads = tuple(limited_stack.read_minima(l, start) for l in lows)
  vec = jnp.exp(log_vector_BxM - scale)
  col, col_v, a_hat, inc, *lo = rns_stack.update(
      state.g, state.head, state.a_hat, push_BxQxSxQxS, repl_BxQxSxQxS,
      pop_BxQxSxQ, precision, ring=True, vectors=(gv, vec), margin=margin,
      row_mins=(tuple(map(limited_stack.log_minima, reads))
                if margin else None))
  # ρ_j = α̂_j e^σ R_j^{j−D}: all of column j's rows, j−D..j−1 (time j−D
  # is the slot after the head, about to be reused for time j).
  d = state.g.shape[2]
  head = (state.head + 1) % d
  sums = jnp.swapaxes(lax.dynamic_index_in_dim(col_v, head, axis=3,
                                               keepdims=False), 1, 2)
  rho = jnp.exp(a_hat[..., None] + _safe_log(sums) + scale[:, None, None])
  if margin:
    lo = jnp.minimum(lo[0], rescaled)
    # The margin's reads of the tables first (`limited_stack.after`).
    col, col_v = (limited_stack.after(c, lo) for c in (col, col_v))
  tables = []
  for t, c in ((state.g, col), (gv, col_v)):
    t = lax.dynamic_update_index_in_dim(t, c, head, axis=2)
    tables.append(lax.dynamic_update_index_in_dim(
        t, jnp.zeros(t.shape[:4] + t.shape[5:], t.dtype), head, axis=4))
  log_mass = state.log_mass + inc
  out = (VectorShareState(tables[0], tables[1], a_hat, log_mass, head,
                          scale), rho, log_mass)
  if margin:
    out += (lo, tuple(limited_stack.write_minima(l, c, head)
                      for l, c in zip(lows, (col, col_v))))
  return out


def with_minima(state: VectorShareState) -> limited_stack.MarginState:
  """A share state as a margin sweep carries it
  (`limited_stack.MarginState`, the suffix minima of g and gv)."""
  return limited_stack.MarginState(
      state, (limited_stack.suffix_minima(state.g, state.head),
              limited_stack.suffix_minima(state.gv, state.head)))


def margin_step(mstate: limited_stack.MarginState, push_BxQxSxQxS,
                repl_BxQxSxQxS, pop_BxQxSxQ, log_vector_BxM,
                precision="highest"):
  """`step` on shares plus the update's product margin [B], on a
  `limited_stack.MarginState` (`with_minima`): (next, ρ_j, log Σα_j,
  margin). Forward only."""
  st, rho, lm, lo_j, lows = _share_step(
      mstate.state, push_BxQxSxQxS, repl_BxQxSxQxS, pop_BxQxSxQ,
      log_vector_BxM, precision, lows=mstate.lows)
  return limited_stack.MarginState(st, lows), rho, lm, lo_j


def _step_log_space(state: VectorWindowState, push_BxQxSxQxS,
                    repl_BxQxSxQxS, pop_BxQxSxQ, log_vector_BxM):
  """`step` in log space (the broadcast bottom)."""
  table, alpha = state.table, state.alpha
  d = table.shape[1]
  log_vec1 = jnp.concatenate(
      [jnp.zeros_like(log_vector_BxM[:, :1]), log_vector_BxM], -1)
  pushed = push_BxQxSxQxS[..., None] + log_vec1[:, None, None, None, None, :]
  if d == 1:  # Only the push row: every older element has left the window.
    col = pushed[:, None]                             # [B,A,Q,X,R,Y,C]
  else:
    prev = table[:, :d - 1, d - 1]           # [B,A,Q,X,S,Z,C] γ|ζ[i→j−1]
    # Replace: Σ_{s,z} γ|ζ[i→j−1][q,x→s,z] R[s,z,r,y]    -> [B,A,Q,X,R,Y,C]
    r_b = repl_BxQxSxQxS[:, None, None, None, ..., None]
    replaced = _lse(prev[:, :, :, :, :, :, None, None, :] + r_b, (4, 5))
    # γ′_j[k][t,y,r] = Σ_{s,z} γ[k→j−1][t,y→s,z] O[s,z,r] [B,K,T,Y,R]
    gp = _lse(prev[..., 0, None] + pop_BxQxSxQ[:, None, None, None], (4, 5))
    # Pop: Σ_{k<j−1,t} γ|ζ[i→k][q,x→t,y] γ′_j[k][t,y,r]   -> [B,A,Q,X,R,Y,C]
    gp_b = jnp.transpose(gp, (0, 1, 2, 4, 3))[:, None, :, None, None, ...,
                                               None]  # [B,1,K,1,1,T,R,Y,1]
    popped = _lse(table[:, :d - 1, :d - 1, :, :, :, None, :, :] + gp_b,
                  (2, 5))
    col = jnp.concatenate(
        [vrns_stack._add(replaced, popped),  # pylint: disable=protected-access
         pushed[:, None]], axis=1)
  # α_j | η_j = Σ_{i,q,x} α̂_i[q,x] γ|ζ[i→j][q,x,r,y]   (α̂: divided by Σα_{j−1})
  fwd = _lse(alpha[..., None, None, None] + col, (1, 2, 3))   # [B,R,Y,C]
  inc = _lse(fwd[..., 0], (1, 2))
  alive = jnp.isfinite(inc)
  safe = jnp.where(alive, inc, 0)
  rho = jnp.where(alive[:, None, None, None],
                  jnp.exp(fwd[..., 1:] - safe[:, None, None, None]), 0)
  # Shift the window by one time: drop the oldest row and column, append
  # column j (its rows j−D+1..j−1, and row j, still empty) and α̂_j.
  older = jnp.concatenate(                     # columns j−D+1..j−1
      [table[:, 1:, 1:], jnp.full_like(table[:, :1, 1:], -jnp.inf)], axis=1)
  newest = jnp.concatenate(                    # column j
      [col[:, 1:], jnp.full_like(col[:, :1], -jnp.inf)], axis=1)
  table = jnp.concatenate([older, newest[:, :, None]], axis=2)
  alpha = jnp.concatenate([alpha[:, 1:], fwd[:, None, ..., 0]], axis=1)
  alpha = alpha - safe[:, None, None, None]
  log_mass = state.log_mass + inc
  return VectorWindowState(table, alpha, log_mass), rho, log_mass


def _check_bottom(q, s, log_bottom_vector, b, m):
  """log v_⊥ as [B, M] (from [M] or [B, M]); one-line ValueError."""
  return vrns_stack._check_inputs(q, s, log_bottom_vector, b, m)  # pylint: disable=protected-access


def reading(rho_BxQxSxM):
  """The controller's input: ρ flattened in (r, y, k) order [B, Q·S·M]."""
  return rho_BxQxSxM.reshape(rho_BxQxSxM.shape[0], -1)


def _state_dims(state):
  """(window D, (B, Q, S, M)) of a carried state of either kind."""
  if isinstance(state, VectorWindowState):
    t = state.table.shape
    return t[1], (t[0], t[3], t[4], t[7] - 1)
  t = state.gv.shape
  return t[2], (t[0], t[3], t[1], t[5])


def run(push, repl, pop, log_vectors, log_bottom_vector, window,
        broadcast_bottom=False, state=None, precision="highest",
        log_space=False):
  """Runs T updates of given log-weights from `state` (default: initial).

  Args:
    push, repl: [B, T, Q, S, Q, S]; pop: [B, T, Q, S, Q]; log_vectors: log
      v_j [B, T, M]; log_bottom_vector: log v_⊥ [M] or [B, M].
    window: D ≥ 1.
    broadcast_bottom: see `initial_state`.
    state: a state to continue from (incremental evaluation), of the kind
      `initial_state` makes for `broadcast_bottom`.
    precision: matmul precision name of the share update's contractions.
    log_space: see `initial_state` (used without `state` only).

  Returns:
    (readings ρ [B, T+1, Q, S, M] (ρ_0 first; from `state`, ρ_0 is the
    bottom's), log Σα [B, T+1], final state).
  """
  _check_window(window)
  push, repl, pop, log_vectors = (
      jnp.asarray(a) for a in (push, repl, pop, log_vectors))
  b, _, q, s = vrns_stack._check_actions(push, repl, pop, log_vectors)  # pylint: disable=protected-access
  m = log_vectors.shape[-1]
  log_bottom_vector = _check_bottom(q, s, log_bottom_vector, b, m)
  if state is None:
    state = initial_state(log_bottom_vector, window, q, s, broadcast_bottom,
                          log_space)
  else:
    d, dims = _state_dims(state)
    if broadcast_bottom and not isinstance(state, VectorWindowState):
      raise ValueError(
          "state is a VectorShareState (the run-consistent bottom), but "
          "broadcast_bottom=True")
    if d != window:
      raise ValueError(f"state has window {d}, not {window}")
    if dims != (b, q, s, m):
      raise ValueError(f"state has B, Q, S, M = {dims}, not that of the "
                       f"actions ({b}, {q}, {s}, {m})")
  rho0 = initial_reading(log_bottom_vector, q, s, broadcast_bottom)
  return _run_jit(push, repl, pop, log_vectors, state, rho0,
                  check_precision(precision))


@functools.partial(jax.jit, static_argnums=(6,))
def _run_jit(push, repl, pop, log_vectors, state, rho0, precision):
  def body(st, acts):
    st, rho, lm = step(st, *acts, precision=precision)
    return st, (rho, lm)

  xs = tuple(jnp.swapaxes(a, 0, 1) for a in (push, repl, pop, log_vectors))
  lm0 = state.log_mass
  state, (rho, lm) = lax.scan(body, state, xs)
  rho = jnp.concatenate([rho0[:, None], jnp.swapaxes(rho, 0, 1)], axis=1)
  lm = jnp.concatenate([lm0[:, None], jnp.swapaxes(lm, 0, 1)], axis=1)
  return rho, lm, state


def share_margin(push, repl, pop, log_vectors, log_bottom_vector, window,
                 precision="highest", num_updates=None):
  """The product margin of `run` (run-consistent bottom, shares): [B] nats.

  `rns_stack.vector_share_margin` for the window: above
  `rns_stack.exact_margin(dtype)` `run`'s readings and log Σα for that
  batch element are exact up to rounding; below it a share may have been
  flushed. Forward only, not differentiable.

  Args:
    push, repl, pop, log_vectors, log_bottom_vector, window, precision: as
      for `run` (from the initial state).
    num_updates: as for `rns_stack.share_margin` (padding left out; the
      bottom vector always counts).
  """
  _check_window(window)
  push, repl, pop, log_vectors = (
      jnp.asarray(a) for a in (push, repl, pop, log_vectors))
  b, _, q, s = vrns_stack._check_actions(push, repl, pop, log_vectors)  # pylint: disable=protected-access
  log_bottom_vector = _check_bottom(q, s, log_bottom_vector, b,
                                    log_vectors.shape[-1])
  state = initial_state(log_bottom_vector, window, q, s)
  return _margin_jit(push, repl, pop, log_vectors, state,
                     check_precision(precision),
                     rns_stack.check_num_updates(num_updates, b))


@functools.partial(jax.jit, static_argnums=(5,))
def _margin_jit(push, repl, pop, log_vectors, state, precision, num_updates):
  def step(mst, acts):
    mst, _, _, lo_j = margin_step(mst, *acts, precision=precision)
    return mst, lo_j

  xs = tuple(lax.stop_gradient(jnp.swapaxes(a, 0, 1))
             for a in (push, repl, pop, log_vectors))
  state = lax.stop_gradient(state)
  return limited_stack.margin_scan(step, with_minima(state),
                                   initial_margin(state), xs, num_updates)


def initial_margin(state: VectorShareState):
  """The product margin [B] of a share state's vector table (the bottom
  vector's shares are stored values, each its own product with 1): where
  `share_margin`'s scan starts."""
  return 0.5 * rns_stack._log_min_positive(state.gv)  # pylint: disable=protected-access


def coupled_parts(log_bottom_vector_BxM, num_states: int, num_symbols: int,
                  window: int, broadcast_bottom: bool = False,
                  precision: str = "highest", log_space: bool = False,
                  margin: bool = False):
  """The stack's side of `limited_stack.run_chunks` / `stream_chunk`:
  (update, read, (state0, ρ_0)). The loop carries (state, ρ_{j−1}): the
  reading the controller gets is the last update's output, so it is not
  recomputed; ``update`` returns ((state, ρ_j), (ρ_j, log Σα_j)), with
  `margin` (shares with the run-consistent bottom only; forward only)
  ((state, ρ_j), (ρ_j, log Σα_j, update j's product margin [B]))."""
  if margin and (broadcast_bottom or log_space):
    raise ValueError("limited_vrns.coupled_parts: margin needs the share "
                     "table with the run-consistent bottom")
  state0 = initial_state(log_bottom_vector_BxM, window, num_states,
                         num_symbols, broadcast_bottom, log_space)
  rho0 = initial_reading(log_bottom_vector_BxM, num_states, num_symbols,
                         broadcast_bottom)
  read = lambda carried: reading(carried[1])
  if margin:
    def margin_update(carried, acts):
      mst, rho, lm, lo_j = margin_step(carried[0], *acts,
                                       precision=precision)
      return (mst, rho), (rho, lm, lo_j)
    # Within a stream chunk the state carries its minima
    # (`limited_stack.stream_chunk`).
    margin_update.enter = lambda c: (with_minima(c[0]), c[1])
    margin_update.leave = lambda c: (c[0].state, c[1])
    return margin_update, read, (state0, rho0)

  def update(carried, acts):
    st, rho, lm = step(carried[0], *acts, precision=precision)
    return (st, rho), (rho, lm)

  return update, read, (state0, rho0)


def run_coupled(step_fn: Callable[..., Any], params, init_carry, xs,
                log_bottom_vector, num_states: int, num_symbols: int,
                window: int, broadcast_bottom: bool = False,
                truncation_length: int = 0,
                actions_fn: Optional[Callable[..., Any]] = None,
                precision: str = "highest", log_space: bool = False):
  """Controller + limited vector stack, chunked for truncated BPTT.

  Args:
    step_fn: as for `vrns_stack.run_coupled`: ``step_fn(params, carry, x_t,
      reading [B, Q·S·M]) -> (carry, (push, repl, pop, log_vector), out)``.
    params, init_carry: differentiable pytrees (init_carry's gradient
      comes from the first chunk only).
    xs: pytree of batch-major inputs [B, T, ...].
    log_bottom_vector: log v_⊥ [M] or [B, M] (differentiable: the first
      chunk starts from it).
    num_states, num_symbols: Q, S.
    window: D ≥ 1.
    broadcast_bottom: see `initial_state`.
    truncation_length: chunk length L ≥ 1 (gradients stop at chunk
      boundaries); 0 = one chunk.
    actions_fn: ``actions_fn(params, carry) -> (push, repl, pop,
      log_vector)`` from the carry `step_fn` returns: a chunk's last update
      is made in the next chunk from the detached carry with live `params`
      (ICLR 2023); None makes it at the chunk's end, without gradient.
    precision: matmul precision name of the share update's contractions.
    log_space: the log-space window also for the run-consistent bottom
      (`initial_state`): exact where the shares flush, slower.

  Returns:
    (outs [B, T, ...], readings ρ [B, T+1, Q, S, M], log Σα [B, T+1]);
    forward values do not depend on `truncation_length` or `actions_fn`.
  """
  _check_window(window)
  b = jax.tree_util.tree_leaves(xs)[0].shape[0]
  log_bottom_vector = vrns_stack._check_inputs(  # pylint: disable=protected-access
      num_states, num_symbols, log_bottom_vector, b)
  update, read, (state0, rho0) = coupled_parts(
      log_bottom_vector, num_states, num_symbols, window, broadcast_bottom,
      check_precision(precision), log_space)
  outs, (rho, lm) = limited_stack.run_chunks(
      step_fn, update, read, params, init_carry, (state0, rho0), xs,
      truncation_length, actions_fn)
  rho = jnp.concatenate([rho0[:, None], rho], axis=1)
  lm = jnp.concatenate([state0.log_mass[:, None], lm], axis=1)
  return outs, rho, lm

