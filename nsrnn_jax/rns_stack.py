"""The generalised nondeterministic stack: exact for any finite log-weights.

A pure-array dynamic program (no Flax) for the stacks of the authors' later
models (rns-vrns-reference.md): the renormalising NS-RNN (RNS-RNN, ICLR 2022)
with unnormalised action weights and readings over (PDA state, top symbol),
and the bottom-symbol fix of ICLR 2023. `ns_stack` stays the CoNLL 2020
stack; this module is separate so that model is untouched.

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
the recurrence is a share in [0, 1], so nothing overflows, the only flush is
of shares below ~1e3 × the smallest normal float (≈1e-35 in float32), and
no share is ever amplified afterwards. All table-sized work is matmuls of
linear shares; only column-sized arrays are exponentiated.

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
G[b, y, i, q, x, k, t] = H_{i,k}[q,x,t,y]; index = time + 1 (time −1 .. T).
With the top symbol y leading and the column (k, t) trailing, the pop term
is one batched matmul over (b, y) contracting (k, t), with no transposes of
the table.
`limited_stack` runs the same step on a D × D sliding window.

Gradient: `run` and `run_coupled` have a custom VJP whose forward keeps only
the final table and log α (O(B·T²·Q²·S²)), and whose backward is one reverse
sweep that takes `jax.vjp` of update j on the final tables (update j reads
only columns < j, which never change after they are written;
ns-stack-gradient.md §3 "vjp-step"). The adjoint table is the only other
table-sized array, so gradient memory is O(T²), not the O(T³) of autodiff
through a scan that carries the table.

Cost: O(B·T³·Q³·S²) time (pop, factorised through M̃) + O(B·T²·Q³·S³)
(replace); every update works on the padded (T+2)² table.

Shape legend: B batch, T updates, N = T + 2 time points of the table axis,
Q states, S stack symbols, Y/X/Z symbols in roles, R destination state.
"""

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nsrnn_jax.ns_stack import logsumexp_guarded as _lse  # -inf-safe
from nsrnn_jax.ns_stack import safe_log as _safe_log

# Every contraction runs at full float32 (float64 stays float64) on every
# backend: JAX's default on GPUs / TPUs is reduced precision (TF32 / bf16
# passes), which the DP's shares cannot afford. Transposes (the custom VJP's
# jax.vjp) inherit it.
_PRECISION = lax.Precision.HIGHEST

Array = jax.Array

__all__ = [
    "BOTTOMS", "READINGS", "FIXED", "FROZEN", "STATE", "SYMBOL",
    "split_action_logits", "readout", "initial_table", "update",
    "run", "run_coupled", "run_log_space", "viterbi", "replay_run",
    "validate_stack_config",
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
  dtypes = {jnp.result_type(a) for a in (push, repl, pop)}
  if len(dtypes) != 1:
    raise ValueError(f"push, repl, pop must share one dtype, got {dtypes}")
  (dtype,) = dtypes
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"actions must be float log-weights, got {dtype}")
  for name, a in (("push", push), ("repl", repl), ("pop", pop)):
    if not isinstance(a, jax.core.Tracer):
      v = np.asarray(a)
      if np.isnan(v).any() or (v == np.inf).any():
        raise ValueError(f"{name} contains NaN or +inf log-weights")
  return b, t, q, s


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
    G [B, Y, N (row i), Q, X, N (column k), T (state t)].
  """
  _check_bottom(bottom)
  g = jnp.zeros((batch_size, num_symbols, num_points, num_states, num_symbols,
                 num_points, num_states), dtype)
  if bottom == FIXED and corner >= 1:
    g = g.at[:, 0, corner - 1, 0, 0, corner, 0].set(1)
  return g


def _finite_max(x, axis):
  """Max over `axis` of the finite entries (0 if none); a gradient constant."""
  m = jnp.max(jnp.where(jnp.isfinite(x), x, -jnp.inf), axis=axis)
  return lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0))


def update(g_BxYxNxQxXxNxT, p, a_prev_BxQxS, push_BxQxSxQxS, repl_BxQxSxQxS,
           pop_BxQxSxQ):
  """One update j on a share table.

  Args:
    g_BxYxNxQxXxNxT: shares (layout of `initial_table`) on a common time
      axis; axis index ``p`` holds
      time j−1. Only columns ≤ p are read (later columns, present in the
      final table during the backward sweep, are masked), and every row the
      table holds is a row the stack keeps at update j.
    p: axis index of time j−1 (int or traced int).
    a_prev_BxQxS: log α_{j−1} up to a constant per batch element (the
      drivers pass the normalised log α̂_{j−1}, logsumexp 0).
    push_BxQxSxQxS, repl_BxQxSxQxS, pop_BxQxSxQ: update j's log-weights.

  Returns:
    (col_BxYxNxQxXxR, a_hat_BxQxS, inc_B): column j on the same row axis
    (row p is the push row, time j−1), indexed [b, y, i, q, x, r]; the normalised log α̂_j; and
    inc = log Σα_j − (the constant of a_prev), so that with a normalised
    a_prev, log Σα_j = log Σα_{j−1} + inc. Dead (all-zero) α_j gives
    α̂_j = −inf and inc = −inf.

  Why the shift m: in float32, log-weights like −1e4 or +50·j lose their
  fractional digits when added to anything; every exponent below is formed
  from small numbers only (α̂ ≤ 0, actions − m, a_j − m) so shares keep full
  relative precision. m is a constant for differentiation (the result does
  not depend on it).
  """
  g = g_BxYxNxQxXxNxT
  dtype = g.dtype
  flush = _flush(dtype)
  n = g.shape[2]
  idx = jnp.arange(n)
  left = idx < p                                   # columns k ≤ j−2
  # prev[b, z, i, q, x, s] = H_{i,j−1}[q,x,s,z].
  prev = lax.dynamic_index_in_dim(g, p, axis=5, keepdims=False)
  colsum = jnp.sum(g, axis=(2, 3, 4))              # b y k t
  c_left = jnp.where(left[None, None, :, None], colsum, 0)
  c_prev = jnp.swapaxes(
      lax.dynamic_index_in_dim(colsum, p, axis=2, keepdims=False), 1, 2)
  # W[y,s,z] = Σ_{k,t} c_k[t,y] H_{k,j−1}[t,y,s,z]  (rows of prev = times k).
  w = jnp.einsum("bykt,bzktys->bysz", c_left, prev, precision=_PRECISION)
  a_prev = a_prev_BxQxS
  ok_r = c_prev > flush
  a_rep = jnp.where(ok_r, a_prev + _safe_log(jnp.where(ok_r, c_prev, 1)),
                    -jnp.inf)
  ok_w = w > flush
  log_w = jnp.where(ok_w, jnp.log(jnp.where(ok_w, w, 1)), -jnp.inf)  # b y s z
  pu, re, po = push_BxQxSxQxS, repl_BxQxSxQxS, pop_BxQxSxQ
  b = pu.shape[0]
  # The three families of terms of α_j (before the shift).
  push_t = a_prev[..., None, None] + pu                          # b q x r y
  repl_t = a_rep[..., None, None] + re                           # b s z r y
  pop_t = (log_w[:, :, :, :, None] + a_prev[:, None, :, :, None]
           + po[:, None])                                        # b y s z r
  m = jnp.maximum(jnp.maximum(_finite_max(push_t.reshape(b, -1), 1),
                              _finite_max(repl_t.reshape(b, -1), 1)),
                  _finite_max(pop_t.reshape(b, -1), 1))
  mb = m[:, None, None, None, None]
  pu, re, po = pu - mb, re - mb, po - m[:, None, None, None]
  # log α_j − m from its three parts, column-sized, in log space.
  push_t = a_prev[..., None, None] + pu
  push_part = _lse(push_t.reshape((b, -1) + pu.shape[3:]), axis=1)   # b r y
  repl_t = a_rep[..., None, None] + re
  repl_part = _lse(repl_t.reshape((b, -1) + re.shape[3:]), axis=1)   # b r y
  pop_t = (log_w[:, :, :, :, None] + a_prev[:, None, :, :, None]
           + po[:, None])                                         # b y s z r
  pop_part = jnp.swapaxes(
      _lse(pop_t.reshape(pop_t.shape[:2] + (-1,) + pop_t.shape[-1:]),
           axis=2), 1, 2)                                         # b r y
  a_j = _lse(jnp.stack([push_part, repl_part, pop_part]), axis=0)  # b r y
  ok_j = jnp.isfinite(a_j)
  # Push row: H_{j−1,j}.
  x = push_t - a_j[:, None, None]
  push_row = _exp_share(x, ok_j[:, None, None] & jnp.isfinite(x), dtype)
  # Replace rows: prev ⊗ K^R (K^R ≤ 1/c_prev; masked where c_prev flushed).
  x = a_prev[..., None, None] + re - a_j[:, None, None]
  k_rep = _exp_share(x, ok_r[..., None, None] & ok_j[:, None, None]
                     & jnp.isfinite(x), dtype)                  # b s z r y
  col = jnp.einsum("bziqxs,bszry->byiqxr", prev, k_rep, precision=_PRECISION)
  # Pop rows: M̃_k[t,y,r] = Σ_{s,z} H_{k,j−1}[t,y,s,z] K^P[y,s,z,r].
  x = (a_prev[:, None, :, :, None] + po[:, None]
       - jnp.swapaxes(a_j, 1, 2)[:, :, None, None, :])          # b y s z r
  k_pop = _exp_share(x, ok_w[..., None] & jnp.isfinite(x), dtype)
  mt = jnp.einsum("bzktys,byszr->byktr", prev, k_pop, precision=_PRECISION)
  mt = jnp.where((c_left > flush)[..., None], mt, 0)
  col = col + jnp.einsum("byiqxkt,byktr->byiqxr", g, mt, precision=_PRECISION)
  row_p = (idx == p).astype(dtype)[None, None, :, None, None, None]
  col = col + row_p * jnp.transpose(push_row, (0, 4, 1, 2, 3))[:, :, None]
  log_z = _lse(a_j.reshape(b, -1), axis=1)                        # b
  alive = jnp.isfinite(log_z)
  a_hat = jnp.where(alive[:, None, None],
                    a_j - jnp.where(alive, log_z, 0)[:, None, None], -jnp.inf)
  return col, a_hat, log_z + m


# ---------------------------------------------------------------------------
# Unlimited stack: forward scan and the vjp-step custom VJP.
# ---------------------------------------------------------------------------


def _initial(b, t, q, s, bottom, dtype):
  """Initial table, normalised log α̂ [B, T+1, Q, S] and log Σα [B, T+1]."""
  g = initial_table(b, t + 2, q, s, bottom, corner=1, dtype=dtype)
  la = jnp.full((b, t + 1, q, s), -jnp.inf, dtype).at[:, 0, 0, 0].set(0)
  return g, la, jnp.zeros((b, t + 1), dtype)


def _forward(push, repl, pop, bottom):
  """Forward scan; returns the final share table, log α̂ and log Σα."""
  b, t, q, s = push.shape[:4]
  g, la, lm = _initial(b, t, q, s, bottom, push.dtype)

  def body(carry, inp):
    g, la, lm = carry
    j, pu, re, po = inp
    a_prev = lax.dynamic_index_in_dim(la, j - 1, axis=1, keepdims=False)
    col, a_hat, inc = update(g, j, a_prev, pu, re, po)  # time j−1 at index j
    g = lax.dynamic_update_index_in_dim(g, col, j + 1, axis=5)
    la = lax.dynamic_update_index_in_dim(la, a_hat, j, axis=1)
    lm_prev = lax.dynamic_index_in_dim(lm, j - 1, axis=1, keepdims=False)
    lm = lax.dynamic_update_index_in_dim(lm, lm_prev + inc, j, axis=1)
    return (g, la, lm), None

  xs = (jnp.arange(1, t + 1),) + tuple(jnp.swapaxes(a, 0, 1)
                                      for a in (push, repl, pop))
  (g, la, lm), _ = lax.scan(body, (g, la, lm), xs)
  return g, la, lm


def _increment_cotangents(lm_ct):
  """log Σα_j = Σ_{l≤j} inc_l, so inc_l's cotangent is Σ_{j≥l} of lm's."""
  return jnp.flip(jnp.cumsum(jnp.flip(lm_ct, 1), axis=1), 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tables(push, repl, pop, bottom):
  return _forward(push, repl, pop, bottom)[1:]


def _tables_fwd(push, repl, pop, bottom):
  g, la, lm = _forward(push, repl, pop, bottom)
  return (la, lm), (g, la, push, repl, pop)


def _tables_bwd(bottom, res, cts):
  del bottom
  g, la, push, repl, pop = res
  la_ct, lm_ct = cts
  inc_ct = _increment_cotangents(lm_ct)
  t = push.shape[1]

  def body(carry, inp):
    g_bar, la_bar = carry
    j, pu, re, po, i_ct = inp
    a_prev = lax.dynamic_index_in_dim(la, j - 1, axis=1, keepdims=False)
    col_ct = lax.dynamic_index_in_dim(g_bar, j + 1, axis=5, keepdims=False)
    a_ct = lax.dynamic_index_in_dim(la_bar, j, axis=1, keepdims=False)
    _, vjp = jax.vjp(lambda gg, ap, a, b_, c: update(gg, j, ap, a, b_, c),
                     g, a_prev, pu, re, po)
    dg, da, dpu, dre, dpo = vjp((col_ct, a_ct, i_ct))
    g_bar = g_bar + dg
    la_bar = lax.dynamic_update_index_in_dim(
        la_bar, lax.dynamic_index_in_dim(la_bar, j - 1, 1, False) + da,
        j - 1, axis=1)
    return (g_bar, la_bar), (dpu, dre, dpo)

  xs = ((jnp.arange(1, t + 1),)
        + tuple(jnp.swapaxes(a, 0, 1) for a in (push, repl, pop))
        + (jnp.swapaxes(inc_ct[:, 1:], 0, 1),))
  _, (dpu, dre, dpo) = lax.scan(body, (jnp.zeros_like(g), la_ct), xs,
                                reverse=True)
  return tuple(jnp.swapaxes(d, 0, 1) for d in (dpu, dre, dpo))


_tables.defvjp(_tables_fwd, _tables_bwd)


def run(push, repl, pop, bottom=FIXED):
  """Normalised log α and log Σα for j = 0..T from action log-weights.

  Exact for any finite log-weights (unnormalised, large, −inf), in float32
  and float64; differentiable in O(T²) memory.

  Args:
    push, repl: [B, T, Q, S, Q, S] log-weights indexed (q, x, r, y).
    pop: [B, T, Q, S, Q] log-weights indexed (q, x, r).
    bottom: "fixed" (default) or "frozen".

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
  return _run_jit(push, repl, pop, bottom)


@functools.partial(jax.jit, static_argnums=(3,))
def _run_jit(push, repl, pop, bottom):
  return _tables(push, repl, pop, bottom)


# ---------------------------------------------------------------------------
# Coupled controller + stack (the RNS-RNN's recurrence).
# ---------------------------------------------------------------------------


def _coupled_step(step_fn, reading, params, ctrl, x, g, la, j):
  """Controller step j, then update j; (ctrl_j, out_j, col_j, α̂_j, inc_j)."""
  a_prev = lax.dynamic_index_in_dim(la, j - 1, axis=1, keepdims=False)
  rho, _ = readout(a_prev, reading)
  ctrl, acts, out = step_fn(params, ctrl, x, rho)
  col, a_hat, inc = update(g, j, a_prev, *acts)
  return ctrl, out, col, a_hat, inc


def _float_dtype(tree):
  leaves = [l for l in jax.tree_util.tree_leaves(tree)
            if jnp.issubdtype(jnp.result_type(l), jnp.floating)]
  return jnp.result_type(*leaves) if leaves else jnp.float32


def _coupled_forward(step_fn, q, s, bottom, reading, params, init_carry, xs):
  leaves = jax.tree_util.tree_leaves(xs)
  b, t = leaves[0].shape[:2]
  g, la, lm = _initial(b, t, q, s, bottom, _float_dtype(params))
  xs_T = jax.tree_util.tree_map(lambda l: jnp.swapaxes(l, 0, 1), xs)

  def body(carry, inp):
    ctrl, g, la, lm = carry
    j, x = inp
    new_ctrl, out, col, a_hat, inc = _coupled_step(step_fn, reading, params,
                                                   ctrl, x, g, la, j)
    g = lax.dynamic_update_index_in_dim(g, col, j + 1, axis=5)
    la = lax.dynamic_update_index_in_dim(la, a_hat, j, axis=1)
    lm_prev = lax.dynamic_index_in_dim(lm, j - 1, axis=1, keepdims=False)
    lm = lax.dynamic_update_index_in_dim(lm, lm_prev + inc, j, axis=1)
    return (new_ctrl, g, la, lm), (out, ctrl)

  (_, g, la, lm), (outs, ctrls) = lax.scan(body, (init_carry, g, la, lm),
                                           (jnp.arange(1, t + 1), xs_T))
  return outs, la, lm, g, ctrls


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _coupled(step_fn, q, s, bottom, reading, params, init_carry, xs):
  outs, la, lm, _, _ = _coupled_forward(step_fn, q, s, bottom, reading,
                                        params, init_carry, xs)
  return outs, la, lm


def _coupled_fwd(step_fn, q, s, bottom, reading, params, init_carry, xs):
  outs, la, lm, g, ctrls = _coupled_forward(step_fn, q, s, bottom, reading,
                                            params, init_carry, xs)
  return (outs, la, lm), (params, xs, g, la, ctrls)


def _zero_cotangent(x):
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


def _coupled_bwd(step_fn, q, s, bottom, reading, res, cts):
  """Reverse sweep: vjp of (controller step j + update j) on final tables."""
  del q, s, bottom
  params, xs, g, la, ctrls = res
  outs_ct, la_ct, lm_ct = cts
  inc_ct = _increment_cotangents(lm_ct)
  xs_T = jax.tree_util.tree_map(lambda l: jnp.swapaxes(l, 0, 1), xs)
  t = jax.tree_util.tree_leaves(xs)[0].shape[1]
  outs_ct_T = outs_ct  # _coupled's outs are time-major
  zeros = lambda tree: jax.tree_util.tree_map(jnp.zeros_like, tree)

  def body(carry, inp):
    p_bar, c_bar, g_bar, la_bar = carry
    j, x, ctrl_prev, out_ct, i_ct = inp

    def f(p, c, lla, gg):
      return _coupled_step(step_fn, reading, p, c, x, gg, lla, j)

    _, vjp = jax.vjp(f, params, ctrl_prev, la, g)
    col_ct = lax.dynamic_index_in_dim(g_bar, j + 1, axis=5, keepdims=False)
    a_ct = lax.dynamic_index_in_dim(la_bar, j, axis=1, keepdims=False)
    dp, dc, dla, dg = vjp((c_bar, out_ct, col_ct, a_ct, i_ct))
    p_bar = jax.tree_util.tree_map(jnp.add, p_bar, dp)
    return (p_bar, dc, g_bar + dg, la_bar + dla), None

  # The carry after the last step feeds nothing: its cotangent is zero.
  ctrl_last = jax.tree_util.tree_map(lambda c: c[-1], ctrls)
  init = (zeros(params), zeros(ctrl_last), jnp.zeros_like(g), la_ct)
  xs_scan = (jnp.arange(1, t + 1), xs_T, ctrls, outs_ct_T,
             jnp.swapaxes(inc_ct[:, 1:], 0, 1))
  (p_bar, c_bar, _, _), _ = lax.scan(body, init, xs_scan, reverse=True)
  return p_bar, c_bar, jax.tree_util.tree_map(_zero_cotangent, xs)


_coupled.defvjp(_coupled_fwd, _coupled_bwd)


def run_coupled(step_fn: Callable[..., Any], params, init_carry, xs,
                num_states: int, num_symbols: int, bottom: str = FIXED,
                reading: str = STATE):
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
                            bottom, reading, params, init_carry, xs)
  outs = jax.tree_util.tree_map(lambda o: jnp.swapaxes(o, 0, 1), outs_T)
  return outs, la, lm


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


PUSH, REPLACE, POP = "push", "replace", "pop"


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
  return [_backtrace(lg[n], la[n], pu[n], re[n], po[n], t, fixed)
          for n in range(b)]


def _argmax(a):
  return np.unravel_index(int(np.argmax(a)), a.shape)


def _backtrace(lg, la, push, repl, pop, t, fixed):
  """One best run from the max-plus tables (lg rows offset by one)."""
  if t == 0:
    return [], 0.0
  best = la[t].max()
  if not np.isfinite(best):
    return [], -np.inf
  # α_j = max_{i,q,x} α_i ⊗ γ_{i,j}; α_{−1} = e (fixed) enters via row −1.
  alpha_rows = np.full((t + 2,) + la.shape[1:], -np.inf)
  alpha_rows[1:] = la
  if fixed:
    alpha_rows[0, 0, 0] = 0.0
  actions, todo = [], []
  r, y = _argmax(la[t])
  j = t
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
    rep = lg[i + 1, j - 1, q, x] + repl[j - 1, :, :, r, y]
    best_rep = rep.max()
    best_pop, pop_terms = -np.inf, None
    ks = np.arange(max(i + 1, 0), j - 1)
    if len(ks):
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


def replay_run(actions, push=None, repl=None, pop=None, bottom=FIXED):
  """Replays a run on an explicit stack (bottom first, ⊥ = 0).

  Returns:
    (stacks after updates 0..T, total log-weight or None without weights).

  Raises:
    ValueError: if the run is invalid under `bottom`'s semantics.
  """
  _check_bottom(bottom)
  min_repl, min_pop = (1, 2) if bottom == FIXED else (2, 3)
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
      if len(stack) < min_repl:
        raise ValueError(f"step {j} replaces the frozen bottom symbol")
      new = stack[:-1] + (y,)
      w = None if repl is None else repl[j - 1][q, x, r, y]
    elif kind == POP:
      if len(stack) < min_pop:
        raise ValueError(f"step {j} pops below the allowed height")
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
