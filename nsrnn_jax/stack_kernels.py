"""Pallas kernels for the share-table stack's updates (GPU).

An experiment for issue 11's GPU targets. On a GPU the NS-RNN's step is
bound by the number of small kernels per update (docs/benchmarks.md, the H100 profile:
~20 kernels of 2-9 µs each), not by the table's bytes. This module computes
the whole forward update j of `rns_stack` — the column-sized part
(`rns_stack._local`: W, α_j, the kernels, M̃, the replace and push rows),
the pop product G·M̃, the write of column j into the table and of its
column sums — as one `pallas_call` (`forward_update`), with the residuals
that the backward reads; the table-sized part of the backward's update j
— W_{j+1} written into the W table, column j's cotangent (the W-table
product) and M̃_j's (the table product) — as a second
(`backward_table_update`), and the column-sized part (`rns_stack.
_local_bwd`) as a third (`local_bwd`). The controller stays XLA ops.

Use: `rns_stack.UPDATE_KERNELS = "pallas"` (before tracing) runs the
sweeps on them. Status: correct (tests/stack_kernels_test.py checks each
in Pallas's interpret mode on CPU against rns_stack's XLA ops on the
tables and residuals of real sweeps, in float64 and float32 and batched
under vmap; whole sweeps, plain and coupled to a controller, against the
brute-force PDA and the XLA gradients; and that each lowers to one Triton
kernel for CUDA, which catches unsupported operations and shapes without
a GPU); not yet timed on a GPU (`benchmarks/train_step.py
--pallas_kernels`).

Layout: every operand is passed flattened, and the kernel reads and
writes it through gathers and scatters with index arrays of power-of-two
shapes (the Triton lowering needs power-of-two array shapes; Q·S, N·Q and
the row tiles are padded and masked). One program per (batch element,
symbol y of column j). Only a sweep's triangle is read: column k's rows
i < k, and M̃_j's columns k < j (the loops' trip counts are traced).
Sizes inside: F = Q·S flattened pairs (state, symbol) padded to FP, rows
of α terms (r, y) likewise, KT = N·Q (column, state) pairs in chunks of
KT_CHUNK, L = N·Q·S table rows in tiles of ROW_TILE.

Shape legend (as in rns_stack): B batch, Y/X/Z stack symbols, N time
points of the (block-sized) table, T/Q/R states.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from nsrnn_jax import rns_stack

# Table rows per tile of the column (a power of two) and table columns
# (column, state pairs) per step of the pop product.
ROW_TILE = 128
KT_CHUNK = 32
# Entries of local_bwd's [pairs, pairs, rows] products per tile (a power
# of two): 16 rows at Q = S = 3, 256 at Q = S = 2.
MIX_TILE_ELEMENTS = 4096
# The grids of the forward and backward table kernels: one program per
# (batch element, symbol), which loops over the table's row tiles (False),
# or per (batch element, symbol, row tile) (True: more programs for a
# GPU's multiprocessors; each forward one recomputes the column-sized
# part, and the column sums and M̃'s cotangent are summed by atomic adds).
ROW_GRID = False
# Warps per Triton program. These three sizes are first guesses, not tuned
# on a GPU yet; they are read when a kernel is traced.
NUM_WARPS = 4
# A Python float: array constants cannot be captured by a Triton kernel.
_NEG_INF = float("-inf")


def _pow2(n):
  return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _load(ref, idx, mask, other):
  """Gather ref[idx] where mask, else `other` (masked lanes never read)."""
  return plt.load(ref.at[idx], mask=mask, other=other)


def _store(ref, idx, val, mask):
  """Scatter val to ref[idx] where mask.

  Masked lanes get an index past the end: Triton never touches them, and
  Pallas's interpreter (a gather, then a scatter of the old values where
  masked) drops them, instead of writing a stale value over a lane that
  the same store writes (padded lanes' indices can land on real entries).
  """
  idx = jnp.where(mask, idx, ref.shape[0])
  plt.store(ref.at[idx], val, mask=mask)


def _accumulate(ref, idx, val, mask, atomic):
  """ref[idx] += val where mask, from programs that run at once.

  On a GPU (`atomic`) an atomic add. Pallas's interpreter has no masked
  atomics and runs the programs one after another, so there a plain read,
  add and write makes the same sum.
  """
  if atomic:
    plt.atomic_add(ref, idx, val, mask=mask)
  else:
    _store(ref, idx, _load(ref, idx, mask, 0.0) + val, mask)


def _max_finite(x):
  """Max of the finite entries of x (−inf if none)."""
  return jnp.max(jnp.where(jnp.isfinite(x), x, -jnp.inf))


def _finite_max(*xs):
  """Max of the finite entries of all xs (0 if none): rns_stack's shift."""
  m = _max_finite(xs[0])
  for x in xs[1:]:
    m = jnp.maximum(m, _max_finite(x))
  return jnp.where(jnp.isfinite(m), m, 0.0)


def _update_kernel(p_ref, a_prev_ref, push_ref, repl_ref, pop_ref, g_in_ref,
                   cs_in_ref, g_ref, cs_ref, mt_ref, a_hat_ref, inc_ref,
                   res_ref, w_ref, *, q, s, n, barrier, row_grid):
  """Update j of batch element b, column j's symbol y (p = axis index of
  time j − 1). Every program computes α_j (it needs all symbols' W); the
  column-sized outputs shared by the symbols are written by y = 0's."""
  b, y_own = pl.program_id(0), pl.program_id(1)
  # With row_grid, one program per row tile too (grid axis 2).
  tile_own = pl.program_id(2) if row_grid else 0
  first = (y_own == 0) & (tile_own == 0)
  dtype = a_prev_ref.dtype
  # rns_stack's flush of shares and clamp of kernels (`_exp_share`).
  flush = rns_stack._flush(dtype)  # pylint: disable=protected-access
  cap = float(-np.log(flush) - 2.0)
  qs, nl = q * s, n * q * s
  fp = _pow2(qs)
  p = p_ref[0]
  f = jnp.arange(fp)                   # flattened (state, symbol) pair
  f_ok = f < qs
  f_st, f_sy = f // s, f % s           # (q, x) or (s, z) of a pair
  row = f                              # α rows (r, y), r·S + y
  r_of, y_of = row // s, row % s

  def tab(y, k, t, i_q_x):
    """Flat index of G[b, y, k, t, (i, q, x)] (i_q_x = the row index)."""
    return (((b * s + y) * n + k) * q + t) * nl + i_q_x

  def cs_at(y, k, t):
    return ((b * s + y) * n + k) * q + t

  # α̂_{j−1}[q, x] and the column sums c_{j−1}[s, z] = cs[b, z, p, s].
  a_prev = _load(a_prev_ref, b * qs + f, f_ok, _NEG_INF)             # [F]
  c_prev = _load(cs_in_ref, cs_at(f_sy, p, f_st), f_ok, 0.0)
  ok_r = c_prev > flush
  a_rep = jnp.where(ok_r, a_prev + jnp.log(jnp.where(ok_r, c_prev, 1.0)),
                    _NEG_INF)
  # c_left[y, k, t] (columns k < p) and column p's entries on row (k, t, y)
  # for every pair (s, z): prev_t[y][(s, z), (k, t)] = H_{k,j−1}[t,y,s,z],
  # in chunks of KT_CHUNK pairs (k, t), as loops in the kernel (registers).
  n_kc = -(-(n * q) // KT_CHUNK)
  live_kc = (p * q + KT_CHUNK - 1) // KT_CHUNK    # the chunks with k < p

  def kt_chunk(y, c):
    """Chunk c of pairs (k, t): the pairs, which have k < p, c_left."""
    kc = c * KT_CHUNK + jnp.arange(KT_CHUNK)
    kc_left = (kc < n * q) & (kc // q < p)
    return kc, kc_left, _load(cs_in_ref, cs_at(y, kc // q, kc % q), kc_left,
                              0.0)

  def prev_t(y, kc, kc_left):                                       # [F,KC]
    return _load(g_in_ref, tab(f_sy[:, None], p, f_st[:, None],
                               kc[None, :] * s + y),
                 f_ok[:, None] & kc_left[None, :], 0.0)

  w_rows = []
  for y in range(s):

    def w_chunk(c, acc, y=y):
      kc, kc_left, c_left = kt_chunk(y, c)
      return acc + jnp.sum(prev_t(y, kc, kc_left) * c_left[None, :], axis=1)
    w_rows.append(jax.lax.fori_loop(0, live_kc, w_chunk,
                                    jnp.zeros((fp,), dtype)))          # [F]
  # The three families of terms on [rows (r, y), F]: push from (q, x),
  # replace and pop from (s, z).
  rf_ok = (row < qs)[:, None] & f_ok[None, :]
  act_idx = (b * qs + f[None, :]) * qs + row[:, None]
  pu = _load(push_ref, act_idx, rf_ok, _NEG_INF)
  re = _load(repl_ref, act_idx, rf_ok, _NEG_INF)
  po = _load(pop_ref, (b * qs + f[None, :]) * q + r_of[:, None], rf_ok,
             _NEG_INF)
  w_row_of = jnp.zeros((fp, fp), dtype)
  for y in range(s):
    sel = (y_of == y)[:, None]
    w_row_of = jnp.where(sel, w_rows[y][None, :], w_row_of)
  ok_w = w_row_of > flush
  log_w = jnp.where(ok_w, jnp.log(jnp.where(ok_w, w_row_of, 1.0)),
                    _NEG_INF)
  lhs_pu = jnp.broadcast_to(a_prev[None, :], (fp, fp))
  lhs_re = jnp.broadcast_to(a_rep[None, :], (fp, fp))
  lhs_po = log_w + a_prev[None, :]
  # One shift m for all terms (a gradient constant in rns_stack).
  m = _finite_max(lhs_pu + pu, lhs_re + re, lhs_po + po)
  fams = []
  for lhs, act in ((lhs_pu, pu), (lhs_re, re), (lhs_po, po)):
    act = act - m
    fams.append((act, lhs + act))
  # a_j[r, y] = logsumexp over the three families' terms.
  row_max = functools.reduce(jnp.maximum,
                             [jnp.max(t, axis=1) for _, t in fams])
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  tot = sum(jnp.sum(jnp.exp(t - row_max[:, None]), axis=1) for _, t in fams)
  ok_j = tot > 0
  a_j = jnp.where(ok_j, jnp.log(jnp.where(ok_j, tot, 1.0)) + row_max,
                  _NEG_INF)
  kerns = []
  for fam, (act, terms) in enumerate(fams):
    x = a_prev[None, :] + act - a_j[:, None]
    ok = jnp.isfinite(terms) & jnp.isfinite(x)
    xm = jnp.where(ok, x, 0.0)
    kern = jnp.where(ok, jnp.exp(jnp.minimum(xm, cap)), 0.0)
    kd = jnp.where(x < cap, kern, 0.0)
    sm = jnp.where(ok, jnp.exp(jnp.where(ok, terms - a_j[:, None], 0.0)),
                   0.0)
    kerns.append(kern)
    # res[kind, b, r, y, fam·QS + f]
    for kind, val in enumerate((kern, kd, sm)):
      idx = (((kind * pl.num_programs(0) + b) * qs + row[:, None]) * 3 * qs
             + fam * qs + f[None, :])
      _store(res_ref, idx, val, rf_ok & first)
  for y in range(s):
    _store(w_ref, (b * s + y) * qs + f, w_rows[y], f_ok & first)
  # log Σα_j − m and α̂_j.
  a_valid = jnp.where(row < qs, a_j, _NEG_INF)
  zmax = _finite_max(a_valid)
  ztot = jnp.sum(jnp.exp(a_valid - zmax))
  log_z = jnp.where(ztot > 0, jnp.log(jnp.where(ztot > 0, ztot, 1.0)) + zmax,
                    _NEG_INF)
  alive = jnp.isfinite(log_z)
  a_hat = jnp.where(alive, a_j - jnp.where(alive, log_z, 0.0), _NEG_INF)
  _store(a_hat_ref, b * qs + row, a_hat, (row < qs) & first)
  _store(inc_ref, b + jnp.arange(1), jnp.broadcast_to(log_z + m, (1,)),
         (jnp.arange(1) < 1) & first)
  k_push, k_rep, k_pop = kerns
  rp = _pow2(q)
  r_idx = jnp.arange(rp)
  # Only the triangle: column j's rows are i ≤ j − 1 (axis indices ≤ p; a
  # segment starts before it ends), so later row tiles are left as the
  # table has them (zero: a sweep's fresh column), and M̃ is zero at
  # columns k ≥ p, so the pop product reads G's columns k < p only (the
  # live_kc chunks). Both counts are traced: on average a third of the
  # full rectangle's reads.
  live_tiles = ((p + 1) * qs + ROW_TILE - 1) // ROW_TILE
  # This program's symbol y: its kernels as [r, pair] (rows (r, y) of the
  # families), M̃ and column j's rows of symbol y.
  y = y_own

  def rows_of(kern):
    sel = (row[None, :, None] == (r_idx * s + y)[:, None, None])
    return jnp.sum(jnp.where(sel, kern[None, :, :], 0.0), axis=1)    # [R,F]
  kr_y, kp_y, kpu_y = rows_of(k_rep), rows_of(k_pop), rows_of(k_push)
  # M̃_k[t, y, r] = Σ_{s,z} H_{k,j−1}[t,y,s,z] K^P[y,s,z,r], zero where
  # c_k flushed (and for k ≥ p: written too, it is a residual).
  r_ok = (r_idx < q)[:, None]

  def mt_chunk(c, carry):
    kc, kc_left, c_left = kt_chunk(y, c)
    mt = jnp.sum(kp_y[:, :, None] * prev_t(y, kc, kc_left)[None, :, :],
                 axis=1)                                            # [R,KC]
    mt = jnp.where((c_left > flush)[None, :], mt, 0.0)
    _store(mt_ref, ((b * s + y) * q + r_idx[:, None]) * (n * q)
           + kc[None, :], mt, r_ok & (kc < n * q)[None, :])
    return carry
  jax.lax.fori_loop(0, n_kc, mt_chunk, 0)
  # The pop product reads M̃ back in chunks (a value cannot be sliced in
  # Triton): make this program's stores visible to all of its threads
  # (the interpreter runs one thread and has no barrier). With row_grid
  # every tile's program of (b, y) stores the same M̃ (the same
  # computation on the same inputs), so whichever store a read sees, it
  # reads the same values.
  if barrier:
    plt.debug_barrier()

  def tile_body(tile, total, live=True):
    li = tile * ROW_TILE + jnp.arange(ROW_TILE)
    l_ok = (li < nl) & live
    # Replace rows: Σ_{s,z} K^R[y,(s,z),r] H_{i,j−1}[q,x,s,z].
    prev = _load(g_in_ref, tab(f_sy[:, None], p, f_st[:, None], li[None, :]),
                 f_ok[:, None] & l_ok[None, :], 0.0)                  # [F,L]
    col = jnp.sum(kr_y[:, :, None] * prev[None, :, :], axis=1)       # [R,L]
    # The push row (row i = p): K^U[(q, x), r] at its (q, x).
    on_p = (li // qs == p) & l_ok
    pick = (f[:, None] == (li % qs)[None, :])
    push = jnp.sum(jnp.where(pick[None], kpu_y[:, :, None], 0.0), axis=1)
    col = col + jnp.where(on_p[None, :], push, 0.0)

    # The pop product Σ_{k,t} M̃[y, r, (k, t)] G[y, (k, t), rows].
    def chunk(c, acc):
      kc = c * KT_CHUNK + jnp.arange(KT_CHUNK)
      kc_ok = kc < n * q
      mtc = _load(mt_ref, ((b * s + y) * q + r_idx[:, None]) * (n * q)
                  + kc[None, :], r_ok & kc_ok[None, :], 0.0)          # [R,KC]
      gc = _load(g_in_ref, tab(y, kc[:, None] // q, kc[:, None] % q,
                               li[None, :]),
                 kc_ok[:, None] & l_ok[None, :], 0.0)                 # [KC,L]
      return acc + jnp.sum(mtc[:, :, None] * gc[None, :, :], axis=1)
    col = jax.lax.fori_loop(0, jnp.where(live, live_kc, 0), chunk, col)
    _store(g_ref, tab(y, p + 1, r_idx[:, None], li[None, :]), col,
           r_ok & l_ok[None, :])
    return total + jnp.sum(jnp.where(l_ok[None, :], col, 0.0), axis=1)
  if row_grid:
    # This program's tile (if in the triangle); the column sums gather
    # the tiles' partial sums (column j's sums start at zero in a sweep;
    # `barrier` is False exactly when interpreted).
    total = tile_body(tile_own, jnp.zeros((rp,), dtype),
                      live=tile_own < live_tiles)
    _accumulate(cs_ref, cs_at(y, p + 1, r_idx), total, r_idx < q,
                atomic=barrier)
  else:
    total = jax.lax.fori_loop(0, live_tiles, tile_body,
                              jnp.zeros((rp,), dtype))
    _store(cs_ref, cs_at(y, p + 1, r_idx), total, r_idx < q)


def _interpret(interpret):
  """None: interpret on the CPU backend, Triton on a GPU."""
  if interpret is not None:
    return interpret
  backend = jax.default_backend()
  if backend not in ("cpu", "gpu"):
    raise ValueError("the Pallas stack kernels run on GPUs (Triton) and, "
                     f"interpreted, on CPU; not on {backend!r}")
  return backend == "cpu"


def _compiler_params(interpret):
  return None if interpret else plt.CompilerParams(num_warps=NUM_WARPS)


def _flat_call(kernel, grid, index, inputs, out_shapes, dtype, interpret,
               aliases=None):
  """One `pallas_call` on flattened operands, outputs in their shapes.

  Every kernel here reads and writes through flat (1-D) refs with its own
  index arithmetic, so the three wrappers differ only in what they pass.

  Args:
    kernel: the kernel, its static arguments bound.
    grid: the program grid.
    index: the traced int the kernel reads first (update j, or axis p),
      passed as a [1] int32 ref.
    inputs: the array operands, in the kernel's order after the index;
      each is flattened (and cast to `dtype`).
    out_shapes: the outputs' shapes; each is produced flat and reshaped.
    dtype: the outputs' (and the operands') dtype.
    interpret: as `_interpret` returned it.
    aliases: `input_output_aliases`, counting the index as input 0.

  Returns:
    The outputs, each in its shape from `out_shapes`.
  """
  sizes = [int(np.prod(sh)) for sh in out_shapes]
  outs = pl.pallas_call(
      kernel, grid=grid,
      out_shape=[jax.ShapeDtypeStruct((n,), dtype) for n in sizes],
      input_output_aliases=aliases or {}, interpret=interpret,
      compiler_params=_compiler_params(interpret))(
          jnp.reshape(jnp.asarray(index, jnp.int32), (1,)),
          *[jnp.reshape(x, (-1,)).astype(dtype) for x in inputs])
  return [o.reshape(sh) for o, sh in zip(outs, out_shapes)]


def forward_update(g, cs, p, a_prev, push, repl, pop, interpret=None):
  """Update j on a share table, as `rns_stack`'s forward sweep does it.

  Args:
    g: the table [B, Y, N, T, N, Q, X] (`rns_stack.initial_table` layout).
    cs: its column sums [B, Y, N, T]; column p (time j − 1) must be set.
    p: axis index of time j − 1 (traced int), with p + 1 < N: column j
      is written at axis index p + 1 (unchecked, as p is traced; the
      sweeps' block tables always have that room).
    a_prev: log α̂_{j−1} [B, Q, S]; push, repl [B, Q, S, Q, S]; pop
      [B, Q, S, Q]: update j's log-weights.
    interpret: run in Pallas's interpreter; None: on the CPU backend (where
      it is only for tests: slow), not on a GPU (Triton).

  Returns:
    (g, cs, mt, a_hat, inc, (kern_kd_sm, w)): the table and sums with
    column j written at axis index p + 1, and the outputs of
    `rns_stack._local(..., residuals=True)`: M̃ [B, Y, R, N, T], α̂_j
    [B, R, Y], inc [B] and the residuals ([3, B, R, Y, 3·Q·S], W
    [B, Y, S, Z]).
  """
  interpret = _interpret(interpret)
  bsz, s, n, q = g.shape[:4]
  dtype = g.dtype
  qs = q * s
  kernel = functools.partial(_update_kernel, q=q, s=s, n=n,
                             barrier=not interpret, row_grid=ROW_GRID)
  grid = (bsz, s) + ((-(-(n * q * s) // ROW_TILE),) if ROW_GRID else ())
  # The table and its sums are updated in place (inputs 5, 6 -> outputs
  # 0, 1).
  g2, cs2, mt, a_hat, inc, res, w = _flat_call(
      kernel, grid, p, (a_prev, push, repl, pop, g, cs),
      [g.shape, cs.shape, (bsz, s, q, n, q), (bsz, q, s), (bsz,),
       (3, bsz, q, s, 3 * qs), (bsz, s, q, s)], dtype, interpret,
      aliases={5: 0, 6: 1})
  return g2, cs2, mt, a_hat, inc, (res, w)


def _backward_table_kernel(j_ref, w_next_ref, e_ref, prev_hat_ref, cs_bar_ref,
                           g_ref, w_in_ref, *refs, q, s, n, rows, row0,
                           num_steps, barrier, row_grid):
  """Update j's table-sized backward work for batch element b, symbol y
  (and with row_grid, one row tile: M̃'s cotangent is then summed over the
  tiles' programs into zeros, an input aliased with it)."""
  del w_in_ref                          # aliased with w_ref
  w_ref, col_ct_ref, mt_ct_ref = refs[-3:]   # after mt_ct's zeros (grid)
  b, y = pl.program_id(0), pl.program_id(1)
  by = b * s + y
  nl = n * q * s                        # table rows (i, q, x)
  j = j_ref[0]
  k = j + 1                             # axis index of column j
  rp = _pow2(q)
  r_idx = jnp.arange(rp)
  r_ok = (r_idx < q)[:, None]
  n_tiles = -(-nl // ROW_TILE)
  dtype = w_next_ref.dtype

  def rows_of_tile(t):
    li = t * ROW_TILE + jnp.arange(ROW_TILE)
    return li, li < nl

  # Every loop below is a loop in the kernel, not unrolled in Python: the
  # program stays small (registers, compile time).
  # W_{j+1} (the cotangent of column j + 1) into its rows of the W table,
  # written one update late as in the XLA sweep.
  w_row = (jnp.minimum(j + 1, num_steps) - row0) * q

  def write_w(t, carry):
    li, l_ok = rows_of_tile(t)
    ok = r_ok & l_ok[None, :]
    val = _load(w_next_ref, (by * q + r_idx[:, None]) * nl + li[None, :],
                ok, 0.0)
    _store(w_ref, (by * rows + w_row + r_idx[:, None]) * nl + li[None, :],
           val, ok)
    return carry
  # The tiles this program works on: all, or with row_grid its own.
  tile_own = pl.program_id(2) if row_grid else None
  if row_grid:
    write_w(tile_own, 0)
  else:
    jax.lax.fori_loop(0, n_tiles, write_w, 0)
  if barrier:                           # its rows are read back below
    plt.debug_barrier()
  # Column j's cotangent: the later updates' pops through it (M̃_{j'}[k]
  # against their W's), what update j + 1 sent back, and its column sums'.
  n_wc = -(-rows // KT_CHUNK)
  # Only updates j' > j + 1 pop through column j (M̃_{j'} is zero at axis
  # indices ≥ j', the input's contract), so the W rows of earlier ones
  # are skipped.
  first_row = jnp.maximum((k + 1 - row0) * q, 0)
  first_wc = first_row // KT_CHUNK
  cs_k = _load(cs_bar_ref, (by * n + k) * q + r_idx, r_idx < q, 0.0)  # [R]

  def col_ct_tile(t, carry):
    li, l_ok = rows_of_tile(t)

    def w_chunk(c, acc):
      jr = c * KT_CHUNK + jnp.arange(KT_CHUNK)
      jr_ok = (jr < rows) & (jr >= first_row)
      e = _load(e_ref, ((by * n + k) * q + r_idx[:, None]) * rows
                + jr[None, :], r_ok & jr_ok[None, :], 0.0)          # [R,C]
      w = _load(w_ref, (by * rows + jr[:, None]) * nl + li[None, :],
                jr_ok[:, None] & l_ok[None, :], 0.0)                # [C,L]
      return acc + jnp.sum(e[:, :, None] * w[None, :, :], axis=1)
    left = jax.lax.fori_loop(first_wc, n_wc, w_chunk,
                             jnp.zeros((rp, ROW_TILE), dtype))
    idx = (by * q + r_idx[:, None]) * nl + li[None, :]
    ok = r_ok & l_ok[None, :]
    col_ct = (_load(prev_hat_ref, idx, ok, 0.0) + left
              + cs_k[:, None])
    _store(col_ct_ref, idx, jnp.where(ok, col_ct, 0.0), ok)
    return carry
  if row_grid:
    col_ct_tile(tile_own, 0)
  else:
    jax.lax.fori_loop(0, n_tiles, col_ct_tile, 0)
  if barrier:                           # col_ct is read back below
    plt.debug_barrier()
  # M̃_j's cotangent: Σ_{i,q,x} G[(k', t), (i, q, x)] col_ct[r, (i, q, x)],
  # at the columns k' < j only (axis indices; M̃_j is zero at the others,
  # so their cotangent is unused: written as zero), and over the rows
  # i < k' < j only (G's triangle).
  n_kc = -(-(n * q) // KT_CHUNK)
  live_kt = j * q
  live_rows = j * q * s
  live_tiles = (live_rows + ROW_TILE - 1) // ROW_TILE
  if row_grid:                          # own tile, if live
    tile_range = (tile_own, jnp.where(tile_own < live_tiles, tile_own + 1,
                                      tile_own))
  else:
    tile_range = (0, live_tiles)

  def kt_chunk(c, carry):
    kc = c * KT_CHUNK + jnp.arange(KT_CHUNK)
    kc_ok = kc < n * q

    def tile(t, acc):
      li, l_ok = rows_of_tile(t)
      live = l_ok & (li < live_rows)
      col_ct = _load(col_ct_ref, (by * q + r_idx[:, None]) * nl + li[None, :],
                     r_ok & live[None, :], 0.0)                     # [R,L]
      g = _load(g_ref, (by * n * q + kc[:, None]) * nl + li[None, :],
                (kc < live_kt)[:, None] & live[None, :], 0.0)       # [KC,L]
      return acc + jnp.sum(col_ct[:, None, :] * g[None, :, :], axis=2)
    acc = jax.lax.fori_loop(*tile_range, tile,
                            jnp.zeros((rp, KT_CHUNK), dtype))
    idx = (by * q + r_idx[:, None]) * (n * q) + kc[None, :]
    if row_grid:
      _accumulate(mt_ct_ref, idx, acc, r_ok & kc_ok[None, :],
                  atomic=barrier)
    else:
      _store(mt_ct_ref, idx, acc, r_ok & kc_ok[None, :])
    return carry
  live_chunks = (live_kt + KT_CHUNK - 1) // KT_CHUNK
  jax.lax.fori_loop(0, live_chunks, kt_chunk, 0)
  if row_grid:                          # the rest is zero already
    return

  def zero_chunk(c, carry):
    kc = c * KT_CHUNK + jnp.arange(KT_CHUNK)
    _store(mt_ct_ref, (by * q + r_idx[:, None]) * (n * q) + kc[None, :],
           jnp.zeros((rp, KT_CHUNK), dtype), r_ok & (kc < n * q)[None, :])
    return carry
  jax.lax.fori_loop(live_chunks, n_kc, zero_chunk, 0)


def backward_table_update(g_t, w_tab, w_next, e_p, prev_hat, cs_bar, j,
                          row0, num_steps, interpret=None):
  """Update j's table-sized backward work, as `rns_stack`'s reverse sweep.

  Args:
    g_t: the block's table as [B·Y, N·R, N·Q·X] (rows (k, t), columns
      (i, q, x)).
    w_tab: the W table [B·Y, rows, N·Q·X]: row (j' − row0)·R + r holds the
      cotangent of column j' (updates row0 .. num_steps).
    w_next: the cotangent of column j + 1, [B, Y, R, N, Q, X].
    e_p: M̃ of the updates row0 .. num_steps, [B, Y, N (k), R (t),
      rows] (e_p[b, y, k, t, (j' − row0)·R + r] = M̃_{j'}[b, y, r, k, t]).
    prev_hat: the cotangent update j + 1 sent to column j [B, Y, R, N, Q,
      X]; cs_bar: the column sums' cotangents [B, Y, N, R].
    j: the update (traced int); row0, num_steps: static.
    interpret: as for `forward_update`.

  The inputs are a sweep's: the table is a triangle (column k's rows are
  i < k, axis indices) and M̃_{j'} is zero at columns k ≥ j'; the kernel
  reads only those parts.

  Returns:
    (w_tab with W_{j+1} written at its rows, col_ct [B, Y, R, N, Q, X] (the
    cotangent of column j), mt_ct [B, Y, R, N, T] (of M̃_j; zero at the
    columns k ≥ j, where M̃_j is zero)).
  """
  interpret = _interpret(interpret)
  bsz, s, q, n = prev_hat.shape[:4]
  rows = w_tab.shape[1]
  dtype = g_t.dtype
  kernel = functools.partial(_backward_table_kernel, q=q, s=s, n=n,
                             rows=rows, row0=row0, num_steps=num_steps,
                             barrier=not interpret, row_grid=ROW_GRID)
  mt_ct_shape = (bsz, s, q, n, q)
  grid, aliases, extra = (bsz, s), {6: 0}, ()
  if ROW_GRID:
    # A program per row tile; M̃'s cotangent is summed into zeros.
    grid += (-(-(n * q * s) // ROW_TILE),)
    aliases[7] = 2
    extra = (jnp.zeros(mt_ct_shape, dtype),)
  # The W table is written in place (input 6 -> output 0).
  w2, col_ct, mt_ct = _flat_call(
      kernel, grid, j, (w_next, e_p, prev_hat, cs_bar, g_t, w_tab) + extra,
      [w_tab.shape, prev_hat.shape, mt_ct_shape], dtype, interpret,
      aliases=aliases)
  return w2, col_ct, mt_ct


def _local_bwd_kernel(p_ref, prev_ref, cs_ref, a_hat_ref, res_ref, w_ref,
                      col_ct_ref, mt_ct_ref, a_hat_ct_ref, inc_ct_ref,
                      d_prev_ref, d_cs_ref, d_a_ref, d_pu_ref, d_re_ref,
                      d_po_ref, *, q, s, n, barrier):
  """`rns_stack._local_bwd` for batch element b (time order, no ring)."""
  b = pl.program_id(0)
  dtype = a_hat_ref.dtype
  flush = rns_stack._flush(dtype)  # pylint: disable=protected-access
  qs, nl = q * s, n * q * s
  fp, rp = _pow2(qs), _pow2(q)
  p = p_ref[0]
  f = jnp.arange(fp)                   # pair (s, z) or (q, x): s·S + z
  f_ok = f < qs
  f_st, f_sy = f // s, f % s
  row = f                              # α rows (r, y): r·S + y
  row_ok = row < qs
  r_of, y_of = row // s, row % s
  rf_ok = row_ok[:, None] & f_ok[None, :]
  r_idx = jnp.arange(rp)
  # The replace mix's products are [pairs, pairs, rows]: tiles of rows
  # sized so that one holds at most MIX_TILE_ELEMENTS (registers).
  tile_n = max(1, min(ROW_TILE, MIX_TILE_ELEMENTS // (fp * fp)))
  n_tiles = -(-nl // tile_n)

  def rows_of_tile(t):
    li = t * tile_n + jnp.arange(tile_n)
    return li, li < nl

  def prev_at(pair, rows):             # prev[b, z, s, rows] of pair (s, z)
    return ((b * s + pair % s) * q + pair // s) * nl + rows

  # The forward's residuals and the cotangents of a_hat and inc.
  nb = pl.num_programs(0)
  fams = []
  for fam in range(3):
    kind_vals = []
    for kind in range(3):
      idx = (((kind * nb + b) * qs + row[:, None]) * 3 * qs + fam * qs
             + f[None, :])
      kind_vals.append(_load(res_ref, idx, rf_ok, 0.0))
    fams.append(kind_vals)                               # kern, kd, sm
  a_hat = _load(a_hat_ref, b * qs + row, row_ok, _NEG_INF)
  a_hat_ct = _load(a_hat_ct_ref, b * qs + row, row_ok, 0.0)
  inc_ct = jnp.sum(_load(inc_ct_ref, b + jnp.arange(1), jnp.arange(1) < 1,
                         0.0))
  alive = jnp.isfinite(jnp.max(a_hat))
  lz_ct = inc_ct - jnp.sum(a_hat_ct)
  aj_ct = jnp.where(alive & row_ok, a_hat_ct + jnp.exp(a_hat) * lz_ct, 0.0)
  # The push row's cotangent: row p of col_ct at (q, x).
  push_ct = _load(col_ct_ref, ((b * s + y_of[:, None]) * q + r_of[:, None])
                  * nl + p * qs + f[None, :], rf_ok, 0.0)        # [row, F]
  c_prev = _load(cs_ref, ((b * s + f_sy) * n + p) * q + f_st, f_ok, 0.0)
  # The replace mix: K^R's cotangent Σ_rows col_ct ⊗ prev over the rows
  # i < p of prev (column p's triangle: the later rows are zero), and
  # prev's (added at the end). Loops in the kernel, not unrolled: the
  # program stays small (registers, compile time).
  k_rep = fams[1][0]

  def col_ct_rows(li, l_ok):
    return _load(col_ct_ref, ((b * s + y_of[:, None]) * q + r_of[:, None])
                 * nl + li[None, :], row_ok[:, None] & l_ok[None, :], 0.0)

  def rep_ct_tile(t, acc):
    li, l_ok = rows_of_tile(t)
    prevt = _load(prev_ref, prev_at(f[:, None], li[None, :]),
                  f_ok[:, None] & l_ok[None, :], 0.0)            # [F, L]
    return acc + jnp.sum(col_ct_rows(li, l_ok)[:, None, :]
                         * prevt[None, :, :], axis=2)
  k_rep_ct = jax.lax.fori_loop(0, (p * qs + tile_n - 1) // tile_n,
                               rep_ct_tile, jnp.zeros((fp, fp), dtype))
  # The pop mix, per symbol y, over chunks of the (column, state) pairs
  # (k, t): K^P's cotangent Σ_{k,t} M̃'s cotangent ⊗ prev_t, where M̃_j
  # lives (k < p; the first loop stops there), and below, prev_t's.
  k_pop = fams[2][0]
  n_kc = -(-(n * q) // KT_CHUNK)
  live_kc = (p * q + KT_CHUNK - 1) // KT_CHUNK

  def pop_chunk(y, c):
    """Chunk c of pairs (k, t): pairs, in range, k < p, c_k, prev_t
    [F, KC] and M̃'s cotangent [R, KC] (zero where c_k flushed)."""
    kc = c * KT_CHUNK + jnp.arange(KT_CHUNK)
    kc_ok = kc < n * q
    kc_left = kc_ok & (kc // q < p)
    c_left = _load(cs_ref, ((b * s + y) * n + kc // q) * q + kc % q, kc_left,
                   0.0)
    prev_t = _load(prev_ref, prev_at(f[:, None], kc[None, :] * s + y),
                   f_ok[:, None] & kc_ok[None, :], 0.0)
    mt_ct = _load(mt_ct_ref, ((b * s + y) * q + r_idx[:, None]) * (n * q)
                  + kc[None, :], (r_idx < q)[:, None] & kc_ok[None, :], 0.0)
    mt_ct = jnp.where((c_left > flush)[None, :], mt_ct, 0.0)
    return kc, kc_ok, kc_left, c_left, prev_t, mt_ct

  k_pop_ct = jnp.zeros((fp, fp), dtype)
  kp_ys = []
  for y in range(s):

    def kp_ct_chunk(c, acc, y=y):
      *_, prev_t, mt_ct = pop_chunk(y, c)
      return acc + jnp.sum(mt_ct[:, None, :] * prev_t[None, :, :], axis=2)
    kp_ct_y = jax.lax.fori_loop(0, live_kc, kp_ct_chunk,
                                jnp.zeros((rp, fp), dtype))       # [R, F]
    sel = ((r_of[:, None] == r_idx[None, :]) & (y_of == y)[:, None])
    k_pop_ct = k_pop_ct + jnp.sum(
        jnp.where(sel[:, :, None], kp_ct_y[None, :, :], 0.0), axis=1)
    kp_ys.append(jnp.sum(jnp.where(
        (row[None, :, None] == (r_idx * s + y)[:, None, None]),
        k_pop[None, :, :], 0.0), axis=1))                        # [R, F]
  # Through kern = exp(x) and a_j = logsumexp(terms).
  kern_cts = (push_ct, k_rep_ct, k_pop_ct)
  x_cts = [kc * fam[1] for kc, fam in zip(kern_cts, fams)]
  aj_ct = aj_ct - sum(jnp.sum(x, axis=1) for x in x_cts)
  terms_cts = [aj_ct[:, None] * fam[2] for fam in fams]
  acts_cts = [x + t for x, t in zip(x_cts, terms_cts)]
  d_a = (sum(jnp.sum(x, axis=0) for x in x_cts)
         + jnp.sum(terms_cts[0], axis=0) + jnp.sum(terms_cts[2], axis=0))
  ok_r = c_prev > flush
  rep_ct = jnp.where(ok_r & f_ok, jnp.sum(terms_cts[1], axis=0), 0.0)
  d_a = d_a + rep_ct
  c_prev_ct = jnp.where(ok_r, rep_ct / jnp.where(ok_r, c_prev, 1.0), 0.0)
  _store(d_a_ref, b * qs + f, d_a, f_ok)
  act_idx = (b * qs + f[None, :]) * qs + row[:, None]
  _store(d_pu_ref, act_idx, acts_cts[0], rf_ok)
  _store(d_re_ref, act_idx, acts_cts[1], rf_ok)
  d_po = jnp.sum(jnp.where((r_of[None, :] == r_idx[:, None])[:, :, None],
                           acts_cts[2][None, :, :], 0.0), axis=1)   # [R, F]
  _store(d_po_ref, (b * qs + f[None, :]) * q + r_idx[:, None], d_po,
         (r_idx < q)[:, None] & f_ok[None, :])
  # W's cotangent per y, then prev_t's share of d_prev and the column
  # sums', chunk by chunk (zero at k ≥ p, written too).
  for y in range(s):
    w = _load(w_ref, (b * s + y) * qs + f, f_ok, 0.0)
    lhs_ct = jnp.sum(jnp.where((y_of == y)[:, None], terms_cts[2], 0.0),
                     axis=0)                                     # [F]
    ok_w = w > flush
    w_ct = jnp.where(ok_w, lhs_ct / jnp.where(ok_w, w, 1.0), 0.0)

    def prev_t_ct_chunk(c, carry, y=y, w_ct=w_ct):
      kc, kc_ok, kc_left, c_left, prev_t, mt_ct = pop_chunk(y, c)
      pt_ct = (jnp.sum(kp_ys[y][:, :, None] * mt_ct[:, None, :], axis=0)
               + w_ct[:, None] * c_left[None, :])                # [F, KC]
      _store(d_prev_ref, prev_at(f[:, None], kc[None, :] * s + y), pt_ct,
             f_ok[:, None] & kc_ok[None, :])
      c_left_ct = jnp.sum(prev_t * w_ct[:, None], axis=0)        # [KC]
      _store(d_cs_ref, ((b * s + y) * n + kc // q) * q + kc % q,
             jnp.where(kc_left, c_left_ct, 0.0), kc_ok)
      return carry
    jax.lax.fori_loop(0, n_kc, prev_t_ct_chunk, 0)
  if barrier:                      # both are added to just below
    plt.debug_barrier()
  # d_cs[z, p, s] += c_prev_ct[(s, z)] (column p is not in `left`: 0 so far).
  _store(d_cs_ref, ((b * s + f_sy) * n + p) * q + f_st, c_prev_ct, f_ok)

  def add_rep_tile(t, carry):
    li, l_ok = rows_of_tile(t)
    rep = jnp.sum(k_rep[:, :, None] * col_ct_rows(li, l_ok)[:, None, :],
                  axis=0)                                        # [F, L]
    idx = prev_at(f[:, None], li[None, :])
    ok = f_ok[:, None] & l_ok[None, :]
    _store(d_prev_ref, idx, _load(d_prev_ref, idx, ok, 0.0) + rep, ok)
    return carry
  jax.lax.fori_loop(0, n_tiles, add_rep_tile, 0)


def local_bwd(prev, cs, p, a_hat, res, cts, interpret=None):
  """`rns_stack._local_bwd` (time order, no ring) as one Pallas kernel.

  Args and returns as `rns_stack._local_bwd` (without the precision):
  prev [B, Z, S, N, Q, X], cs [B, Y, N, T], p (traced int), a_hat [B, R, Y],
  res ([3, B, R, Y, 3·Q·S], W [B, Y, S, Z]) and cts (col_ct
  [B, Y, R, N, Q, X], mt_ct [B, Y, R, N, T], a_hat_ct [B, R, Y], inc_ct
  [B]) -> cotangents of (prev, cs, a_prev [B, Q, S], push, repl, pop).
  """
  interpret = _interpret(interpret)
  bsz, s, q, n = prev.shape[:4]
  dtype = prev.dtype
  col_ct, mt_ct, a_hat_ct, inc_ct = cts
  kernel = functools.partial(_local_bwd_kernel, q=q, s=s, n=n,
                             barrier=not interpret)
  shapes = [prev.shape, cs.shape, (bsz, q, s), (bsz, q, s, q, s),
            (bsz, q, s, q, s), (bsz, q, s, q)]
  return tuple(_flat_call(
      kernel, (bsz,), p, (prev, cs, a_hat, res[0], res[1], col_ct, mt_ct,
                          a_hat_ct, inc_ct), shapes, dtype, interpret))
