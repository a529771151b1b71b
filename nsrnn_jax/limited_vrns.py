"""The memory-limited vector stack (window D; VRNS-RNN), run incrementally.

rns-vrns-reference.md §2 and §3.4: the vector stack of `vrns_stack` (bottom
fix, run-consistent or broadcast bottom vector) restricted to the runs in
which an element is on top only during the D time steps after its push
(⊥ counts as pushed at update 0, so it can be the top only at times
0..D−1). γ[i→j] and ζ[i→j] are kept for j−D ≤ i ≤ j−1 only; with
D ≥ T + 1 this is the unlimited stack. Cost per update O(B·D²·Q³·S²·M)
(pop) + O(B·D·Q³·S³·M) (replace), independent of the position in the
stream; the state is O(B·D²·Q²·S²·M), so long streams run in linear time.

Recurrences (real semiring; the code works in log space with a guarded
log-sum-exp per sum, exact for any finite log-weights, −inf allowed):
with α_{−1} = e_{0,⊥} and γ|ζ[−1→0] the bottom element (γ one-hot at
(0,⊥ → 0,⊥), ζ = γ ⊗ v_⊥, or v_⊥ at every (0,⊥ → r,y) with the broadcast
bottom), update j computes column j for the rows i = j−D..j−1:

  γ[j−1→j] = P_j,  ζ[j−1→j] = P_j ⊗ v_j                          (push)
  γ|ζ[i→j] = Σ_{s,z} γ|ζ[i→j−1] R_j                                (replace)
           + Σ_{k=i+1}^{j−2} Σ_t γ|ζ[i→k][·→t,y] γ′_j[k][t,y,r]    (pop)
  γ′_j[k][t,y,r] = Σ_{s,z} γ[k→j−1][t,y→s,z] O_j[s,z,r]
  α_j = Σ_{i=j−D}^{j−1} α_i γ[i→j],   η_j = Σ_{i=j−D}^{j−1} α_i ζ[i→j]
  ρ_j = η_j / Σ_{r,y} α_j

The bottom element is row −1 of the window (not a separate bottom row as
in `vrns_stack`): it leaves the window after update D−1, which is when the
limit stops ⊥ from being the top. The window shifts by one time per update
(the oldest row and column dropped, column j appended); α is kept
normalised (log α̂ and log Σα apart, as `limited_stack` does), so log
weights do not grow along a long stream.

Training (truncated BPTT) uses `limited_stack.run_chunks`: chunks of
``truncation_length`` controller steps, values carried across chunk
boundaries and gradients stopped there; the chunk's last update is made
in the next chunk from the detached controller carry (the ICLR 2023
boundary, which the model uses: the VRNS has the bottom fix). The first
chunk starts from the bottom element with its gradient (a learned v_⊥
trains). Within a chunk the gradient is autodiff of the scan,
O(B·L·D²·Q²·S²·M) memory.

Shape legend: B batch, T updates, D window, Q states, S stack symbols
(0 = ⊥), M vector size, C = 1 + M (component 0 the scalar weight, 1..M the
vector weight).
"""

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from nsrnn_jax import limited_stack
from nsrnn_jax import vrns_stack

Array = jax.Array

__all__ = ["VectorWindowState", "initial_state", "step", "reading", "run",
           "run_coupled", "coupled_parts"]

_lse = vrns_stack._lse  # pylint: disable=protected-access
_check_window = limited_stack._check_window  # pylint: disable=protected-access


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
                  broadcast_bottom=False) -> VectorWindowState:
  """The state before update 1: α_0 = α_{−1} = e_{0,⊥} and the bottom
  element γ|ζ[−1→0] (row D−2, column D−1; absent for D = 1).

  Args:
    log_bottom_vector_BxM: log v_⊥ [B, M] (−inf entries allowed).
    window: D ≥ 1.
    num_states, num_symbols: Q, S.
    broadcast_bottom: v_⊥ at every (0,⊥ → r,y) as the authors' code
      (rns-vrns-reference.md §3.3) instead of at (0,⊥ → 0,⊥) only.
  """
  _check_window(window)
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


def step(state: VectorWindowState, push_BxQxSxQxS, repl_BxQxSxQxS,
         pop_BxQxSxQ, log_vector_BxM):
  """Update j; returns (next state, ρ_j [B, Q, S, M], log Σα_j [B])."""
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
  lv = vrns_stack._check_inputs(q, s, log_bottom_vector, b)  # pylint: disable=protected-access
  if lv.shape[1] != m:
    raise ValueError(f"log_bottom_vector has M={lv.shape[1]} but the pushed "
                     f"vectors have M={m}")
  return lv


def reading(rho_BxQxSxM):
  """The controller's input: ρ flattened in (r, y, k) order [B, Q·S·M]."""
  return rho_BxQxSxM.reshape(rho_BxQxSxM.shape[0], -1)


def run(push, repl, pop, log_vectors, log_bottom_vector, window,
        broadcast_bottom=False, state=None):
  """Runs T updates of given log-weights from `state` (default: initial).

  Args:
    push, repl: [B, T, Q, S, Q, S]; pop: [B, T, Q, S, Q]; log_vectors: log
      v_j [B, T, M]; log_bottom_vector: log v_⊥ [M] or [B, M].
    window: D ≥ 1.
    broadcast_bottom: see `initial_state`.
    state: a VectorWindowState to continue from (incremental evaluation).

  Returns:
    (readings ρ [B, T+1, Q, S, M] (ρ_0 first; from `state`, ρ_0 is the
    bottom's), log Σα [B, T+1], final state).
  """
  _check_window(window)
  push, repl, pop, log_vectors = (
      jnp.asarray(a) for a in (push, repl, pop, log_vectors))
  b, _, q, s = vrns_stack._check_actions(push, repl, pop, log_vectors)  # pylint: disable=protected-access
  log_bottom_vector = _check_bottom(q, s, log_bottom_vector, b,
                                    log_vectors.shape[-1])
  if state is None:
    state = initial_state(log_bottom_vector, window, q, s, broadcast_bottom)
  elif state.table.shape[1] != window:
    raise ValueError(f"state has window {state.table.shape[1]}, not "
                     f"{window}")
  elif state.table.shape[:1] + state.table.shape[3:] != (
      b, q, s, q, s, 1 + log_vectors.shape[-1]):
    raise ValueError(f"state's table has shape {state.table.shape}, not "
                     f"that of B={b}, Q={q}, S={s}, "
                     f"M={log_vectors.shape[-1]}")
  rho0 = initial_reading(log_bottom_vector, q, s, broadcast_bottom)
  return _run_jit(push, repl, pop, log_vectors, state, rho0)


@jax.jit
def _run_jit(push, repl, pop, log_vectors, state, rho0):
  def body(st, acts):
    st, rho, lm = step(st, *acts)
    return st, (rho, lm)

  xs = tuple(jnp.swapaxes(a, 0, 1) for a in (push, repl, pop, log_vectors))
  lm0 = state.log_mass
  state, (rho, lm) = lax.scan(body, state, xs)
  rho = jnp.concatenate([rho0[:, None], jnp.swapaxes(rho, 0, 1)], axis=1)
  lm = jnp.concatenate([lm0[:, None], jnp.swapaxes(lm, 0, 1)], axis=1)
  return rho, lm, state


def coupled_parts(log_bottom_vector_BxM, num_states: int, num_symbols: int,
                  window: int, broadcast_bottom: bool = False):
  """The stack's side of `limited_stack.run_chunks` / `stream_chunk`:
  (update, read, (state0, ρ_0)). The loop carries (state, ρ_{j−1}): the
  reading the controller gets is the last update's output, so it is not
  recomputed; ``update`` returns ((state, ρ_j), (ρ_j, log Σα_j))."""
  state0 = initial_state(log_bottom_vector_BxM, window, num_states,
                         num_symbols, broadcast_bottom)
  rho0 = initial_reading(log_bottom_vector_BxM, num_states, num_symbols,
                         broadcast_bottom)

  def update(carried, acts):
    st, rho, lm = step(carried[0], *acts)
    return (st, rho), (rho, lm)

  return update, lambda carried: reading(carried[1]), (state0, rho0)


def run_coupled(step_fn: Callable[..., Any], params, init_carry, xs,
                log_bottom_vector, num_states: int, num_symbols: int,
                window: int, broadcast_bottom: bool = False,
                truncation_length: int = 0,
                actions_fn: Optional[Callable[..., Any]] = None):
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

  Returns:
    (outs [B, T, ...], readings ρ [B, T+1, Q, S, M], log Σα [B, T+1]);
    forward values do not depend on `truncation_length` or `actions_fn`.
  """
  _check_window(window)
  b = jax.tree_util.tree_leaves(xs)[0].shape[0]
  log_bottom_vector = vrns_stack._check_inputs(  # pylint: disable=protected-access
      num_states, num_symbols, log_bottom_vector, b)
  update, read, (state0, rho0) = coupled_parts(
      log_bottom_vector, num_states, num_symbols, window, broadcast_bottom)
  outs, (rho, lm) = limited_stack.run_chunks(
      step_fn, update, read, params, init_carry, (state0, rho0), xs,
      truncation_length, actions_fn)
  rho = jnp.concatenate([rho0[:, None], rho], axis=1)
  lm = jnp.concatenate([state0.log_mass[:, None], lm], axis=1)
  return outs, rho, lm

