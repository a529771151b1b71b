"""Lang's algorithm for the nondeterministic stack (DuSell & Chiang, 2020).

A pure-array dynamic program (no Flax): given per-update action log-weights it
computes the inner weights γ and forward weights α of the paper's Figure 3 and
returns the stack readings τ. Exact, differentiable, O(T²) memory under
reverse-mode differentiation (custom VJP), plus a max-plus (Viterbi) variant.

Semantics (reference-behaviour.md §1.5, the authors' conll2020 code)
--------------------------------------------------------------------
State 0 is the start state and stack symbol 0 the bottom symbol ⊥. ⊥ lives
only in α's initial entry α_0 = one-hot(state 0, symbol 0); it is not a γ
transition. Hence, exactly, the DP sums the weights of PDA runs in which ⊥ is
never replaced or popped and the symbol directly on ⊥ is never popped; update
1 is push-only (mass Δ puts on replace/pop there is lost). Σ α_j < 1 in
general; readings renormalise.

Index conventions (paper ↔ code)
--------------------------------
Updates are j = 1..T (paper time j+1; the paper's α[1] is our α_0). For
0 ≤ i < j ≤ T, γ_{i,j}[q,x,r,y] is the weight of sub-runs from time i (state
q, top x) to time j (state r, top y) that push exactly one symbol y on x
overall and never go below it. With w_j = update j's actions:

  γ_{i,j} = [i=j−1] push_j
          + [i≤j−2] Σ_{s,z} γ_{i,j−1}[q,x,s,z] repl_j[s,z,r,y]          (R)
          + [i≤j−3] Σ_{k=i+1}^{j−2} Σ_t γ_{i,k}[q,x,t,y] M_{j,k}[t,y,r]  (P)
  M_{j,k}[t,y,r] = Σ_{s,z} γ_{k,j−1}[t,y,s,z] pop_j[s,z,r]   (pop folded first)
  α_j[r,y] = Σ_{i<j} Σ_{q,x} α_i[q,x] γ_{i,j}[q,x,r,y]
  τ_j(y) = Σ_r α_j[r,y] / Σ_{r,y} α_j[r,y];     log_mass_j = ln Σ_{r,y} α_j.

Inputs push, repl are [B,T,Q,S,Q,S] indexed (q, x, r, y) = (from state, top
symbol, to state, pushed / replacing symbol); pop is [B,T,Q,S,Q] indexed
(q, x, r). All are log-weights (log semiring; −inf = weight zero).

Representation: scaled linear storage
-------------------------------------
γ is stored as linear mantissas G in [0, 1] with one log-scale c_j per (batch
element, column j): γ_{i,j} = G_{i,j} · exp(c_j), c_j = log of the column's
largest entry. All table-sized work is then plain matmuls; only column-sized
arrays are exponentiated or logged per step. Every shift (column scale,
action maxima) is a constant for differentiation, so represented values and
derivatives are exact. α is kept in log space (it is column-sized). Entries
more than ~87 nats (float32; ~700 nats float64) below their column's maximum
flush to zero, like a log-space implementation's s_min flush.

Known limit of this representation. A column's maximum can sit on a row i
whose α_i is negligible; entries of the rows that dominate α_j may then lie
beyond the flush and are lost. Measured against the float64 log-space
reference (B=4, Q=S=2, T=80, weights σ × log-softmax of N(0, 1) logits,
i.e. sharpened and sub-normalised): float32 readings are off by 2e-7 at
σ=1, 4e-3 at σ=2, 0.12 at σ=3 and 0.55 at σ=6; float64 stays exact
(≤ 5e-14, also at σ=12) until weights spread ~700 nats (N(0, 8²)
unnormalised log-weights over 30 updates: 0.92). Normalised random actions
(log-softmax of N(0, σ²) logits, σ up to 20) stay within 3e-6. Our trained
NS-RNNs (marked / unmarked reversal, Dyck) on their own languages' strings
of length 40-100 stay within 2e-6 in float32, but the marked-reversal model
on random strings of length 80 is off by 0.19. Strict xfail tests keep the
limit in view. `rns_stack.run(push, repl, pop, bottom="frozen")` computes
this module's semantics (the same log α up to normalisation, the same
log-mass) in a share representation that keeps log α apart and stays exact
in both regimes (float32 ≤ 2e-6, float64 3e-14; tested). The NS-RNN model
therefore runs that DP by default (`models.run_ns_stack`,
config.stack_table = "shares"); this module is its opt-in "scaled" table
(once ~1.1x faster per train step on CPU, now ~1.3x slower than the shares
table, whose update runs in fewer ops: README, "The stack") and the home of
the CoNLL 2020 reference, Viterbi and run replay.

Table layout (column-major): G_BxYxJxRxIxQxX[b, y, j, r, i, q, x] =
mantissa of γ_{i,j}[q,x,r,y], with I = J = T+1; column j is the contiguous
block G[b, y, j]. The pop term is then one dot_general per (b, y),
E [R, K·T] × G [K·T, I·Q·X], contracting (k, t) = the table's column axes,
and a step writes one contiguous column.

Cost and memory
---------------
Time O(B·T³·Q³·S²) (pop contraction factorised through M) + O(B·T²·Q³·S³).
Forward memory O(B·T²·Q²·S²). Time is split into up to 4 static blocks, each
a `lax.scan` over the table sliced to the rows / columns it can reach
(≈47% of the padded-triangle work).

The gradient is a `jax.custom_vjp` whose forward saves only the final table,
column scales and α (plus, for `run_coupled`, the O(T) controller carries and
actions). Its backward is one reverse sweep (per block a reverse `lax.scan`)
with hand-written log-adjoints  v̂ = v · ∂L/∂v  (ns-stack-gradient.md §5) in
the scaled representation. It never forms the adjoint of γ as a table: the
left pop factor's contribution to column j from all later updates j' is one
matmul of a table W[(j',r), (i,q,x)] of the later updates' pop-term adjoints
with E_{·,j}, and all E_{j',k} are computed once before the sweep; replace /
right-pop contributions travel column-sized from update j+1 to j. Memory:
the final table, W and E, i.e. O(B·T²·Q²·S²). The real
adjoint ĝ/g of an entry is clamped at exp(log(float max) − 20) so entries
flushed to ~0 cannot create inf·0.

Precision and unrolling
-----------------------
Every contraction (forward and backward) takes an explicit matmul
precision, "highest" by default: JAX's own default on recent GPUs and TPUs
uses TF32 / bf16 passes, which broke float32 tests there. On CPUs XLA emits
the same program either way (tested). `unroll` unrolls the forward and
backward `lax.scan`s (same values; meant for launch-bound accelerators; on
CPU it only made steps slower).

XLA:CPU notes (measured): table-sized contractions run fastest as
dot_generals on flat [B·Y, rows, cols] views, with the long axis (i, q, x)
as the output axis of the forward's pop term (1.3-1.6x faster forward than
the row-major table with the state r as output axis) and as the contracted
axis of the backward's M̄ (the table as left operand: W · Gᵀ ran 3x slower);
an in-place column update of a carried table must happen before the
table is read in the same step and be fenced by an optimization barrier, or
XLA copies the table (3 copies per step). The backward step works in the
table's column layout [B, Y, R, I, Q, X] (no transposes of column-sized
arrays inside the loop) and avoids column-sized logs: a fused
log → exp loop runs ~5x slower than an exp alone. Batched dot_generals with
many tiny batches (e.g. batch B·T) are slow; such contractions are hoisted
out of the loop.

Shape legend: B batch, T updates, Q states, S stack symbols, Y/X/Z stack
symbols in roles (top at the column end / at the row start / intermediate),
I row (source time i), J column (destination time j), R destination state,
H controller hidden size.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array

__all__ = [
    "MATMUL_PRECISIONS",
    "check_precision",
    "check_sizes",
    "check_unroll",
    "lax_precision",
    "init_state",
    "step",
    "readout",
    "run",
    "run_coupled",
    "run_reference",
    "viterbi",
    "replay_run",
    "replay_with_heights",
    "backtrace",
    "time_blocks",
    "StackState",
]


# ---------------------------------------------------------------------------
# Small guarded primitives.
# ---------------------------------------------------------------------------


def _finite_shift(x, axis, keepdims=False):
  """Max over `axis` with non-finite maxima replaced by 0; a gradient constant.

  Shifts only choose the working range of exp(); treating them as constants
  keeps values and derivatives exact and avoids −inf − (−inf) = NaN.
  """
  m = jnp.max(x, axis=axis, keepdims=keepdims)
  return lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0))


def _lse(x, axis):
  """logsumexp that is −inf (value) with zero gradient over all-−inf slices."""
  m = _finite_shift(x, axis, keepdims=True)
  s = jnp.sum(jnp.exp(x - m), axis=axis, keepdims=True)
  ok = s > 0
  out = jnp.where(ok, jnp.log(jnp.where(ok, s, 1)) + m, -jnp.inf)
  return jnp.squeeze(out, axis=axis)


def _safe_log(x):
  """log(x) for x ≥ 0 with log(0) = −inf and a finite (zero) gradient there."""
  ok = x > 0
  return jnp.where(ok, jnp.log(jnp.where(ok, x, 1)), -jnp.inf)


def _mix_column(k_BxOxC, col_BxCxL, prec, dot_general=None):
  """out[b, o, ...] = Σ_c k[b, o, c] col[b, c, ...] for a column-sized `col`.

  `col` is [B, C, L...] (C short, e.g. a table column's (top, state) pair
  flattened; L the long row axes): one [O, C] × [C, L] matmul per b on the
  column as it lies, so the long axis stays the output's last. XLA:CPU ran
  the equivalent einsum (e.g. "bzsiqx,bszry->byriqx") as [L, O] then a
  transpose, 2.8x slower.

  `dot_general(lhs, rhs, dimension_numbers, prec)` contracts instead of
  `lax.dot_general` when given (rns_stack's `COLUMN_CONTRACTIONS`).

  Returns:
    [B, O, L...].
  """
  bsz, nc = col_BxCxL.shape[:2]
  dims = (((2,), (1,)), ((0,), (0,)))
  if dot_general is None:
    out = lax.dot_general(k_BxOxC, col_BxCxL.reshape(bsz, nc, -1), dims,
                          precision=prec)
  else:
    out = dot_general(k_BxOxC, col_BxCxL.reshape(bsz, nc, -1), dims, prec)
  return out.reshape((bsz, k_BxOxC.shape[1]) + col_BxCxL.shape[2:])


def _replace_rows(col, k_rep, prec):
  """Σ_{s,z} col[b,z,s,i,q,x] k_rep[b,s,z,r,y], as [b, y, r, i, q, x].

  The replace term of a column (top z, state s) with replace weights
  (s, z) → (r, y): `_mix_column` with the weights as [b, (y, r), (z, s)].
  """
  bsz = col.shape[0]
  ny, nr = k_rep.shape[4], k_rep.shape[3]
  k_yrzs = jnp.transpose(k_rep, (0, 4, 3, 2, 1)).reshape(bsz, ny * nr, -1)
  return _mix_column(k_yrzs, col.reshape((bsz, -1) + col.shape[3:]),
                     prec).reshape((bsz, ny, nr) + col.shape[3:])


# Public names of the guarded primitives and the column kernels (used by
# rns_stack; replace_rows by its versions before e89574a, which
# benchmarks/train_step.py --baseline_ref loads against this module).
logsumexp_guarded = _lse
safe_log = _safe_log
replace_rows = _replace_rows
mix_column = _mix_column

MATMUL_PRECISIONS = ("highest", "high", "default")


def check_precision(precision):
  """Validates a matmul precision name; returns it (a static string).

  "highest" is full float32 (float64 stays float64) on every backend;
  "high" and "default" let GPUs / TPUs use reduced-precision passes (TF32,
  bf16x3 / bf16). "default" leaves the choice to JAX (and to
  JAX_DEFAULT_MATMUL_PRECISION), exactly as a plain matmul would.
  """
  if precision not in MATMUL_PRECISIONS:
    raise ValueError(f"matmul_precision must be one of "
                     f"{', '.join(MATMUL_PRECISIONS)}; got {precision!r}")
  return precision


def check_unroll(unroll):
  """Validates a scan unroll factor (a positive int); returns it."""
  if isinstance(unroll, bool) or not isinstance(unroll, (int, np.integer)) \
      or unroll < 1:
    raise ValueError(f"unroll (scan unroll factor) must be a positive "
                     f"integer, got {unroll!r}")
  return int(unroll)


def lax_precision(precision):
  """The `precision=` argument of jnp / lax contractions for a name."""
  check_precision(precision)
  return None if precision == "default" else lax.Precision[
      precision.upper()]


def readout(log_alpha_BxQxS):
  """Reading τ and log-mass from log α.

  Args:
    log_alpha_BxQxS: log α_j, [..., Q, S].

  Returns:
    (reading [..., S], log_mass [...]). If every run died (log_mass = −inf)
    the reading is all zeros, never NaN.
  """
  per_symbol = _lse(log_alpha_BxQxS, axis=-2)
  log_mass = _lse(per_symbol, axis=-1)
  alive = jnp.isfinite(log_mass)[..., None]
  safe_mass = jnp.where(alive, log_mass[..., None], 0)
  reading = jnp.where(alive, jnp.exp(per_symbol - safe_mass), 0)
  return reading, log_mass


# ---------------------------------------------------------------------------
# State and the forward step.
# ---------------------------------------------------------------------------


class StackState(NamedTuple):
  """The DP tables after some updates (a pytree; fixed shape for T updates).

  Attributes:
    gamma: G_BxYxJxRxIxQxX, linear mantissas of γ (see module docstring).
    scale: c_BxJ, log-scale of each γ column (c_0 unused, 0).
    log_alpha: [B, T+1, Q, S], log α_j (−inf rows not yet computed).
  """
  gamma: Array
  scale: Array
  log_alpha: Array


def check_sizes(minimum: int = 1, **sizes) -> tuple[int, ...]:
  """The named table sizes as ints, in order; one-line ValueError unless each
  is an integer >= `minimum` (bools and floats such as 2.0 refused: a shape
  from them would fail deep inside JAX)."""
  for name, value in sizes.items():
    if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
        or value < minimum):
      raise ValueError(f"{name} must be an integer >= {minimum}, got "
                       f"{value!r}")
  return tuple(int(v) for v in sizes.values())


def init_state(batch_size, num_steps, num_states, num_symbols,
               dtype=jnp.float32):
  """Empty tables for `num_steps` updates: α_0 = one-hot(state 0, ⊥)."""
  batch_size, num_states, num_symbols = check_sizes(
      batch_size=batch_size, num_states=num_states, num_symbols=num_symbols)
  (num_steps,) = check_sizes(0, num_steps=num_steps)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"dtype must be a float type, got {dtype}")
  n = num_steps + 1
  b, q, s = batch_size, num_states, num_symbols
  gamma = jnp.zeros((b, s, n, q, n, q, s), dtype)
  scale = jnp.zeros((b, n), dtype)
  log_alpha = jnp.full((b, n, q, s), -jnp.inf, dtype).at[:, 0, 0, 0].set(0)
  return StackState(gamma, scale, log_alpha)


class _Shifts(NamedTuple):
  """Per-step constants shared by the forward and backward step."""
  repl_e: Array   # exp(repl − max), [B, s, z, r, y]
  pop_e: Array    # exp(pop − max), [B, s, z, r]
  ek: Array       # exp(c_k − max c) on valid k = 1..j−2, else 0; [B, J]
  log_r: Array    # log-scale of the replace term, [B]
  log_p: Array    # log-scale of the pop term, [B]
  sigma: Array    # common shift of the unnormalised column, [B]


def _shifts(scale, j, push, repl, pop):
  """Shifts and exponentiated actions of update j."""
  num_cols = scale.shape[1]
  c_prev = lax.dynamic_index_in_dim(scale, j - 1, axis=1, keepdims=False)
  m_repl = _finite_shift(repl, axis=(1, 2, 3, 4))
  m_pop = _finite_shift(pop, axis=(1, 2, 3))
  m_push = _finite_shift(push, axis=(1, 2, 3, 4))
  repl_e = jnp.exp(repl - m_repl[:, None, None, None, None])
  pop_e = jnp.exp(pop - m_pop[:, None, None, None])
  k = jnp.arange(num_cols)
  # M_{j,k} exists only for 1 ≤ k ≤ j−2; the final table (backward) has
  # later columns filled, so the range must be explicit here.
  valid_k = (k >= 1) & (k <= j - 2)
  c_max = _finite_shift(jnp.where(valid_k, scale, -jnp.inf), axis=1)
  ek = jnp.where(valid_k, jnp.exp(scale - c_max[:, None]), 0)
  ek = lax.stop_gradient(ek)
  log_r = c_prev + m_repl
  log_p = c_prev + m_pop + c_max
  sigma = lax.stop_gradient(jnp.maximum(jnp.maximum(log_r, log_p), m_push))
  return _Shifts(repl_e, pop_e, ek, log_r, log_p, sigma)


# Largest spread (nats) of the finite log α rows for which α_j is computed as a
# linear matvec. With α_i / max α ≥ e^−40, a product α_i·G underflows only
# where the mantissa G is below ~e^−47 (float32; e^−668 in float64), i.e.
# the fast path flushes entries 47 nats below their column's maximum
# instead of the representation's 87. A wider spread takes the log-space
# path. Trained NS-RNNs on their languages' strings of length 60-80 kept
# their rows within 11-43 nats (marked / unmarked reversal, Dyck).
_LINEAR_ALPHA_SPREAD = 40.0


def _alpha_weights(log_alpha):
  """Linear α rows for the matvec path.

  Args:
    log_alpha: [B, I, Q, X] log α rows (−inf where zero or not computed).

  Returns:
    (a [B, I, Q, X] = exp(log α − m) with 0 for −inf rows, m [B] (a
    gradient constant), linear_ok: scalar bool, every batch element's finite
    rows lie within `_LINEAR_ALPHA_SPREAD` nats of its maximum).
  """
  finite = jnp.isfinite(log_alpha)
  m = _finite_shift(log_alpha, axis=(1, 2, 3))
  lo = jnp.min(jnp.where(finite, log_alpha, jnp.inf), axis=(1, 2, 3))
  linear_ok = jnp.all(~(lo < m - _LINEAR_ALPHA_SPREAD))
  shifted = jnp.where(finite, log_alpha - m[:, None, None, None], 0)
  return jnp.where(finite, jnp.exp(shifted), 0), m, linear_ok


def _alpha_sums(g_col, a, precision):
  """S[b, y, r] = Σ_{i,q,x} G[b,y,r,i,q,x] a[b,i,q,x] (one batched matvec)."""
  bsz, ny, nr = g_col.shape[:3]
  return lax.dot_general(
      g_col.reshape(bsz, ny * nr, -1), a.reshape(bsz, -1),
      (((2,), (1,)), ((0,), (0,))),
      precision=lax_precision(precision)).reshape(bsz, ny, nr)


def _alpha_step(log_alpha, g_col, c_col, precision="highest"):
  """log α_j from column j (mantissa g_col [B,Y,R,I,Q,X], scale c_col [B]).

  α_j[r, y] = Σ_{i,q,x} α_i[q, x] γ_{i,j}[q, x, r, y]. When the rows' spread
  allows (`_alpha_weights`), one matvec in linear space; otherwise a
  logsumexp over log α + log G, whose column-sized log is the costly part on
  XLA:CPU. (Under vmap the predicate is batched and both branches run:
  loop.py calls a single model's step without vmap.)
  """
  a, m, linear_ok = _alpha_weights(log_alpha)

  def linear(_):
    out_byr = (_safe_log(_alpha_sums(g_col, a, precision))
               + (m + c_col)[:, None, None])
    return jnp.swapaxes(out_byr, 1, 2)

  def log_space(_):
    terms = (log_alpha[:, None, None] + _safe_log(g_col)
             + c_col[:, None, None, None, None, None])
    out_byr = _lse(terms.reshape(terms.shape[:3] + (-1,)), axis=3)
    return jnp.swapaxes(out_byr, 1, 2)

  return lax.cond(linear_ok, linear, log_space, None)


def _column(gamma, scale, j, push, repl, pop, precision):
  """Column j (mantissa [B,Y,R,I,Q,X] and log-scale [B]) from columns < j."""
  prec = lax_precision(precision)
  sh = _shifts(scale, j, push, repl, pop)
  bsz, ny, nj, nr, ni, nq, nx = gamma.shape
  # Column j−1: its Y axis is z (the top at time j−1), its R axis s.
  g_prev = lax.dynamic_index_in_dim(gamma, j - 1, axis=2, keepdims=False)
  r_til = _replace_rows(g_prev, sh.repl_e, prec)
  g_prev_zs = g_prev.reshape((bsz, -1) + g_prev.shape[3:])
  # M̃_{j,k}[t,y,r] (rows k, t, y of column j−1), scaled by ek.
  # [b, r, (z, s)] × column j−1 → [b, r, k, t, y], then the small result to
  # [b, y, r, k, t].
  m_til = jnp.transpose(_mix_column(
      jnp.transpose(sh.pop_e, (0, 3, 2, 1)).reshape(bsz, nr, -1), g_prev_zs,
      prec), (0, 4, 1, 2, 3))
  e = m_til * sh.ek[:, None, None, :, None]
  # Pop term: a [R, K·T] × [K·T, I·Q·X] matmul per (b, y). The table's
  # column-major layout makes the long axis (rows i, q, x) the matmul's
  # output axis, where XLA:CPU's kernels run ~2x faster than with the short
  # state axis r there.
  p_til = lax.dot_general(
      e.reshape(bsz * ny, nr, nj * nr),
      gamma.reshape(bsz * ny, nj * nr, ni * nq * nx),
      (((2,), (1,)), ((0,), (0,))), precision=prec).reshape(r_til.shape)
  push_row = jnp.exp(push - sh.sigma[:, None, None, None, None])
  row = (jnp.arange(ni) == j - 1).astype(gamma.dtype)
  b = (slice(None),) + (None,) * 5
  u = (r_til * jnp.exp(sh.log_r - sh.sigma)[b]
       + p_til * jnp.exp(sh.log_p - sh.sigma)[b]
       + jnp.transpose(push_row, (0, 4, 3, 1, 2))[:, :, :, None]
       * row[None, None, None, :, None, None])
  u_max = lax.stop_gradient(jnp.max(u, axis=(1, 2, 3, 4, 5)))
  u_max = jnp.where(u_max > 0, u_max, 1)
  return u / u_max[b], sh.sigma + jnp.log(u_max)


@functools.partial(jax.jit, static_argnames="precision")
def step(state, j, push_BxQxSxQxS, repl_BxQxSxQxS, pop_BxQxSxQ,
         precision="highest"):
  """Applies update j (1-based, may be traced) to `state`.

  Args:
    state: StackState holding updates 1..j−1.
    j: update number, 1 ≤ j ≤ T (int or int32 scalar).
    push_BxQxSxQxS, repl_BxQxSxQxS, pop_BxQxSxQ: update j's log-weights.
    precision: matmul precision name (`MATMUL_PRECISIONS`), static.

  Returns:
    (new_state, reading_BxS, log_mass_B) after update j.
  """
  g_col, c_col = _column(state.gamma, state.scale, j, push_BxQxSxQxS,
                         repl_BxQxSxQxS, pop_BxQxSxQ, precision)
  la_col = _alpha_step(state.log_alpha, g_col, c_col, precision)
  new = StackState(
      lax.dynamic_update_index_in_dim(state.gamma, g_col, j, axis=2),
      lax.dynamic_update_index_in_dim(state.scale, c_col, j, axis=1),
      lax.dynamic_update_index_in_dim(state.log_alpha, la_col, j, axis=1))
  reading, log_mass = readout(la_col)
  return new, reading, log_mass


# ---------------------------------------------------------------------------
# Hand-written backward step (log-adjoints in the scaled representation).
# ---------------------------------------------------------------------------


def _left_pop_factors(state, pop_TB, precision):
  """Left pop factors E_{j',k} of every update j' at every column k, at once.

  E_{j',k}[t,y,r] = ek_{j'}(k) · Σ_{s,z} G_{k,j'−1}[t,y,s,z] pop_e_{j'}[s,z,r]
  is the (scaled) M_{j',k} of the forward step j'; the backward step k reads
  the slice k. Computing it once here, as one contraction over the final
  table, replaces a per-step batched matmul with T·B tiny batches (which
  XLA:CPU runs slowly: it was ~40% of the backward). Memory O(B·T²·Q²·S).

  Returns:
    E_BxYxKxTxJxR: [B, Y, T+1 (k), T (state t), T+1 (j'), R]; zero where
    k ∉ [1, j'−2] and at j' = 0.
  """
  scale, gamma = state.scale, state.gamma
  num_cols = scale.shape[1]
  m_pop = _finite_shift(pop_TB, axis=(2, 3, 4))
  pop_e = jnp.exp(pop_TB - m_pop[:, :, None, None, None])
  jj = jnp.arange(num_cols)[:, None]
  kk = jnp.arange(num_cols)[None, :]
  valid = (kk >= 1) & (kk <= jj - 2)
  c_max = _finite_shift(jnp.where(valid, scale[:, None, :], -jnp.inf), axis=2)
  ek = jnp.where(valid, jnp.exp(scale[:, None, :] - c_max[:, :, None]), 0)
  # Column j' − 1 of the table feeds update j'; column −1 does not exist.
  # Column j' − 1 feeds update j' (pop_TB[j' − 1]); E_{0,·} = 0.
  e_all = jnp.einsum("bznskty,nbszr->byktnr", gamma[:, :, :-1], pop_e,
                     precision=lax_precision(precision))
  e_all = jnp.concatenate([jnp.zeros_like(e_all[:, :, :, :, :1]), e_all],
                          axis=4)
  return e_all * jnp.swapaxes(ek, 1, 2)[:, None, :, None, :, None]


def _backward_step(state, e_all, w_table, col0, j, push, repl, pop, prev_hat,
                   a_hat, precision):
  """Reverse of update j on the final tables.

  The adjoint table is never formed. The left pop factor's contribution to
  column j (from every later update j') is G_{·,j} ⊙ Σ_{j',r} W_{j'} ⊗ E_{j',j},
  one matmul of E_{·,j} with the table W_table[b,y,(j',r),(i,q,x)] of the
  later updates' pop adjoints W_{j'}; the replace / right-pop contributions
  to column j arrive column-sized from update j+1 (`prev_hat`). Column-sized
  arrays here are in the layout [B, Y, R, I, Q, X].

  Args:
    state: final StackState, sliced to the rows / columns < j1 of the block.
    e_all: `_left_pop_factors` sliced to columns k < j1 and updates
      j' ≥ col0, [B, Y, K, T, J', R].
    w_table: W_{j'} of updates j' > j, flat [B·Y, J·R, I·Q·X] (row j');
      W_{j+1} may still be missing: E_{j+1,j} = 0. Only columns j' ≥ col0
      are passed (E_{j',j} = 0 for j' ≤ j + 1 anyway).
    col0: static first update j' of `w_table`.
    j: update number.
    push, repl, pop: update j's log-weights.
    prev_hat: log-adjoint added to column j by update j+1, [B,Y,R,I,Q,X].
    a_hat: complete log-adjoint of log α_j, [B, Q(r), S(y)].
    precision: matmul precision name.

  Returns:
    (W_j [B,Y,R,I,Q,X], prev_hat for column j−1, la_hat for log α rows < j,
     push_hat, repl_hat, pop_hat).
  """
  gamma, scale, log_alpha = state
  prec = lax_precision(precision)
  bsz, ny, _, nr, ni, nq, nx = gamma.shape
  nj = col0 + e_all.shape[4]
  dtype = gamma.dtype
  b = (slice(None),) + (None,) * 5
  sh = _shifts(scale, j, push, repl, pop)
  # Columns j−1 and j in the table's column layout [B, Y, R, I, Q, X] (a
  # column is contiguous). The whole step works in this layout: a strided
  # column read fused into the step's elementwise fusions made them scalar,
  # strided loops that dominated the step.
  col_pair = lax.dynamic_slice_in_dim(gamma, j - 1, 2, axis=2)
  g_prev, g_new = col_pair[:, :, 0], col_pair[:, :, 1]
  c_new = lax.dynamic_index_in_dim(scale, j, axis=1, keepdims=False)
  la_new = lax.dynamic_index_in_dim(log_alpha, j, axis=1, keepdims=False)

  # Left pop factor: E_{j',j}[t,y,r] of all later j' (precomputed).
  e_col = lax.dynamic_index_in_dim(e_all, j, axis=2, keepdims=False)
  left = lax.dot_general(
      e_col.reshape(bsz * ny, nr, (nj - col0) * nr), w_table,
      (((2,), (1,)), ((0,), (0,))), precision=prec)
  gh_col = g_new * left.reshape(g_new.shape) + prev_hat

  # No column-sized log below: XLA:CPU runs a fused log → exp elementwise
  # loop ~5x slower than exp alone, and it dominated the step. Every exp
  # argument that a log-space form would write as `… + log g` is instead
  # split in halves, exp(a/2) · g · exp(a/2) or exp(d/2) / g · exp(d/2), so
  # no factor overflows or underflows where the log-space value would not.
  ok = g_new > 0

  # α_j = Σ α_i ⊗ γ_{i,j}: column-sized shares α_i γ_{i,j} / α_j ≤ 1, on
  # the forward's path (the same test on rows i < j, which the forward saw).
  rows_before = (jnp.arange(log_alpha.shape[1]) < j)[None, :, None, None]
  a, _, linear_ok = _alpha_weights(
      jnp.where(rows_before, log_alpha, -jnp.inf))

  def linear_share(_):
    sums = _alpha_sums(g_new, a, precision)[:, :, :, None, None, None]
    live = sums > 0
    return jnp.where(live, a[:, None, None] * g_new
                     / jnp.where(live, sums, 1), 0)

  def log_space_share(_):
    la_new_yr = jnp.swapaxes(la_new, 1, 2)[:, :, :, None, None, None]
    la_i = log_alpha[:, None, None]
    live = ok & jnp.isfinite(la_i) & jnp.isfinite(la_new_yr)
    half = jnp.exp(jnp.where(live, (la_i + c_new[b] - la_new_yr) * 0.5, 0))
    return jnp.where(live, half * g_new * half, 0)

  share = lax.cond(linear_ok, linear_share, log_space_share, None)
  share = share * jnp.swapaxes(a_hat, 1, 2)[:, :, :, None, None, None]
  la_hat = jnp.sum(share, axis=(1, 2))
  gh_col = gh_col + share

  # Push row i = j−1 has share 1.
  push_hat = jnp.transpose(
      lax.dynamic_index_in_dim(gh_col, j - 1, axis=3, keepdims=False),
      (0, 3, 4, 2, 1))

  # Real adjoints of the replace / pop mantissas: ĝ / g · exp(scale − c_j).
  # The factor is clamped at exp(big) so that astronomically small entries
  # cannot turn a bounded log-adjoint into inf (their true share is
  # negligible). With h = exp(d/2): if h / g overflows, the product exceeds
  # exp(big) anyway, so the clamp gives the same value.
  big = float(np.exp(np.log(np.finfo(dtype).max) - 20.0))
  g_safe = jnp.where(ok, g_new, 1)

  def adjoint(log_term_scale):
    h = jnp.exp((log_term_scale - c_new) * 0.5)[b]
    ratio = jnp.minimum(h / g_safe * h, big)
    return jnp.where(ok, gh_col * ratio, 0)

  w_r = adjoint(sh.log_r)
  w_p = adjoint(sh.log_p)

  # Replace (g_prev is column j−1: its Y axis is z, its R axis s).
  repl_hat = sh.repl_e * jnp.einsum("bzsiqx,byriqx->bszry", g_prev, w_r,
                                    precision=prec)
  prev_out = g_prev * _mix_column(
      jnp.transpose(sh.repl_e, (0, 2, 1, 4, 3)).reshape(bsz, ny * nr, -1),
      w_r.reshape((bsz, -1) + w_r.shape[3:]), prec).reshape(g_prev.shape)

  # Pop, right factor: M̄_{j,k}[t,y,r] = ek · Σ_{i,q,x} G_{i,k} W_j, one
  # matmul per (b, y) contracting the table's contiguous rows i, q, x (with
  # the table as the left operand: XLA:CPU ran W · Gᵀ 3x slower).
  m_bar = lax.dot_general(
      gamma.reshape(bsz * ny, -1, ni * nq * nx),
      w_p.reshape(bsz * ny, nr, ni * nq * nx),
      (((2,), (2,)), ((0,), (0,))), precision=prec)
  m_bar = (m_bar.reshape(bsz, ny, ni, nr, nr)
           * sh.ek[:, None, :, None, None])
  pop_hat = sh.pop_e * jnp.einsum("bzskty,byktr->bszr", g_prev, m_bar,
                                  precision=prec)
  prev_out = prev_out + g_prev * _mix_column(
      jnp.transpose(sh.pop_e, (0, 2, 1, 3)).reshape(bsz, ny * nr, nr),
      jnp.transpose(m_bar, (0, 4, 2, 3, 1)), prec).reshape(g_prev.shape)
  return w_p, prev_out, la_hat, push_hat, repl_hat, pop_hat


def _backward_sweep(state, push_TB, repl_TB, pop_TB, la_ct_fn, ctrl_fn,
                    ctrl_init, precision, unroll=1):
  """One reverse scan j = T..1 over the final tables.

  Args:
    state: final StackState.
    push_TB, repl_TB, pop_TB: time-major action log-weights.
    la_ct_fn: (j, ctrl_carry) -> cotangent of log α_j from outside the DP
      (readings, log-mass, controller), [B, Q, S].
    ctrl_fn: (j, ctrl_carry, push_hat, repl_hat, pop_hat) -> ctrl_carry; the
      controller's reverse step (identity for `run`).
    ctrl_init: initial controller backward carry.
    precision: matmul precision name.
    unroll: `lax.scan` unroll factor of the reverse scans (values unchanged).

  Returns:
    (final ctrl carry, (push_hat, repl_hat, pop_hat) time-major).
  """
  num_steps = push_TB.shape[0]
  bsz, ny, nj, nr, ni, nq, nx = state.gamma.shape
  e_all = _left_pop_factors(state, pop_TB, precision)

  def body(part, e_part, col0, carry, inp):
    w_table, w_next, prev_hat, ah, ctrl = carry
    j, push, repl, pop = inp
    # W_{j+1} is written one step late, before the table is read: written
    # after the read, the in-place update would force a copy of the table.
    # The barrier stops XLA from duplicating the update into the matmul's
    # operand fusion, which costs three table copies per step.
    w_table = lax.optimization_barrier(lax.dynamic_update_slice_in_dim(
        w_table, w_next.reshape(w_table.shape[0], -1, w_table.shape[2]),
        (jnp.minimum(j + 1, num_steps) - col0) * nr, axis=1))
    a_hat = lax.dynamic_index_in_dim(ah, j, axis=1, keepdims=False)
    a_hat = a_hat + la_ct_fn(j, ctrl)
    w_next, prev_hat, la_hat, push_hat, repl_hat, pop_hat = _backward_step(
        part, e_part, w_table, col0, j, push, repl, pop, prev_hat, a_hat,
        precision)
    ah = ah + la_hat
    ctrl = ctrl_fn(j, ctrl, push_hat, repl_hat, pop_hat)
    return (w_table, w_next, prev_hat, ah, ctrl), (push_hat, repl_hat,
                                                  pop_hat)

  # W table kept flat as [B·Y, J·R, I·Q·X], the matmul's operand layout.
  w_table = jnp.zeros((bsz * ny, nj * nr, ni * nq * nx), state.gamma.dtype)
  col = jnp.zeros((bsz, ny, nr, ni, nq, nx), state.gamma.dtype)
  carry = (w_table, col, col, jnp.zeros_like(state.log_alpha), ctrl_init)
  hats = []
  # Blocks in reverse; block [j0, j1) only needs rows / columns < j1 of the
  # tables, and rows < j1, columns ≥ j0 of the W table.
  for j0, j1 in reversed(_time_blocks(num_steps)):
    part = _slice_state(state, j1)
    w_full, w_next, prev_hat, ah_full, ctrl = carry
    rows = j1 * nq * nx
    sub = (w_full[:, j0 * nr:, :rows], w_next[:, :, :, :j1],
           prev_hat[:, :, :, :j1],
           ah_full[:, :j1], ctrl)
    xs = (jnp.arange(j0, j1), push_TB[j0 - 1:j1 - 1], repl_TB[j0 - 1:j1 - 1],
          pop_TB[j0 - 1:j1 - 1])
    e_part = e_all[:, :, :j1, :, j0:]
    sub, blk_hats = lax.scan(functools.partial(body, part, e_part, j0),
                             sub, xs, reverse=True, unroll=unroll)
    w_sub, w_next_s, prev_s, ah_s, ctrl = sub
    pad = lambda a, full, axis: lax.dynamic_update_slice_in_dim(
        jnp.zeros_like(full), a, 0, axis)
    carry = (w_full.at[:, j0 * nr:, :rows].set(w_sub),
             pad(w_next_s, w_next, 3),
             pad(prev_s, prev_hat, 3), ah_full.at[:, :j1].set(ah_s), ctrl)
    hats.append(blk_hats)
  ctrl = carry[4]
  hats = tuple(jnp.concatenate(h[::-1], axis=0) for h in zip(*hats))
  return ctrl, hats


# ---------------------------------------------------------------------------
# run: actions given up front.
# ---------------------------------------------------------------------------


def _check_actions(push, repl, pop):
  """Validates run()'s inputs; returns (B, T, Q, S)."""
  arrays = {"push": push, "repl": repl, "pop": pop}
  for name, a in arrays.items():
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
      raise ValueError(f"{name} must be an array, got {type(a).__name__}")
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"{name} must hold float log-weights, got {a.dtype}")
  if push.ndim != 6:
    raise ValueError(f"push must be [B, T, Q, S, Q, S], got {push.shape}")
  b, t, q, s, q2, s2 = push.shape
  if q2 != q or s2 != s:
    raise ValueError(f"push must be [B, T, Q, S, Q, S], got {push.shape}")
  if repl.shape != push.shape:
    raise ValueError(
        f"repl must have push's shape {push.shape}, got {repl.shape}")
  if pop.shape != (b, t, q, s, q):
    raise ValueError(f"pop must be [B, T, Q, S, Q] = {(b, t, q, s, q)}, "
                     f"got {pop.shape}")
  if not push.dtype == repl.dtype == pop.dtype:
    raise ValueError("push, repl, pop must share one dtype, got "
                     f"{push.dtype}, {repl.dtype}, {pop.dtype}")
  if min(b, q, s) < 1:
    raise ValueError(f"B, Q, S must be >= 1, got shape {push.shape}")
  for name, a in arrays.items():
    if not isinstance(a, jax.core.Tracer):
      if np.any(np.isnan(np.asarray(a))) or np.any(np.asarray(a) == np.inf):
        raise ValueError(f"{name} contains NaN or +inf log-weights")
  return b, t, q, s


def _time_blocks(num_steps, num_blocks=None):
  """Static blocks [j0, j1) of updates; block b only touches table[:j1, :j1].

  Each block is its own lax.scan over a table sliced to the rows/columns it
  can reach, so the padded triangle is not swept in full at every step
  (4 blocks do ~47% of the padded work; more blocks cost compile time).
  num_blocks: how many (near-equal) blocks; None = up to 4 of ≥ 24 updates.
  """
  nb = (max(1, min(4, num_steps // 24)) if num_blocks is None
        else max(1, num_blocks))
  edges = [1 + (num_steps * b) // nb for b in range(nb + 1)]
  return [(j0, j1) for j0, j1 in zip(edges[:-1], edges[1:]) if j1 > j0]


# Public name of the time blocking (rns_stack blocks its table the same way).
time_blocks = _time_blocks


def _slice_state(state, n):
  """The tables restricted to rows / columns < n (a static prefix)."""
  g = state.gamma[:, :, :n, :, :n]
  return StackState(g, state.scale[:, :n], state.log_alpha[:, :n])


def _unslice_state(full, part):
  """Writes a prefix state (from `_slice_state`) back into the full one."""
  n = part.scale.shape[1]
  return StackState(
      full.gamma.at[:, :, :n, :, :n].set(part.gamma),
      full.scale.at[:, :n].set(part.scale),
      full.log_alpha.at[:, :n].set(part.log_alpha))


def _forward_tables(push, repl, pop, precision, unroll=1):
  """Runs all T updates (blocked lax.scans); returns the final StackState."""
  b, t, q, s = push.shape[:4]
  state = init_state(b, t, q, s, push.dtype)

  def body(st, inp):
    j, pu, re, po = inp
    st, _, _ = step(st, j, pu, re, po, precision=precision)
    return st, None

  for j0, j1 in _time_blocks(t):
    xs = (jnp.arange(j0, j1), jnp.swapaxes(push[:, j0 - 1:j1 - 1], 0, 1),
          jnp.swapaxes(repl[:, j0 - 1:j1 - 1], 0, 1),
          jnp.swapaxes(pop[:, j0 - 1:j1 - 1], 0, 1))
    part, _ = lax.scan(body, _slice_state(state, j1), xs, unroll=unroll)
    state = _unslice_state(state, part)
  return state


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _log_alpha_table(push, repl, pop, precision, unroll):
  """log α_j for j = 0..T, [B, T+1, Q, S], with the O(T²)-memory gradient."""
  return _forward_tables(push, repl, pop, precision, unroll).log_alpha


def _log_alpha_fwd(push, repl, pop, precision, unroll):
  """Forward: residuals are the final tables only (O(T²))."""
  state = _forward_tables(push, repl, pop, precision, unroll)
  return state.log_alpha, (state, push, repl, pop)


def _log_alpha_bwd(precision, unroll, res, la_ct):
  """Backward: one reverse sweep over the final tables."""
  state, push, repl, pop = res
  t_major = [jnp.swapaxes(a, 0, 1) for a in (push, repl, pop)]

  def la_ct_fn(j, _):
    return lax.dynamic_index_in_dim(la_ct, j, axis=1, keepdims=False)

  _, hats = _backward_sweep(state, *t_major, la_ct_fn,
                            lambda j, c, *_: c, (), precision, unroll)
  return tuple(jnp.swapaxes(h, 0, 1) for h in hats)


_log_alpha_table.defvjp(_log_alpha_fwd, _log_alpha_bwd)


def run(push, repl, pop, precision="highest", unroll=1):
  """Runs the nondeterministic stack over T updates given all actions.

  Args:
    push: [B, T, Q, S, Q, S] log-weights push_j[q, x, r, y].
    repl: [B, T, Q, S, Q, S] log-weights repl_j[q, x, r, y].
    pop: [B, T, Q, S, Q] log-weights pop_j[q, x, r].
    precision: matmul precision of every contraction, forward and backward
      (`MATMUL_PRECISIONS`; "highest" = full float32 on GPUs / TPUs too).
    unroll: `lax.scan` unroll factor of the forward and backward sweeps
      (same values; fewer loop iterations, larger programs; for
      launch-bound accelerators).

  Returns:
    readings_BxT1xS: τ after 0..T updates (τ_0 = one-hot on ⊥ = symbol 0).
    log_mass_BxT1: ln Σ_{r,y} α_j (−inf once every run has died; readings
      are then zero).
  Gradients (reverse mode) use the O(T²)-memory custom VJP.
  """
  push, repl, pop = (jnp.asarray(a) if isinstance(a, np.ndarray) else a
                     for a in (push, repl, pop))
  _check_actions(push, repl, pop)
  return _run_jit(push, repl, pop, check_precision(precision),
                  check_unroll(unroll))


@functools.partial(jax.jit, static_argnames=("precision", "unroll"))
def _run_jit(push, repl, pop, precision, unroll=1):
  """Jitted body of `run` (inputs already validated)."""
  return readout(_log_alpha_table(push, repl, pop, precision, unroll))


# ---------------------------------------------------------------------------
# run_coupled: the controller computes update t's actions from reading t−1.
# ---------------------------------------------------------------------------


def _check_controller_actions(acts, b, q, s, dtype):
  """Validates the (push, repl, pop) a controller step returned."""
  if not isinstance(acts, (tuple, list)) or len(acts) != 3:
    raise ValueError("step_fn must return (carry, (push, repl, pop), out)")
  want = ((b, q, s, q, s), (b, q, s, q, s), (b, q, s, q))
  for name, a, shape in zip(("push", "repl", "pop"), acts, want):
    if tuple(a.shape) != shape:
      raise ValueError(f"step_fn's {name} must have shape {shape} "
                       f"(num_states={q}, num_symbols={s}), got {a.shape}")
    if a.dtype != dtype:
      raise ValueError(f"step_fn's {name} has dtype {a.dtype}, expected "
                       f"{dtype} (the controller's reading dtype)")


def _split_float(tree):
  """Splits a pytree's leaves into differentiable (float) and other leaves."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  is_float = [jnp.issubdtype(jnp.asarray(l).dtype, jnp.inexact)
              for l in leaves]
  return leaves, treedef, is_float


def _coupled_forward(step_fn, q, s, params, init_carry, xs_T, dtype,
                     precision, unroll=1):
  """Coupled forward scan; returns outs_T, carries_T (h_{t−1}), state."""
  num_steps = jax.tree_util.tree_leaves(xs_T)[0].shape[0]
  b = jax.tree_util.tree_leaves(xs_T)[0].shape[1]
  state = init_state(b, num_steps, q, s, dtype)
  reading0 = jnp.zeros((b, s), dtype).at[:, 0].set(1)

  def body(carry, inp):
    ctrl, st, reading = carry
    j, x = inp
    new_ctrl, acts, out = step_fn(params, ctrl, x, reading)
    _check_controller_actions(acts, b, q, s, dtype)
    st, reading_new, _ = step(st, j, *acts, precision=precision)
    return (new_ctrl, st, reading_new), (out, ctrl, tuple(acts))

  carry, ys = (init_carry, reading0), []
  for j0, j1 in _time_blocks(num_steps):
    xs_blk = jax.tree_util.tree_map(lambda l: l[j0 - 1:j1 - 1], xs_T)
    (ctrl, part, reading), y = lax.scan(
        body, (carry[0], _slice_state(state, j1), carry[1]),
        (jnp.arange(j0, j1), xs_blk), unroll=unroll)
    state = _unslice_state(state, part)
    carry = (ctrl, reading)
    ys.append(y)
  outs, carries, acts_T = jax.tree_util.tree_map(
      lambda *a: jnp.concatenate(a, axis=0), *ys)
  return outs, carries, acts_T, state


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 6, 7, 8))
def _coupled(step_fn, q, s, params, init_carry, xs_T, dtype, precision,
             unroll):
  """Coupled recurrence; returns (outs_T, log α table) with a custom VJP."""
  outs, _, _, state = _coupled_forward(step_fn, q, s, params, init_carry,
                                       xs_T, dtype, precision, unroll)
  return outs, state.log_alpha


def _coupled_fwd(step_fn, q, s, params, init_carry, xs_T, dtype, precision,
                 unroll):
  """Forward of `_coupled`, saving tables, carries and actions."""
  outs, carries, acts_T, state = _coupled_forward(
      step_fn, q, s, params, init_carry, xs_T, dtype, precision, unroll)
  # Residuals: final tables plus O(T) controller carries and actions.
  return (outs, state.log_alpha), (params, xs_T, carries, acts_T, state)


def _coupled_bwd(step_fn, q, s, dtype, precision, unroll, res, cts):
  """Reverse sweep interleaving DP step j and the controller VJP of step j."""
  params, xs_T, carries, acts_T, state = res
  outs_ct, la_ct = cts
  la_ct = jnp.asarray(la_ct)
  x_leaves, x_def, x_float = _split_float(xs_T)
  # Readings τ_{j−1} fed to controller step j, recomputed from log α (O(T)).
  readings_T = jnp.swapaxes(readout(state.log_alpha)[0], 0, 1)  # [T+1, B, S]

  def ctrl_vjp(j, carry_ct, acts_hat):
    """VJP of controller step j; returns (params, carry, x, reading) cts."""
    idx = j - 1
    carry_prev = jax.tree_util.tree_map(
        lambda c: lax.dynamic_index_in_dim(c, idx, 0, keepdims=False), carries)
    x_t = [lax.dynamic_index_in_dim(l, idx, 0, keepdims=False)
           for l in x_leaves]
    reading_prev = lax.dynamic_index_in_dim(readings_T, idx, 0, keepdims=False)
    out_ct = jax.tree_util.tree_map(
        lambda c: lax.dynamic_index_in_dim(c, idx, 0, keepdims=False), outs_ct)
    x_const = [None if f else l for l, f in zip(x_t, x_float)]

    def f(p, c, xf, rd):
      it = iter(xf)
      leaves = [next(it) if fl else xc for fl, xc in zip(x_float, x_const)]
      return step_fn(p, c, jax.tree_util.tree_unflatten(x_def, leaves), rd)

    xf = [l for l, fl in zip(x_t, x_float) if fl]
    _, vjp = jax.vjp(f, params, carry_prev, xf, reading_prev)
    return vjp((carry_ct, tuple(acts_hat), out_ct))

  zeros_like = lambda t: jax.tree_util.tree_map(jnp.zeros_like, t)
  xf_leaves = [l for l, fl in zip(x_leaves, x_float) if fl]
  ctrl_init = (zeros_like(params),
               jax.tree_util.tree_map(
                   lambda c: jnp.zeros_like(c[0]), carries),
               jnp.zeros(readings_T.shape[1:], dtype),
               [jnp.zeros_like(l) for l in xf_leaves])

  def la_ct_fn(j, ctrl):
    reading_ct = ctrl[2]
    la_j = lax.dynamic_index_in_dim(state.log_alpha, j, 1, keepdims=False)
    _, vjp = jax.vjp(lambda la: readout(la)[0], la_j)
    (ct,) = vjp(reading_ct)
    return ct + lax.dynamic_index_in_dim(la_ct, j, 1, keepdims=False)

  def ctrl_fn(j, ctrl, push_hat, repl_hat, pop_hat):
    p_bar, c_bar, _, x_bar = ctrl
    dp, dc, dx, dr = ctrl_vjp(j, c_bar, (push_hat, repl_hat, pop_hat))
    p_bar = jax.tree_util.tree_map(jnp.add, p_bar, dp)
    x_bar = [lax.dynamic_update_index_in_dim(xb, d, j - 1, 0)
             for xb, d in zip(x_bar, dx)]
    return (p_bar, dc, dr, x_bar)

  (p_bar, c_bar, _, x_bar), _ = _backward_sweep(
      state, *acts_T, la_ct_fn, ctrl_fn, ctrl_init, precision, unroll)
  it = iter(x_bar)
  x_ct = [next(it) if fl else np.zeros(jnp.shape(l), jax.dtypes.float0)
          for l, fl in zip(x_leaves, x_float)]
  return p_bar, c_bar, jax.tree_util.tree_unflatten(x_def, x_ct)


_coupled.defvjp(_coupled_fwd, _coupled_bwd)


def run_coupled(step_fn, params, init_carry, xs, num_states, num_symbols,
                precision="highest", unroll=1):
  """Runs a controller and the stack together, t = 1..T.

  Controller step t sees the reading after t−1 updates (reading 0 is one-hot
  on ⊥), then update t uses the actions it returned.

  Args:
    step_fn: (params, carry, x_t, reading_prev_BxS) -> (carry_t,
      (push_t, repl_t, pop_t), out_t), with push_t/repl_t [B,Q,S,Q,S] and
      pop_t [B,Q,S,Q] log-weights in the reading's dtype.
    params: pytree of controller parameters (differentiable).
    init_carry: pytree, the controller's initial carry (differentiable).
    xs: pytree of batch-major inputs, leaves [B, T, ...]; float leaves are
      differentiable, integer leaves get float0 cotangents.
    num_states: Q. num_symbols: S.
    precision: matmul precision of the stack DP's contractions, forward and
      backward (`MATMUL_PRECISIONS`). The controller's own matmuls are
      step_fn's business (see models.ns_controller_step).
    unroll: `lax.scan` unroll factor of the forward and backward sweeps
      (same values; for launch-bound accelerators).

  Returns:
    outs: pytree of out_t stacked batch-major, leaves [B, T, ...].
    readings_BxT1xS, log_mass_BxT1 as in `run`.
  """
  if not callable(step_fn):
    raise ValueError("step_fn must be callable")
  if int(num_states) < 1 or int(num_symbols) < 1:
    raise ValueError(f"num_states and num_symbols must be >= 1, got "
                     f"{num_states}, {num_symbols}")
  leaves = jax.tree_util.tree_leaves(xs)
  if not leaves:
    raise ValueError("xs must contain at least one array [B, T, ...]")
  if any(jnp.ndim(l) < 2 for l in leaves):
    raise ValueError("every leaf of xs must be [B, T, ...]")
  bt = {tuple(jnp.shape(l)[:2]) for l in leaves}
  if len(bt) != 1:
    raise ValueError(f"xs leaves disagree on [B, T]: {sorted(bt)}")
  float_leaves = [l for l in jax.tree_util.tree_leaves((params, init_carry))
                  if jnp.issubdtype(jnp.asarray(l).dtype, jnp.floating)]
  dtype = jnp.result_type(*float_leaves) if float_leaves else jnp.float32
  xs_T = jax.tree_util.tree_map(lambda l: jnp.swapaxes(l, 0, 1), xs)
  # Validate the controller's outputs once, abstractly, before tracing scans.
  b = leaves[0].shape[0]
  reading0 = jax.ShapeDtypeStruct((b, int(num_symbols)), dtype)
  x0 = jax.tree_util.tree_map(lambda l: l[0], xs_T)
  try:
    out_shape = jax.eval_shape(step_fn, params, init_carry, x0, reading0)
  except (TypeError, ValueError) as err:
    raise ValueError(f"step_fn failed on (params, carry, x_t [B, ...], "
                     f"reading [B, S]): {err}") from err
  if not isinstance(out_shape, tuple) or len(out_shape) != 3:
    raise ValueError("step_fn must return (carry, (push, repl, pop), out)")
  _check_controller_actions(out_shape[1], b, int(num_states),
                            int(num_symbols), jnp.dtype(dtype))
  outs_T, log_alpha = _coupled(step_fn, int(num_states), int(num_symbols),
                               params, init_carry, xs_T, jnp.dtype(dtype),
                               check_precision(precision),
                               check_unroll(unroll))
  outs = jax.tree_util.tree_map(lambda o: jnp.swapaxes(o, 0, 1), outs_T)
  readings, log_mass = readout(log_alpha)
  return outs, readings, log_mass


# ---------------------------------------------------------------------------
# Straightforward log-space reference (plain autodiff) and Viterbi.
# ---------------------------------------------------------------------------


def _max_reduce(x, axis):
  """Max-plus ⊕ (Viterbi)."""
  return jnp.max(x, axis=axis)


def _reference_tables(push, repl, pop, reduce):
  """Direct transcription of the recurrence in log space (or max-plus).

  Carries the padded table lg[b, i, j, q, x, r, y] = log γ_{i,j} through a
  lax.scan and materialises every product term: O(T²·Q³·S²) memory per step,
  O(T³) under autodiff. Used as the test reference and for Viterbi.

  Returns:
    (log_gamma [B, T+1, T+1, Q, S, Q, S], log_alpha [B, T+1, Q, S]).
  """
  b, t, q, s = push.shape[:4]
  n = t + 1
  neg = jnp.asarray(-jnp.inf, push.dtype)
  lg0 = jnp.full((b, n, n, q, s, q, s), neg)
  la0 = jnp.full((b, n, q, s), neg).at[:, 0, 0, 0].set(0)
  idx = jnp.arange(n)

  def body(carry, inp):
    lg, la = carry
    j, pu, re, po = inp
    prev = lax.dynamic_index_in_dim(lg, j - 1, axis=2, keepdims=False)
    # R[i,q,x,r,y] = ⊕_{s,z} γ_{i,j−1}[q,x,s,z] ⊗ repl[s,z,r,y].
    rep = reduce(prev[..., None, None] + re[:, None, None, None],
                 axis=(4, 5))
    # M[k,t,y,r] = ⊕_{s,z} γ_{k,j−1}[t,y,s,z] ⊗ pop[s,z,r], 1 ≤ k ≤ j−2.
    m = reduce(prev[..., None] + po[:, None, None, None], axis=(4, 5))
    m = jnp.where(((idx >= 1) & (idx <= j - 2))[None, :, None, None, None],
                  m, neg)
    # P[i,q,x,r,y] = ⊕_{k,t} γ_{i,k}[q,x,t,y] ⊗ M[k,t,y,r].
    terms = (lg[:, :, :, :, :, :, :, None]            # b i k q x t y .
             + m[:, None, :, None, None])              # b . k . . t y r
    pp = reduce(terms, axis=(2, 5))                    # b i q x y r
    pp = jnp.swapaxes(pp, -1, -2)                           # b i q x r y
    col = jnp.where((idx <= j - 2)[None, :, None, None, None, None], rep, neg)
    col = jnp.where((idx <= j - 3)[None, :, None, None, None, None],
                    reduce(jnp.stack([col, pp]), axis=0), col)
    col = jnp.where((idx == j - 1)[None, :, None, None, None, None],
                    pu[:, None], col)
    lg = lax.dynamic_update_index_in_dim(lg, col, j, axis=2)
    la_j = reduce(la[:, :, :, :, None, None] + col, axis=(1, 2, 3))
    la = lax.dynamic_update_index_in_dim(la, la_j, j, axis=1)
    return (lg, la), None

  xs = (jnp.arange(1, t + 1), jnp.swapaxes(push, 0, 1),
        jnp.swapaxes(repl, 0, 1), jnp.swapaxes(pop, 0, 1))
  (lg, la), _ = lax.scan(body, (lg0, la0), xs)
  return lg, la


def run_reference(push, repl, pop):
  """Same contract as `run`, computed naively in log space.

  Differentiated by plain autodiff through the scan (O(T³) memory); only for
  tests and small inputs.
  """
  push, repl, pop = (jnp.asarray(a) for a in (push, repl, pop))
  _check_actions(push, repl, pop)
  return _reference_jit(push, repl, pop)


@jax.jit
def _reference_jit(push, repl, pop):
  """Jitted body of `run_reference`."""
  return readout(_reference_tables(push, repl, pop, _lse)[1])


PUSH, REPLACE, POP = "push", "replace", "pop"


def viterbi(push, repl, pop):
  """Most probable PDA run for each batch element (max-plus recurrence).

  Args:
    push, repl, pop: log-weights as for `run` (arrays; evaluated eagerly).

  Returns:
    A list of B pairs (actions, log_weight). `actions` lists T tuples
    (step, kind, from_state, to_state, symbol) in step order, kind one of
    "push" / "replace" / "pop"; symbol is the pushed symbol, the replacing
    symbol, or the popped symbol. log_weight is the run's total log-weight
    (−inf and an empty list if no run survives T updates).
  """
  push, repl, pop = (jnp.asarray(a) for a in (push, repl, pop))
  b, t, q, s = _check_actions(push, repl, pop)
  lg, la = jax.jit(functools.partial(_reference_tables, reduce=_max_reduce))(
      push, repl, pop)
  lg, la = np.asarray(lg, np.float64), np.asarray(la, np.float64)
  # backtrace's tables have a bottom row (time −1) first: empty here.
  lg = np.concatenate([np.full_like(lg[:, :1], -np.inf), lg], axis=1)
  pu, re, po = (np.asarray(a, np.float64) for a in (push, repl, pop))
  return [backtrace(lg[n], la[n], pu[n], re[n], po[n], t, False)
          for n in range(b)]


def _argmax(a):
  """Index tuple of the (first) maximum of `a`."""
  return np.unravel_index(int(np.argmax(a)), a.shape)


def backtrace(lg, la, push, repl, pop, t, bottom_row):
  """One best run from max-plus tables (shared with rns_stack.viterbi).

  Args:
    lg: [T+2, T+1, Q, S, Q, S], lg[i+1, j] = max log γ_{i,j}; row 0 is the
      bottom row (time −1) of rns_stack's fixed bottom, all −inf otherwise.
    la: [T+1, Q, S], max log α_j.
    push, repl, pop: one batch element's log-weights.
    t: number of updates T.
    bottom_row: whether row −1 is live (α_{−1} = e_{q0,⊥}, the fixed bottom).

  Returns:
    (actions, log_weight) as described in `viterbi`.
  """
  if t == 0:
    return [], 0.0
  best = la[t].max()
  if not np.isfinite(best):
    return [], -np.inf
  # α_j = max_{i,q,x} α_i ⊗ γ_{i,j}; α_{−1} = e (fixed) enters via row −1.
  alpha_rows = np.full((t + 2,) + la.shape[1:], -np.inf)
  alpha_rows[1:] = la
  if bottom_row:
    alpha_rows[0, 0, 0] = 0.0
  actions, todo = [], []
  r, y = _argmax(la[t])
  j = t
  # Peel γ's off α.
  while j > 0:
    cand = alpha_rows[:j + 1] + lg[:j + 1, j, :, :, r, y]   # rows −1..j−1
    i1, q, x = _argmax(cand)
    i = i1 - 1
    todo.append((i, j, q, x, r, y))
    if i == -1:
      break
    j, r, y = i, q, x
  while todo:
    i, j, q, x, r, y = todo.pop()
    if j == 0:
      continue
    if i == j - 1:
      actions.append((j, PUSH, q, r, y))
      continue
    # Replace candidate vs pop candidates (all in the final max table).
    rep = lg[i + 1, j - 1, q, x] + repl[j - 1, :, :, r, y]         # [s, z]
    best_rep = rep.max()
    best_pop, pop_terms = -np.inf, None
    ks = np.arange(max(i + 1, 0), j - 1)
    if len(ks):
      # [k, t, s, z]: γ_{i,k}[q,x,t,y] + γ_{k,j−1}[t,y,s,z] + pop[s,z,r].
      pop_terms = (lg[i + 1, ks, q, x, :, y][:, :, None, None]
                   + lg[ks + 1, j - 1, :, y] + pop[j - 1, :, :, r][None, None])
      best_pop = pop_terms.max()
    if best_rep >= best_pop:
      s_, z = _argmax(rep)
      actions.append((j, REPLACE, s_, r, y))
      todo.append((i, j - 1, q, x, s_, z))
    else:
      kk, t_, s_, z = _argmax(pop_terms)
      k = int(ks[kk])
      actions.append((j, POP, s_, r, z))
      todo.append((i, k, q, x, t_, y))
      todo.append((k, j - 1, t_, y, s_, z))
  actions.sort()
  return actions, float(best)


def replay_run(actions, push=None, repl=None, pop=None):
  """Replays a run (as returned by `viterbi`) on an explicit stack.

  Args:
    actions: list of (step, kind, from_state, to_state, symbol), steps 1..T.
    push, repl, pop: optional log-weights of ONE batch element ([T,Q,S,Q,S],
      [T,Q,S,Q,S], [T,Q,S,Q]) to total the run's log-weight.

  Returns:
    (stacks, log_weight): the stack (tuple, bottom first, ⊥ = 0) after each
    update 0..T and the total log-weight (None without weights).

  Raises:
    ValueError: if the run is not valid under the frozen-bottom semantics
      (wrong state, replacing ⊥, popping the symbol on ⊥, bad popped symbol).
  """
  return replay_with_heights(
      actions, push, repl, pop, min_replace_height=2, min_pop_height=3,
      replace_error="replaces the bottom symbol",
      pop_error="pops the symbol directly on the bottom")


def replay_with_heights(actions, push, repl, pop, min_replace_height,
                        min_pop_height, replace_error, pop_error):
  """`replay_run` with the stack heights replace / pop need (⊥ counts 1).

  Shared with rns_stack.replay_run (fixed bottom: 1 and 2). `replace_error`
  and `pop_error` end the ValueError for a replace / pop below its height.
  """
  stacks, state, total = [(0,)], 0, 0.0
  for n, (j, kind, q, r, y) in enumerate(actions):
    stack = stacks[-1]
    if j != n + 1:
      raise ValueError(f"action {n} has step {j}, expected {n + 1}")
    if q != state:
      raise ValueError(f"step {j} starts in state {q}, run is in {state}")
    x = stack[-1]
    if kind == PUSH:
      new, w = stack + (y,), None if push is None else push[j - 1][q, x, r, y]
    elif kind == REPLACE:
      if len(stack) < min_replace_height:
        raise ValueError(f"step {j} {replace_error}")
      new = stack[:-1] + (y,)
      w = None if repl is None else repl[j - 1][q, x, r, y]
    elif kind == POP:
      if len(stack) < min_pop_height:
        raise ValueError(f"step {j} {pop_error}")
      if y != x:
        raise ValueError(f"step {j} pops {y} but the top is {x}")
      new, w = stack[:-1], None if pop is None else pop[j - 1][q, x, r]
    else:
      raise ValueError(f"unknown action kind {kind!r} at step {j}")
    if w is not None:
      total += float(w)
    stacks.append(new)
    state = r
  return stacks, (None if push is None else total)
