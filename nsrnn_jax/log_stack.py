"""The generalised nondeterministic stack in log space: exact, no flush.

The same function as `rns_stack.run` / `rns_stack.run_coupled` (the
unlimited stack, fixed or frozen bottom, state or symbol reading), computed
with every table entry in log space. `rns_stack` stores posterior shares as
linear numbers, so a share that falls below ~1e-35 (float32; ~1e-300 in
float64) is flushed to zero and lost for good: a run more than ~80 nats
behind the best run to the same (state, top) that a later weight brings back
is missing from its result (rns_stack's docstring; strict xfail tests). Here
each entry keeps its own exponent, so the result is exact for any finite
log-weights, at a constant factor in time (log-matmuls, by matmul only
where that is exact to rounding). Opt in with ``config.stack_table = "log"``
(NS-RNN and RNS-RNN).

Representation: log posterior shares
------------------------------------
As in `rns_stack`, each γ entry is stored relative to the α's at both of
its ends, but as a logarithm:

  L_{i,j}[q,x,r,y] = log α_i[q,x] + log γ_{i,j}[q,x,r,y] − log α_j[r,y]  ≤ 0,

and α_j as its normalised logarithm â_j (logsumexp 0) plus the increment
δ_j = log Σα_j − log Σα_{j−1}. Storing the raw log γ instead would also be
exact in range, but in float32 its entries reach the size of log Σα (1e6 for
unnormalised weights), where their rounding (~0.06) would swamp the readings;
shares of the runs that matter are near 0, where float32 is finest.

Recurrence for update j (rns_stack's, in the log semiring; ⊕ = logsumexp,
a = â_{j−1}; c_k[t,y] = ⊕_{i,q,x} L_{i,k}[q,x,t,y], the log share of α_k
still usable; times i, k index rows −1..T, the bottom row first):

  W[y,s,z]   = ⊕_{0≤k≤j−2, t} c_k[t,y] + L_{k,j−1}[t,y,s,z]
  e[r,y]     = ⊕( ⊕_{q,x} a[q,x] + pu[q,x,r,y],                     push
                  ⊕_{s,z} a[s,z] + c_{j−1}[s,z] + re[s,z,r,y],       replace
                  ⊕_{s,z} a[s,z] + W[y,s,z] + po[s,z,r] )            pop
  δ_j        = ⊕_{r,y} e[r,y];   â_j = e − δ_j
  L_{j−1,j}  = a[q,x] + pu[q,x,r,y] − e[r,y]
  L_{i,j}    = ⊕( ⊕_{s,z} L_{i,j−1}[q,x,s,z] + a[s,z] + re[s,z,r,y] − e[r,y],
                  ⊕_{k,t} L_{i,k}[q,x,t,y] + M_k[t,y,r] ),    i ≤ j−2
  M_k[t,y,r] = ⊕_{s,z} L_{k,j−1}[t,y,s,z] + a[s,z] + po[s,z,r] − e[r,y]

(e = log α_j − log Σα_{j−1}). The bottom is row −1: L_{−1,0} = 0 at
(q0,⊥)→(q0,⊥) for the fixed bottom and −inf for the frozen one, â_0 =
one-hot(q0, ⊥); as in `rns_stack` the same code then gives both semantics.

Gradient: O(T²) memory. The forward keeps only its final table and the
â's; the backward is one reverse sweep that re-differentiates update j
(jax.vjp of the update above) on the final table — update j reads only
columns < j, which never change after they are written — and accumulates
the table's cotangent, so no per-update copy of the table is kept.

Layout: the table is L[b, y, i+1, q, x, k, t] = L_{i,k}[q,x,t,y], so the
pop term's logsumexp over (k, t) runs along the last, contiguous axes, and
the sweeps run in time blocks on the tables cut to what each block reaches
(`NUM_TIME_BLOCKS`).

Cost: per update, the pop contraction is a log-matmul of B·(j1+1)·j1·Q³·S²
terms for block end j1 (the replace one B·(j1+1)·Q³·S³), so time is
O(B·T³·Q³·S²) like rns_stack. It runs as a matmul of shifted
exponentials where that is exact to rounding, else over the materialised
terms (`pop_rows_of`): 14-23x rns_stack's time at n = 80 on CPU
(benchmarks/log_stack.py).
"""

import functools
from typing import Any, Callable

import jax
from jax import lax
import jax.numpy as jnp

from nsrnn_jax import ns_stack
from nsrnn_jax import rns_stack
from nsrnn_jax.ns_stack import logsumexp_guarded as _lse  # -inf-safe

FIXED, FROZEN = rns_stack.FIXED, rns_stack.FROZEN
STATE = rns_stack.STATE


def _minus(x, e):
  """x − e, −inf where e is −inf (a dead configuration), zero gradient there."""
  ok = jnp.isfinite(e)
  return jnp.where(ok, x - jnp.where(ok, e, 0), -jnp.inf)


def _initial(b, t, q, s, bottom, dtype):
  """(L [B, Y, I, Q, X, K, T] as `update` reads it, log c [B, T+1, Q, S],
  â [B, T+1, Q, S]): the state before update 1."""
  table = jnp.full((b, s, t + 2, q, s, t + 1, q), -jnp.inf, dtype)
  log_c = jnp.full((b, t + 1, q, s), -jnp.inf, dtype)
  if bottom == FIXED:
    table = table.at[:, 0, 0, 0, 0, 0, 0].set(0)
    log_c = log_c.at[:, 0, 0, 0].set(0)
  a_hat = jnp.full((b, t + 1, q, s), -jnp.inf, dtype).at[:, 0, 0, 0].set(0)
  return table, log_c, a_hat


def update(table, log_c, a_hat, j, push_BxQxSxQxS, repl_BxQxSxQxS,
           pop_BxQxSxQ, precision="highest"):
  """Update j (1 ≤ j ≤ T) of the log-share recurrence (module docstring).

  Reads columns < j of `table` and `log_c` and â_{j−1} only, so it gives
  the same result on the final tables as on those of its time (the
  backward relies on this), and on the tables cut to a time block that
  holds column j (`_cut`: N = the block's end j1; N = T+1 uncut).

  Args:
    table: L [B, Y, N+1, Q, X, N, T] (`table[b, y, i+1, q, x, k, t] =
      L_{i,k}[q,x,t,y]`; rows: times −1..N−1, columns: times 0..N−1; the
      last axis is the state t of the top, not time).
    log_c: log c_k [B, N, Q, S] (column k's log share still usable,
      ⊕ of the column over rows and (q, x); carried, not recomputed).
    a_hat: â [B, N, Q, S].
    j: the update (traced int).
    push, repl [B, Q, S, Q, S] and pop [B, Q, S, Q]: update j's log-weights.
    precision: matmul precision name of the pop term's matmul
      (`pop_rows_of`).

  Returns:
    (column j [B, N+1, Q, S, Q, S] indexed (i+1, q, x, r, y), log c_j
    [B, Q, S], â_j [B, Q, S], δ_j [B]).
  """
  rows, cols = table.shape[2], table.shape[5]     # rows = N+1, cols = N
  row_time = jnp.arange(rows) - 1
  col_time = jnp.arange(cols)
  prev = column(table, j - 1)                                  # b i q x s z
  col, a_new, delta = new_column(
      table, log_c, prev, prev[:, 1:],  # rows of times 0..N−1 (as columns)
      lax.dynamic_index_in_dim(log_c, j - 1, axis=1, keepdims=False),
      lax.dynamic_index_in_dim(a_hat, j - 1, axis=1, keepdims=False),
      push_BxQxSxQxS, repl_BxQxSxQxS, pop_BxQxSxQ,
      cols_before=col_time <= j - 2, rows_before=row_time <= j - 2,
      push_at=row_time == j - 1, precision=precision)
  return col, _lse(col, axis=(1, 2, 3)), a_new, delta


def new_column(table, log_c, prev, prev_rows, c_prev, a, push_BxQxSxQxS,
               repl_BxQxSxQxS, pop_BxQxSxQ, cols_before, rows_before,
               push_at, precision="highest"):
  """The recurrence of update j (module docstring) on any time axes.

  Shared by `update` (time-ordered axes) and `limited_log_stack` (a ring
  window of time slots); the caller says which slots are which times.

  Args:
    table: L [B, Y, I, Q, X, K, T] (rows I, columns K).
    log_c: log c_k [B, K, Q, S] (entries outside `cols_before` ignored).
    prev: column j−1 [B, I, Q, X, S, Z] (L_{i,j−1}[q,x,s,z]).
    prev_rows: column j−1's rows of the times of the columns K, [B, K, T,
      Y, S, Z] (L_{k,j−1}[t,y,s,z]).
    c_prev: log c_{j−1} [B, Q, S].
    a: â_{j−1} [B, Q, S].
    push, repl [B, Q, S, Q, S] and pop [B, Q, S, Q]: update j's log-weights.
    cols_before: bool [K], the columns of times k ≤ j−2.
    rows_before: bool [I], the rows of times i ≤ j−2.
    push_at: bool [I], the row of time j−1.
    precision: matmul precision name of `pop_rows_of`'s matmul.

  Returns:
    (column j [B, I, Q, X, R, Y], â_j [B, Q, S], δ_j [B]).
  """
  b = table.shape[0]
  below = cols_before[None, :, None, None]
  log_c = jnp.where(below, log_c, -jnp.inf)
  w = _lse(log_c[..., None, None] + prev_rows, axis=(1, 2))   # b y s z
  e_push = _lse(a[..., None, None] + push_BxQxSxQxS, axis=(1, 2))
  e_repl = _lse((a + c_prev)[..., None, None] + repl_BxQxSxQxS, axis=(1, 2))
  e_pop = _lse((a[:, None] + w)[..., None] + pop_BxQxSxQ[:, None],
               axis=(2, 3))                                    # b y r
  e = _lse(jnp.stack([e_push, e_repl, jnp.swapaxes(e_pop, 1, 2)]), axis=0)
  delta = _lse(e.reshape(b, -1), axis=1)
  a_new = _minus(e, delta[:, None, None])
  e_bryx = e[:, None, None]                                    # b . . r y
  push_row = _minus(a[..., None, None] + push_BxQxSxQxS, e_bryx)
  k_repl = _minus(a[..., None, None] + repl_BxQxSxQxS, e_bryx)  # b s z r y
  repl_rows = _lse(prev[..., None, None] + k_repl[:, None, None, None],
                   axis=(4, 5))                                # b i q x r y
  # M_k[t,y,r] for the rows of the columns' times, k ≤ j−2.
  k_pop = (a[..., None] + pop_BxQxSxQ)[:, None, None, None]    # b . . . s z r
  m = _lse(prev_rows[..., None] + k_pop, axis=(4, 5))          # b k t y r
  m = _minus(m, jnp.swapaxes(e, 1, 2)[:, None, None])
  m = jnp.where(below[..., None], m, -jnp.inf)
  m_byrkt = jnp.transpose(m, (0, 3, 4, 1, 2))
  pop_rows = jnp.moveaxis(pop_rows_of(table, m_byrkt, cols_before,
                                      precision), 1, -1)       # b i q x r y
  col = _lse(jnp.stack([repl_rows, pop_rows]), axis=0)
  at = lambda cond: cond[None, :, None, None, None, None]
  col = jnp.where(at(rows_before), col, -jnp.inf)
  col = jnp.where(at(push_at), push_row[:, None], col)
  return col, a_new, delta


# The pop term's log-matmul, out[i, r] = ⊕_{k,t} L[i, k, t] + M[r, k, t],
# runs as a matmul of exp(L − max_row) and exp(M − max_col) whenever that is
# exact to rounding, else by logsumexp over the materialised terms:
# "matmul" (the default; forward 1.5x / 1.9x and forward+backward 1.5x /
# 2.2x faster at Q = S = 2 / 3, benchmarks/log_stack.py) or "logsumexp"
# (always; the reference).
POP_CONTRACTIONS = ("matmul", "logsumexp")
POP_CONTRACTION = "matmul"


def pop_rows_of(table, m_byrkt, cols_before, precision="highest"):
  """⊕_{k,t} L_{i,k}[q,x,t,y] + M_k[t,y,r], [B, Y, I, Q, X, R]: the pop
  rows of column j, exact for any finite log-weights.

  By matmul: with c = max_{k,t} L[i,·] (the columns of `cols_before`) and
  d = max_{k,t} M[r,·], out = c + d + log Σ_{k,t} e^{L−c} e^{M−d}, every
  factor ≤ 1. A product below the dtype's smallest normal number (tiny)
  is flushed, so the sum is exact to rounding wherever it is at least
  sqrt(tiny) (e^−44 in float32): the flushed part is then below
  K·T·sqrt(tiny) of it. If any entry whose row and column are not all
  −inf has a smaller sum (a run far behind its row's and column's best,
  exactly what the share table loses), the update takes the logsumexp
  instead (`lax.cond`, one branch runs). The gradient is written out the
  same way (two matmuls, or the logsumexp's own gradient), keeping only
  the inputs and the output: autodiff through the cond kept both branches'
  residuals at every update (1.5x the log table's gradient temporaries).

  Args:
    table: L [B, Y, I, Q, X, K, T].
    m_byrkt: M [B, Y, R, K, T] (−inf outside `cols_before`).
    cols_before: bool [K], the columns the sum runs over.
    precision: matmul precision name (`ns_stack.MATMUL_PRECISIONS`): the
      model's ``config.matmul_precision``; anything below "highest" makes
      the sums (not the exponents) reduced-precision on GPUs / TPUs.
  """
  if POP_CONTRACTION not in POP_CONTRACTIONS:
    raise ValueError(f"log_stack.POP_CONTRACTION must be one of "
                     f"{POP_CONTRACTIONS}, got {POP_CONTRACTION!r}")
  if POP_CONTRACTION == "logsumexp":
    return _pop_rows_by_logsumexp(table, m_byrkt)
  return _pop_rows_by_matmul(table, m_byrkt, cols_before, precision)


def _shifted_exponentials(table, m_byrkt, cols_before):
  """(row_max, col_max, c, d, e_rows [B,Y,I·Q·X,K·T], e_cols [B,Y,R,K·T])
  of `pop_rows_of`: e^{L−c} and e^{M−d}, every entry ≤ 1."""
  b, y, i, q, x, k, t = table.shape
  r = m_byrkt.shape[2]
  rows = jnp.where(cols_before[:, None], table, -jnp.inf)
  row_max = jnp.max(rows, axis=(-2, -1))                       # b y i q x
  col_max = jnp.max(m_byrkt, axis=(-2, -1))                    # b y r
  shift = lambda mx: lax.stop_gradient(jnp.where(jnp.isfinite(mx), mx, 0))
  c, d = shift(row_max), shift(col_max)
  e_rows = jnp.exp(rows - c[..., None, None]).reshape(b, y, i * q * x,
                                                      k * t)
  e_cols = jnp.exp(m_byrkt - d[..., None, None]).reshape(b, y, r, k * t)
  return row_max, col_max, c, d, e_rows, e_cols


def _pop_rows_primal(table, m_byrkt, cols_before, precision):
  """`pop_rows_of` by matmul, and whether the matmul was exact (else the
  logsumexp gave the value)."""
  b, y, i, q, x, _, _ = table.shape
  r = m_byrkt.shape[2]
  row_max, col_max, c, d, e_rows, e_cols = _shifted_exponentials(
      table, m_byrkt, cols_before)
  sums = lax.dot_general(e_rows, e_cols, (((3,), (3,)), ((0, 1), (0, 1))),
                         precision=rns_stack.lax_precision(precision)
                         ).reshape(b, y, i, q, x, r)
  live = (jnp.isfinite(row_max)[..., None]
          & jnp.isfinite(col_max)[:, :, None, None, None])
  exact = jnp.all(~live | (sums >= float(jnp.finfo(table.dtype).tiny) ** 0.5))
  ok = sums > 0
  fast = jnp.where(ok, jnp.log(jnp.where(ok, sums, 1)) + c[..., None]
                   + d[:, :, None, None, None], -jnp.inf)
  out = lax.cond(exact, lambda f, *_: f,
                 lambda f, tb, mm: _pop_rows_by_logsumexp(tb, mm), fast,
                 table, m_byrkt)
  return out, exact


# The gradient is written out (below) so that it keeps only the inputs and
# the output: autodiff through the `lax.cond` keeps the residuals of both
# branches, the logsumexp's Q-times-the-table terms included, at every
# update.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pop_rows_by_matmul(table, m_byrkt, cols_before, precision):
  return _pop_rows_primal(table, m_byrkt, cols_before, precision)[0]


def _pop_rows_by_matmul_fwd(table, m_byrkt, cols_before, precision):
  out, exact = _pop_rows_primal(table, m_byrkt, cols_before, precision)
  return out, (table, m_byrkt, cols_before, out, exact)


def _pop_rows_by_matmul_bwd(precision, res, out_ct):
  """d out / d L = Σ_r g·e^{L+M−out}, d out / d M = Σ_{i,q,x} g·e^{L+M−out}:
  two matmuls of the shifted exponentials with w = g·e^{c+d−out} where
  the forward's matmul was exact (there every live sum is ≥ sqrt(tiny),
  so w ≤ |g|/sqrt(tiny)); else the logsumexp's own gradient."""
  table, m_byrkt, cols_before, out, exact = res
  lax_precision = rns_stack.lax_precision(precision)

  def by_matmul(g):
    b, y, i, q, x, k, t = table.shape
    r = m_byrkt.shape[2]
    _, _, c, d, e_rows, e_cols = _shifted_exponentials(table, m_byrkt,
                                                       cols_before)
    live = jnp.isfinite(out)
    w = jnp.where(live, g * jnp.exp(
        c[..., None] + d[:, :, None, None, None] - jnp.where(live, out, 0)),
                  0).reshape(b, y, i * q * x, r)
    d_rows = e_rows * lax.dot_general(
        w, e_cols, (((3,), (2,)), ((0, 1), (0, 1))), precision=lax_precision)
    d_cols = e_cols * lax.dot_general(
        w, e_rows, (((2,), (2,)), ((0, 1), (0, 1))), precision=lax_precision)
    return d_rows.reshape(table.shape), d_cols.reshape(m_byrkt.shape)

  def by_logsumexp(g):
    return jax.vjp(_pop_rows_by_logsumexp, table, m_byrkt)[1](g)

  table_ct, m_ct = lax.cond(exact, by_matmul, by_logsumexp, out_ct)
  return table_ct, m_ct, None


_pop_rows_by_matmul.defvjp(_pop_rows_by_matmul_fwd, _pop_rows_by_matmul_bwd)


def _pop_rows_by_logsumexp(table, m_byrkt):
  """`pop_rows_of` over the materialised terms (Q times the table): (k, t)
  are the table's last axes, so the logsumexp runs along contiguous memory
  (2-3x faster than over the column axis of a [B, I, K, Q, X, T, Y] table,
  measured)."""
  terms = table[:, :, :, :, :, None] + m_byrkt[:, :, None, None, None]
  return _lse(terms, axis=(-2, -1))


def column(table, k):
  """Column k of the table as [B, I, Q, X, T, Y] (L_{i,k}[q,x,t,y])."""
  return jnp.moveaxis(lax.dynamic_index_in_dim(table, k, axis=5,
                                               keepdims=False), 1, -1)


def _write(tables, j, col, c_col, a_new):
  """Writes update j's column, log c_j and â_j into (table, log_c, â)."""
  table, log_c, a_hat = tables
  return (lax.dynamic_update_index_in_dim(table, jnp.moveaxis(col, -1, 1), j,
                                          axis=5),
          lax.dynamic_update_index_in_dim(log_c, c_col, j, axis=1),
          lax.dynamic_update_index_in_dim(a_hat, a_new, j, axis=1))


# The sweeps split the updates into up to this many time blocks of at least
# MIN_TIME_BLOCK updates; block [j0, j1) runs on the tables cut to the
# columns < j1 and the rows before them, the only entries it reads or
# writes, instead of the padded (T+2)·(T+1) table (B = 10, n = 80, Q = S =
# 2: forward 2.3x, gradient 1.8x faster than one block). Each block is one
# more scan to compile, which short strings do not repay.
NUM_TIME_BLOCKS = 4
MIN_TIME_BLOCK = 16


def _time_blocks(t):
  """Static update ranges [j0, j1) covering 1..T (one empty one if T = 0)."""
  n = max(1, min(NUM_TIME_BLOCKS, t // MIN_TIME_BLOCK))
  edges = sorted({1 + (t * k) // n for k in range(n + 1)})
  return list(zip(edges[:-1], edges[1:])) or [(1, 1)]


def _cut(tables, j1):
  """The tables (or their cotangents) as updates j < j1 see them."""
  table, log_c, a_hat = tables
  return (table[:, :, :j1 + 1, :, :, :j1], log_c[:, :j1], a_hat[:, :j1])


def _paste(tables, part):
  """`tables` with `_cut(tables, j1)` replaced by `part`."""
  j1 = part[1].shape[1]
  table, log_c, a_hat = tables
  return (table.at[:, :, :j1 + 1, :, :, :j1].set(part[0]),
          log_c.at[:, :j1].set(part[1]), a_hat.at[:, :j1].set(part[2]))


def _blocked_scan(make_body, tables, carry, xs_T, t, reverse=False):
  """`lax.scan` of ``make_body(j1)`` over updates j = 1..T, one scan per
  time block, with (cut tables, carry) as its carry.

  xs_T: pytree of per-update inputs with leading axis T (update j at
  j − 1). Returns ((tables, carry), per-update outputs stacked over T).
  """
  blocks = _time_blocks(t)
  outs = []
  for j0, j1 in (blocks[::-1] if reverse else blocks):
    xs = jax.tree_util.tree_map(lambda x, j0=j0, j1=j1: x[j0 - 1:j1 - 1],
                                xs_T)
    (part, carry), ys = lax.scan(make_body(j1), (_cut(tables, j1), carry),
                                 xs, reverse=reverse)
    tables = _paste(tables, part)
    outs.append(ys)
  outs = outs[::-1] if reverse else outs
  return (tables, carry), jax.tree_util.tree_map(
      lambda *ys: jnp.concatenate(ys), *outs)


def _log_mass(delta_BxT):
  """log Σα_j for j = 0..T from the increments (log Σα_0 = 0)."""
  zero = jnp.zeros((delta_BxT.shape[0], 1), delta_BxT.dtype)  # T may be 0
  return jnp.concatenate([zero, jnp.cumsum(delta_BxT, axis=1)], axis=1)


# ---------------------------------------------------------------------------
# Given actions.
# ---------------------------------------------------------------------------


def _sweep(push, repl, pop, bottom, precision):
  """Forward sweep: (final table, â [B, T+1, Q, S], δ [B, T])."""
  b, t, q, s = push.shape[:4]
  init = _initial(b, t, q, s, bottom, push.dtype)

  def body(carry, inp):
    tables, _ = carry
    j, pu, re, po = inp
    col, c_col, a_new, delta = update(*tables, j, pu, re, po, precision)
    return (_write(tables, j, col, c_col, a_new), None), delta

  xs = (jnp.arange(1, t + 1),) + tuple(jnp.swapaxes(x, 0, 1)
                                      for x in (push, repl, pop))
  (tables, _), delta_TxB = _blocked_scan(lambda j1: body, init, None, xs, t)
  return tables, delta_TxB.T


def _column_cotangents(tables_ct, j):
  """The cotangents of update j's outputs (column, log c_j, â_j), complete
  once the reverse sweep has passed every later update."""
  table_ct, log_c_ct, a_hat_ct = tables_ct
  return (column(table_ct, j),
          lax.dynamic_index_in_dim(log_c_ct, j, axis=1, keepdims=False),
          lax.dynamic_index_in_dim(a_hat_ct, j, axis=1, keepdims=False))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tables(push, repl, pop, bottom, precision):
  tables, delta = _sweep(push, repl, pop, bottom, precision)
  return tables[2], delta


def _tables_fwd(push, repl, pop, bottom, precision):
  tables, delta = _sweep(push, repl, pop, bottom, precision)
  return (tables[2], delta), (tables, push, repl, pop)


def _tables_bwd(bottom, precision, res, cts):
  del bottom
  tables, push, repl, pop = res
  a_ct, delta_ct = cts
  t = push.shape[1]

  def make_body(j1):
    final = _cut(tables, j1)

    def body(carry, inp):
      tables_ct, _ = carry
      j, pu, re, po, d_ct = inp
      _, vjp = jax.vjp(
          lambda tb, pu, re, po: update(*tb, j, pu, re, po, precision),
          final, pu, re, po)
      d_tables, d_pu, d_re, d_po = vjp(
          _column_cotangents(tables_ct, j) + (d_ct,))
      return (jax.tree_util.tree_map(jnp.add, tables_ct, d_tables), None), (
          d_pu, d_re, d_po)
    return body

  xs = (jnp.arange(1, t + 1),) + tuple(jnp.swapaxes(x, 0, 1)
                                      for x in (push, repl, pop, delta_ct))
  init = (jnp.zeros_like(tables[0]), jnp.zeros_like(tables[1]), a_ct)
  _, acts_ct = _blocked_scan(make_body, init, None, xs, t, reverse=True)
  return tuple(jnp.swapaxes(x, 0, 1) for x in acts_ct)


_tables.defvjp(_tables_fwd, _tables_bwd)


def run(push, repl, pop, bottom=FIXED, precision="highest"):
  """Normalised log α and log Σα for j = 0..T, exact for finite log-weights.

  The contract of `rns_stack.run` (without `unroll`), without its flush
  limit; differentiable in O(T²) memory.

  Args:
    push, repl: [B, T, Q, S, Q, S] log-weights indexed (q, x, r, y).
    pop: [B, T, Q, S, Q] log-weights indexed (q, x, r).
    bottom: "fixed" (default) or "frozen".
    precision: matmul precision name of the pop term's matmul
      (`pop_rows_of`; `ns_stack.MATMUL_PRECISIONS`).

  Returns:
    (log_alpha_hat [B, T+1, Q, S], log_mass [B, T+1]) as `rns_stack.run`.
  """
  rns_stack._check_bottom(bottom)  # pylint: disable=protected-access
  push, repl, pop = (jnp.asarray(x) for x in (push, repl, pop))
  rns_stack._check_actions(push, repl, pop)  # pylint: disable=protected-access
  return _run_jit(push, repl, pop, bottom, ns_stack.check_precision(precision))


@functools.partial(jax.jit, static_argnums=(3, 4))
def _run_jit(push, repl, pop, bottom, precision):
  a_hat, delta = _tables(push, repl, pop, bottom, precision)
  return a_hat, _log_mass(delta)


# ---------------------------------------------------------------------------
# Coupled controller + stack.
# ---------------------------------------------------------------------------


def _coupled_step(step_fn, reading, precision, params, x, tables, ctrl, j):
  """Controller step j (reads ρ_{j−1}) then update j: (column, log c_j,
  â_j, δ_j, new carry, output)."""
  rho, _ = rns_stack.readout(
      lax.dynamic_index_in_dim(tables[2], j - 1, axis=1, keepdims=False),
      reading)
  new_ctrl, (pu, re, po), out = step_fn(params, ctrl, x, rho)
  return update(*tables, j, pu, re, po, precision) + (new_ctrl, out)


def _coupled_sweep(step_fn, q, s, bottom, reading, precision, params,
                   init_carry, xs):
  b, t = jax.tree_util.tree_leaves(xs)[0].shape[:2]
  init = _initial(b, t, q, s, bottom, rns_stack._float_dtype(params))  # pylint: disable=protected-access
  xs_T = jax.tree_util.tree_map(lambda l: jnp.swapaxes(l, 0, 1), xs)

  def body(carry, inp):
    tables, ctrl = carry
    j, x = inp
    col, c_col, a_new, delta, new_ctrl, out = _coupled_step(
        step_fn, reading, precision, params, x, tables, ctrl, j)
    return (_write(tables, j, col, c_col, a_new), new_ctrl), (
        delta, out, ctrl)

  (tables, _), (delta_TxB, outs_T, ctrls) = _blocked_scan(
      lambda j1: body, init, init_carry, (jnp.arange(1, t + 1), xs_T), t)
  return outs_T, tables[2], delta_TxB.T, tables, ctrls


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _coupled(step_fn, q, s, bottom, reading, precision, params, init_carry,
             xs):
  return _coupled_sweep(step_fn, q, s, bottom, reading, precision, params,
                        init_carry, xs)[:3]


def _coupled_fwd(step_fn, q, s, bottom, reading, precision, params,
                 init_carry, xs):
  outs_T, a_hat, delta, tables, ctrls = _coupled_sweep(
      step_fn, q, s, bottom, reading, precision, params, init_carry, xs)
  return (outs_T, a_hat, delta), (params, xs, tables, ctrls)


def _coupled_bwd(step_fn, q, s, bottom, reading, precision, res, cts):
  """Reverse sweep: vjp of (controller step j + update j) on final tables."""
  del q, s, bottom
  params, xs, tables, ctrls = res
  outs_ct, a_ct, delta_ct = cts
  t = a_ct.shape[1] - 1
  xs_T = jax.tree_util.tree_map(lambda l: jnp.swapaxes(l, 0, 1), xs)
  zeros = lambda tree: jax.tree_util.tree_map(jnp.zeros_like, tree)

  def make_body(j1):
    final = _cut(tables, j1)

    def body(carry, inp):
      tables_ct, (p_bar, c_bar) = carry
      j, x, ctrl_prev, out_ct, d_ct = inp
      f = lambda p, tb, c: _coupled_step(step_fn, reading, precision, p, x,
                                         tb, c, j)
      _, vjp = jax.vjp(f, params, final, ctrl_prev)
      dp, d_tables, dc = vjp(_column_cotangents(tables_ct, j)
                             + (d_ct, c_bar, out_ct))
      p_bar = jax.tree_util.tree_map(jnp.add, p_bar, dp)
      return (jax.tree_util.tree_map(jnp.add, tables_ct, d_tables),
              (p_bar, dc)), None
    return body

  init = (jnp.zeros_like(tables[0]), jnp.zeros_like(tables[1]), a_ct)
  bars = (zeros(params), rns_stack.zero_carry_cotangent(ctrls))
  (_, (p_bar, c_bar)), _ = _blocked_scan(
      make_body, init, bars,
      (jnp.arange(1, t + 1), xs_T, ctrls, outs_ct, delta_ct.T), t,
      reverse=True)
  return p_bar, c_bar, rns_stack.inputs_cotangent(xs, None)


_coupled.defvjp(_coupled_fwd, _coupled_bwd)


def run_coupled(step_fn: Callable[..., Any], params: Any, init_carry: Any,
                xs: Any, num_states: int, num_symbols: int,
                bottom: str = FIXED, reading: str = STATE,
                precision: str = "highest"):
  """Runs a controller and the stack together, t = 1..T, exactly.

  The contract of `rns_stack.run_coupled` (without `unroll`), without its
  flush limit; O(T²) gradient memory. Controller step t sees ρ_{t−1} (ρ_0
  one-hot at index 0), then update t uses the log-weights it returned.

  Args and returns: those of `rns_stack.run_coupled` without `unroll`:
  step_fn(params, carry, x_t, reading_prev) -> (carry_t, (push_t, repl_t,
  pop_t), out_t); xs batch-major [B, T, ...] (zero cotangent); bottom
  "fixed" or "frozen"; reading "state" or "symbol"; precision the matmul
  precision name of the pop term's matmul; returns (outs [B, T, ...],
  log_alpha_hat [B, T+1, Q, S], log_mass [B, T+1]).
  """
  rns_stack._check_bottom(bottom)  # pylint: disable=protected-access
  rns_stack._check_reading(reading)  # pylint: disable=protected-access
  q, s = ns_stack.check_sizes(num_states=num_states,
                               num_symbols=num_symbols)
  leaves = jax.tree_util.tree_leaves(xs)
  if not leaves or any(jnp.ndim(l) < 2 for l in leaves):
    raise ValueError("xs must be a pytree of arrays [B, T, ...]")
  outs_T, a_hat, delta = _coupled(step_fn, q, s, bottom, reading,
                                  ns_stack.check_precision(precision),
                                  params, init_carry, xs)
  outs = jax.tree_util.tree_map(lambda o: jnp.swapaxes(o, 0, 1), outs_T)
  return outs, a_hat, _log_mass(delta)
