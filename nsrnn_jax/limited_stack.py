"""The memory-limited nondeterministic stack (window D), run incrementally.

rns-vrns-reference.md §2 (the authors' ``Limited*`` stacks, ICLR 2022/2023):
γ[i→j] is kept only for j−D ≤ i ≤ j−1. Exactly, this sums the runs of the
unlimited stack in which an element is on top only during the D time steps
after its push (⊥ counts as pushed at update 0); with D ≥ T + 1 it equals
the unlimited stack. Cost per update is O(B·D²·Q³·S²), independent of the
position in the stream, and the state is O(B·D²·Q²·S²): long strings are
processed incrementally in linear time.

The update is `rns_stack.update` (posterior shares, exact up to its flush
limit, either bottom) applied to a D × D window of the share table on
the times j−D..j−1. The window is a ring: time τ lives at slot
(τ + D − 1) mod D on both time axes (column and row), so update j writes
column j into the slot of the oldest time j−D and clears that slot's row
(time j: no entries yet) in place, instead of shifting the whole window by
one column and one row (two table copies per update). Unlike the authors'
code, no α window is carried: shares need only α̂_{j−1}.

Training (truncated BPTT): `run_coupled` processes the inputs in chunks of
``truncation_length`` controller steps with a `lax.scan` over chunks; the
controller carry and the stack state cross chunk boundaries with their
values (so chunked = unchunked in the forward pass) but no gradient
(`lax.stop_gradient`), as the authors' trainer detaches them. Which
computations the boundary's gradient reaches follows the authors' two tags
(rns-vrns-reference.md §2.2), chosen by `run_coupled`'s ``actions_fn``:
* given (ICLR 2023): a chunk's last update is made at the start of the
  next chunk, from the carried, detached h with the live action layer, so
  every update trains the action layer (not h);
* None (ICLR 2022): a chunk's last update is made at its end and then
  detached: the actions of each chunk's last hidden state get no gradient.
Within a chunk the gradient is hand-written (`WINDOW_VJP`, "custom" by
default): the forward keeps the row each update overwrites (the column it
overwrites is always empty) and the backward rebuilds the windows in
reverse, O(B·L·D·Q²·S²) memory for chunk length L (autodiff of the scan,
"autodiff", keeps every window: O(B·L·D²·Q²·S²)).

Shape legend: B batch, T updates, D window, Q states, S stack symbols,
Y/X symbols in roles, L chunk length, C chunks.
"""

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nsrnn_jax import rns_stack
from nsrnn_jax.ns_stack import check_precision

Array = jax.Array

__all__ = ["WindowState", "initial_state", "step", "run", "run_coupled",
           "run_parts", "run_given", "run_chunks", "stream_chunk",
           "chunk_start", "coupled_parts", "share_margin", "margin_scan",
           "MarginState", "with_minima", "margin_step", "suffix_minima",
           "read_minima", "write_minima", "log_minima", "after"]


class WindowState(NamedTuple):
  """The carried stack state before update j (a pytree).

  Attributes:
    g: shares on times j−D..j−1, [B, Y, D (column), T, D (row), Q, X]
      (rns_stack's column-major layout), time τ at slot (τ + D − 1) mod D
      of both time axes (a ring).
    a_hat: normalised log α_{j−1}, [B, Q, S].
    log_mass: log Σα_{j−1}, [B].
    head: the slot of time j−1, int32 [] (D − 1 before update 1).
  """
  g: Array
  a_hat: Array
  log_mass: Array
  head: Array


class MarginState(NamedTuple):
  """A window's state in a margin sweep: the state and, per share table
  (g; the VRNS's g and gv), each column's suffix minima (`suffix_minima`),
  so that an update's pop margin reads one slot of them (`read_minima`)
  instead of reducing its whole ring.

  Attributes:
    state: the window's state (`WindowState`, or
      `limited_vrns.VectorShareState`).
    lows: a tuple, one [B, Y, D (column), T, D (row slot)] array per
      table.
  """
  state: Any
  lows: tuple


# Why suffix minima: before update j every column holds rows of times
# j−D..j−1 only, and its entries never change but for rows leaving (the
# oldest first). So the least entry of column k now is the least over its
# rows of time ≥ j−D, a suffix in time order, which the column can store
# for every cutoff when it is written: update j reads one slot per column
# (the cutoff j−D) and writes the new column's D cutoffs, column-sized work
# where reducing the ring each update was table-sized.


def _block_min(x, first_axis):
  """min of x's positive entries over the axes from `first_axis` on (+inf
  where none)."""
  return jnp.min(jnp.where(x > 0, x, jnp.inf),
                 axis=tuple(range(first_axis, x.ndim)))


def _suffix_min(m, oldest):
  """m [..., D] over ring slots, the oldest time at slot `oldest`: the
  minimum over each slot and the later times' slots."""
  rolled = jnp.roll(m, -oldest, axis=-1)             # time order, oldest first
  return jnp.roll(lax.cummin(rolled, axis=m.ndim - 1, reverse=True), oldest,
                  axis=-1)


def suffix_minima(table, head):
  """Each column's suffix minima of a ring table [B, Y, D, T, D, ...] whose
  newest time is at slot `head` (a state's head): [B, Y, D, T, D], at
  [b, y, k, t, s] the least nonzero entry of column (k, t, y) over its rows
  of the time at slot s and later (+inf where none). One table-sized
  reduction, made once per sweep or stream chunk."""
  # The table is often a constant (a sweep's initial state, jitted): the
  # barrier keeps XLA from folding this reduction while compiling (2.5 s
  # for B = 10, D = 35, Q = S = 3; 0.1 s with it).
  m = _block_min(lax.optimization_barrier(table), 5)
  return _suffix_min(m, (head + 1) % table.shape[2])


def read_minima(lows, head):
  """The least nonzero entry of each table row (y, k, t) of a state whose
  newest time is at slot `head`, [B, Y, D, T] (+inf where none): slot
  head + 1 (the oldest time) of each column's suffix minima."""
  return lax.dynamic_index_in_dim(lows, (head + 1) % lows.shape[4], axis=4,
                                  keepdims=False)


def after(value, margin):
  """`value` as it is, made to depend on `margin` (an update's margin [B]).

  A margin sweep reads its carried tables (and their minima) for the
  margin only; nothing orders those reads before the update overwrites the
  tables in place, so XLA:CPU copied every carried table each update (the
  window's margin sweep ran 2-2.6x slower). Writing the new column as
  `after(col, margin)` orders them. `margin < −inf` is false for every
  float, NaN included: the value never changes.
  """
  return jnp.where(jnp.any(margin < -jnp.inf), jnp.zeros_like(value), value)


def write_minima(lows, col, head):
  """The suffix minima after `_ring_write(table, col, head)` (column j at
  the new head, its row slot `head` cleared), from those before: the new
  column's only (col [B, Y, T, D, ...], as `after` gives it, so that the
  update's reads of `lows` come first and `lows` is written in place)."""
  d = lows.shape[4]
  m = _block_min(col, 4)
  m = jnp.where(jnp.arange(d) == head, jnp.inf, m)      # the cleared row
  return lax.dynamic_update_index_in_dim(
      lows, _suffix_min(m, (head + 1) % d), head, axis=2)


def log_minima(read):
  """`rns_stack._row_min` of a table from its `read_minima`."""
  return rns_stack._log_or_inf(read)  # pylint: disable=protected-access


def check_window(window):
  """Raises a one-line ValueError unless `window` is an integer D ≥ 1."""
  if (isinstance(window, bool) or not isinstance(window, int)
      or window < 1):
    raise ValueError(f"window must be an integer D >= 1, got {window!r}")


def initial_state(batch_size, window, num_states, num_symbols,
                  bottom=rns_stack.FIXED, dtype=jnp.float32) -> WindowState:
  """The state before update 1: α_0 = e_{q0,⊥} and, with the fixed bottom,
  the bottom share H_{−1,0} (time 0 at window index D−1)."""
  check_window(window)
  g = rns_stack.initial_table(batch_size, window, num_states, num_symbols,
                              bottom, corner=window - 1, dtype=dtype)
  a_hat = jnp.full((batch_size, num_states, num_symbols), -jnp.inf,
                   dtype).at[:, 0, 0].set(0)
  return WindowState(g, a_hat, jnp.zeros((batch_size,), dtype),
                     jnp.asarray(window - 1, jnp.int32))


# How a window update is differentiated: "custom" (`_window_update`'s
# hand-written VJP, the default) or "autodiff" (JAX's transpose of the
# same forward; the reference). Read when the update is traced.
WINDOW_VJP = "custom"
WINDOW_VJP_MODES = ("custom", "autodiff")


def _ring_write(g, col, head):
  """Column j into slot `head` (the oldest time's), then that slot's row
  (time j−D, now time j: no entries yet) cleared in every column."""
  g = lax.dynamic_update_index_in_dim(g, col, head, axis=2)
  return lax.dynamic_update_index_in_dim(
      g, jnp.zeros(g.shape[:4] + g.shape[5:], g.dtype), head, axis=4)


def _window_update_plain(g, head, a_prev, push, repl, pop, precision):
  col, a_hat, inc = rns_stack.update(g, head, a_prev, push, repl, pop,
                                     precision, ring=True)
  return _ring_write(g, col, (head + 1) % g.shape[2]), a_hat, inc


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _window_update(g, head, a_prev, push, repl, pop, precision):
  """One ring update: (next window, log α̂_j, inc); hand-written VJP.

  Same values as `_window_update_plain`. The backward takes the next
  window's cotangent apart as the forward put it together (row clear,
  column write, the pop matmul's two transposes as table-sized matmuls)
  and differentiates the column-sized part with `rns_stack._local_bwd`
  from the forward's residuals, so each update's backward is a few
  table-sized ops where autodiff's transpose of the ring writes and the
  column sums made several more.
  """
  return _window_update_fwd(g, head, a_prev, push, repl, pop, precision)[0]


def _window_update_fwd(g, head, a_prev, push, repl, pop, precision):
  col, a_hat, inc, (cs, mt, res) = rns_stack.update(
      g, head, a_prev, push, repl, pop, precision, ring=True, residuals=True)
  out = (_ring_write(g, col, (head + 1) % g.shape[2]), a_hat, inc)
  return out, (g, head, cs, mt, res, a_hat)


def _window_update_bwd(precision, resid, cts):
  g, head, cs, mt, res, a_hat = resid
  g_ct, a_hat_ct, inc_ct = cts
  prec = rns_stack.lax_precision(precision)
  b, ny, d, nr = g.shape[:4]
  nxt = (head + 1) % d
  # The row clear and the column write, transposed: the cleared row and
  # the overwritten column of the old window get no cotangent.
  g_ct = lax.dynamic_update_index_in_dim(
      g_ct, jnp.zeros(g.shape[:4] + g.shape[5:], g.dtype), nxt, axis=4)
  col_ct = lax.dynamic_index_in_dim(g_ct, nxt, axis=2, keepdims=False)
  g_ct = lax.dynamic_update_index_in_dim(
      g_ct, jnp.zeros_like(col_ct), nxt, axis=2)
  # col += Σ_{k,t} mt[b,y,r,k,t] G[b,y,k,t,i,q,x], transposed: M̃'s
  # cotangent contracts the table's rows (the table as it lies, the left
  # operand), the table's is a rank-R product added to the carried one.
  g_rows = g.reshape(b * ny, d * nr, -1)
  col_rows = col_ct.reshape(b * ny, nr, -1)
  mt_ct = jnp.transpose(rns_stack._table_dot(  # pylint: disable=protected-access
      g_rows, col_rows, 2, prec).reshape(b, ny, d, nr, nr),
                        (0, 1, 4, 2, 3))                   # b y r k t
  outer = rns_stack._table_dot(  # pylint: disable=protected-access
      jnp.swapaxes(mt.reshape(b * ny, nr, d * nr), 1, 2), col_rows, 1, prec)
  prev = lax.dynamic_index_in_dim(g, head, axis=2, keepdims=False)
  d_prev, d_cs, d_a, d_pu, d_re, d_po = rns_stack._local_bwd(  # pylint: disable=protected-access
      prev, cs, head, a_hat, res, (col_ct, mt_ct, a_hat_ct, inc_ct), prec,
      ring=True)
  g_ct = (g_ct + outer.reshape(g.shape)
          + d_cs[:, :, :, :, None, None, None])
  g_ct = lax.dynamic_update_index_in_dim(
      g_ct, lax.dynamic_index_in_dim(g_ct, head, axis=2, keepdims=False)
      + d_prev, head, axis=2)
  return (g_ct, np.zeros(jnp.shape(head), jax.dtypes.float0), d_a, d_pu,
          d_re, d_po)


_window_update.defvjp(_window_update_fwd, _window_update_bwd)


# ---------------------------------------------------------------------------
# A chunk of coupled steps with a reversible window (the training path).
# ---------------------------------------------------------------------------
#
# Autodiff of a scan saves every carried value at every step: here the whole
# D × D window per update, L·D² memory written in the forward and read in
# the backward (profiled at D = 35, B = 10, L = 79 on 2 CPU cores: ~40% of
# the gradient's time, most of it zeroing the fresh residual buffer;
# benchmarks/window_vjp.py has the before/after). An update changes the
# window only in one column slot and one row slot, so the backward can
# rebuild the window before update j from the one after it and the row
# slice the update overwrote (the column it overwrites is always empty):
# `_window_scan` saves those rows (L·D) and
# sweeps the chunk in reverse with the window as a carry, differentiating
# each update with `_window_update_bwd` and the controller with `jax.vjp`.


def _controller_step(step_fn, reading, params, ctrl, x, a_prev):
  rho = rns_stack.readout(a_prev, reading)[0]
  return step_fn(params, ctrl, x, rho)


def _window_scan_forward(step_fn, reading, precision, params, ctrl0, state0,
                         xs_T, keep):
  def body(carry, x):
    ctrl, g, a_prev, lm_prev, head = carry
    ctrl_new, acts, out = _controller_step(step_fn, reading, params, ctrl, x,
                                           a_prev)
    (g_new, a_hat, inc), resid = _window_update_fwd(g, head, a_prev, *acts,
                                                    precision)
    lm = lm_prev + inc
    nxt = (head + 1) % g.shape[2]
    saved = None
    if keep:
      _, _, cs, mt, res, _ = resid
      # What update j overwrote (the rest of the window is unchanged): the
      # row of time j−D. The column it overwrites, time j−D's, is empty:
      # its rows are times before j−D, all cleared by now.
      saved = (ctrl, a_prev, head,
               lax.dynamic_index_in_dim(g, nxt, axis=4, keepdims=False),
               cs, mt, res)
    return (ctrl_new, g_new, a_hat, lm, nxt), (out, a_hat, lm, saved)

  carry = (ctrl0, state0.g, state0.a_hat, state0.log_mass, state0.head)
  return lax.scan(body, carry, xs_T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _window_scan(step_fn, reading, precision, params, ctrl0, state0, xs_T):
  (ctrl, g, a, lm, head), (outs, a_hats, lms, _) = _window_scan_forward(
      step_fn, reading, precision, params, ctrl0, state0, xs_T, False)
  return ctrl, WindowState(g, a, lm, head), outs, a_hats, lms


def _window_scan_fwd(step_fn, reading, precision, params, ctrl0, state0,
                     xs_T):
  (ctrl, g, a, lm, head), (outs, a_hats, lms, saved) = _window_scan_forward(
      step_fn, reading, precision, params, ctrl0, state0, xs_T, True)
  out = (ctrl, WindowState(g, a, lm, head), outs, a_hats, lms)
  return out, (params, xs_T, g, a_hats, saved)


def _flat_window(g):
  """The window [B, Y, D, T, D, Q, X] as [B·Y, D·T, D·Q·X] (a reshape): a
  column slot is D·T's slice [slot·T, (slot + 1)·T), a row slot D·Q·X's
  slice [slot·Q·X, (slot + 1)·Q·X)."""
  b, ny, d, nr = g.shape[:4]
  return g.reshape(b * ny, d * nr, -1)


def _rebuild_flat(flat, old_row, nxt, shape):
  """The flat window before update j from the one after it: slot nxt's row
  back (old_row, [B, Y, D, T, Q, X]) and its column empty again."""
  b, ny, d, nr, _, q, nx = shape
  flat = lax.dynamic_update_slice_in_dim(
      flat, old_row.reshape(b * ny, d * nr, q * nx), nxt * q * nx, axis=2)
  return lax.dynamic_update_slice_in_dim(
      flat, jnp.zeros((b * ny, nr, d * q * nx), flat.dtype), nxt * nr,
      axis=1)


def _window_scan_bwd(step_fn, reading, precision, resid, cts):
  params, xs_T, g_last, a_hats, saved = resid
  ctrl_ct, state_ct, outs_ct, a_hats_ct, lms_ct = cts
  shape = g_last.shape

  def body(carry, inp):
    # The window is carried flat (`_flat_window`), the layout of the
    # backward's table-sized product. Carried as [B, Y, D, T, D, Q, X],
    # XLA:CPU made the rebuilt window twice (once for the carry, once in
    # the product's flat layout) and copied it four times per update: the
    # chunk gradient ran 1.3x slower at D = 35 and 1.5x at D = 100, same
    # values (window_vjp_before_after.json).
    flat, g_ct, ctrl_ct, a_ct, lm_ct, p_ct = carry
    x, out_ct, a_out_ct, lm_out_ct, a_hat, sv = inp
    ctrl_prev, a_prev, head, old_row, cs, mt, res = sv
    a_ct = a_ct + a_out_ct
    lm_ct = lm_ct + lm_out_ct
    # The window before update j: its overwritten row back, its
    # overwritten column empty again (see `_window_scan_forward`).
    flat = _rebuild_flat(flat, old_row, (head + 1) % shape[2], shape)
    g_ct, _, d_a, *d_acts = _window_update_bwd(
        precision, (flat.reshape(shape), head, cs, mt, res, a_hat),
        (g_ct, a_ct, lm_ct))
    xf, merge = rns_stack.float_inputs(x)

    def ctrl(p, c, ap, xf):
      return _controller_step(step_fn, reading, p, c, merge(xf), ap)

    _, vjp = jax.vjp(ctrl, params, ctrl_prev, a_prev, xf)
    dp, dc, d_a_ctrl, dxf = vjp((ctrl_ct, tuple(d_acts), out_ct))
    p_ct = jax.tree_util.tree_map(jnp.add, p_ct, dp)
    return (flat, g_ct, dc, d_a + d_a_ctrl, lm_ct, p_ct), dxf

  init = (_flat_window(g_last), state_ct.g, ctrl_ct, state_ct.a_hat,
          state_ct.log_mass, jax.tree_util.tree_map(jnp.zeros_like, params))
  (_, g_ct, ctrl_ct, a_ct, lm_ct, p_ct), dxf_T = lax.scan(
      body, init, (xs_T, outs_ct, a_hats_ct, lms_ct, a_hats, saved),
      reverse=True)
  xs_ct = rns_stack.inputs_cotangent(xs_T, dxf_T)
  state0_ct = WindowState(g_ct, a_ct, lm_ct, np.zeros((), jax.dtypes.float0))
  return p_ct, ctrl_ct, state0_ct, xs_ct


_window_scan.defvjp(_window_scan_fwd, _window_scan_bwd)


def coupled_scan_of(window_scan, reading, precision):
  """`stream_chunk`'s scan of coupled steps from a window stack's
  custom-VJP chunk scan (`_window_scan`, `limited_log_stack`'s).

  ``window_scan(step_fn, reading, precision, params, ctrl, state, xs)``
  returns (ctrl, state, outs, log α̂_j's, log Σα_j's); the result has the
  signature of ``lax.scan`` over (controller step, update), with the same
  values and gradients as that generic loop (`run_chunks`'), and returns
  ((controller carry, state), (outs, (log α̂_j, log Σα_j))), all
  time-major [L, B, ...].
  """

  def scan(step_fn, params, carry, xs_chunk):
    ctrl, st = carry
    ctrl, st, outs, a_hats, lms = window_scan(step_fn, reading, precision,
                                              params, ctrl, st, xs_chunk)
    return (ctrl, st), (outs, (a_hats, lms))

  return scan


def step(state: WindowState, push_BxQxSxQxS, repl_BxQxSxQxS, pop_BxQxSxQ,
         precision="highest"):
  """One update; returns (next state, log α̂_j [B,Q,S], log Σα_j [B]).

  `precision` is the matmul precision name of the update's contractions
  (`ns_stack.MATMUL_PRECISIONS`), forward and backward.
  """
  if WINDOW_VJP not in WINDOW_VJP_MODES:
    raise ValueError(f"limited_stack.WINDOW_VJP must be one of "
                     f"{WINDOW_VJP_MODES}, got {WINDOW_VJP!r}")
  update = (_window_update if WINDOW_VJP == "custom"
            else _window_update_plain)
  g, a_hat, inc = update(state.g, state.head, state.a_hat, push_BxQxSxQxS,
                         repl_BxQxSxQxS, pop_BxQxSxQ, precision)
  log_mass = state.log_mass + inc
  return (WindowState(g, a_hat, log_mass, (state.head + 1) % g.shape[2]),
          a_hat, log_mass)


def run(push, repl, pop, window, bottom=rns_stack.FIXED, state=None,
        precision="highest"):
  """Runs T updates from `state` (default: the initial state).

  Args:
    push, repl, pop: log-weights [B,T,Q,S,Q,S], [B,T,Q,S,Q,S], [B,T,Q,S,Q].
    window: D ≥ 1.
    bottom: "fixed" or "frozen" (used only for the initial state).
    state: a WindowState to continue from (incremental evaluation).
    precision: matmul precision name (`ns_stack.MATMUL_PRECISIONS`).

  Returns:
    (log_alpha_hat [B, T, Q, S], log_mass [B, T], final state) for times
    1..T after `state`; log α_j = log_alpha_hat_j + log_mass_j.
  """
  return run_given(step, initial_state, WindowState, push, repl, pop, window,
                   bottom, state, precision)


def run_given(step_fn, initial_state_fn, state_type, push, repl, pop,
              window, bottom, state, precision):
  """A window stack's `run`: its `step_fn(state, push_j, repl_j, pop_j,
  precision=) -> (state, log α̂_j, log Σα_j)` over T given updates, from
  `state` (a `state_type` whose first field's axis 2 is the window) or
  ``initial_state_fn(B, D, Q, S, bottom, dtype)``. This module's `run`
  and `limited_log_stack.run`.

  Returns:
    (log_alpha_hat [B, T, Q, S], log_mass [B, T], final state).
  """
  check_window(window)
  push, repl, pop = (jnp.asarray(a) for a in (push, repl, pop))
  b, _, q, s = rns_stack._check_actions(push, repl, pop)  # pylint: disable=protected-access
  if state is None:
    state = initial_state_fn(b, window, q, s, bottom, push.dtype)
  elif not isinstance(state, state_type):
    raise ValueError(f"state must be a "
                     f"{state_type.__module__.rsplit('.', 1)[-1]}."
                     f"{state_type.__name__}, got {type(state).__name__}")
  elif state[0].shape[2] != window:
    raise ValueError(f"state has window {state[0].shape[2]}, not {window}")
  return _run_steps(step_fn, push, repl, pop, state,
                    check_precision(precision))


@functools.partial(jax.jit, static_argnums=(0, 5))
def _run_steps(step_fn, push, repl, pop, state, precision):
  def body(st, acts):
    st, a_hat, lm = step_fn(st, *acts, precision=precision)
    return st, (a_hat, lm)

  xs = tuple(jnp.swapaxes(a, 0, 1) for a in (push, repl, pop))
  state, (a_hat, lm) = lax.scan(body, state, xs)
  return jnp.swapaxes(a_hat, 0, 1), jnp.swapaxes(lm, 0, 1), state


def share_margin(push, repl, pop, window, bottom=rns_stack.FIXED,
                 precision="highest", num_updates=None):
  """The product margin of `run` on these log-weights: [B] nats.

  `rns_stack.share_margin` for the window: above
  `rns_stack.exact_margin(dtype)` `run`'s values for that batch element
  equal exact arithmetic up to rounding (`limited_log_stack.run`'s); below
  it a share may have been flushed. Forward only, not differentiable.

  Args:
    push, repl, pop, window, bottom, precision: as for `run` (from the
      initial state).
    num_updates: as for `rns_stack.share_margin` (padding left out).
  """
  check_window(window)
  push, repl, pop = (jnp.asarray(a) for a in (push, repl, pop))
  b, _, q, s = rns_stack._check_actions(push, repl, pop)  # pylint: disable=protected-access
  state = with_minima(initial_state(b, window, q, s, bottom, push.dtype))
  return _margin_steps(push, repl, pop, state, check_precision(precision),
                       rns_stack.check_num_updates(num_updates, b))


@functools.partial(jax.jit, static_argnums=(4,))
def _margin_steps(push, repl, pop, state, precision, num_updates):
  def one(st, acts):
    st, _, _, lo_j = margin_step(st, *acts, precision=precision)
    return st, lo_j

  xs = tuple(lax.stop_gradient(jnp.swapaxes(a, 0, 1))
             for a in (push, repl, pop))
  return margin_scan(one, state, jnp.full(push.shape[:1], jnp.inf, push.dtype),
                     xs, num_updates)


def with_minima(state: WindowState) -> MarginState:
  """A window state as a margin sweep carries it (`MarginState`)."""
  return MarginState(state, (suffix_minima(state.g, state.head),))


def margin_step(mstate: MarginState, push_BxQxSxQxS, repl_BxQxSxQxS,
                pop_BxQxSxQ, precision="highest"):
  """`step` plus the update's product margin [B] (`share_margin`), last,
  on a `MarginState` (`with_minima`; its state is `step`'s).

  Forward only (the plain update, no hand-written VJP): for evaluation,
  e.g. a corpus stream's margin chunk by chunk (`coupled_parts(...,
  margin=True)`).
  """
  state, (lows,) = mstate
  g = state.g
  read = read_minima(lows, state.head)
  col, a_hat, inc, lo_j = rns_stack.update(
      g, state.head, state.a_hat, push_BxQxSxQxS, repl_BxQxSxQxS,
      pop_BxQxSxQ, precision, ring=True, margin=True,
      row_mins=log_minima(read))
  head = (state.head + 1) % g.shape[2]
  log_mass = state.log_mass + inc
  col = after(col, lo_j)
  state = WindowState(_ring_write(g, col, head), a_hat, log_mass, head)
  return (MarginState(state, (write_minima(lows, col, head),)), a_hat,
          log_mass, lo_j)


def margin_scan(step, carry, lo0, xs_T, num_updates):
  """A window's product margin: the minimum of lo0 and every update's.

  Shared by this module's and `limited_vrns`'s share margins.

  Args:
    step: (carry, x_j) -> (carry, update j's margin [B]).
    carry: the window's state.
    lo0: the initial state's margin [B] (+inf, or the bottom vector's).
    xs_T: time-major inputs of updates 1..T (pytree, leading axis T).
    num_updates: None or [B] ints: element b counts its first
      num_updates[b] updates only (`rns_stack.share_margin`).
  """
  def body(c, inp):
    carry, lo = c
    j, x_j = inp
    carry, lo_j = step(carry, x_j)
    return (carry, jnp.minimum(
        lo, rns_stack._counted(lo_j, j, num_updates))), None  # pylint: disable=protected-access

  t = jax.tree_util.tree_leaves(xs_T)[0].shape[0]
  (_, lo), _ = lax.scan(body, (carry, lo0), (jnp.arange(1, t + 1), xs_T))
  return lo


def run_coupled(step_fn: Callable[..., Any], params, init_carry, xs,
                num_states: int, num_symbols: int, window: int,
                bottom: str = rns_stack.FIXED,
                reading: str = rns_stack.STATE,
                truncation_length: int = 0, precision: str = "highest",
                actions_fn: Optional[Callable[..., Any]] = None):
  """Controller + limited stack, chunked for truncated BPTT.

  Args:
    step_fn: as for `rns_stack.run_coupled`.
    params, init_carry: differentiable pytrees (init_carry's gradient
      comes from the first chunk only).
    xs: pytree of batch-major inputs [B, T, ...].
    num_states, num_symbols: Q, S.
    window: D ≥ 1.
    bottom, reading: stack variant.
    truncation_length: chunk length L ≥ 1 (gradients stop at chunk
      boundaries); 0 = one chunk (no truncation).
    precision: matmul precision name of the stack's contractions.
    actions_fn: ``actions_fn(params, carry) -> (push, repl, pop)``, the
      log-weights `step_fn` computes from the controller carry it returns.
      Given: the ICLR 2023 boundary (a chunk's last update is made in the
      next chunk from the detached carry with live `params`, so it trains
      them); None: the ICLR 2022 boundary (it gets no gradient). The two
      differ only in the gradient, and only with truncation.

  Returns:
    (outs [B, T, ...], log_alpha_hat [B, T+1, Q, S], log_mass [B, T+1]);
    forward values do not depend on `truncation_length` or `actions_fn`.
  """
  check_window(window)
  check_precision(precision)
  rns_stack._check_bottom(bottom)  # pylint: disable=protected-access
  rns_stack._check_reading(reading)  # pylint: disable=protected-access
  b = jax.tree_util.tree_leaves(xs)[0].shape[0]
  dtype = rns_stack._float_dtype(params)  # pylint: disable=protected-access
  return run_parts(step_fn, coupled_parts(b, num_states, num_symbols,
                                          window, bottom, reading, dtype,
                                          precision),
                   params, init_carry, xs, truncation_length, actions_fn)


def run_parts(step_fn: Callable[..., Any], parts, params, init_carry, xs,
              truncation_length: int = 0,
              actions_fn: Optional[Callable[..., Any]] = None):
  """`run_chunks` on a window stack's ``parts`` (update, read, state0)
  whose updates output (log α̂_j, log Σα_j) and whose state0 has fields
  ``a_hat`` and ``log_mass`` (this module's and `limited_log_stack`'s).

  Returns:
    (outs [B, T, ...], log_alpha_hat [B, T+1, Q, S], log_mass [B, T+1]),
    time 0 included.
  """
  update, read, state0 = parts
  outs, (a_hat, lm) = run_chunks(step_fn, update, read, params, init_carry,
                                 state0, xs, truncation_length, actions_fn)
  a_hat = jnp.concatenate([state0.a_hat[:, None], a_hat], axis=1)
  lm = jnp.concatenate([state0.log_mass[:, None], lm], axis=1)
  return outs, a_hat, lm


def coupled_parts(batch: int, num_states: int, num_symbols: int,
                  window: int, bottom: str = rns_stack.FIXED,
                  reading: str = rns_stack.STATE, dtype=jnp.float32,
                  precision: str = "highest", margin: bool = False):
  """The stack's side of `run_chunks` / `stream_chunk`: (update, read,
  state0) for B strings (``update`` returns (state, (α̂_j, log Σα_j))).

  With WINDOW_VJP = "custom" (as when this is called), ``update`` carries
  ``coupled_scan``: `stream_chunk` then runs a chunk's steps as
  `_window_scan` (same values and gradients, O(L·D) memory). With
  `margin`, ``update`` is `margin_step` (forward only, same values) and
  returns (state, (α̂_j, log Σα_j, update j's product margin [B])); its
  state is a `MarginState`, which `stream_chunk` makes from the carried
  state and takes apart again (``update.enter`` / ``update.leave``), so
  the carry between chunks is the same as without `margin`.
  """
  state0 = initial_state(batch, window, num_states, num_symbols, bottom,
                         dtype)
  if margin:
    def margin_update(mst, acts):
      mst, a_hat, lm, lo_j = margin_step(mst, *acts, precision=precision)
      return mst, (a_hat, lm, lo_j)
    margin_update.enter = with_minima
    margin_update.leave = lambda mst: mst.state
    read = lambda mst: rns_stack.readout(mst.state.a_hat, reading)[0]
    return margin_update, read, state0

  read = lambda st: rns_stack.readout(st.a_hat, reading)[0]

  def update(st, acts):
    st, a_hat, lm = step(st, *acts, precision=precision)
    return st, (a_hat, lm)

  if WINDOW_VJP == "custom":
    # stream_chunk's fast path: the chunk's scan with the reversible window.
    update.coupled_scan = coupled_scan_of(_window_scan, reading, precision)
  return update, read, state0


def run_chunks(step_fn: Callable[..., Any],
               update: Callable[..., Any], read: Callable[..., Any],
               params, init_carry, state0, xs, truncation_length: int = 0,
               actions_fn: Optional[Callable[..., Any]] = None):
  """Controller + any windowed stack, in chunks for truncated BPTT.

  The chunk loop shared by this module's stack and `limited_vrns`'s.

  Args:
    step_fn: ``step_fn(params, carry, x_t, reading) -> (carry, actions,
      out)``, the controller step.
    update: ``update(state, actions) -> (state, stack_out)``, one update of
      the stack (``stack_out`` a pytree of [B, ...] arrays per time). It
      may carry an attribute ``coupled_scan(step_fn, params, (ctrl,
      state), xs) -> ((ctrl, state), (outs, stack_out))`` that replaces
      the chunk's ``lax.scan`` over (controller step, update) with the
      same values and gradients (this module's window:
      `_window_scan`).
    read: ``read(state) -> reading``, what the controller reads.
    params, init_carry: differentiable pytrees.
    state0: the stack state before update 1 (differentiable: it may depend
      on parameters). init_carry and state0 reach the first chunk with
      their gradients; later chunks get the carry detached.
    xs: pytree of batch-major inputs [B, T, ...].
    truncation_length: chunk length L ≥ 1 (gradients stop at chunk
      boundaries); 0 = one chunk (no truncation).
    actions_fn: ``actions_fn(params, carry) -> actions`` (what `step_fn`
      computes from the carry it returns): the ICLR 2023 boundary if given,
      the ICLR 2022 one if None (see `run_coupled`).

  Returns:
    (outs [B, T, ...], stack_out [B, T, ...] of times 1..T); forward values
    do not depend on `truncation_length` or `actions_fn`.
  """
  if (isinstance(truncation_length, bool)
      or not isinstance(truncation_length, int) or truncation_length < 0):
    raise ValueError("truncation_length must be 0 (none) or >= 1, got "
                     f"{truncation_length!r}")
  leaves = jax.tree_util.tree_leaves(xs)
  b, t = leaves[0].shape[:2]
  chunk = truncation_length or t
  num_chunks = -(-t // chunk)
  pad = num_chunks * chunk - t
  # Padded steps run after the last real one; nothing reads them.
  xs_c = jax.tree_util.tree_map(
      lambda l: jnp.concatenate(
          [l, jnp.repeat(l[:, -1:], pad, axis=1)], axis=1).reshape(
              (b, num_chunks, chunk) + l.shape[2:]).swapaxes(0, 1)
      .swapaxes(1, 2), xs)                       # [C, L, B, ...]

  start = (init_carry, state0)

  def one_chunk(carry, xs_chunk):
    carried, first = carry
    carried, ys = stream_chunk(step_fn, update, read, params, start, carried,
                               first, xs_chunk, actions_fn)
    return (carried, jnp.asarray(False)), ys

  carried, ys = lax.scan(one_chunk, (start, jnp.asarray(True)), xs_c)
  if actions_fn is None:
    outs, stack_out = ys
  else:
    # The last chunk's last update, made after the loop.
    (ctrl, st), _ = carried
    _, out_f = update(_enter(update, st), actions_fn(params, ctrl))
    outs, (out_b, stack_out) = ys

    def times(boundary, inner, final):
      # Chunk k holds times kL (its boundary update) .. kL+L−1; chunk 0's
      # boundary slot (time 0) is dropped and time C·L appended.
      per_chunk = jnp.concatenate([boundary[:, None], inner], axis=1)
      flat = per_chunk.reshape((-1,) + per_chunk.shape[2:])
      return jnp.concatenate([flat[1:], final[None]], axis=0).reshape(
          inner.shape[:1] + (inner.shape[1] + 1,) + inner.shape[2:])

    stack_out = jax.tree_util.tree_map(times, out_b, stack_out, out_f)
  batch_major = lambda a: jnp.swapaxes(
      a.reshape((num_chunks * chunk,) + a.shape[2:])[:t], 0, 1)
  return (jax.tree_util.tree_map(batch_major, outs),
          jax.tree_util.tree_map(batch_major, stack_out))


def _enter(update, state):
  """The state `update` steps from a stream's carried state: an update may
  carry more within a chunk (a margin sweep's `MarginState`, made at the
  chunk's start by ``update.enter`` and dropped by ``update.leave``)."""
  return getattr(update, "enter", lambda st: st)(state)


def _leave(update, state):
  """The stream's carried state from `update`'s (`_enter`'s inverse)."""
  return getattr(update, "leave", lambda st: st)(state)


def chunk_start(start, carried, first):
  """The carry a chunk starts from: `start` if `first`, else the values of
  `carried` with their gradient stopped.

  Values cross a chunk boundary, gradients do not; the first chunk keeps
  them, as its carry is the start (an initial carry and a state that may
  depend on parameters, e.g. the VRNS's learned bottom vector).
  """
  return jax.tree_util.tree_map(
      lambda a, b: jnp.where(first, a, lax.stop_gradient(b)), start, carried)


def stream_chunk(step_fn: Callable[..., Any], update: Callable[..., Any],
                 read: Callable[..., Any], params, start, carried, first,
                 xs_chunk, actions_fn: Optional[Callable[..., Any]] = None):
  """One chunk of L controller steps and their stack updates.

  The unit of truncated BPTT, used by `run_chunks` inside a scan over chunks
  and by the models' `stream` (one chunk per optimizer step, the carry kept
  between calls: corpus language modelling).

  Args:
    step_fn, update, read, params, actions_fn: as for `run_chunks`.
    start: (init_carry, state0), the carry of a stream's first chunk
      (differentiable: the state may depend on parameters).
    carried: (controller carry, stack state) left by the previous chunk;
      only its values are used (no gradient crosses a chunk boundary).
    first: bool scalar; True: this chunk starts the stream from `start`.
    xs_chunk: pytree of time-major inputs [L, B, ...].

  Returns:
    ((controller carry, stack state) for the next chunk, ys) with ys =
    (outs [L, B, ...], stack_out [L, B, ...]) if `actions_fn` is None (the
    chunk's L updates, the last one made here: ICLR 2022), else (outs,
    (boundary_out [B, ...], stack_out [L − 1, B, ...])): the update left by
    the previous chunk is made first, from its detached controller carry
    with the live `actions_fn` (a stream's first chunk has none: its
    boundary_out is a placeholder), and this chunk's last update is left to
    the next chunk (ICLR 2023). The forward values are the same either way.
  """
  ctrl, st = chunk_start(start, carried, first)
  coupled_scan = getattr(update, "coupled_scan", None)
  st = _enter(update, st)
  leave = lambda st: _leave(update, st)

  def one_step(carry, x):
    ctrl, st = carry
    ctrl, acts, out = step_fn(params, ctrl, x, read(st))
    st, stack_out = update(st, acts)
    return (ctrl, st), (out, stack_out)

  def scan(carry, xs):
    # An update may bring its own scan of coupled steps (same values and
    # gradients; e.g. `_window_scan`'s O(L·D) memory).
    if coupled_scan is not None:
      return coupled_scan(step_fn, params, carry, xs)
    return lax.scan(one_step, carry, xs)

  if actions_fn is None:
    (ctrl, st), ys = scan((ctrl, st), xs_chunk)
    return (ctrl, leave(st)), ys
  st_b, out_b = update(st, actions_fn(params, ctrl))
  # A stream's first chunk has no earlier update to make.
  st = jax.tree_util.tree_map(lambda old, new: jnp.where(first, old, new),
                              st, st_b)
  body = jax.tree_util.tree_map(lambda l: l[:-1], xs_chunk)
  last = jax.tree_util.tree_map(lambda l: l[-1], xs_chunk)
  (ctrl, st), (outs, stack_out) = scan((ctrl, st), body)
  ctrl, _, out = step_fn(params, ctrl, last, read(st))
  outs = jax.tree_util.tree_map(
      lambda a, o: jnp.concatenate([a, o[None]], axis=0), outs, out)
  return (ctrl, leave(st)), (outs, (out_b, stack_out))
