"""The generalised nondeterministic stack: posterior shares, exact up to a flush.

A pure-array dynamic program (no Flax) for the stacks of the authors' later
models (rns-vrns-reference.md): the renormalising NS-RNN (RNS-RNN, ICLR 2022)
with unnormalised action weights and readings over (PDA state, top symbol),
and the bottom-symbol fix of ICLR 2023. With the frozen bottom and the
symbol reading it is also the CoNLL 2020 NS-RNN's default stack
(`models.run_ns_stack`, config.stack_table = "shares"): `ns_stack`'s scaled
table computes the same function but can flush in float32.

Variants (arguments, not forks):
  * ``bottom="fixed"`` (ICLR 2023, the default for new models): runs start in
    (q0, [⊥]); push is always allowed, replace is allowed on any top
    including ⊥, pop needs height ≥ 2. ``bottom="frozen"`` (CoNLL 2020 and
    ICLR 2022): ⊥ is never replaced or uncovered, update 1 is push-only.
  * ``reading="state"`` (RNS-RNN): ρ_j = softmax over the Q·S entries of
    log α_j, flattened (r, y). ``reading="symbol"``: softmax over y of
    logsumexp_r log α_j (the CoNLL 2020 reading).
  * normalised vs unnormalised actions is a transform of the controller's
    logits before the DP (`split_action_logits`); the DP takes any finite
    log-weights (−inf = weight zero).

Representation: posterior shares
--------------------------------
With unnormalised weights Σα_j drifts by hundreds of nats and, more
importantly, different (state, top) configurations, and different start
times i of the same column, differ by hundreds of nats: any one scale per
column (ns_stack's scaled-linear storage) then flushes the short spans to
zero. Here each γ entry is stored relative to the α's at both of its ends:

  H_{i,j}[q,x,r,y] = α_i[q,x] · γ_{i,j}[q,x,r,y] / α_j[r,y]   ∈ [0, 1],

the share of α_j[r,y] whose top element was pushed on (q, x) at time i (a
"backpointer" distribution: Σ_{i,q,x} H_{i,j}[q,x,r,y] = 1). log α_j is
kept in log space (column-sized). Every stored number and every kernel of
the recurrence is a share in [0, 1], so nothing overflows, and the only
flush is of shares below ~1e3 × the smallest normal float (≈1e-35, i.e. ~80
nats, in float32; ~700 nats in float64). The limit (found by an audit,
strict xfail tests in rns_stack_test): a flushed share is lost for good, so
a run that falls that far below the best run to the same (state, top) and
is later brought back by a larger weight (e.g. a replace of weight e^100
beside a push of weight 1, then a push of weight e^200 from the pushed
run's configuration) is missing from the result: readings off by up to 1
and log Σα off by the amount it came back by. Normalised actions and the
weight spreads of trained models mostly stay inside the limit; `log_stack`
computes the same function with the shares as logarithms, exact for any
finite log-weights and ~20x slower (config.stack_table = "log").
`share_margin` says, per batch element, whether a sweep stayed inside it:
above `exact_margin` (−40.2 nats in float32) no product came near the
flush and the values are exact up to rounding; below, use `log_stack`. All
table-sized work is matmuls of linear shares; only column-sized arrays are
exponentiated.

Recurrence for update j (log-weights pu, re, po of update j; times i, k run
over the rows the stack keeps: all of them, or j−D..j−2 for a window D):

  c_k[t,y]   = Σ_{i<k, q,x} H_{i,k}[q,x,t,y]      (share of α_k still usable)
  W[y,s,z]   = Σ_{k≤j−2, t} c_k[t,y] H_{k,j−1}[t,y,s,z]   (P(y under (s,z)))
  log α_j    = ⊕( ⊕_{q,x} a_{j−1}[q,x] + pu[q,x,r,y],              push
                  ⊕_{s,z} a_{j−1} + log c_{j−1}[s,z] + re[s,z,r,y], replace
                  ⊕_{s,z} a_{j−1} + log W[y,s,z] + po[s,z,r] )      pop
  H_{j−1,j}  = exp(a_{j−1}[q,x] + pu[q,x,r,y] − a_j[r,y])
  H_{i,j}    = Σ_{s,z} H_{i,j−1}[q,x,s,z] exp(a_{j−1}[s,z] + re − a_j[r,y])
             + Σ_{k,t} H_{i,k}[q,x,t,y] M̃_k[t,y,r],
  M̃_k[t,y,r] = Σ_{s,z} H_{k,j−1}[t,y,s,z] exp(a_{j−1}[s,z] + po[s,z,r] − a_j[r,y])

(a = log α). The bottom is one extra row, time −1: H_{−1,0} = one-hot at
(q0,⊥)→(q0,⊥) for the fixed bottom and 0 for the frozen one; α_0 = e_{q0,⊥}
in both. With the fixed bottom this is the note's bottom row b_j; with the
frozen one the zero row makes update 1 push-only and keeps ⊥ from being
uncovered (c_0 = 0) — the same code gives both semantics.

Storage: a square table on a common time axis (rows and columns share it),
column-major as in ns_stack: G[b, y, k, t, i, q, x] = H_{i,k}[q,x,t,y];
index = time + 1 (time −1 .. T). Column k is the contiguous block G[b, y, k]
(a step writes one block). The pop term is one matmul per (b, y),
M̃ᵀ [R, K·T] × G [K·T, I·Q·X], with the long axis as its output axis, and
M̃'s cotangent contracts the table's contiguous rows with the table as the
left operand, so neither direction transposes the table.
`limited_stack` runs the same step on a D × D sliding window;
`run_coupled_vectors` carries the VRNS-RNN's expected top vectors beside
the unlimited sweep (`vrns_stack`'s default), `limited_vrns` beside the
window.

Blocking (ns_stack's technique): the updates are split into up to 4 static
time blocks (on CPU up to 6 of ≥ 12 updates: `CPU_BLOCK_UPDATES`);
block [j0, j1) is one `lax.scan` over the time points ≤ j1, the only ones
it reads or writes, so the padded table is not swept in full at every
step. The sweeps keep the table in column chunks, one per block: the
columns block [j0, j1) writes hold rows ≤ j1 only (a column's rows are the
times before it), so its chunk stores those rows and no more, and the pop
matmul is one product per chunk on the rows it has. A square table holds
zeros in every row at or after its column, half of it, which the pop
matmul and M̃'s cotangent would read at every update; the chunks also need
no copy of the table at block boundaries (train step, n = 80, one CPU
core, one run: 1.09x best / 1.27x median at Q = S = 3, 1.07x at Q = S =
2; README). That is the CPU's default (`TABLE_LAYOUT`); accelerators and
the Pallas update kernels keep the square table. The column sums c_k are carried
(written with their column) rather than recomputed from the table, so the
pop matmul G·M̃ is the only table-sized work of an update.

Gradient: `run` and `run_coupled` have a custom VJP whose forward keeps the
final table, the column sums, log α̂, every update's M̃ (O(B·T²·Q²·S)) and
the column-sized residuals of every update's `_local` (its kernels, the
terms' softmax and W), and whose backward is one blocked reverse sweep.
Update j's column-sized part is differentiated on the final tables (update
j reads only columns < j, which never change after they are written;
ns-stack-gradient.md §3 "vjp-step"): the stack's part by `_local_bwd`, its
VJP written out from those residuals (a third fewer ops per update than
re-running it under `jax.vjp`; tested against `jax.vjp(_local)`), the
controller step of `run_coupled` with `jax.vjp`. The pop matmul is
transposed by hand, as in ns_stack: M̃'s cotangent is one matmul with the
table (contracting its rows), and the table's cotangent is never formed —
column k's share of it, Σ_{j'} W_{j'} M̃_{j'}[k] with W_{j'} the cotangent
of column j', is one matmul of a W table of all later updates with the
stored M̃'s, computed when the sweep reaches column k. Gradient memory is
O(T²) (table, W table, M̃'s), not the O(T³) of autodiff through a scan that
carries the table.

Precision: every contraction, forward and backward, takes the matmul
precision name of `ns_stack` ("highest" by default: reduced-precision
passes on GPUs / TPUs would cost the shares their accuracy).

Cost: O(B·T³·Q³·S²) time (pop, factorised through M̃) + O(B·T²·Q³·S³)
(replace), with ns_stack's constants (benchmarks/rns_stack.py --vs-ns).

Shape legend: B batch, T updates, N = T + 2 time points of the table axis,
Q states, S stack symbols, Y/X/Z symbols in roles, R destination state.
"""

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nsrnn_jax import ns_stack
from nsrnn_jax.ns_stack import backtrace
from nsrnn_jax.ns_stack import check_precision
from nsrnn_jax.ns_stack import check_unroll
from nsrnn_jax.ns_stack import lax_precision
from nsrnn_jax.ns_stack import mix_column as _mix_column
from nsrnn_jax.ns_stack import replay_with_heights
from nsrnn_jax.ns_stack import logsumexp_guarded as _lse  # -inf-safe
from nsrnn_jax.ns_stack import safe_log as _safe_log
from nsrnn_jax.ns_stack import time_blocks as _default_time_blocks

Array = jax.Array

__all__ = [
    "BOTTOMS", "READINGS", "FIXED", "FROZEN", "STATE", "SYMBOL",
    "split_action_logits", "readout", "initial_table", "update",
    "run", "run_coupled", "run_coupled_vectors", "run_log_space", "viterbi",
    "replay_run", "square_table",
    "validate_stack_config", "share_margin", "vector_share_margin",
    "exact_margin", "MARGIN_KIND", "check_num_updates",
]

FIXED, FROZEN = "fixed", "frozen"
BOTTOMS = (FIXED, FROZEN)
STATE, SYMBOL = "state", "symbol"
READINGS = (STATE, SYMBOL)


# ---------------------------------------------------------------------------
# Argument checks.
# ---------------------------------------------------------------------------


def _check_bottom(bottom):
  if bottom not in BOTTOMS:
    raise ValueError(f"bottom must be one of {BOTTOMS}, got {bottom!r}")


def _check_reading(reading):
  if reading not in READINGS:
    raise ValueError(f"reading must be one of {READINGS}, got {reading!r}")


def _check_actions(push, repl, pop):
  """Validates [B,T,Q,S,Q,S] / [B,T,Q,S,Q,S] / [B,T,Q,S,Q] log-weights."""
  if jnp.ndim(push) != 6:
    raise ValueError(f"push must be [B, T, Q, S, Q, S], got shape "
                     f"{jnp.shape(push)}")
  b, t, q, s = jnp.shape(push)[:4]
  if jnp.shape(push) != (b, t, q, s, q, s):
    raise ValueError(f"push must be [B, T, Q, S, Q, S], got shape "
                     f"{jnp.shape(push)}")
  if jnp.shape(repl) != jnp.shape(push):
    raise ValueError(f"repl must have push's shape {jnp.shape(push)}, got "
                     f"{jnp.shape(repl)}")
  if jnp.shape(pop) != (b, t, q, s, q):
    raise ValueError(f"pop must be [B, T, Q, S, Q] = {(b, t, q, s, q)}, got "
                     f"{jnp.shape(pop)}")
  if min(b, q, s) < 1:
    raise ValueError(f"push has shape {jnp.shape(push)}: B, Q and S must be "
                     ">= 1")
  dtypes = {jnp.result_type(a) for a in (push, repl, pop)}
  if len(dtypes) != 1:
    raise ValueError(f"push, repl, pop must share one dtype, got {dtypes}")
  (dtype,) = dtypes
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"actions must be float log-weights, got {dtype}")
  for name, a in (("push", push), ("repl", repl), ("pop", pop)):
    check_no_nan_or_inf(name, a)
  return b, t, q, s


def check_no_nan_or_inf(name: str, log_weights) -> None:
  """ValueError if concrete `log_weights` hold NaN or +inf (−inf, a zero
  weight, is allowed; a traced array is not checked)."""
  if not isinstance(log_weights, jax.core.Tracer):
    v = np.asarray(log_weights)
    if np.isnan(v).any() or (v == np.inf).any():
      raise ValueError(f"{name} contains NaN or +inf log-weights")


# ---------------------------------------------------------------------------
# Actions and readings.
# ---------------------------------------------------------------------------


def split_action_logits(logits_BxA, num_states, num_symbols, normalize):
  """Controller logits → (push, repl, pop) log-weights (rns-vrns §1.1).

  The flat output is viewed as rows ``q·S + x`` and columns
  ``[push r·S+y | replace QS + r·S+y | pop 2QS + r]``.

  Args:
    logits_BxA: [..., Q·S·(2QS+Q)].
    num_states, num_symbols: Q, S.
    normalize: log-softmax each row (NS, NS+S) or use the logits as
      log-weights directly (RNS: NS+U, NS+S+U).

  Returns:
    push [..., Q, S, Q, S], repl [..., Q, S, Q, S], pop [..., Q, S, Q].
  """
  q, s = num_states, num_symbols
  lead = logits_BxA.shape[:-1]
  rows = logits_BxA.reshape(lead + (q * s, 2 * q * s + q))
  if normalize:
    rows = jax.nn.log_softmax(rows, axis=-1)
  push = rows[..., :q * s].reshape(lead + (q, s, q, s))
  repl = rows[..., q * s:2 * q * s].reshape(lead + (q, s, q, s))
  pop = rows[..., 2 * q * s:].reshape(lead + (q, s, q))
  return push, repl, pop


def readout(log_alpha_xQxS, reading=STATE):
  """Reading ρ and log Σα from log α (any leading axes).

  Returns:
    (reading [..., Q·S] (state, flattened (r, y)) or [..., S] (symbol),
    log_mass [...]). A time at which every run died reads all zeros.
  """
  _check_reading(reading)
  lead = log_alpha_xQxS.shape[:-2]
  if reading == STATE:
    logits = log_alpha_xQxS.reshape(lead + (-1,))
  else:
    logits = _lse(log_alpha_xQxS, axis=-2)
  log_mass = _lse(logits, axis=-1)
  alive = jnp.isfinite(log_mass)[..., None]
  safe = jnp.where(alive, log_mass[..., None], 0)
  out = jnp.where(alive, jnp.exp(jnp.where(alive, logits, 0) - safe), 0)
  return out, log_mass


# ---------------------------------------------------------------------------
# The update (shared by the unlimited table and the window of limited_stack).
# ---------------------------------------------------------------------------


def _flush(dtype):
  """Shares below this are treated as zero (never divided by)."""
  return float(jnp.finfo(dtype).tiny) * 1e3


def _exp_share(x, ok, dtype):
  """exp(x) where `ok` (x ≤ ~0 up to the 1/flush of masked shares), else 0.

  Double `where` so that masked entries (x may be ±inf or NaN-prone) give a
  zero gradient; the clamp keeps a kernel that multiplies shares ≤ flush·…
  finite.
  """
  cap = float(-np.log(_flush(dtype)) - 2.0)
  x = jnp.where(ok, x, 0)
  return jnp.where(ok, jnp.exp(jnp.minimum(x, cap)), 0)


def initial_table(batch_size, num_points, num_states, num_symbols, bottom,
                  corner, dtype=jnp.float32):
  """A share table with only the bottom entry set.

  Args:
    batch_size, num_points: B and the axis length N.
    num_states, num_symbols: Q, S.
    bottom: "fixed" (H_{−1,0} one-hot at (q0,⊥)→(q0,⊥)) or "frozen" (zeros).
    corner: axis index of time 0 (the bottom row is corner − 1); ignored if
      < 1 (no room for the bottom entry, e.g. a window of D = 1).
    dtype: float dtype.

  Returns:
    G [B, Y, N (column k), T (state t), N (row i), Q, X]: column-major,
    G[b, y, k, t, i, q, x] = H_{i,k}[q,x,t,y].
  """
  _check_bottom(bottom)
  batch_size, num_points, num_states, num_symbols = ns_stack.check_sizes(
      batch_size=batch_size, num_points=num_points, num_states=num_states,
      num_symbols=num_symbols)
  g = jnp.zeros((batch_size, num_symbols, num_points, num_states, num_points,
                 num_states, num_symbols), dtype)
  if bottom == FIXED and corner >= 1:
    g = g.at[:, 0, corner, 0, corner - 1, 0, 0].set(1)
  return g


def _finite_max(x, axis):
  """Max over `axis` of the finite entries (0 if none); a gradient constant."""
  m = jnp.max(jnp.where(jnp.isfinite(x), x, -jnp.inf), axis=axis)
  return lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0))


# How an update contracts its operands (every stack built on it: the
# NS-RNN's shares table, the RNS-RNN, the memory-limited stack): "dot"
# (lax.dot_general) or "reduce" (a multiply and a sum, which XLA can fuse
# with the elementwise work around it: fewer kernels per update, and full
# float32 whatever the matmul precision). COLUMN_CONTRACTIONS: the
# column-sized ones of `_local` and `_local_bwd` (W, the replace rows, M̃
# and their cotangents);
# TABLE_CONTRACTIONS: the table-sized ones (the pop product G·M̃, and in
# the backward M̃'s cotangent and the W-table product), whose few output
# rows (R = Q) pad a GEMM kernel's tile. An experiment for GPUs, where an
# update is a chain of small kernels each with a floor of a few µs (docs/benchmarks.md,
# the H100 profile); read when an update is traced, so set them before
# tracing (benchmarks/train_step.py --contractions_by_sum). "dot" until
# "reduce" is measured faster on a GPU (on 2 CPU cores it is slower).
COLUMN_CONTRACTIONS = "dot"
TABLE_CONTRACTIONS = "dot"
CONTRACTION_MODES = ("dot", "reduce")

# How the sweeps over the unlimited table compute an update: "xla" (XLA
# ops) or "pallas" (`stack_kernels`: the whole forward update, column write
# included, as one Pallas kernel; in the backward, the table-sized part (W
# table write, column cotangent, M̃'s cotangent) as one and `_local_bwd` as
# another). Triton on a GPU, Pallas's interpreter on CPU, where it is only
# for tests. Same values and gradients. An experiment for GPUs (issue 11),
# not measured on one yet; read when the sweeps are traced.
UPDATE_KERNELS = "xla"
UPDATE_KERNEL_MODES = ("xla", "pallas")


def dot_by_sum(lhs, rhs, dimension_numbers):
  """`lax.dot_general(lhs, rhs, dimension_numbers)` as a multiply and a sum.

  Same output layout (batch axes, then lhs's free axes, then rhs's); the
  contracted axes go last so that the sum runs over contiguous memory.
  """
  (lc, rc), (lb, rb) = dimension_numbers
  lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
  rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
  lhs = jnp.transpose(lhs, list(lb) + lf + list(lc))
  rhs = jnp.transpose(rhs, list(rb) + rf + list(rc))
  nb = len(lb)
  batch = lhs.shape[:nb]
  l_free, r_free = lhs.shape[nb:nb + len(lf)], rhs.shape[nb:nb + len(rf)]
  size = int(np.prod(lhs.shape[nb + len(lf):], dtype=np.int64))
  lhs = lhs.reshape(batch + (int(np.prod(l_free, dtype=np.int64)), 1, size))
  rhs = rhs.reshape(batch + (1, int(np.prod(r_free, dtype=np.int64)), size))
  return jnp.sum(lhs * rhs, axis=-1).reshape(batch + l_free + r_free)


def _contraction_mode(name):
  mode = globals()[name]
  if mode not in CONTRACTION_MODES:
    raise ValueError(f"rns_stack.{name} must be one of {CONTRACTION_MODES}, "
                     f"got {mode!r}")
  return mode


# How the sweeps (XLA path) store the share table: "chunks", one column
# chunk per time block holding only the rows its columns can have (CPU:
# train step 1.09x best / 1.27x median at Q = S = 3 on one core, by fewer
# reads and no table copies at block boundaries), or "square" (one array:
# one pop matmul and one M̃ cotangent product per update instead of one
# per chunk, fewer ops for launch-bound accelerators, where the chunks are
# not measured yet). "auto": chunks on CPU, square elsewhere. The Pallas
# update kernels always use the square table.
TABLE_LAYOUT = "auto"
TABLE_LAYOUTS = ("auto", "chunks", "square")


def _chunked_table():
  """True: the sweeps keep the table in column chunks (`TABLE_LAYOUT`)."""
  if TABLE_LAYOUT not in TABLE_LAYOUTS:
    raise ValueError(f"rns_stack.TABLE_LAYOUT must be one of "
                     f"{TABLE_LAYOUTS}, got {TABLE_LAYOUT!r}")
  if _update_kernels():
    return False
  if TABLE_LAYOUT == "auto":
    return jax.default_backend() == "cpu"
  return TABLE_LAYOUT == "chunks"


def _update_kernels():
  """True: the sweeps run on `stack_kernels` (UPDATE_KERNELS = "pallas")."""
  if UPDATE_KERNELS not in UPDATE_KERNEL_MODES:
    raise ValueError(f"rns_stack.UPDATE_KERNELS must be one of "
                     f"{UPDATE_KERNEL_MODES}, got {UPDATE_KERNELS!r}")
  return UPDATE_KERNELS == "pallas"


def _column_dot(lhs, rhs, dimension_numbers, prec):
  """A column-sized contraction, as `COLUMN_CONTRACTIONS` says."""
  if _contraction_mode("COLUMN_CONTRACTIONS") == "reduce":
    return dot_by_sum(lhs, rhs, dimension_numbers)
  return lax.dot_general(lhs, rhs, dimension_numbers, precision=prec)


def _table_dot(lhs, rhs, rhs_contracting, prec):
  """A table-sized product [B, M, K] · rhs -> [B, M, N], as
  `TABLE_CONTRACTIONS` says; rhs is [B, K, N] (rhs_contracting = 1) or
  [B, N, K] (2). As a sum, each operand keeps its own axis order (the
  table is never transposed, not even inside a fusion)."""
  if _contraction_mode("TABLE_CONTRACTIONS") == "reduce":
    if rhs_contracting == 1:                     # joint [B, M, K, N]
      return jnp.sum(lhs[:, :, :, None] * rhs[:, None], axis=2)
    return jnp.sum(lhs[:, :, None, :] * rhs[:, None], axis=3)   # [B,M,N,K]
  return lax.dot_general(lhs, rhs, (((2,), (rhs_contracting,)), ((0,), (0,))),
                         precision=prec)


def _column_views(prev, cs, p, ring=False):
  """What update j contracts of column j−1 and the column sums.

  Shared by `_local` and `_local_bwd` (the backward rebuilds these views
  rather than keeping them as residuals: they are table-row-sized).

  Returns:
    left [N]: the columns k ≤ j−2 (in time order those before p; in a ring
      window every column but p, since the slot after p holds the oldest
      time, not a later one);
    c_left [b, y, k, t]: their column sums (0 elsewhere);
    c_prev [b, s, z]: column j−1's sums c_{j−1}[s, z];
    prev_t [b, y, (z, s), (k, t)]: prev with its rows (times k, states t)
      last, one copy that both of its contractions take as it stands (XLA
      made one transposed copy per einsum).
  """
  idx = jnp.arange(cs.shape[2])
  left = idx != p if ring else idx < p
  c_left = jnp.where(left[None, None, :, None], cs, 0)
  c_prev = jnp.swapaxes(
      lax.dynamic_index_in_dim(cs, p, axis=2, keepdims=False), 1, 2)
  b, nz, ns_, nk, nt, ny = prev.shape
  prev_t = jnp.transpose(prev, (0, 5, 1, 2, 3, 4)).reshape(
      b, ny, nz * ns_, nk * nt)
  return left, c_left, c_prev, prev_t


def _local(prev, cs, p, a_prev_BxQxS, push_BxQxSxQxS, repl_BxQxSxQxS,
           pop_BxQxSxQ, prec, ring=False, residuals=False, vectors=None,
           margin=False):
  """The column-sized part of update j (everything but the pop matmul).

  Args:
    prev: column j−1, H_{i,j−1}[q,x,s,z] at [b, z, s, i, q, x].
    cs: column sums c_k[t,y] = Σ_{i,q,x} H_{i,k}[q,x,t,y], [b, y, k, t],
      on the table's time axis (entries k ≥ p are ignored).
    p, a_prev_BxQxS, actions, ring: as for `update`.
    prec: lax precision of the contractions.
    vectors: None, or (prev_v [b, z, s, A, M], v [b, M]): column j−1 of a
      vector table in the cutoff basis (`update`'s ``vectors``) and the
      pushed vector; its column j but for the pop term (`_vector_local`)
      is then added as a last output.
    margin: also return, last, the product margin [b] of this update's
      column-sized contractions (`_local_margin`); the caller adds its
      pop's (`_pop_margin`).

  Returns:
    (col_local [b,y,r,i,q,x] (replace rows + push row), mt [b,y,r,k,t]
    (M̃_k[t,y,r]; zero for k ≥ p and where c_k flushed), a_hat_BxQxS,
    inc_B); column j = col_local + Σ_{k,t} mt[b,y,r,k,t] G[b,y,k,t,i,q,x].
    With `residuals`, a fifth entry: what `_local_bwd` needs of this update
    (the kernels, the terms' softmax over F and W; column-sized); with
    `vectors`, then the vector column; with `margin`, last, the margin
    (`_optional_outputs` names them).
  """
  dtype = prev.dtype
  flush = _flush(dtype)
  left, c_left, c_prev, prev_t = _column_views(prev, cs, p, ring)
  b, nz, ns_, nk, nt, ny = prev.shape
  # W[y,s,z] = Σ_{k,t} c_k[t,y] H_{k,j−1}[t,y,s,z].
  w = jnp.swapaxes(_column_dot(
      prev_t, c_left.reshape(b, ny, nk * nt),
      (((3,), (2,)), ((0, 1), (0, 1))), prec).reshape(
          b, ny, nz, ns_), 2, 3)                               # b y s z
  a_prev = a_prev_BxQxS
  ok_r = c_prev > flush
  a_rep = jnp.where(ok_r, a_prev + _safe_log(jnp.where(ok_r, c_prev, 1)),
                    -jnp.inf)
  ok_w = w > flush
  log_w = jnp.where(ok_w, jnp.log(jnp.where(ok_w, w, 1)), -jnp.inf)  # b y s z
  pu, re, po = push_BxQxSxQxS, repl_BxQxSxQxS, pop_BxQxSxQ
  nq, nx = a_prev.shape[1:]
  # The three families of terms of α_j (push from (q,x), replace and pop
  # from (s,z)) side by side on one axis F of 3·Q·S, as [b, r, y, F]: one
  # shift, one logsumexp and one exp serve all three (fewer, larger ops
  # per update than one set per family).
  # acts: the actions; lhs: what each family adds to them (α̂_{j−1}, with
  # log c_{j−1} for replace and log W for pop).
  def flat(x):                                  # [b, r, y, q, x] -> F part
    return x.reshape(x.shape[:3] + (nq * nx,))
  po_ry = jnp.broadcast_to(jnp.transpose(po, (0, 3, 1, 2))[:, :, None],
                           (b, po.shape[3], ny, nq, nx))
  acts = jnp.concatenate([flat(jnp.transpose(pu, (0, 3, 4, 1, 2))),
                          flat(jnp.transpose(re, (0, 3, 4, 1, 2))),
                          flat(po_ry)], axis=-1)                  # b r y F
  a_f = a_prev.reshape(b, 1, 1, nq * nx)
  lhs = jnp.concatenate(
      [jnp.broadcast_to(a_f, (b, 1, ny, nq * nx)),
       jnp.broadcast_to(a_rep.reshape(b, 1, 1, -1), (b, 1, ny, nq * nx)),
       (log_w.reshape(b, ny, nq * nx) + a_prev.reshape(b, 1, -1))[:, None]],
      axis=-1)                                                    # b 1 y F
  m = _finite_max((lhs + acts).reshape(b, -1), 1)
  acts = acts - m[:, None, None, None]
  terms = lhs + acts
  a_j = _lse(terms, axis=3)                                       # b r y
  # The kernels exp(α̂_{j−1} + action − α_j) of all three families at once;
  # masked where the term is zero (−inf: a flushed c_{j−1} or W) or α_j is.
  x = jnp.concatenate([a_f] * 3, axis=-1) + acts - a_j[..., None]
  ok = jnp.isfinite(terms) & jnp.isfinite(x)
  kern = _exp_share(x, ok, dtype)
  fs = nq * nx
  push_row = jnp.swapaxes(kern[..., :fs], 1, 2).reshape(
      b, ny, -1, nq, nx)                                          # b y r q x
  # Replace rows: prev ⊗ K^R (K^R ≤ 1/c_prev; masked where c_prev flushed),
  # the weights as [b, (y, r), (z, s)] for `_mix_column`.
  k_rep = jnp.transpose(kern[..., fs:2 * fs].reshape(b, -1, ny, nq, nx),
                        (0, 2, 1, 4, 3)).reshape(b, -1, nx * nq)
  col = _mix_column(k_rep, prev.reshape((b, -1) + prev.shape[3:]), prec,
                    _column_dot).reshape((b, ny, -1) + prev.shape[3:])
  # Pop rows: M̃_k[t,y,r] = Σ_{s,z} H_{k,j−1}[t,y,s,z] K^P[y,s,z,r].
  k_pop = jnp.transpose(kern[..., 2 * fs:].reshape(b, -1, ny, nq, nx),
                        (0, 2, 1, 4, 3)).reshape(b, ny, -1, nx * nq)  # b y r zs
  # [b, y, r, k, t]: the pop matmul's left operand as it stands ([R, K·T]
  # per (b, y); 1.2x faster on XLA:CPU than contracting a [K·T, R] operand).
  mt = _column_dot(k_pop, prev_t, (((3,), (2,)), ((0, 1), (0, 1))),
                   prec).reshape(b, ny, -1, nk, nt)
  mt = jnp.where((c_left > flush)[:, :, None], mt, 0)
  # The push row goes in as a one-row slice update: a one-hot product here
  # made XLA recompute the push row per table entry and, in the backward,
  # reduce the column's cotangent over its rows (train step 1.14x faster
  # without, Q = S = 2 on CPU).
  row = lax.dynamic_slice_in_dim(col, p, 1, axis=3)
  col = lax.dynamic_update_slice_in_dim(col, row + push_row[:, :, :, None],
                                        p, axis=3)
  log_z = _lse(a_j.reshape(b, -1), axis=1)                        # b
  alive = jnp.isfinite(log_z)
  a_hat = jnp.where(alive[:, None, None],
                    a_j - jnp.where(alive, log_z, 0)[:, None, None], -jnp.inf)
  out = (col, mt, a_hat, log_z + m)
  if residuals:
    # Each term's share of α_j (the softmax that a_j's logsumexp weighs).
    sm = jnp.where(ok, jnp.exp(jnp.where(ok, terms - a_j[..., None], 0)), 0)
    # d kern / d x: kern, but zero where `_exp_share` clamped x.
    kd = jnp.where(x < float(-np.log(flush) - 2.0), kern, 0)
    # One stacked array (one write per update into the scan's outputs).
    out += ((jnp.stack([kern, kd, sm]), w),)
  if vectors is not None:
    out += (_vector_local(kern, *vectors, prec),)
  if margin:
    out += (_local_margin(prev, prev_t, c_left, x, ok, nq, nx, vectors),)
  return out


def _log_min_positive(v):
  """log of the smallest positive entry of each v[b] (inf if none)."""
  return _log_min(v.reshape(v.shape[0], -1), 1)


def _log_or_inf(v):
  """log v where v > 0, +inf elsewhere (a zero factor forms no product)."""
  pos = v > 0
  return jnp.where(pos, jnp.log(jnp.where(pos, v, 1)), jnp.inf)


def _log_min(v, axis, where=True):
  """log of the least positive entry of v over `axis` (+inf if none), of
  the entries `where` allows: the minimum first, then one log per output
  (a log per entry made the window's margin sweep ~7x slower)."""
  return _log_or_inf(jnp.min(jnp.where((v > 0) & where, v, jnp.inf),
                             axis=axis))


def _half_least(*log_products):
  """Half the least of some [b, ...] log-products, per batch element [b]."""
  return 0.5 * functools.reduce(jnp.minimum, [
      jnp.min(lp.reshape(lp.shape[0], -1), axis=1) for lp in log_products])


def _local_margin(prev, prev_t, c_left, x, ok, nq, nx, vectors=None):
  """Update j's product margin [b], but for its pop products (`_pop_margin`).

  Each contraction Σ_k A[.., k] B[k, ..] forms the products A·B over every
  k; the least nonzero one is min over k of (the least nonzero entry of A
  at k + that of B at k), in logs, so one column-sized reduction per
  operand bounds every product a contraction forms. This update's:
  W = Σ_{k,t} c_k[t,y] H_{k,j−1}[t,y,s,z]; the replace rows
  Σ_{s,z} K^R[y,r,z,s] H_{i,j−1}[q,x,s,z]; M̃ = Σ_{s,z} H_{k,j−1}[t,y,s,z]
  K^P[y,s,z,r]; with `vectors` the vector table's replace rows and the
  push row's (Σ_{q,x} K^U) v_j. Kernels count by their exponents x (their
  exact logs, even where exp(x) underflows). A value stored as it is (the
  push row K^U; the pushed vector) counts as its own product with 1, and
  every kernel counts as exact_margin + (cap − x), above exact_margin
  exactly when the kernel is not clamped (`_exp_share`).

  Args:
    prev: column j−1 [b, z, s, i, q, x], and as `_column_views`' prev_t
      [b, y, (z, s), (k, t)] (its rows last: W's and M̃'s reductions run
      along it, 1.3x faster than across prev); c_left: the column sums
      of the columns k ≤ j−2 [b, y, k, t] (0 elsewhere); x, ok: the
      kernels' exponents [b, r, y, F] and where they are nonzero (F: push (q, x),
      replace and pop (s, z), Q·S each); nq, nx: Q, S.
    vectors: None, or `_local`'s (prev_v [b, z, s, A, M], v [b, M]).
  """
  b, nr, ny = x.shape[:3]
  dtype = prev.dtype
  c_kt = c_left.reshape(b, ny, 1, -1)                         # b y 1 (k t)
  xk = jnp.where(ok, x, jnp.inf).reshape(b, nr, ny, 3, nq, nx)
  x_push = jnp.min(xk[:, :, :, 0].reshape(b, -1), axis=1)            # b
  x_rep = jnp.min(xk[:, :, :, 1], axis=(1, 2))                     # b s z
  x_pop = jnp.swapaxes(jnp.min(xk[:, :, :, 2], axis=1), 2, 3)    # b y z s
  # W: c_k[t,y] by column j−1's row (k, t, y) least over (s, z).
  w = _log_or_inf(c_kt[:, :, 0]) + _log_min(prev_t, 2)           # b y (k t)
  rep = x_rep + jnp.swapaxes(_log_min(prev, (3, 4, 5)), 1, 2)
  # M̃: its rows (k, t) where c_k[t,y] flushed are zeroed, not used.
  pop = x_pop.reshape(b, ny, -1) + _log_min(prev_t, 3,
                                            c_kt > _flush(dtype))  # b y (z s)
  products = [w, rep, pop, x_push[:, None]]       # the push row: K^U · 1
  cap = float(-np.log(_flush(dtype)) - 2.0)
  x_max = jnp.max(jnp.where(ok, x, -jnp.inf).reshape(b, -1), axis=1)
  headroom = exact_margin(dtype) + cap - x_max
  if vectors is not None:
    prev_v, vec = vectors
    log_vec = _log_min_positive(vec)
    products += [
        x_rep + jnp.swapaxes(_log_min(prev_v, (3, 4)), 1, 2),
        x_push + log_vec, log_vec]
  return jnp.minimum(_half_least(*products), headroom)


def _pop_margin(mt, row_min):
  """The product margin [b] of a pop Σ_{k,t} M̃[y,r,k,t] G[y,k,t,...]:
  M̃ [b, y, r, k, t] and row_min [b, y, k, t], the log of the least
  nonzero entry of each table row (`_row_min`)."""
  return _half_least(_log_min(mt, 2) + row_min)


def _row_min(g):
  """log of the least nonzero entry of each row (y, k, t) of a table
  [b, y, k, t, ...] over its other axes: [b, y, k, t] (+inf if none)."""
  return _log_min(g.reshape(g.shape[:4] + (-1,)), -1)


def _optional_outputs(parts, residuals, vectors, margin):
  """`_local`'s optional outputs by name: (residuals, the vector column,
  the margin), each None where not asked for (they follow its first four
  outputs in that order)."""
  rest = list(parts[4:])
  return tuple(rest.pop(0) if asked else None
               for asked in (residuals, vectors, margin))


def _counted(lo_j, j, num_updates):
  """Update j's margin lo_j [B], or +inf where j is past num_updates[b]
  (padding: the margin of the actions' first num_updates[b] updates)."""
  if num_updates is None:
    return lo_j
  return jnp.where(j <= num_updates, lo_j, jnp.inf)


def _vector_local(kern, prev_v, vec, prec):
  """The vector table's column j but for its pop term, from the kernels.

  The vector shares follow H's kernels (see `update`): the replace mix of
  column j−1, then the push row summed over (q, x) times the pushed vector,
  at every cutoff (all are ≤ j−1, the push row's time).

  Args:
    kern: `_local`'s kernels [b, r, y, F] (F = push (q,x), replace and pop
      (s,z), each Q·S).
    prev_v: column j−1 of the vector table, [b, z, s, A, M].
    vec: the pushed vector v_j [b, M].
    prec: lax precision.

  Returns:
    [b, y, r, A, M].
  """
  b, nr, ny, f3 = kern.shape
  fs = f3 // 3
  nz, ns_ = prev_v.shape[1:3]
  k_rep = jnp.transpose(kern[..., fs:2 * fs].reshape(b, nr, ny, ns_, nz),
                        (0, 2, 1, 4, 3)).reshape(b, ny * nr, nz * ns_)
  col_v = _mix_column(k_rep, prev_v.reshape((b, -1) + prev_v.shape[3:]),
                      prec, _column_dot).reshape((b, ny, nr)
                                                 + prev_v.shape[3:])
  push_sum = jnp.swapaxes(jnp.sum(kern[..., :fs], axis=-1), 1, 2)  # b y r
  push_v = push_sum[..., None] * vec[:, None, None]
  return col_v + push_v[:, :, :, None]


def _local_bwd(prev, cs, p, a_hat, res, cts, prec, kern_ct=None,
               ring=False):
  """The VJP of `_local` from its forward residuals.

  The backward sweep would otherwise re-run update j's column-sized part
  under `jax.vjp` to rebuild what this reads from `res`; written out, the
  backward does about a third fewer ops per update. Checked against
  `jax.vjp(_local)` (tests/rns_stack_test.py), masks and flushes included.

  Args:
    prev, cs, p: as for `_local` (final tables: column p and the column
      sums are as update j read them).
    a_hat: update j's normalised log α̂_j [b, r, y].
    res: `_local(..., residuals=True)`'s fifth output ([kern, kd, sm]
      stacked, w).
    cts: cotangents of (col_local, mt, a_hat, inc).
    prec: lax precision.
    kern_ct: None, or a cotangent [b, r, y, F] of the kernels from their
      other uses (the vector column, `_vector_local`), added to theirs.
    ring: as for `_local` (a window's ring of time slots).

  Returns:
    Cotangents of (prev, cs, a_prev, push, repl, pop).
  """
  (kern, kd, sm), w = list(res[0]), res[1]
  col_ct, mt_ct, a_hat_ct, inc_ct = cts
  dtype = prev.dtype
  flush = _flush(dtype)
  b, nz, ns_, nk, nt, ny = prev.shape
  nr = kern.shape[1]
  fs = nz * ns_
  left, c_left, c_prev, prev_t = _column_views(prev, cs, p, ring)
  # a_hat = a_j − log_z, log_z = logsumexp(a_j), inc = log_z + m.
  alive = jnp.isfinite(jnp.max(a_hat, axis=(1, 2)))              # b
  e = jnp.exp(a_hat)                                               # b r y
  lz_ct = inc_ct - jnp.sum(a_hat_ct, axis=(1, 2))
  aj_ct = jnp.where(alive[:, None, None],
                    a_hat_ct + e * lz_ct[:, None, None], 0)        # b r y
  # The push row (row p of col_local) and the two mixes of prev.
  push_ct = lax.dynamic_index_in_dim(col_ct, p, axis=3, keepdims=False)
  col_l = col_ct.reshape(b, ny * nr, -1)                           # b yr L
  prev_l = prev.reshape(b, fs, -1)                                 # b zs L
  k_rep = jnp.transpose(kern[..., fs:2 * fs].reshape(b, nr, ny, ns_, nz),
                        (0, 2, 1, 4, 3)).reshape(b, ny * nr, fs)
  k_rep_ct = _column_dot(col_l, prev_l, (((2,), (2,)), ((0,), (0,))),
                         prec)                                      # b yr zs
  d_prev = _column_dot(k_rep, col_l, (((1,), (1,)), ((0,), (0,))),
                       prec).reshape(prev.shape)
  mt_ct = jnp.where((c_left > flush)[:, :, None], mt_ct, 0).reshape(
      b, ny, nr, nk * nt)
  k_pop = jnp.transpose(kern[..., 2 * fs:].reshape(b, nr, ny, ns_, nz),
                        (0, 2, 1, 4, 3)).reshape(b, ny, nr, fs)
  k_pop_ct = _column_dot(mt_ct, prev_t, (((3,), (3,)), ((0, 1), (0, 1))),
                         prec)                                      # b y r zs
  prev_t_ct = _column_dot(k_pop, mt_ct, (((2,), (2,)), ((0, 1), (0, 1))),
                          prec)                                     # b y zs kt
  # The kernels' cotangents on [b, r, y, F] (F = push (q,x), replace and
  # pop (s,z)), then through kern = exp(x) (zero where masked or clamped).
  def to_ryf(x_byrzs):                       # [b, y, r, z, s] -> [b, r, y, F]
    return jnp.transpose(x_byrzs, (0, 2, 1, 4, 3)).reshape(b, nr, ny, fs)
  kern_ct_all = jnp.concatenate(
      [jnp.swapaxes(push_ct, 1, 2).reshape(b, nr, ny, fs),
       to_ryf(k_rep_ct.reshape(b, ny, nr, nz, ns_)),
       to_ryf(k_pop_ct.reshape(b, ny, nr, nz, ns_))], axis=-1)
  if kern_ct is not None:
    kern_ct_all = kern_ct_all + kern_ct
  x_ct = kern_ct_all * kd
  # x = α̂_{j−1}[source] + action − a_j; a_j = logsumexp_F(terms) with
  # terms = lhs + action (lhs: α̂_{j−1}, + log c_{j−1} for replace, + log W
  # for pop).
  aj_ct = aj_ct - jnp.sum(x_ct, axis=3)
  terms_ct = aj_ct[..., None] * sm
  acts_ct = x_ct + terms_ct                                         # b r y F
  lhs_ct = jnp.sum(terms_ct, axis=1)                                # b y F
  d_a = (jnp.sum(x_ct, axis=(1, 2)).reshape(b, 3, fs).sum(axis=1)
         + jnp.sum(lhs_ct[..., :fs], axis=1)
         + jnp.sum(lhs_ct[..., 2 * fs:], axis=1))                    # b F/3
  ok_r = c_prev > flush
  rep_ct = jnp.where(ok_r, jnp.sum(lhs_ct[..., fs:2 * fs], axis=1).reshape(
      b, ns_, nz), 0)                                               # b s z
  d_a = d_a.reshape(b, ns_, nz) + rep_ct
  c_prev_ct = jnp.where(ok_r, rep_ct / jnp.where(ok_r, c_prev, 1), 0)
  ok_w = w > flush
  w_ct = jnp.where(ok_w, lhs_ct[..., 2 * fs:].reshape(b, ny, ns_, nz)
                   / jnp.where(ok_w, w, 1), 0)                      # b y s z
  # w = Σ_{kt} prev_t[b,y,(z,s),kt] c_left[b,y,kt].
  w_zs = jnp.swapaxes(w_ct, 2, 3).reshape(b, ny, fs)
  prev_t_ct = prev_t_ct + w_zs[..., None] * c_left.reshape(b, ny, 1, -1)
  c_left_ct = _column_dot(prev_t, w_zs, (((2,), (2,)), ((0, 1), (0, 1))),
                          prec)                                     # b y kt
  d_cs = jnp.where(left[None, None, :, None],
                   c_left_ct.reshape(cs.shape), 0)
  d_cs = d_cs.at[:, :, p].add(jnp.swapaxes(c_prev_ct, 1, 2))
  d_prev = d_prev + jnp.transpose(
      prev_t_ct.reshape(b, ny, nz, ns_, nk, nt), (0, 2, 3, 4, 5, 1))
  # The actions' cotangents back from [b, r, y, F].
  def from_ryf(x_ryf):                          # -> [b, q, x, r, y]
    return jnp.transpose(x_ryf.reshape(b, nr, ny, ns_, nz), (0, 3, 4, 1, 2))
  d_pu = from_ryf(acts_ct[..., :fs])
  d_re = from_ryf(acts_ct[..., fs:2 * fs])
  d_po = jnp.transpose(jnp.sum(acts_ct[..., 2 * fs:], axis=2).reshape(
      b, nr, ns_, nz), (0, 2, 3, 1))                                 # b s z r
  return d_prev, d_cs, d_a, d_pu, d_re, d_po


def _stack_bwd(prev, cs, p, a_hat, res, cts, prec):
  """`_local_bwd`, or its Pallas kernel under UPDATE_KERNELS = "pallas"."""
  if _update_kernels():
    from nsrnn_jax import stack_kernels  # pylint: disable=g-import-not-at-top
    return stack_kernels.local_bwd(prev, cs, p, a_hat, res, cts)
  return _local_bwd(prev, cs, p, a_hat, res, cts, prec)


def _pop_matmul(g, mt, prec):
  """Σ_{k,t} mt[b,y,r,k,t] G[b,y,k,t,i,q,x]: the only table-sized work.

  One [R, K·T] × [K·T, I·Q·X] matmul per (b, y): the column-major table
  makes the long axis (rows i, q, x) the output axis, where XLA:CPU's
  kernels run ~2x faster than with the short state axis r there (measured
  for ns_stack's table, which has the same layout).
  """
  bsz, ny, nk, nt = g.shape[:4]
  nr = mt.shape[2]
  out = _table_dot(mt.reshape(bsz * ny, nr, nk * nt),
                   g.reshape(bsz * ny, nk * nt, -1), 1, prec)
  return out.reshape((bsz, ny, nr) + g.shape[4:])


def _chunk_pop(frozen, g, mt, prec):
  """`_pop_matmul` over a table stored in column chunks (`_forward_blocks`).

  `g` is the block's own chunk (its columns, rows up to its last column),
  `frozen` the earlier blocks' chunks, each with only the rows older than
  its last column: the rows a column can hold. Each chunk's product fills
  the rows it has; the square table's other entries are all zero.
  """
  n = g.shape[4]
  out = _pop_matmul(g, mt[:, :, :, n - g.shape[2]:], prec)
  for c in frozen:
    start, end = c.shape[4] - c.shape[2], c.shape[4]
    out = out + _pad_to(_pop_matmul(c, mt[:, :, :, start:end], prec), n,
                        (3,))
  return out


def square_table(table, num_points):
  """A share table as one square array [B, Y, N, T, N, Q, X] of
  `num_points` time points, from `_forward_blocks`' column chunks (or as it
  is, zero-padded, if already square)."""
  if not isinstance(table, tuple):
    return _pad_to(table, num_points, (2, 4))
  return _pad_to(jnp.concatenate(
      [_pad_to(c, table[-1].shape[4], (4,)) for c in table], axis=2),
                 num_points, (2, 4))


def update(g_BxYxNxTxNxQxX, p, a_prev_BxQxS, push_BxQxSxQxS, repl_BxQxSxQxS,
           pop_BxQxSxQ, precision="highest", ring=False, vectors=None,
           residuals=False, margin=False, row_mins=None):
  """One update j on a share table.

  Args:
    g_BxYxNxTxNxQxX: shares (layout of `initial_table`) on a common time
      axis; axis index ``p`` holds
      time j−1. Only columns ≤ p are read (later columns, present in the
      final table during the backward sweep, are masked), and every row the
      table holds is a row the stack keeps at update j.
    p: axis index of time j−1 (int or traced int).
    a_prev_BxQxS: log α_{j−1} up to a constant per batch element (the
      drivers pass the normalised log α̂_{j−1}, logsumexp 0).
    push_BxQxSxQxS, repl_BxQxSxQxS, pop_BxQxSxQ: update j's log-weights.
    precision: matmul precision name (`ns_stack.MATMUL_PRECISIONS`).
    ring: the time axis is a ring window (`limited_stack`): every column
      but p holds an earlier time, in any rotation (rows rotated alike).
    vectors: None, or (gv [B, Y, N, T, A, M], v [B, M]): the VRNS's vector
      shares (`limited_vrns`) and update j's pushed vector, with `ring`.
      The vector shares Z_{i,k}[q,x,t,y,:] = α_i[q,x] ζ_{i,k}[q,x,t,y,:] /
      α_k[t,y] follow H's recurrence with H's kernels row by row (the push
      row times v), so any linear map of the rows commutes with the update:
      gv holds them summed over (q, x) and over the rows i ≥ a of each
      cutoff time a on the window's time axis (A = N slots), all that the
      reading and the window's row limit need, Q·S times smaller than Z.
      Its new column costs one more replace mix and pop matmul.
    residuals: also return what `_local_bwd` needs to differentiate the
      update by hand (`limited_stack`'s window VJP).
    margin: also return, last, the update's product margin [B]
      (`share_margin`; with `vectors` also over the vector column and the
      pushed vector: `vector_share_margin`; `limited_stack.share_margin`
      takes their minimum).
    row_mins: with `margin`, None or what `_row_min` gives of the table
      (with `vectors`, a pair: of g and of gv), e.g. carried by a window
      (`limited_stack.MarginState`) so that the update need not reduce its
      whole table; None: reduced here.

  Returns:
    (col_BxYxRxNxQxX, a_hat_BxQxS, inc_B): column j on the same row axis
    (row p is the push row, time j−1), indexed [b, y, r, i, q, x]; the
    normalised log α̂_j; and
    inc = log Σα_j − (the constant of a_prev), so that with a normalised
    a_prev, log Σα_j = log Σα_{j−1} + inc. Dead (all-zero) α_j gives
    α̂_j = −inf and inc = −inf. With `vectors`: (col, col_v, a_hat, inc),
    col_v [b, y, r, A, M] the vector table's column j. With `residuals`,
    a last entry (cs, mt, res): the column sums it read, M̃ and `_local`'s
    residuals.

  Why the shift m: in float32, log-weights like −1e4 or +50·j lose their
  fractional digits when added to anything; every exponent below is formed
  from small numbers only (α̂ ≤ 0, actions − m, a_j − m) so shares keep full
  relative precision. m is a constant for differentiation (the result does
  not depend on it).
  """
  g = g_BxYxNxTxNxQxX
  prec = lax_precision(precision)
  # prev[b, z, s, i, q, x] = H_{i,j−1}[q,x,s,z] (a contiguous column).
  prev = lax.dynamic_index_in_dim(g, p, axis=2, keepdims=False)
  colsum = jnp.sum(g, axis=(4, 5, 6))              # b y k t
  local_vectors = None
  if vectors is not None:
    if not ring:
      # The push row lands at every cutoff: all must be times ≤ j−1.
      raise ValueError("rns_stack.update: vectors need ring=True (a "
                       "window's time axis)")
    gv, vec = vectors
    local_vectors = (lax.dynamic_index_in_dim(gv, p, axis=2, keepdims=False),
                     vec)
  parts = _local(prev, colsum, p, a_prev_BxQxS, push_BxQxSxQxS,
                 repl_BxQxSxQxS, pop_BxQxSxQ, prec, ring,
                 residuals=residuals, vectors=local_vectors, margin=margin)
  col, mt, a_hat, inc = parts[:4]
  res, vec_local, lo_local = _optional_outputs(parts, residuals,
                                               vectors is not None, margin)
  col = col + _pop_matmul(g, mt, prec)
  out = (col, a_hat, inc)
  if vectors is not None:
    col_v = vec_local + _pop_matmul(gv, mt, prec)
    out = (col, col_v, a_hat, inc)
  if residuals:
    out += ((colsum, mt, res),)
  if margin:
    if row_mins is None:
      row_mins = (_row_min(g) if vectors is None
                  else (_row_min(g), _row_min(gv)))
    lo = lo_local
    for rows in (row_mins if vectors is not None else (row_mins,)):
      lo = jnp.minimum(lo, _pop_margin(mt, rows))
    out += (lo,)
  return out


# ---------------------------------------------------------------------------
# Unlimited stack: blocked forward scans and the hand-split custom VJP.
# ---------------------------------------------------------------------------


# On CPU the sweeps run in more, shorter time blocks than ns_stack's (which
# takes one block below T = 48): up to CPU_MAX_BLOCKS blocks of at least
# CPU_BLOCK_UPDATES updates, so that each update reads less of the padded
# table, for longer compiles (one scan per block). Train step, batch 10, one
# AMD EPYC core (AVX2), the paper's training lengths 41-80, one run
# (`train_step_cpu_time_blocks.json`): up to 2.05x faster at Q = S = 3 and
# 1.58x at Q = S = 2, most below T = 48, where one block swept the whole
# square table at every update; the same where a table of >= 8 MiB had these
# blocks already (the rule before, measured at n = 80 alone). Accelerators
# keep ns_stack's blocking (not measured there).
CPU_BLOCK_UPDATES = 12
CPU_MAX_BLOCKS = 6


def _time_blocks(num_steps):
  """Static time blocks [j0, j1) of the sweeps over T = num_steps updates."""
  blocks = _default_time_blocks(num_steps)
  if jax.default_backend() == "cpu":
    nb = min(CPU_MAX_BLOCKS, num_steps // CPU_BLOCK_UPDATES)
    if nb > len(blocks):
      blocks = _default_time_blocks(num_steps, nb)
  return blocks


def _initial(b, t, q, s, bottom, dtype):
  """Initial table, its column sums, log α̂ [B, T+1, Q, S], log Σα [B, T+1]."""
  g = initial_table(b, t + 2, q, s, bottom, corner=1, dtype=dtype)
  la = jnp.full((b, t + 1, q, s), -jnp.inf, dtype).at[:, 0, 0, 0].set(0)
  return g, jnp.sum(g, axis=(4, 5, 6)), la, jnp.zeros((b, t + 1), dtype)


def _forward_blocks(t, init, xs_T, actions_fn, extra0, prec, keep_mt,
                    unroll=1, vectors0=None, margin=False,
                    num_updates=None):
  """Runs updates 1..T in static time blocks (shared by run / run_coupled).

  Block [j0, j1) is one `lax.scan` over the table sliced to the time points
  ≤ j1 (axis indices < j1 + 1), the only ones its updates read or write
  (ns_stack's blocking). The column sums are carried, not recomputed from
  the table, so each update touches the table once (the pop matmul).

  Args:
    t: number of updates T.
    init: (g, cs, la, lm) from `_initial`.
    xs_T: time-major per-update inputs (pytree, leading axis T).
    actions_fn: (j, extra, x_j, a_prev) -> (extra, (push, repl, pop),
      ys_j): update j's action log-weights (x_j itself for `run`; the
      controller step for `run_coupled`).
    extra0: initial extra carry (controller carry, or ()).
    prec: lax precision.
    keep_mt: also return every update's M̃ and `_local` residuals (for
      the backward sweep).
    unroll: `lax.scan` unroll factor (same values).
    vectors0: None, or the initial vector table [B, Y, N, T, 1, M] of the
      vector stack (`run_coupled_vectors`: E_k[t,y] at [b, y, k+1, t, 0]);
      actions_fn is then called with E_{j−1} [b, y, r, 1, M] as a fifth
      argument and returns the pushed vector v_j [B, M] after the actions.
    margin: also compute the product margin [B] of every update (`_local`'s
      ``margin`` and the pop's, with the vector stack's products; on XLA)
      and return its minimum.
    num_updates: with `margin`, None or [B] ints: the minimum over element
      b's first num_updates[b] updates only (the rest are padding).

  Returns:
    (table, cs, la, lm, extra, ys (time-major), mt_TxBxYxRxNxT or None,
    residuals (time-major) or None, the final vector table or None, the
    margin [B] or None); the
    table as column chunks, a tuple with one per time block (block [j0, j1)
    writes axis indices j0+1..j1: chunk [B, Y, K, T, j1+1, Q, X] holds
    those columns, the first also 0..j0, with their rows ≤ j1), or square
    [B, Y, N, T, N, Q, X] (`TABLE_LAYOUT`, the Pallas path; `square_table`
    makes any of them square).
  """
  g, cs, la, lm = init
  num_pts = g.shape[2]
  vec = vectors0 is not None
  # The Pallas update has no vector column: the vector stack runs on XLA.
  fused = _update_kernels() and not vec and not margin
  if fused:
    # Imported on use: Pallas is needed only by this opt-in path.
    from nsrnn_jax import stack_kernels  # pylint: disable=g-import-not-at-top
  extra, ys_all, mts, a_hats, lms, res_all = extra0, [], [], [], [], []
  # The running product margin and the least share of each table row
  # [b, y, k, t] (carries only when asked for).
  lo = jnp.full(g.shape[:1], jnp.inf, g.dtype) if margin else ()
  if margin and vec:           # the bottom vector's entries: stored values
    lo = jnp.minimum(lo, 0.5 * _log_min_positive(vectors0))
  if margin:
    # The initial table holds at most one entry per row (the bottom's), so
    # its row minima are the logs of its column sums (`_row_min(g)` on the
    # constant table took XLA seconds of constant folding).
    lo = (_log_or_inf(cs), lo)
  # T = 0: one empty block.
  blocks = _time_blocks(t) or [(1, 1)]
  # With the chunked layout (`TABLE_LAYOUT`) the table is kept in column
  # chunks, one per block: block [j0, j1) writes columns j0+1..j1 (axis
  # indices), which hold rows ≤ j1 only, so its chunk has those rows and
  # no more. A square table holds zeros in every row at or after its
  # column (half of it); the chunks leave them out of the pop matmul's
  # reads and need no copy of the table at block boundaries. The square
  # table grows block by block (zero-padded at each boundary) instead of
  # being sliced out of, and written back into, a full-size table: two
  # table copies per block fewer (train step 1.03-1.05x, XLA temporary
  # memory -16%). (The vector stack's forward runs on XLA under Pallas too,
  # but keeps the square table: its backward runs the Pallas kernel.)
  chunked = _chunked_table()
  frozen = []                   # chunked: the earlier blocks' chunks
  n = blocks[0][1] + 1
  g, cs = g[:, :, :n, :, :n], cs[:, :, :n]
  if margin:
    lo = (lo[0][:, :, :n], lo[1])
  # log α̂_{j−1} and log Σα_{j−1} are carried as they are and every
  # update's values leave the scan as outputs: reading and writing rows of
  # [B, T+1, ...] carries made XLA copy them at every update.
  a_prev, lm_prev = la[:, 0], lm[:, 0]
  # Column j − 1 of update j (time 0's at first), carried as a value by the
  # chunked table: the column update j writes is update j + 1's.
  prev = g[:, :, 1] if chunked else ()
  # The vector table and E_{j−1} (its column j − 1, carried as a value).
  vcarry = ()
  if vec:
    gv = vectors0[:, :, :n]
    vcarry = (gv, gv[:, :, 1])
  for j0, j1 in blocks:
    n = j1 + 1
    if chunked and j0 > blocks[0][0]:
      frozen.append(g)
      g = jnp.zeros(g.shape[:2] + (n - g.shape[4],) + g.shape[3:4]
                    + (n,) + g.shape[5:], g.dtype)
      prev = _pad_to(prev, n, (3,))
    elif not chunked:
      g = _pad_to(g, n, (2, 4))
    cs = _pad_to(cs, n, (2,))
    if margin:                             # rows not yet written: none
      rows = lo[0]
      lo = (jnp.pad(rows, [(0, 0)] * 2 + [(0, n - rows.shape[2]), (0, 0)],
                    constant_values=jnp.inf), lo[1])
    if vec:
      vcarry = (_pad_to(vcarry[0], n, (2,)), vcarry[1])

    def body(carry, inp, frozen_b=tuple(frozen)):
      extra, g, cs, cs_col, a_prev, lm_prev, vcarry, prev, lo = carry
      j, x_j = inp
      if vec:
        gv, e_prev = vcarry
        extra, (*acts, v_j), ys = actions_fn(j, extra, x_j, a_prev, e_prev)
      else:
        extra, acts, ys = actions_fn(j, extra, x_j, a_prev)
      if fused:
        # One kernel: update j, column j and its sums written in place.
        g, cs, mt, a_hat, inc, res = stack_kernels.forward_update(
            g, cs, j, a_prev, *acts)
        lm_j = lm_prev + inc
        kept = (mt, res) if keep_mt else None
        return ((extra, g, cs, cs_col, a_hat, lm_j, vcarry, prev, lo),
                (ys, kept, a_hat, lm_j))
      # Column j − 1's sums are written one update late, before anything
      # reads cs, and fenced: XLA then updates cs in place instead of
      # copying it twice per update (as ns_stack's backward does for W).
      cs = lax.optimization_barrier(
          lax.dynamic_update_index_in_dim(cs, cs_col, j, axis=2))
      if not chunked:
        prev = lax.dynamic_index_in_dim(g, j, axis=2, keepdims=False)
      parts = _local(prev, cs, j, a_prev, *acts, prec, residuals=keep_mt,
                     vectors=(e_prev, v_j) if vec else None, margin=margin)
      col, mt, a_hat, inc = parts[:4]
      res, vec_local, lo_local = _optional_outputs(parts, keep_mt, vec,
                                                   margin)
      if chunked:                                   # column j, index j + 1
        col = col + _chunk_pop(frozen_b, g, mt, prec)
        g = lax.dynamic_update_index_in_dim(
            g, col, j + 1 - (n - g.shape[2]), axis=2)
      else:
        col = col + _pop_matmul(g, mt, prec)
        g = lax.dynamic_update_index_in_dim(g, col, j + 1, axis=2)
      if margin:
        # The pop's products, by each table row's least share (`rows`,
        # written with its column), then column j's rows.
        rows, lo = lo
        lo_j = jnp.minimum(lo_local, _pop_margin(mt, rows))
        rows = lax.dynamic_update_index_in_dim(
            rows, _log_min(col, (3, 4, 5)), j + 1, axis=2)
      if vec:
        if margin:
          lo_j = jnp.minimum(lo_j, _pop_margin(mt, _row_min(gv)))
        # E_j: a column-sized pop (M̃ with the vector table's columns).
        col_v = vec_local + _pop_matmul(gv, mt, prec)
        vcarry = (lax.dynamic_update_index_in_dim(gv, col_v, j + 1, axis=2),
                  col_v)
      if margin:
        lo = (rows, jnp.minimum(lo, _counted(lo_j, j, num_updates)))
      lm_j = lm_prev + inc
      kept = (mt, res) if keep_mt else None
      return ((extra, g, cs, jnp.sum(col, axis=(3, 4, 5)), a_hat, lm_j,
               vcarry, col if chunked else (), lo), (ys, kept, a_hat, lm_j))

    x_blk = jax.tree_util.tree_map(lambda l: l[j0 - 1:j1 - 1], xs_T)
    cs_col = cs[:, :, j0]                     # already in place: rewritten
    (extra, g, cs, cs_col, a_prev, lm_prev, vcarry, prev, lo), (
        ys, kept, a_hat, lm_j) = lax.scan(
            body, (extra, g, cs, cs_col, a_prev, lm_prev, vcarry, prev, lo),
            (jnp.arange(j0, j1), x_blk), unroll=unroll)
    if not fused:
      cs = lax.dynamic_update_index_in_dim(cs, cs_col, j1, axis=2)
    ys_all.append(ys)
    a_hats.append(a_hat)
    lms.append(lm_j)
    if keep_mt:
      mt, res = kept
      mts.append(jnp.pad(mt, [(0, 0)] * 4 + [(0, num_pts - n), (0, 0)]))
      res_all.append(res)
  ys = jax.tree_util.tree_map(lambda *a: jnp.concatenate(a, axis=0), *ys_all)
  mt = jnp.concatenate(mts, axis=0) if keep_mt else None
  res = (jax.tree_util.tree_map(lambda *a: jnp.concatenate(a, axis=0),
                                *res_all) if keep_mt else None)
  la = jnp.concatenate([la[:, :1]] + [jnp.swapaxes(a, 0, 1) for a in a_hats],
                       axis=1)[:, :t + 1]
  lm = jnp.concatenate([lm[:, :1]] + [jnp.swapaxes(a, 0, 1) for a in lms],
                       axis=1)[:, :t + 1]
  gv = _pad_to(vcarry[0], num_pts, (2,)) if vec else None
  table = tuple(frozen) + (g,) if chunked else _pad_to(g, num_pts, (2, 4))
  return (table, _pad_to(cs, num_pts, (2,)), la, lm, extra, ys, mt, res, gv,
          lo[1] if margin else None)


def _pad_to(x, n, axes):
  """`x` zero-padded at the end of each of `axes` to length n (no-op if
  already n)."""
  pad = [(0, 0)] * x.ndim
  for a in axes:
    pad[a] = (0, n - x.shape[a])
  return jnp.pad(x, pad) if any(p[1] for p in pad) else x


def _backward_blocks(g, cs, la, mt_all, res_T, xs_T, la_ct, inc_ct,
                     local_vjp, extra_init, prec, unroll=1):
  """One reverse sweep j = T..1 over the final tables (blocked like forward).

  Update j's column-sized part is differentiated with `jax.vjp` (it reads
  only column j−1, the column sums and α̂_{j−1}, which are final). The pop
  matmul col += G·M̃_j is transposed by hand: its M̃ cotangent is one
  matmul with the (transposed) table, and its table cotangent
  Σ_r W_j[...,r] M̃_j[k,t,r] (W_j = the cotangent of column j) is never
  formed: column k's share of it is needed only when the sweep reaches
  the update that wrote column k, as one matmul of the stored W's of all
  later updates with the forward's M̃_{·}[k] (ns_stack's W-table trick).
  Memory: the table, the W table and M̃ of all updates, O(B·T²·Q²·S²·Q);
  no adjoint table. The column-major table is the left operand of M̃'s
  cotangent as it stands (no transposed copy).

  Args:
    g, cs, la: final share table (as `_forward_blocks` returns it: column
      chunks, or square: `TABLE_LAYOUT`), column sums, log α̂.
    mt_all: M̃ of every update, [T, B, Y, R, N, T(state)].
    res_T: `_local`'s residuals of every update (time-major).
    xs_T: time-major per-update inputs passed to `local_vjp`.
    la_ct: cotangent of log α̂ [B, T+1, Q, S]; inc_ct: of the increments,
      [B, T+1] (entry j for update j).
    local_vjp: (j, extra, x_j, prev, cs, a_prev, a_hat, res_j, cts) ->
      (extra, d_prev, d_cs, d_a_prev, ys_j): the VJP of update j's
      column-sized part (`_forward_blocks`' actions_fn, then `_local`) with
      cts = (col_local_ct, mt_ct, a_hat_ct, inc_ct).
    extra_init: initial backward extra carry.
    prec: lax precision.
    unroll: `lax.scan` unroll factor (same values).

  Returns:
    (final extra carry, ys (time-major)).
  """
  num_steps = mt_all.shape[0]
  chunked = isinstance(g, tuple)
  # npt: the row axis of the column cotangents (the chunks' longest).
  bsz, ny, _, nr, npt, nq, nx = (g[-1] if chunked else g).shape
  dtype = mt_all.dtype
  fused = _update_kernels()
  if fused:
    from nsrnn_jax import stack_kernels  # pylint: disable=g-import-not-at-top
  # e_all[b, y, k, t, j', r] = M̃_{j'+1}[b, y, r, k, t].
  e_all = jnp.transpose(mt_all, (1, 2, 4, 5, 0, 3))
  if not num_steps:           # no update: nothing to differentiate.
    return extra_init, None
  # Block-sized carries: the W table (rows: updates j' ≥ j0 of the block,
  # columns: its rows i < n) and the two column cotangents are cut down (and
  # the W table extended by zero rows) at each block boundary, rather than
  # sliced out of and written back into full-size arrays (two copies each).
  w_tab = None
  col0 = jnp.zeros((bsz, ny, nr, npt, nq, nx), dtype)
  # la_bar: the cotangent update j+1 sends to log α̂_j (carried as a value;
  # reading and writing rows of a [B, T+1, Q, S] carry made XLA copy it at
  # every update). The per-update inputs come in as scan inputs.
  carry = (col0, col0, jnp.zeros_like(cs), jnp.zeros_like(la[:, 0]),
           extra_init)
  la_ct_T, inc_ct_T, la_T = (jnp.swapaxes(a, 0, 1)
                             for a in (la_ct, inc_ct, la))
  ys_all = []
  blocks = _time_blocks(num_steps)   # the forward's blocks
  for bi in reversed(range(len(blocks))):
    j0, j1 = blocks[bi]
    n = j1 + 1
    rows = (num_steps - j0 + 1) * nr
    if w_tab is None:
      w_tab = jnp.zeros((bsz * ny, rows, n * nq * nx), dtype)
    else:
      w_tab = jnp.concatenate(
          [jnp.zeros((bsz * ny, rows - w_tab.shape[1], n * nq * nx), dtype),
           w_tab[:, :, :n * nq * nx]], axis=1)
    if chunked:
      # The block's chunk and those before it, each as [b·y, (k, t),
      # (i, q, x)] (no copy): M̃'s cotangent contracts each chunk's rows
      # with as many rows of the column cotangent. Update j reads column
      # j − 1 from the block's chunk, but update j0 the last column of
      # the chunk before, its rows padded to this block's.
      views = tuple(c.reshape(bsz * ny, c.shape[2] * nr, -1)
                    for c in g[:bi + 1])
      start = n - g[bi].shape[2]             # the block's first column
      g_t = (views, _pad_to(g[bi - 1][:, :, -1], n, (3,)) if bi else None)
    else:
      # The table as [b·y, (k, t), (i, q, x)] (one copy per block; none
      # for the last): M̃'s cotangent contracts its contiguous rows (i, q,
      # x), and column j − 1 is a contiguous slice of it.
      g_t = g[:, :, :n, :, :n].reshape(bsz * ny, n * nr, n * nq * nx)
      start = 0
    cs_p = cs[:, :, :n]
    e_p = e_all[:, :, :n, :, j0 - 1:].reshape(bsz, ny, n, nr, -1)

    def body(carry, inp, g_t=g_t, cs_p=cs_p, e_p=e_p, j0=j0, n=n,
             start=start):
      w_tab, w_next, prev_hat, cs_bar, la_bar, extra = carry
      j, x_j, a_ct, i_ct, a_prev, a_hat, res_j = inp
      if fused:
        # One kernel for what the XLA ops below do.
        w_tab, col_ct, mt_ct = stack_kernels.backward_table_update(
            g_t, w_tab, w_next, e_p, prev_hat, cs_bar, j, j0, num_steps)
      else:
        # W_{j+1} is written one step late, before the W table is read,
        # and fenced, so XLA updates it in place (ns_stack's measured
        # layout).
        w_tab = lax.optimization_barrier(lax.dynamic_update_slice_in_dim(
            w_tab, w_next.reshape(bsz * ny, nr, -1),
            (jnp.minimum(j + 1, num_steps) - j0) * nr, axis=1))
        k = j + 1                                   # index of column j
        e_col = lax.dynamic_index_in_dim(e_p, k, axis=2, keepdims=False)
        left = _table_dot(e_col.reshape(bsz * ny, nr, -1), w_tab, 1, prec)
        left = left.reshape(bsz, ny, nr, n, nq, nx)
        cs_k = lax.dynamic_index_in_dim(cs_bar, k, axis=2, keepdims=False)
        col_ct = prev_hat + left + cs_k[:, :, :, None, None, None]
        # [b·y, (k, t), r] with the table as the left operand (measured
        # faster than W·Gᵀ: 1.3-2.5x for these shapes on XLA:CPU), then
        # the small result to M̃'s layout.
        col_flat = col_ct.reshape(bsz * ny, nr, -1)
        if chunked:
          mt_ct = jnp.concatenate(
              [_table_dot(v, col_flat[:, :, :v.shape[2]], 2, prec)
               for v in g_t[0]], axis=1)
        else:
          mt_ct = _table_dot(g_t, col_flat, 2, prec)
        mt_ct = jnp.transpose(mt_ct.reshape(bsz, ny, n, nr, nr),
                              (0, 1, 4, 2, 3))
      a_ct = a_ct + la_bar
      if chunked:
        prev = lax.dynamic_slice_in_dim(
            g_t[0][-1], (j - start) * nr, nr, axis=1).reshape(
                bsz, ny, nr, n, nq, nx)
        if g_t[1] is not None:                # column j0 − 1: chunk before
          prev = jnp.where(j == j0, g_t[1], prev)
      else:
        prev = lax.dynamic_slice_in_dim(g_t, j * nr, nr, axis=1).reshape(
            bsz, ny, nr, n, nq, nx)
      extra, d_prev, d_cs, d_a, ys = local_vjp(
          j, extra, x_j, prev, cs_p, a_prev, a_hat, res_j,
          (col_ct, mt_ct, a_ct, i_ct))
      return (w_tab, col_ct, d_prev, cs_bar + d_cs, d_a, extra), ys

    # Rows i ≥ n of the carried column cotangents are zero (column j0 − 1
    # of the next block has rows < j0 only), so cutting them loses nothing.
    w_next, prev_hat, cs_bar, la_bar, extra = carry
    sub = (w_tab, w_next[:, :, :, :n], prev_hat[:, :, :, :n],
           cs_bar[:, :, :n], la_bar, extra)
    x_blk = jax.tree_util.tree_map(lambda l: l[j0 - 1:j1 - 1], xs_T)
    sub, ys = lax.scan(body, sub, (jnp.arange(j0, j1), x_blk,
                                   la_ct_T[j0:j1], inc_ct_T[j0:j1],
                                   la_T[j0 - 1:j1 - 1], la_T[j0:j1],
                                   jax.tree_util.tree_map(
                                       lambda l: l[j0 - 1:j1 - 1], res_T)),
                       reverse=True, unroll=unroll)
    w_tab, w_next, prev_hat, cs_s, la_bar, extra = sub
    carry = (w_next, prev_hat, cs_bar.at[:, :, :n].set(cs_s), la_bar, extra)
    ys_all.append(ys)
  ys = jax.tree_util.tree_map(lambda *a: jnp.concatenate(a, axis=0),
                              *ys_all[::-1])
  return carry[4], ys


def _increment_cotangents(lm_ct):
  """log Σα_j = Σ_{l≤j} inc_l, so inc_l's cotangent is Σ_{j≥l} of lm's."""
  return jnp.flip(jnp.cumsum(jnp.flip(lm_ct, 1), axis=1), 1)


def _given_actions(j, extra, acts, a_prev):
  """actions_fn of `run`: the per-update inputs are the actions themselves."""
  del j, a_prev
  return extra, acts, None


def _forward(push, repl, pop, bottom, precision, keep_mt=False, unroll=1,
             square=True):
  """Forward; returns (g, cs, log α̂, log Σα, M̃ of every update or None,
  `_local`'s residuals or None); g square [B, Y, T+2, T, T+2, Q, X], or as
  `_forward_blocks` keeps it (`square=False`: the backward's residual)."""
  b, t, q, s = push.shape[:4]
  prec = lax_precision(precision)
  xs_T = tuple(jnp.swapaxes(a, 0, 1) for a in (push, repl, pop))
  g, cs, la, lm, _, _, mt, res, _, _ = _forward_blocks(
      t, _initial(b, t, q, s, bottom, push.dtype), xs_T,
      _given_actions, (), prec, keep_mt, unroll)
  return (square_table(g, t + 2) if square else g), cs, la, lm, mt, res


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _tables(push, repl, pop, bottom, precision, unroll):
  return _forward(push, repl, pop, bottom, precision, unroll=unroll,
                  square=False)[2:4]


def _tables_fwd(push, repl, pop, bottom, precision, unroll):
  g, cs, la, lm, mt, lres = _forward(push, repl, pop, bottom, precision,
                                     True, unroll, square=False)
  return (la, lm), (g, cs, la, mt, lres, push, repl, pop)


def _tables_bwd(bottom, precision, unroll, res, cts):
  del bottom
  g, cs, la, mt, lres, push, repl, pop = res
  la_ct, lm_ct = cts
  prec = lax_precision(precision)

  def local_vjp(j, extra, acts, prev, cs_p, a_prev, a_hat, res_j, cts):
    del acts, a_prev
    d_prev, d_cs, d_a, *d_acts = _stack_bwd(prev, cs_p, j, a_hat, res_j, cts,
                                            prec)
    return extra, d_prev, d_cs, d_a, tuple(d_acts)

  xs_T = tuple(jnp.swapaxes(a, 0, 1) for a in (push, repl, pop))
  _, d_acts = _backward_blocks(g, cs, la, mt, lres, xs_T, la_ct,
                               _increment_cotangents(lm_ct), local_vjp, (),
                               prec, unroll)
  if d_acts is None:          # T = 0
    return tuple(jnp.zeros_like(a) for a in (push, repl, pop))
  return tuple(jnp.swapaxes(d, 0, 1) for d in d_acts)


_tables.defvjp(_tables_fwd, _tables_bwd)


def run(push, repl, pop, bottom=FIXED, precision="highest", unroll=1):
  """Normalised log α and log Σα for j = 0..T from action log-weights.

  Exact for finite log-weights (unnormalised, large, −inf), in float32 and
  float64, unless a run falls more than ~80 nats (float32; ~700 in float64)
  below the best run to the same configuration and a later weight brings
  it back (module docstring; `log_stack.run` has no such limit);
  differentiable in O(T²) memory.

  Args:
    push, repl: [B, T, Q, S, Q, S] log-weights indexed (q, x, r, y).
    pop: [B, T, Q, S, Q] log-weights indexed (q, x, r).
    bottom: "fixed" (default) or "frozen".
    precision: matmul precision of every contraction, forward and backward
      (`ns_stack.MATMUL_PRECISIONS`; "highest" = full float32 everywhere).
    unroll: `lax.scan` unroll factor of the forward and backward sweeps
      (same values; fewer loop iterations, larger programs; for
      launch-bound accelerators).

  Returns:
    (log_alpha_hat [B, T+1, Q, S], log_mass [B, T+1]) with
    log α_j = log_alpha_hat_j + log_mass_j; log_alpha_hat_j has logsumexp 0
    (all −inf once every run died). They are returned apart because in
    float32 log_mass can reach 1e6, where adding it back would round away
    the digits the readings need. `readout(log_alpha_hat)` gives readings.
  """
  _check_bottom(bottom)
  push, repl, pop = (jnp.asarray(a) for a in (push, repl, pop))
  _check_actions(push, repl, pop)
  return _run_jit(push, repl, pop, bottom, check_precision(precision),
                  check_unroll(unroll))


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _run_jit(push, repl, pop, bottom, precision, unroll):
  return _tables(push, repl, pop, bottom, precision, unroll)


# ---------------------------------------------------------------------------
# The product margin: when the shares are exact.
# ---------------------------------------------------------------------------
#
# Every product the sweep forms has two non-negative factors, a share of
# the table and a kernel exp(x) (x: α̂_{j−1} + action − α_j), a column sum
# or an entry of M̃; column sums and W enter α_j only through their
# logarithms. The margin m is half the log of the least nonzero product
# (computed in logs from its factors, so a product that underflowed still
# counts), with each value stored as it is (a push-row share exp(x), a
# pushed or bottom vector) counting as its own product with 1, and each
# kernel as exact_margin + (cap − x), its headroom below the clamp of
# `_exp_share`. With m > exact_margin(dtype) = ½ ln(flush) every product
# is above the flush threshold, so none underflows, no sum of them (which
# only grows) is dropped as flushed, no kernel is clamped, and every entry,
# log α̂ and log Σα equal exact arithmetic up to rounding — the values
# `log_stack` computes. Below it nothing is promised (a run may or may not
# have lost mass): `log_stack` cannot flush, and float64 moves the bound to
# about −350 nats. One reduction per operand bounds a whole contraction
# (`_local_margin`); the pop's table-sized operand by each row's least
# share, kept with the column sums. The margin covers the forward values
# (readings, log Σα, the loss), not the backward's cotangents.
#
# It replaced a factor margin (every factor within [e^m, e^−m]), which the
# product margin is never below: a share e^−60 times a kernel near 1 is a
# product of e^−60, ½ ln = −30, where the factor margin counted −60
# (benchmarks/margin_certificates.py: on random N(0, 6²) log-weights the
# product margin proves 35 of 40 float32 sweeps, the factor margin 6).


# Which certificate `share_margin` computes, named where margins are
# saved (run records, benchmark results): those that name none are of the
# factor margin.
MARGIN_KIND = "product"


def exact_margin(dtype=jnp.float32) -> float:
  """The product margin above which the shares are exact (½ ln flush).

  About −40.2 nats in float32 and −350 in float64 (`share_margin`).
  """
  return 0.5 * float(np.log(_flush(jnp.dtype(dtype))))


def share_margin(push, repl, pop, bottom=FIXED, precision="highest",
                 num_updates=None):
  """The product margin of `run` on these log-weights: [B] nats.

  Half the log of the least nonzero product the share sweep forms for
  batch element b (a stored push-row share counting as its own product,
  a kernel by its headroom below the clamp; the comment above
  `exact_margin`), +inf when there is none. Above `exact_margin(dtype)` `run`'s values are
  exact up to rounding for that element; below it they may have lost runs
  that fell that far behind (module docstring), and `log_stack.run` gives
  the exact ones. Forward only, not differentiable; costs a few column
  reductions per update beside `run`'s forward.

  Args:
    push, repl, pop, bottom, precision: as for `run`.
    num_updates: None, or [B] ints in 0..T: element b's margin is that of
      its first num_updates[b] updates, as if the actions ended there (the
      rest are padding, as in a batch padded to a compiled length).
  """
  _check_bottom(bottom)
  push, repl, pop = (jnp.asarray(a) for a in (push, repl, pop))
  b = _check_actions(push, repl, pop)[0]
  return _margin_jit(push, repl, pop, bottom, check_precision(precision),
                     check_num_updates(num_updates, b))


def vector_share_margin(push, repl, pop, vectors, bottom_vector,
                        precision="highest", num_updates=None):
  """`share_margin` of the vector stack (`run_coupled_vectors`): [B] nats.

  The stack's pushed and bottom vectors are positive, so its vector
  shares are too and every product of its sweep has two non-negative
  factors: `share_margin`'s products plus the vector table's replace rows
  and pop (its entries by kernels and M̃) and the push row's kernels by
  the pushed vector, the vectors counting as stored values. Above `exact_margin(dtype)` the readings ρ_j = α̂_j ⊗ E_j
  of `run_coupled_vectors` on these actions are exact up to rounding.
  Forward only, not differentiable.

  Args:
    push, repl, pop: log-weights as for `run` (fixed bottom).
    vectors: the pushed vectors v_t [B, T, M] (linear, > 0).
    bottom_vector: v_⊥ [B, M] (linear, > 0).
    precision: as for `run`.
    num_updates: as for `share_margin` (the bottom vector always counts).
  """
  push, repl, pop = (jnp.asarray(a) for a in (push, repl, pop))
  b, t = _check_actions(push, repl, pop)[:2]
  vectors, bottom_vector = jnp.asarray(vectors), jnp.asarray(bottom_vector)
  if (vectors.ndim != 3 or vectors.shape[:2] != (b, t)
      or bottom_vector.shape != (b, vectors.shape[2])):
    raise ValueError(f"vectors must be [B={b}, T={t}, M] and bottom_vector "
                     f"[B, M], got shapes {vectors.shape} and "
                     f"{bottom_vector.shape}")
  return _vector_margin_jit(push, repl, pop, vectors, bottom_vector,
                            check_precision(precision),
                            check_num_updates(num_updates, b))


@functools.partial(jax.jit, static_argnums=(5,))
def _vector_margin_jit(push, repl, pop, vectors, bottom_vector, precision,
                       num_updates):
  acts = tuple(lax.stop_gradient(a)
               for a in (push, repl, pop, vectors.astype(push.dtype)))
  b, t, q, s = push.shape[:4]
  xs_T = tuple(jnp.swapaxes(a, 0, 1) for a in acts)

  def given(j, extra, x_j, a_prev, e_prev):
    del j, a_prev, e_prev
    return extra, x_j, None

  return _forward_blocks(
      t, _initial(b, t, q, s, FIXED, push.dtype), xs_T, given, (),
      lax_precision(precision), False,
      vectors0=_initial_vectors(
          lax.stop_gradient(bottom_vector.astype(push.dtype)), t, q, s),
      margin=True, num_updates=num_updates)[-1]


@functools.partial(jax.jit, static_argnums=(3, 4))
def _margin_jit(push, repl, pop, bottom, precision, num_updates):
  push, repl, pop = (lax.stop_gradient(a) for a in (push, repl, pop))
  b, t, q, s = push.shape[:4]
  xs_T = tuple(jnp.swapaxes(a, 0, 1) for a in (push, repl, pop))
  lo = _forward_blocks(t, _initial(b, t, q, s, bottom, push.dtype), xs_T,
                       _given_actions, (), lax_precision(precision), False,
                       margin=True, num_updates=num_updates)[-1]
  return lo


def check_num_updates(num_updates, batch):
  """`share_margin`'s num_updates as [batch] int32 (None stays None), or a
  one-line ValueError."""
  if num_updates is None:
    return None
  shape = np.shape(num_updates)
  if shape != (batch,):
    raise ValueError(f"num_updates must have shape ({batch},) (one count "
                     f"per batch element), got {shape}")
  return jnp.asarray(num_updates, jnp.int32)


# ---------------------------------------------------------------------------
# Coupled controller + stack (the RNS-RNN's recurrence).
# ---------------------------------------------------------------------------


def _controller_actions(step_fn, reading, params):
  """actions_fn of `run_coupled`: controller step j reads ρ_{j−1}."""
  def actions_fn(j, ctrl, x, a_prev, params=params):
    del j
    rho, _ = readout(a_prev, reading)
    new_ctrl, acts, out = step_fn(params, ctrl, x, rho)
    return new_ctrl, acts, (out, ctrl)
  return actions_fn


def _float_dtype(tree):
  leaves = [l for l in jax.tree_util.tree_leaves(tree)
            if jnp.issubdtype(jnp.result_type(l), jnp.floating)]
  return jnp.result_type(*leaves) if leaves else jnp.float32


def _coupled_forward(step_fn, q, s, bottom, reading, precision, unroll,
                     params, init_carry, xs, keep_mt):
  leaves = jax.tree_util.tree_leaves(xs)
  b, t = leaves[0].shape[:2]
  prec = lax_precision(precision)
  xs_T = jax.tree_util.tree_map(lambda l: jnp.swapaxes(l, 0, 1), xs)
  init = _initial(b, t, q, s, bottom, _float_dtype(params))
  g, cs, la, lm, _, (outs, ctrls), mt, lres, _, _ = _forward_blocks(
      t, init, xs_T, _controller_actions(step_fn, reading, params),
      init_carry, prec, keep_mt, unroll)
  return outs, la, lm, g, cs, ctrls, (mt, lres)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5, 6))
def _coupled(step_fn, q, s, bottom, reading, precision, unroll, params,
             init_carry, xs):
  outs, la, lm = _coupled_forward(step_fn, q, s, bottom, reading, precision,
                                  unroll, params, init_carry, xs, False)[:3]
  return outs, la, lm


def _coupled_fwd(step_fn, q, s, bottom, reading, precision, unroll, params,
                 init_carry, xs):
  outs, la, lm, g, cs, ctrls, mt = _coupled_forward(
      step_fn, q, s, bottom, reading, precision, unroll, params, init_carry,
      xs, True)
  return (outs, la, lm), (params, xs, g, cs, la, ctrls, mt)


def _zero_cotangent(x):
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


def float_inputs(x):
  """(float leaves of pytree x, merge): what a VJP over one step's inputs
  differentiates; ``merge(float_leaves)`` rebuilds x with the others (ids)
  as they were. Shared by the reverse sweeps that re-run controller steps
  (`run_coupled_vectors`, `limited_stack`'s window)."""
  leaves, treedef = jax.tree_util.tree_flatten(x)
  is_f = [jnp.issubdtype(jnp.result_type(l), jnp.floating) for l in leaves]

  def merge(xf):
    it = iter(xf)
    return jax.tree_util.tree_unflatten(
        treedef, [next(it) if f else l for l, f in zip(leaves, is_f)])

  return [l for l, f in zip(leaves, is_f) if f], merge


def inputs_cotangent(xs, float_cts):
  """xs's cotangent: `float_cts` (its float leaves' cotangents, in order,
  shaped as those leaves; None: zeros) and float0 for the other leaves."""
  leaves, treedef = jax.tree_util.tree_flatten(xs)
  it = iter(float_cts or ())
  return jax.tree_util.tree_unflatten(treedef, [
      (next(it) if float_cts is not None else jnp.zeros_like(l))
      if jnp.issubdtype(jnp.result_type(l), jnp.floating)
      else _zero_cotangent(l) for l in leaves])


def zero_carry_cotangent(ctrls_T):
  """Zeros shaped like one controller carry of the stacked carries
  `ctrls_T` (leading axis T, which may be 0): the cotangent of the carry
  after the last step, which feeds nothing."""
  return jax.tree_util.tree_map(
      lambda c: jnp.zeros(jnp.shape(c)[1:], jnp.result_type(c)), ctrls_T)


def _coupled_bwd(step_fn, q, s, bottom, reading, precision, unroll, res,
                 cts):
  """Reverse sweep: vjp of (controller step j + update j's local part)."""
  del q, s, bottom
  params, xs, g, cs, la, ctrls, (mt, lres) = res
  outs_ct, la_ct, lm_ct = cts
  prec = lax_precision(precision)
  xs_T = jax.tree_util.tree_map(lambda l: jnp.swapaxes(l, 0, 1), xs)
  zeros = lambda tree: jax.tree_util.tree_map(jnp.zeros_like, tree)

  def local_vjp(j, extra, inp, prev, cs_p, a_prev, a_hat, res_j, cts):
    p_bar, c_bar = extra
    x, ctrl_prev, out_ct = inp

    # The controller step under jax.vjp; the stack's part from the forward's
    # residuals (`_local_bwd`), chained through the actions.
    def ctrl(p, c, ap):
      rho, _ = readout(ap, reading)
      new_ctrl, acts, out = step_fn(p, c, x, rho)
      return new_ctrl, out, acts

    (_, _, acts), vjp = jax.vjp(ctrl, params, ctrl_prev, a_prev)
    d_prev, d_cs, d_a, *d_acts = _stack_bwd(prev, cs_p, j, a_hat, res_j, cts,
                                            prec)
    acts_ct = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(acts), d_acts)
    dp, dc, d_a_ctrl = vjp((c_bar, out_ct, acts_ct))
    p_bar = jax.tree_util.tree_map(jnp.add, p_bar, dp)
    return (p_bar, dc), d_prev, d_cs, d_a + d_a_ctrl, None

  # The carry after the last step feeds nothing: its cotangent is zero.
  (p_bar, c_bar), _ = _backward_blocks(
      g, cs, la, mt, lres, (xs_T, ctrls, outs_ct), la_ct,
      _increment_cotangents(lm_ct), local_vjp,
      (zeros(params), zero_carry_cotangent(ctrls)), prec, unroll)
  return p_bar, c_bar, jax.tree_util.tree_map(_zero_cotangent, xs)


_coupled.defvjp(_coupled_fwd, _coupled_bwd)


def run_coupled(step_fn: Callable[..., Any], params, init_carry, xs,
                num_states: int, num_symbols: int, bottom: str = FIXED,
                reading: str = STATE, precision: str = "highest",
                unroll: int = 1):
  """Runs a controller and the stack together, t = 1..T (O(T²) gradient).

  Controller step t sees ρ_{t−1} (ρ_0 is one-hot at index 0), then update t
  uses the log-weights it returned.

  Args:
    step_fn: (params, carry, x_t, reading_prev) -> (carry_t, (push_t,
      repl_t, pop_t), out_t); actions [B,Q,S,Q,S], [B,Q,S,Q,S], [B,Q,S,Q].
    params: differentiable pytree.
    init_carry: the controller's initial carry (differentiable).
    xs: pytree of batch-major inputs, leaves [B, T, ...]; they receive a
      zero cotangent (the models feed integer ids).
    num_states, num_symbols: Q, S.
    bottom: "fixed" or "frozen".
    reading: "state" (Q·S) or "symbol" (S).
    precision: matmul precision of the stack DP's contractions (as `run`);
      the controller's own matmuls are step_fn's business.
    unroll: `lax.scan` unroll factor (as `run`).

  Returns:
    (outs, log_alpha_hat, log_mass): outs stacked batch-major [B, T, ...],
    normalised log α [B, T+1, Q, S] and log Σα [B, T+1] as in `run`.
  """
  _check_bottom(bottom)
  _check_reading(reading)
  if int(num_states) < 1 or int(num_symbols) < 1:
    raise ValueError(f"num_states and num_symbols must be >= 1, got "
                     f"{num_states}, {num_symbols}")
  leaves = jax.tree_util.tree_leaves(xs)
  if not leaves or any(jnp.ndim(l) < 2 for l in leaves):
    raise ValueError("xs must be a pytree of arrays [B, T, ...]")
  outs_T, la, lm = _coupled(step_fn, int(num_states), int(num_symbols),
                            bottom, reading, check_precision(precision),
                            check_unroll(unroll), params, init_carry, xs)
  outs = jax.tree_util.tree_map(lambda o: jnp.swapaxes(o, 0, 1), outs_T)
  return outs, la, lm


# ---------------------------------------------------------------------------
# The vector stack (VRNS-RNN) on the share sweep.
# ---------------------------------------------------------------------------
#
# Without a window one cutoff is enough (`update`'s ``vectors`` with A = 1):
# the vector shares summed over every row, E_k[t,y] = Σ_{i,q,x} Z_{i,k}, are
# the expected top vector jointly with the share of (t, y) at time k, and
# E_j = Σ_{s,z} E_{j−1} K^R + Σ_{k,t} E_k[t,y] M̃_k[t,y,r] + (Σ_{q,x} K^P) v_j
# (`_vector_local` + a pop with M̃): column-sized work per update next to
# the table's pop matmul, where the log-space `vrns_stack` sweeps an m-fold
# table. ρ_j[r,y] = α̂_j[r,y] E_j[r,y] (vrns_stack.py's readings).


def _initial_vectors(bottom_vector_BxM, num_steps, num_states, num_symbols):
  """Vector table [B, Y, N, T, 1, M]: E_0 = v_⊥ at (q0, ⊥), else zero."""
  b, m = bottom_vector_BxM.shape
  gv = jnp.zeros((b, num_symbols, num_steps + 2, num_states, 1, m),
                 bottom_vector_BxM.dtype)
  return gv.at[:, 0, 1, 0, 0].set(bottom_vector_BxM)


def _vector_reading(a_hat_BxQxS, e_BxYxRx1xM):
  """The controller's reading ρ [B, Q·S·M] (order r, y, m) from α̂ and E."""
  rho = (jnp.exp(a_hat_BxQxS)[..., None]
         * jnp.swapaxes(e_BxYxRx1xM[:, :, :, 0], 1, 2))
  return rho.reshape(rho.shape[0], -1)


def _vector_actions(step_fn, params):
  """actions_fn of `run_coupled_vectors`: controller step j reads ρ_{j−1}."""
  def actions_fn(j, ctrl, x, a_prev, e_prev, params=params):
    del j
    new_ctrl, (pu, re, po, log_v), out = step_fn(
        params, ctrl, x, _vector_reading(a_prev, e_prev))
    return new_ctrl, (pu, re, po, jnp.exp(log_v)), (out, ctrl)
  return actions_fn


def _coupled_vectors_forward(step_fn, q, s, precision, unroll, params,
                             init_carry, bottom_v, xs, keep_mt):
  b, t = jax.tree_util.tree_leaves(xs)[0].shape[:2]
  dtype = _float_dtype((params, bottom_v))
  xs_T = jax.tree_util.tree_map(lambda l: jnp.swapaxes(l, 0, 1), xs)
  g, cs, la, lm, _, (outs, ctrls), mt, lres, gv, _ = _forward_blocks(
      t, _initial(b, t, q, s, FIXED, dtype), xs_T,
      _vector_actions(step_fn, params), init_carry, lax_precision(precision),
      keep_mt, unroll,
      vectors0=_initial_vectors(bottom_v.astype(dtype), t, q, s))
  return outs, la, lm, gv, (g, cs, ctrls, mt, lres)


def _e_of(gv):
  """E [B, T+1, R, Y, M] (times 0..T) from the vector table."""
  return jnp.transpose(gv[:, :, 1:, :, 0], (0, 2, 3, 1, 4))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _coupled_vectors(step_fn, q, s, precision, unroll, params, init_carry,
                     bottom_v, xs):
  outs, la, lm, gv, _ = _coupled_vectors_forward(
      step_fn, q, s, precision, unroll, params, init_carry, bottom_v, xs,
      False)
  return outs, la, lm, _e_of(gv)


def _coupled_vectors_fwd(step_fn, q, s, precision, unroll, params,
                         init_carry, bottom_v, xs):
  outs, la, lm, gv, (g, cs, ctrls, mt, lres) = _coupled_vectors_forward(
      step_fn, q, s, precision, unroll, params, init_carry, bottom_v, xs,
      True)
  return ((outs, la, lm, _e_of(gv)),
          (params, xs, gv, g, cs, la, ctrls, mt, lres))


def _coupled_vectors_bwd(step_fn, q, s, precision, unroll, res, cts):
  """Reverse sweep: `_coupled_bwd`'s, with the vector column's VJP.

  The vector table's cotangent (column-sized per time, carried whole)
  collects Ē_k from every later update's pop and replace and from the
  controller step that read ρ_k; when the sweep reaches update k it is
  complete. Update j's vector column is differentiated with `jax.vjp` on
  its kernels (the forward's residuals), E_{j−1}, v_j, M̃_j and the final
  vector table; the kernels' and M̃'s cotangents join the stack's own in
  `_local_bwd`.
  """
  del q, s
  params, xs, gv, g, cs, la, ctrls, mt, lres = res
  outs_ct, la_ct, lm_ct, e_ct = cts
  prec = lax_precision(precision)
  xs_T = jax.tree_util.tree_map(lambda l: jnp.swapaxes(l, 0, 1), xs)
  zeros = lambda tree: jax.tree_util.tree_map(jnp.zeros_like, tree)
  gv_bar = jnp.zeros_like(gv).at[:, :, 1:, :, 0].set(
      jnp.transpose(e_ct, (0, 3, 1, 2, 4)))

  def local_vjp(j, extra, inp, prev, cs_p, a_prev, a_hat, res_j, cts):
    p_bar, c_bar, gv_bar = extra
    x, ctrl_prev, out_ct, mt_j = inp
    n = prev.shape[3]
    e_prev = lax.dynamic_index_in_dim(gv, j, axis=2, keepdims=False)
    e_bar = lax.dynamic_index_in_dim(gv_bar, j + 1, axis=2, keepdims=False)
    xf, merge = float_inputs(x)

    def ctrl(p, c, ap, ep, xf):
      new_ctrl, acts, out = step_fn(p, c, merge(xf), _vector_reading(ap, ep))
      return new_ctrl, out, acts

    (_, _, (_, _, _, log_v)), ctrl_vjp = jax.vjp(
        ctrl, params, ctrl_prev, a_prev, e_prev, xf)
    v = jnp.exp(log_v)

    def vector_column(kern, ep, v, mt_n, gv_n):
      return _vector_local(kern, ep, v, prec) + _pop_matmul(gv_n, mt_n, prec)

    _, vec_vjp = jax.vjp(vector_column, res_j[0][0], e_prev, v,
                         mt_j[:, :, :, :n], gv[:, :, :n])
    kern_ct, ep_ct, v_ct, mt_ct_v, gv_ct = vec_vjp(e_bar)
    col_ct, mt_ct, a_ct, i_ct = cts
    d_prev, d_cs, d_a, *d_acts = _local_bwd(
        prev, cs_p, j, a_hat, res_j, (col_ct, mt_ct + mt_ct_v, a_ct, i_ct),
        prec, kern_ct=kern_ct)
    dp, dc, d_a_ctrl, d_ep, dxf = ctrl_vjp(
        (c_bar, out_ct, (*d_acts, v_ct * v)))
    gv_bar = gv_bar.at[:, :, :n].add(gv_ct)
    gv_bar = lax.dynamic_update_index_in_dim(
        gv_bar, lax.dynamic_index_in_dim(gv_bar, j, axis=2, keepdims=False)
        + ep_ct + d_ep, j, axis=2)
    p_bar = jax.tree_util.tree_map(jnp.add, p_bar, dp)
    return (p_bar, dc, gv_bar), d_prev, d_cs, d_a + d_a_ctrl, dxf

  (p_bar, c_bar, gv_bar), dxf_T = _backward_blocks(
      g, cs, la, mt, lres, (xs_T, ctrls, outs_ct, mt), la_ct,
      _increment_cotangents(lm_ct), local_vjp,
      (zeros(params), zero_carry_cotangent(ctrls), gv_bar), prec,
      unroll)
  xs_ct = inputs_cotangent(xs, None if dxf_T is None else [
      jnp.swapaxes(d, 0, 1) for d in dxf_T])
  return p_bar, c_bar, gv_bar[:, 0, 1, 0, 0], xs_ct


_coupled_vectors.defvjp(_coupled_vectors_fwd, _coupled_vectors_bwd)


def run_coupled_vectors(step_fn: Callable[..., Any], params, init_carry, xs,
                        bottom_vector, num_states: int, num_symbols: int,
                        precision: str = "highest", unroll: int = 1):
  """The vector stack (VRNS-RNN, fixed bottom) with a controller, t = 1..T.

  The run-consistent vector stack of `vrns_stack` (its module docstring:
  semantics and readings) computed on this module's share sweep: exact
  up to the share table's flush limit, O(T²) gradient memory, and the vectors cost
  column-sized work per update (module comment above `_initial_vectors`).
  `vrns_stack.run_coupled` calls it for the run-consistent bottom.

  Args:
    step_fn: (params, carry, x_t, reading_prev [B, Q·S·M]) -> (carry_t,
      (push_t, repl_t, pop_t, log_vector_t), out_t): log-weights as for
      `run_coupled`, log_vector [B, M] = log v_t (any values; v_t must be
      finite in the dtype).
    params, init_carry: differentiable pytrees.
    xs: pytree of batch-major inputs [B, T, ...]; float leaves get their
      cotangents, the others float0.
    bottom_vector: v_⊥ [B, M] (linear; differentiable).
    num_states, num_symbols: Q, S.
    precision: matmul precision of the stack's contractions (as `run`).
    unroll: `lax.scan` unroll factor (as `run`).

  Returns:
    (outs [B, T, ...], readings [B, T+1, Q, S, M], log_mass [B, T+1]):
    ρ_j = α̂_j ⊗ E_j and log Σα_j.
  """
  leaves = jax.tree_util.tree_leaves(xs)
  if not leaves or any(jnp.ndim(l) < 2 for l in leaves):
    raise ValueError("xs must be a pytree of arrays [B, T, ...]")
  if int(num_states) < 1 or int(num_symbols) < 1:
    raise ValueError(f"num_states and num_symbols must be >= 1, got "
                     f"{num_states}, {num_symbols}")
  b = jnp.shape(leaves[0])[0]
  bottom_vector = jnp.asarray(bottom_vector)
  if bottom_vector.shape[:1] != (b,) or bottom_vector.ndim != 2:
    raise ValueError(f"bottom_vector must be [B={b}, M], got shape "
                     f"{bottom_vector.shape}")
  outs_T, la, lm, e = _coupled_vectors(
      step_fn, int(num_states), int(num_symbols), check_precision(precision),
      check_unroll(unroll), params, init_carry, bottom_vector, xs)
  outs = jax.tree_util.tree_map(lambda o: jnp.swapaxes(o, 0, 1), outs_T)
  return outs, jnp.exp(la)[..., None] * e, lm


# ---------------------------------------------------------------------------
# Plain log-space transcription (reference, Viterbi) and run replay.
# ---------------------------------------------------------------------------


def _max(x, axis):
  return jnp.max(x, axis=axis)


def _log_space_tables(push, repl, pop, bottom, window, reduce):
  """The rns-vrns-reference.md §1.4/§1.5/§2.1 recurrences in log space.

  Carries lg[b, i+1, j, q, x, r, y] = log γ[i→j] (row −1 = the bottom row
  of the fixed bottom) through a lax.scan, materialising every term.
  O(T²·Q³·S²) memory per step; for tests, Viterbi and short strings.
  `window` None is unlimited, else D (rows i < j − D are dropped).
  """
  b, t, q, s = push.shape[:4]
  n = t + 1
  neg = jnp.asarray(-jnp.inf, push.dtype)
  lg = jnp.full((b, n + 1, n, q, s, q, s), neg)
  if bottom == FIXED:
    lg = lg.at[:, 0, 0, 0, 0, 0, 0].set(0)
  la = jnp.full((b, n + 1, q, s), neg).at[:, 1, 0, 0].set(0)   # α_0
  if bottom == FIXED:
    la = la.at[:, 0, 0, 0].set(0)                                 # α_{−1}
  rows = jnp.arange(n + 1) - 1          # time of each row
  cols = jnp.arange(n)

  def body(carry, inp):
    lg, la = carry
    j, pu, re, po = inp
    lo = -2 if window is None else j - window
    keep = (rows >= lo)[None, :, None, None, None, None]
    prev = lax.dynamic_index_in_dim(lg, j - 1, axis=2, keepdims=False)
    rep = reduce(prev[..., None, None] + re[:, None, None, None], axis=(4, 5))
    # γ′[k] from row k of column j−1, k = 0..j−2 (row index k+1).
    m = reduce(prev[..., None] + po[:, None, None, None], axis=(4, 5))
    kk = rows
    ok_k = (kk >= 0) & (kk <= j - 2) & (kk >= lo + 1)
    m = jnp.where(ok_k[None, :, None, None, None], m, neg)      # b k t y r
    m_cols = m[:, 1:]                                            # k = 0..n−1
    terms = lg[..., None] + m_cols[:, None, :, None, None]       # b i k q x t y r
    pp = jnp.swapaxes(reduce(terms, axis=(2, 5)), -1, -2)        # b i q x r y
    col = jnp.where(keep & (rows <= j - 2)[None, :, None, None, None, None],
                    reduce(jnp.stack([rep, pp]), axis=0), neg)
    col = jnp.where((rows == j - 1)[None, :, None, None, None, None],
                    pu[:, None], col)
    col = jnp.where(keep, col, neg)
    lg = lax.dynamic_update_index_in_dim(lg, col, j, axis=2)
    la_j = reduce(la[:, :, :, :, None, None] + col, axis=(1, 2, 3))
    la = lax.dynamic_update_index_in_dim(la, la_j, j + 1, axis=1)
    return (lg, la), None

  del cols
  xs = (jnp.arange(1, t + 1),) + tuple(jnp.swapaxes(a, 0, 1)
                                      for a in (push, repl, pop))
  (lg, la), _ = lax.scan(body, (lg, la), xs)
  return lg, la[:, 1:]


def run_log_space(push, repl, pop, bottom=FIXED, window=None):
  """Same contract as `run` (and `limited_stack.run` with a window), naively.

  A direct log-space transcription of the note's recurrences, differentiated
  by plain autodiff (O(T³) memory). For tests and short strings only.
  """
  _check_bottom(bottom)
  push, repl, pop = (jnp.asarray(a) for a in (push, repl, pop))
  _check_actions(push, repl, pop)
  return _log_space_jit(push, repl, pop, bottom, window)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _log_space_jit(push, repl, pop, bottom, window):
  return _split_mass(_log_space_tables(push, repl, pop, bottom, window,
                                       _lse)[1])


def _split_mass(log_alpha):
  """log α → (normalised log α̂, log Σα), the contract of `run`."""
  lm = _lse(log_alpha.reshape(log_alpha.shape[:-2] + (-1,)), axis=-1)
  alive = jnp.isfinite(lm)[..., None, None]
  hat = jnp.where(alive, log_alpha - jnp.where(alive, lm[..., None, None], 0),
                  -jnp.inf)
  return hat, lm


PUSH, REPLACE, POP = ns_stack.PUSH, ns_stack.REPLACE, ns_stack.POP


def viterbi(push, repl, pop, bottom=FIXED, window=None):
  """Best PDA run per batch element under the given bottom semantics.

  Args:
    push, repl, pop: log-weights as for `run` (evaluated eagerly).
    bottom: "fixed" or "frozen".
    window: None (unlimited) or D ≥ 1 (runs of the memory-limited stack).

  Returns:
    B pairs (actions, log_weight); actions lists T tuples (step, kind,
    from_state, to_state, symbol) as in `ns_stack.viterbi` (symbol: pushed,
    replacing, or popped symbol). −inf and [] if no run survives.
  """
  _check_bottom(bottom)
  push, repl, pop = (jnp.asarray(a) for a in (push, repl, pop))
  b, t, _, _ = _check_actions(push, repl, pop)
  if window is not None and (isinstance(window, bool)
                             or not isinstance(window, int) or window < 1):
    raise ValueError(f"window must be None or an integer D >= 1, got "
                     f"{window!r}")
  lg, la = jax.jit(functools.partial(_log_space_tables, bottom=bottom,
                                     window=window, reduce=_max))(
                                         push, repl, pop)
  lg, la = np.asarray(lg, np.float64), np.asarray(la, np.float64)
  pu, re, po = (np.asarray(a, np.float64) for a in (push, repl, pop))
  fixed = bottom == FIXED
  return [backtrace(lg[n], la[n], pu[n], re[n], po[n], t, fixed)
          for n in range(b)]


def replay_run(actions, push=None, repl=None, pop=None, bottom=FIXED):
  """Replays a run on an explicit stack (bottom first, ⊥ = 0).

  Returns:
    (stacks after updates 0..T, total log-weight or None without weights).

  Raises:
    ValueError: if the run is invalid under `bottom`'s semantics.
  """
  _check_bottom(bottom)
  min_repl, min_pop = (1, 2) if bottom == FIXED else (2, 3)
  return replay_with_heights(actions, push, repl, pop, min_repl, min_pop,
                             "replaces the frozen bottom symbol",
                             "pops below the allowed height")


# ---------------------------------------------------------------------------
# Config validation (called by train.validate_config and models.build).
# ---------------------------------------------------------------------------


def validate_stack_config(config) -> None:
  """Checks the stack-variant fields; raises a one-line ValueError.

  Fields (configs/default.py): stack_normalize (bool), stack_reading
  ("symbol" | "state"), stack_bottom ("frozen" | "fixed"), stack_window
  (0 = unlimited, else D ≥ 1), truncation_length (0 = none, else ≥ 1; needs
  a window). Missing fields take their defaults.
  """

  def get(name, default):
    try:
      return config[name]
    except (KeyError, AttributeError, TypeError):
      return getattr(config, name, default)

  normalize = get("stack_normalize", False)
  if not isinstance(normalize, (bool, np.bool_)):
    raise ValueError(f"config.stack_normalize must be a bool (got "
                     f"{normalize!r})")
  reading = get("stack_reading", STATE)
  if reading not in READINGS:
    raise ValueError(f"config.stack_reading is {reading!r}; expected one of "
                     f"{', '.join(READINGS)}")
  bottom = get("stack_bottom", FIXED)
  if bottom not in BOTTOMS:
    raise ValueError(f"config.stack_bottom is {bottom!r}; expected one of "
                     f"{', '.join(BOTTOMS)}")
  window = get("stack_window", 0)
  if (isinstance(window, bool) or not isinstance(window, (int, np.integer))
      or window < 0):
    raise ValueError(f"config.stack_window must be 0 (unlimited) or a window "
                     f"size D >= 1 (got {window!r})")
  trunc = get("truncation_length", 0)
  if (isinstance(trunc, bool) or not isinstance(trunc, (int, np.integer))
      or trunc < 0):
    raise ValueError(f"config.truncation_length must be 0 (none) or >= 1 "
                     f"(got {trunc!r})")
  if trunc and not window:
    raise ValueError("config.truncation_length needs a memory-limited stack "
                     "(config.stack_window >= 1): the unlimited stack reads "
                     "every earlier column")
