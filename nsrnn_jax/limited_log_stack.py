"""The memory-limited stack (window D) in log space: exact, no flush.

The same function as `limited_stack` (the RNS-RNN's memory-limited stack,
rns-vrns-reference.md §2: γ[i→j] kept for j−D ≤ i ≤ j−1, fixed or frozen
bottom, state or symbol reading, run incrementally and trained with
truncated BPTT), with the table of `log_stack`: log posterior shares,
so a run far behind the best one (more than ~80 nats in float32) that a
later weight brings back is kept, where `limited_stack`'s linear shares
flush it to zero for good. Opt in with ``config.stack_table = "log"`` on
an RNS-RNN with ``stack_window`` D ≥ 1.

The window is `limited_stack`'s ring of D time slots (time τ at slot
(τ + D − 1) mod D on both time axes) in `log_stack`'s layout: update j
computes column j with `log_stack.new_column` from the window as it
stands (every slot but that of time j−1 holds an earlier time), writes it
into the slot of the oldest time j−D and sets that slot's row (now time
j) to −inf in every column, exactly as `limited_stack` writes and clears
its share ring. The column sums log c_k are recomputed from the window at
each update (the row cleared at update j changes every column's sum, and a
log-space subtraction of it would not be exact); measured at D = 35, B =
10, n = 80, Q = S = 2, that is ~7% of the forward's and the gradient's
time.

Gradient: in a chunk of L coupled steps (`run_coupled`, the models'
training and streams), a reverse sweep as `limited_stack`'s: the forward
keeps the column and the row each update overwrites, O(L·D) memory, and
the backward rebuilds the windows in reverse and re-differentiates each
update (`limited_stack.WINDOW_VJP`: "custom", the default). With
"autodiff", and for `run` / `step` on given actions, autodiff of the scan
with each update rematerialised (`jax.checkpoint`): the L windows, O(L·D²).

Cost per update: the pop term is a log-matmul of B·D²·Q³·S² terms
(`log_stack.pop_rows_of`: a matmul where that is exact to rounding, else a
logsumexp over the terms), independent of the position in the stream, so
long streams still run in linear time.

Shape legend: B batch, T updates, D window, Q states, S stack symbols,
Y/X symbols in roles, L chunk length.
"""

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from nsrnn_jax import limited_stack
from nsrnn_jax import log_stack
from nsrnn_jax import ns_stack
from nsrnn_jax import rns_stack
from nsrnn_jax.limited_stack import _controller_step  # pylint: disable=protected-access
from nsrnn_jax.ns_stack import logsumexp_guarded as _lse  # -inf-safe

Array = jax.Array

__all__ = ["LogWindowState", "initial_state", "step", "run", "run_coupled",
           "coupled_parts"]


class LogWindowState(NamedTuple):
  """The carried stack state before update j (a pytree).

  Attributes:
    table: log shares on times j−D..j−1, [B, Y, D (row i), Q, X, D
      (column k), T] (`log_stack`'s layout: table[b, y, i, q, x, k, t] =
      L_{i,k}[q,x,t,y]), time τ at slot (τ + D − 1) mod D of both time
      axes (a ring); −inf where no run is kept.
    a_hat: normalised log α_{j−1}, [B, Q, S].
    log_mass: log Σα_{j−1}, [B].
    head: the slot of time j−1, int32 [] (D − 1 before update 1).
  """
  table: Array
  a_hat: Array
  log_mass: Array
  head: Array


def initial_state(batch_size, window, num_states, num_symbols,
                  bottom=rns_stack.FIXED, dtype=jnp.float32
                  ) -> LogWindowState:
  """The state before update 1: α_0 = e_{q0,⊥} and, with the fixed bottom,
  the bottom share L_{−1,0} = 0 (time 0 at slot D−1, time −1 at D−2; a
  window of D = 1 has no room for it, as in `limited_stack`)."""
  limited_stack.check_window(window)
  rns_stack._check_bottom(bottom)  # pylint: disable=protected-access
  b, d, q, s = ns_stack.check_sizes(batch_size=batch_size, num_points=window,
                                    num_states=num_states,
                                    num_symbols=num_symbols)
  table = jnp.full((b, s, d, q, s, d, q), -jnp.inf, dtype)
  if bottom == rns_stack.FIXED and d >= 2:
    table = table.at[:, 0, d - 2, 0, 0, d - 1, 0].set(0)
  a_hat = jnp.full((b, q, s), -jnp.inf, dtype).at[:, 0, 0].set(0)
  return LogWindowState(table, a_hat, jnp.zeros((b,), dtype),
                        jnp.asarray(d - 1, jnp.int32))


def _update(state: LogWindowState, push_BxQxSxQxS, repl_BxQxSxQxS,
            pop_BxQxSxQ, precision):
  table, a_prev, log_mass, p = state
  d = table.shape[2]
  log_c = jnp.transpose(_lse(table, axis=(2, 3, 4)), (0, 2, 3, 1))  # b k t y
  prev = log_stack.column(table, p)                            # b i q x s z
  slots = jnp.arange(d)
  earlier = slots != p       # in a ring every other slot is an earlier time
  col, a_hat, delta = log_stack.new_column(
      table, log_c, prev, prev,  # rows and columns share the slots
      lax.dynamic_index_in_dim(log_c, p, axis=1, keepdims=False), a_prev,
      push_BxQxSxQxS, repl_BxQxSxQxS, pop_BxQxSxQ, cols_before=earlier,
      rows_before=earlier, push_at=slots == p, precision=precision)
  nxt = (p + 1) % d
  table = lax.dynamic_update_index_in_dim(table, jnp.moveaxis(col, -1, 1),
                                          nxt, axis=5)
  table = lax.dynamic_update_index_in_dim(
      table, jnp.full(table.shape[:2] + table.shape[3:], -jnp.inf,
                      table.dtype), nxt, axis=2)
  log_mass = log_mass + delta
  return LogWindowState(table, a_hat, log_mass, nxt), a_hat, log_mass


# Each update is recomputed in the backward pass: a scan then keeps only
# its carried windows, not the table-sized intermediates of every update.
_remat_update = jax.checkpoint(_update, static_argnums=(4,))


def step(state: LogWindowState, push_BxQxSxQxS, repl_BxQxSxQxS,
         pop_BxQxSxQ, precision="highest"):
  """One update; returns (next state, log α̂_j [B,Q,S], log Σα_j [B]).

  `precision` is the matmul precision name of the pop term's matmul.
  """
  return _remat_update(state, push_BxQxSxQxS, repl_BxQxSxQxS, pop_BxQxSxQ,
                       precision)


def run(push, repl, pop, window, bottom=rns_stack.FIXED, state=None,
        precision="highest"):
  """Runs T updates from `state` (default: the initial state), exactly:
  the arguments and results of `limited_stack.run` (`state` a
  `LogWindowState`), without its flush limit. Returns (log_alpha_hat
  [B, T, Q, S], log_mass [B, T], final state) for times 1..T after `state`.
  """
  return limited_stack.run_given(step, initial_state, LogWindowState, push,
                                 repl, pop, window, bottom, state, precision)


# ---------------------------------------------------------------------------
# A chunk of coupled steps with a reversible window (the training path).
# ---------------------------------------------------------------------------
#
# As `limited_stack._window_scan`: an update changes the window in one
# column slot (written) and one row slot (cleared), so the forward keeps
# those two slices (O(L·D)) instead of a window per update (O(L·D²) under
# autodiff of the scan), and the backward rebuilds each window from the
# one after it and re-differentiates the update (jax.vjp of `_update`, as
# `log_stack`'s reverse sweep) and the controller step.


def _log_window_scan_forward(step_fn, reading, precision, params, ctrl0,
                             state0, xs_T, keep):
  def body(carry, x):
    ctrl, table, a_prev, lm_prev, head = carry
    ctrl_new, acts, out = _controller_step(step_fn, reading, params, ctrl, x,
                                           a_prev)
    st, a_hat, lm = _update(LogWindowState(table, a_prev, lm_prev, head),
                            *acts, precision)
    saved = None
    if keep:
      nxt = (head + 1) % table.shape[2]
      # What update j overwrote (the rest of the window is unchanged).
      saved = (ctrl, a_prev, lm_prev, head,
               lax.dynamic_index_in_dim(table, nxt, axis=5, keepdims=False),
               lax.dynamic_index_in_dim(table, nxt, axis=2, keepdims=False))
    return (ctrl_new, st.table, a_hat, lm, st.head), (out, a_hat, lm, saved)

  carry = (ctrl0, state0.table, state0.a_hat, state0.log_mass, state0.head)
  return lax.scan(body, carry, xs_T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _log_window_scan(step_fn, reading, precision, params, ctrl0, state0,
                     xs_T):
  (ctrl, table, a, lm, head), (outs, a_hats, lms, _) = (
      _log_window_scan_forward(step_fn, reading, precision, params, ctrl0,
                               state0, xs_T, False))
  return ctrl, LogWindowState(table, a, lm, head), outs, a_hats, lms


def _log_window_scan_fwd(step_fn, reading, precision, params, ctrl0, state0,
                         xs_T):
  (ctrl, table, a, lm, head), (outs, a_hats, lms, saved) = (
      _log_window_scan_forward(step_fn, reading, precision, params, ctrl0,
                               state0, xs_T, True))
  out = (ctrl, LogWindowState(table, a, lm, head), outs, a_hats, lms)
  return out, (params, xs_T, table, saved)


def _log_window_scan_bwd(step_fn, reading, precision, resid, cts):
  params, xs_T, table_last, saved = resid
  ctrl_ct, state_ct, outs_ct, a_hats_ct, lms_ct = cts

  def body(carry, inp):
    table, table_ct, ctrl_ct, a_ct, lm_ct, p_ct = carry
    x, out_ct, a_out_ct, lm_out_ct, sv = inp
    ctrl_prev, a_prev, lm_prev, head, old_col, old_row = sv
    # The window before update j: its cleared row and written column back.
    nxt = (head + 1) % table.shape[2]
    table = lax.dynamic_update_index_in_dim(table, old_row, nxt, axis=2)
    table = lax.dynamic_update_index_in_dim(table, old_col, nxt, axis=5)
    xf, merge = rns_stack.float_inputs(x)

    def ctrl(p, c, ap, xf):
      return _controller_step(step_fn, reading, p, c, merge(xf), ap)

    (_, acts, _), ctrl_vjp = jax.vjp(ctrl, params, ctrl_prev, a_prev, xf)

    def update(tb, ap, lp, acts):
      st, a_hat, lm = _update(LogWindowState(tb, ap, lp, head), *acts,
                              precision)
      return st.table, a_hat, lm

    _, update_vjp = jax.vjp(update, table, a_prev, lm_prev, acts)
    table_ct, d_a, d_lm, d_acts = update_vjp(
        (table_ct, a_ct + a_out_ct, lm_ct + lm_out_ct))
    dp, dc, d_a_ctrl, dxf = ctrl_vjp((ctrl_ct, d_acts, out_ct))
    p_ct = jax.tree_util.tree_map(jnp.add, p_ct, dp)
    return (table, table_ct, dc, d_a + d_a_ctrl, d_lm, p_ct), dxf

  init = (table_last, state_ct.table, ctrl_ct, state_ct.a_hat,
          state_ct.log_mass, jax.tree_util.tree_map(jnp.zeros_like, params))
  (_, table_ct, ctrl_ct, a_ct, lm_ct, p_ct), dxf_T = lax.scan(
      body, init, (xs_T, outs_ct, a_hats_ct, lms_ct, saved), reverse=True)
  xs_ct = rns_stack.inputs_cotangent(xs_T, dxf_T)
  state0_ct = LogWindowState(table_ct, a_ct, lm_ct,
                             np.zeros((), jax.dtypes.float0))
  return p_ct, ctrl_ct, state0_ct, xs_ct


_log_window_scan.defvjp(_log_window_scan_fwd, _log_window_scan_bwd)


def coupled_parts(batch: int, num_states: int, num_symbols: int,
                  window: int, bottom: str = rns_stack.FIXED,
                  reading: str = rns_stack.STATE, dtype=jnp.float32,
                  precision: str = "highest"):
  """The stack's side of `limited_stack.run_chunks` / `stream_chunk`:
  (update, read, state0) for B strings, as `limited_stack.coupled_parts`
  (``update`` returns (state, (α̂_j, log Σα_j)))."""
  state0 = initial_state(batch, window, num_states, num_symbols, bottom,
                         dtype)

  def update(st, acts):
    st, a_hat, lm = step(st, *acts, precision=precision)
    return st, (a_hat, lm)

  if limited_stack.WINDOW_VJP == "custom":
    # stream_chunk's fast path: the chunk's scan with the reversible window.
    update.coupled_scan = limited_stack.coupled_scan_of(
        _log_window_scan, reading, precision)
  read = lambda st: rns_stack.readout(st.a_hat, reading)[0]
  return update, read, state0


def run_coupled(step_fn: Callable[..., Any], params, init_carry, xs,
                num_states: int, num_symbols: int, window: int,
                bottom: str = rns_stack.FIXED,
                reading: str = rns_stack.STATE,
                truncation_length: int = 0,
                actions_fn: Optional[Callable[..., Any]] = None,
                precision: str = "highest"):
  """Controller + the exact limited stack, chunked for truncated BPTT.

  The contract of `limited_stack.run_coupled`: the same chunks, boundary gradients (`actions_fn`: ICLR 2023 if given, ICLR 2022
  if None) and outputs (outs [B, T, ...], log_alpha_hat [B, T+1, Q, S],
  log_mass [B, T+1]).
  """
  limited_stack.check_window(window)
  rns_stack._check_bottom(bottom)  # pylint: disable=protected-access
  rns_stack._check_reading(reading)  # pylint: disable=protected-access
  b = jax.tree_util.tree_leaves(xs)[0].shape[0]
  dtype = rns_stack._float_dtype(params)  # pylint: disable=protected-access
  return limited_stack.run_parts(
      step_fn, coupled_parts(b, num_states, num_symbols, window, bottom,
                             reading, dtype,
                             ns_stack.check_precision(precision)),
      params, init_carry, xs, truncation_length, actions_fn)

