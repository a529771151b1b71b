"""The vector nondeterministic stack (VRNS-RNN; DuSell & Chiang, 2023).

A pure-array dynamic program (no Flax). Every stack element carries a vector
in R^m besides its symbol: a push of symbol y at update j stores the vector
v_j (from the controller), a replace changes the symbol and keeps the
vector, a pop uncovers the element below with its own vector. The reading
after update j is, for every PDA state r and top symbol y, the expected
vector of the top element jointly with (state, top) = (r, y) under the
global run weights:

  ρ_j[r,y,:] = Σ_runs w(run) 𝟙[state=r, top=y] vec(top) / Σ_runs w(run),

a Q·S·m vector (rns-vrns-reference.md §3). Action weights are
unnormalised (the RNS-RNN's exp(affine)), so ρ is invariant to adding a
constant to all log-weights of one update.

Semantics: the bottom fix (rns-vrns-reference.md §1.5)
------------------------------------------------------
Runs start in state 0 with the stack [⊥] (symbol 0) whose vector is v_⊥.
Push is always allowed, replace is allowed on any top including the bottom
element (its symbol can change; it keeps v_⊥), pop needs height >= 2. With
P_j / R_j / O_j the push / replace / pop weights of update j (real semiring;
the code works in log space):

  γ[j−1→j] = P_j,                    ζ[j−1→j] = P_j ⊗ v_j
  γ′_j[k][t,y,r] = Σ_{s,z} γ[k→j−1][t,y→s,z] O_j[s,z,r]            (pop)
  γ[i→j] = Σ_{s,z} γ[i→j−1] R_j + Σ_{k=i+1}^{j−2} Σ_t γ[i→k][·→t,y] γ′_j[k][t,y,r]
  ζ[i→j] = the same with ζ in place of γ on the left (γ′ stays γ′)
  α_j = b_j + Σ_{i=0}^{j−1} α_i γ[i→j],   η_j = c_j + Σ_{i=0}^{j−1} α_i ζ[i→j]
  ρ_j = η_j / Σ_{r,y} α_j

with 0 ≤ i < j, α_0 = e_{0,⊥}, and the "bottom rows" b_j = γ[−1→j][0,⊥→·]
and c_j = ζ[−1→j][0,⊥→·] (the runs whose top at time j is the bottom
element) following the same replace/pop recurrence from b_0 = e_{0,⊥}.

The bottom vector: c_0 = e_{0,⊥} ⊗ v_⊥ (run-consistent, the default) makes
ρ_j exactly the expectation above. `broadcast_bottom=True` reproduces the
authors' code, which writes v_⊥ into every (state, symbol) of c_0
(rns-vrns-reference.md §3.3): the readings then also count, with weight 1
each, the Q·S start configurations (state t, stack [y]) that the stack was
never in, for runs whose top is still the bottom element; the denominator
does not, so ρ_j is no longer an expectation.

Two implementations
-------------------
`run` and `run_coupled` compute the run-consistent stack by default on the
RNS-RNN's share sweep (`rns_stack.run_coupled_vectors`): α as posterior
shares and, per (state, top) and time, the expected top vector E_k summed
over every row (η_j = α_j ⊗ E_j), whose recurrence uses the share kernels and
M̃ already formed for α, so the vectors add column-sized work per update
(≈ the RNS stack's cost; ~100× faster than the tables below at n = 80;
docs/benchmarks.md). E_k is a share-weighted average of pushed vectors, so
it stays within the vectors' range in any dtype. The log-space tables below
are the reference (``log_space=True``; equal values and gradients, tested in
float64) and the broadcast bottom's path, whose phantom start
configurations have no α to take shares of.

Representation and numerics of the log-space tables
---------------------------------------------------
Everything is in log space (γ, ζ, α, η, b, c and the inputs; −inf = weight
zero, log v for vectors). Each semiring contraction is an explicit
broadcast followed by a log-sum-exp whose shift is the maximum of that very
sum, so the dominant term of every sum is represented exactly whatever the
magnitudes of the log-weights (any finite values; large, unnormalised,
mixed with −inf); only terms more than ~87 nats (float32) below their own
sum's largest term are lost. Sums over nothing but −inf give −inf with zero
gradient (no NaN).

Memory: the gradient is a `jax.custom_vjp` whose forward saves only the
final tables (every column is written once and never changed, so the final
table holds every value any step read) and the per-step controller carries.
Its backward is one reverse `lax.scan` that, at step j, re-runs step j's
VJP on the final tables. Memory is O(B·T²·Q²·S²·m) for the tables and their
cotangent plus one step's temporaries (O(B·T²·Q³·S²·m) for the pop
broadcast); plain autodiff of the scan would save the tables at every step,
O(T³).

Cost per update j: O(B·T²·Q³·S²·m) (pop, over the full square of rows and
intermediate times) + O(B·T·Q³·S³·m) (replace).

Table layout (I = J = T + 1 times 0..T; entries with i ≥ j stay −inf). The
scalar and vector weights share one trailing axis of 1 + M components
(component 0 = the scalar), so one set of contractions updates both:
  log_table   [B, I, J, Q, S, Q, S, 1+M]  [b, i, j, q, x, r, y] = γ[i→j] | ζ[i→j]
  log_forward [B, J, Q, S, 1+M]           α_j | η_j
  log_bottom  [B, J, Q, S, 1+M]           b_j | c_j

Shape legend: B batch, T updates, Q states, S stack symbols (0 = ⊥), M
stack-vector size m, I/K row (source) times, J column (destination) time,
H controller hidden size.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nsrnn_jax import ns_stack
from nsrnn_jax import rns_stack

Array = jax.Array

__all__ = [
    "VectorStackState",
    "bottom_element",
    "check_log_bottom_vector",
    "init_state",
    "step",
    "readings",
    "run",
    "run_coupled",
    "run_autodiff",
    "time_blocks_of",
]


# ---------------------------------------------------------------------------
# Guarded log-semiring primitives.
# ---------------------------------------------------------------------------


def _lse(x, axis):
  """log Σ exp over `axis` (int or tuple); all −inf gives −inf, grad 0.

  The shift is each sum's own maximum (a gradient constant), so the largest
  term of every sum is exactly 1 before the log.
  """
  m = lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  s = jnp.sum(jnp.exp(x - m), axis=axis, keepdims=True)
  positive = s > 0
  out = jnp.where(positive, jnp.log(jnp.where(positive, s, 1.0)) + m,
                  -jnp.inf)
  return jnp.squeeze(out, axis)


def _add(a, b):
  """Log-semiring ⊕ of two arrays of one shape."""
  return _lse(jnp.stack([a, b]), 0)


# ---------------------------------------------------------------------------
# State, one update, readings.
# ---------------------------------------------------------------------------


class VectorStackState(NamedTuple):
  """The append-only tables of the DP (see the module docstring).

  The last axis holds 1 + M components: component 0 is the scalar weight
  (γ, α, b) and components 1..M the vector weight (ζ, η, c), so that one
  set of contractions updates both.
  """
  log_table: Array    # [B, I, J, Q, S, Q, S, 1+M]  γ[i→j] | ζ[i→j]
  log_forward: Array  # [B, J, Q, S, 1+M]           α_j | η_j
  log_bottom: Array   # [B, J, Q, S, 1+M]           b_j | c_j

  @property
  def log_gamma(self):
    """log γ [B, I, J, Q, S, Q, S]."""
    return self.log_table[..., 0]

  @property
  def log_zeta(self):
    """log ζ [B, I, J, Q, S, Q, S, M]."""
    return self.log_table[..., 1:]

  @property
  def log_alpha(self):
    """log α [B, J, Q, S]."""
    return self.log_forward[..., 0]

  @property
  def log_eta(self):
    """log η [B, J, Q, S, M]."""
    return self.log_forward[..., 1:]


def check_log_bottom_vector(log_bottom_vector_BxM) -> Array:
  """log v_⊥ as a float array [B, M], B, M >= 1; one-line ValueError
  otherwise (a shape that would fail deep inside JAX)."""
  log_v = jnp.asarray(log_bottom_vector_BxM)
  if (log_v.ndim != 2 or min(log_v.shape) < 1
      or not jnp.issubdtype(log_v.dtype, jnp.floating)):
    raise ValueError("the log bottom vector must be a float array [B, M] "
                     f"with B, M >= 1, got {log_v.dtype}{list(log_v.shape)}")
  return log_v


def bottom_element(log_bottom_vector_BxM, num_states, num_symbols,
                   broadcast_bottom=False):
  """α_0 | c_0 [B, Q, S, 1+M]: the start (0, ⊥) with the bottom's vector.

  Component 0 is log e_{0,⊥}; components 1.. are log v_⊥ at (0, ⊥) only,
  or at every (state, symbol) with `broadcast_bottom` (the authors' code,
  rns-vrns-reference.md §3.3).
  """
  log_v = check_log_bottom_vector(log_bottom_vector_BxM)
  b, m = log_v.shape
  q, s = ns_stack.check_sizes(num_states=num_states, num_symbols=num_symbols)
  dt = log_v.dtype
  one_hot_QxS = jnp.full((q, s), -jnp.inf, dt).at[0, 0].set(0.0)
  a0 = jnp.broadcast_to(one_hot_QxS[None, :, :, None], (b, q, s, 1))
  if broadcast_bottom:
    c0 = jnp.broadcast_to(log_v[:, None, None, :], (b, q, s, m))
  else:
    c0 = one_hot_QxS[None, :, :, None] + log_v[:, None, None, :]
  return jnp.concatenate([a0, c0], axis=-1)


def init_state(log_bottom_vector_BxM, num_steps, num_states, num_symbols,
               broadcast_bottom=False):
  """Tables for `num_steps` updates with time 0 filled in.

  Args:
    log_bottom_vector_BxM: log v_⊥, [B, M] (or [M] for batch 1). −inf
      entries (v_⊥ = 0) are allowed.
    num_steps: T.
    num_states: Q.
    num_symbols: S.
    broadcast_bottom: put v_⊥ in every (state, symbol) of c_0 as the authors'
      code does, instead of only at (0, ⊥).
  """
  log_v = jnp.asarray(log_bottom_vector_BxM)
  if log_v.ndim == 1:
    log_v = log_v[None]
  (num_steps,) = ns_stack.check_sizes(0, num_steps=num_steps)
  # bottom_element checks the vector and Q, S.
  first = bottom_element(log_v, num_states, num_symbols, broadcast_bottom)
  b, q, s, m1 = first.shape  # m1 = 1 + M
  t1, dt, ninf = num_steps + 1, first.dtype, -jnp.inf
  forward = jnp.full((b, t1, q, s, m1), ninf, dt).at[:, 0].set(first)
  return VectorStackState(
      log_table=jnp.full((b, t1, t1, q, s, q, s, m1), ninf, dt),
      log_forward=forward, log_bottom=forward)


class _Column(NamedTuple):
  """What update j adds: column j of every table."""
  table: Array    # [B, I, Q, S, Q, S, 1+M]
  forward: Array  # [B, Q, S, 1+M]
  bottom: Array   # [B, Q, S, 1+M]


_POP_ROW_CHUNKS = 4


def _pop_rows(log_table, gp_b):
  """Σ_{k,t} table[i→k][q,x→t,y] γ′[k][t,y,r] over the live (i, k) pairs.

  Only k > i contributes (γ[i→k] is −inf otherwise), so the rows are cut
  into static chunks [r0, r1), each contracted with k ≥ r0 + 1 only: 4
  chunks do ~5/8 of the square's work, with the same values (the skipped
  terms are −inf).
  """
  n = log_table.shape[1]
  chunks = min(_POP_ROW_CHUNKS, n)
  edges = [(n * c) // chunks for c in range(chunks + 1)]
  parts = []
  for r0, r1 in zip(edges[:-1], edges[1:]):
    if r1 <= r0:
      continue
    k0 = r0 + 1
    sub = log_table[:, r0:r1]
    if k0 >= n:  # no live k: every entry of these rows is −inf
      shape = sub.shape[:2] + sub.shape[3:5] + gp_b.shape[6:7] + sub.shape[6:]
      parts.append(jnp.full(shape, -jnp.inf, log_table.dtype))
      continue
    parts.append(_lse(sub[:, :, k0:, :, :, :, None, :, :]
                      + gp_b[:, :, k0:], (2, 5)))
  return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


def _column(state, j, push, repl, pop, log_vec):
  """Column j from the tables' columns < j (later columns are never read).

  Reading only columns < j is what lets the backward pass run this function
  on the final tables. Entries of later columns meet −inf factors: γ[k→j−1]
  is −inf for k ≥ j−1, so γ′_j[k] is too, and the new column is masked to
  rows i < j before α_i (i ≥ j) multiplies it.
  """
  prev = state.log_table[:, :, j - 1]          # [B,I,Q,X,S,Z,C] (C = 1+M)
  # Replace: Σ_{s,z} γ|ζ[i→j−1][q,x→s,z] R[s,z,r,y].
  r_b = repl[:, None, None, None, ..., None]   # [B,1,1,1,S,Z,R,Y,1]
  repl_all = _lse(prev[:, :, :, :, :, :, None, None, :] + r_b, (4, 5))
  # γ′_j[k][t,y,r] = Σ_{s,z} γ[k→j−1][t,y→s,z] O[s,z,r]   [B,K,T,Y,R]
  gp = _lse(prev[..., 0, None] + pop[:, None, None, None], (4, 5))
  # Pop: Σ_{k,t} γ|ζ[i→k][q,x→t,y] γ′_j[k][t,y,r]   -> [B,I,Q,X,R,Y,C]
  gp_b = jnp.transpose(gp, (0, 1, 2, 4, 3))[:, None, :, None, None, ...,
                                             None]  # [B,1,K,1,1,T,R,Y,1]
  pop_all = _pop_rows(state.log_table, gp_b)
  # Bottom rows b_k | c_k in place of row i.
  bot_repl = _lse(state.log_bottom[:, j - 1][:, :, :, None, None, :]
                  + repl[..., None], (1, 2))
  bot_pop = jnp.swapaxes(
      _lse(state.log_bottom[:, :, :, :, None, :] + gp[..., None], (1, 2)),
      1, 2)
  bottom = _add(bot_repl, bot_pop)
  rows = jnp.arange(state.log_table.shape[1])
  shape = (1, -1, 1, 1, 1, 1, 1)
  is_push = (rows == j - 1).reshape(shape)
  below = (rows < j - 1).reshape(shape)
  log_vec1 = jnp.concatenate([jnp.zeros_like(log_vec[:, :1]), log_vec], -1)
  pushed = push[:, None, ..., None] + log_vec1[:, None, None, None, None,
                                               None, :]
  ninf = jnp.array(-jnp.inf, prev.dtype)
  table = jnp.where(is_push, pushed,
                    jnp.where(below, _add(repl_all, pop_all), ninf))
  # α_j | η_j = b_j | c_j + Σ_{i,q,x} α_i[q,x] γ|ζ[i→j][q,x,r,y].
  a_b = state.log_forward[..., 0][..., None, None, None]  # [B,I,Q,X,1,1,1]
  forward = _add(bottom, _lse(a_b + table, (1, 2, 3)))
  return _Column(table, forward, bottom)


def _write(state, j, col):
  return VectorStackState(
      log_table=state.log_table.at[:, :, j].set(col.table),
      log_forward=state.log_forward.at[:, j].set(col.forward),
      log_bottom=state.log_bottom.at[:, j].set(col.bottom))


def _read_column(state, j):
  """Column j of every table (the cotangent of update j's outputs)."""
  return _Column(state.log_table[:, :, j], state.log_forward[:, j],
                 state.log_bottom[:, j])


def step(state, j, push_BxQxSxQxS, repl_BxQxSxQxS, pop_BxQxSxQ,
         log_vector_BxM):
  """Update j (1-based) of the stack: fills column j of every table.

  Args:
    state: tables after updates 1..j−1.
    j: the update number (traced int allowed).
    push_BxQxSxQxS, repl_BxQxSxQxS: log-weights indexed (q, x, r, y).
    pop_BxQxSxQ: log-weights indexed (q, x, r).
    log_vector_BxM: log of the pushed vector v_j.
  """
  return _write(state, j, _column(state, j, push_BxQxSxQxS, repl_BxQxSxQxS,
                                  pop_BxQxSxQ, log_vector_BxM))


def readings(state, j=None):
  """Readings ρ and log Σα from the tables.

  Args:
    state: a `VectorStackState`.
    j: a time (then [B, Q·S·M] and [B]) or None (all times: [B, T+1, Q, S,
      M] and [B, T+1]).

  Returns:
    (reading, log_mass). Flattened readings are in (r, y, k) order, index
    (r·S + y)·M + k, as in the authors' code. A time whose runs all have
    weight zero reads 0.
  """
  la, le = state.log_alpha, state.log_eta
  if j is not None:
    la, le = la[:, j], le[:, j]
    log_mass = _lse(la, (1, 2))
    fin = jnp.isfinite(log_mass)
    safe = jnp.where(fin, log_mass, 0.0)
    rho = jnp.where(fin[:, None, None, None],
                    jnp.exp(le - safe[:, None, None, None]), 0.0)
    return rho.reshape(rho.shape[0], -1), log_mass
  log_mass = _lse(la, (2, 3))
  fin = jnp.isfinite(log_mass)
  safe = jnp.where(fin, log_mass, 0.0)
  rho = jnp.where(fin[..., None, None, None],
                  jnp.exp(le - safe[..., None, None, None]), 0.0)
  return rho, log_mass


# ---------------------------------------------------------------------------
# Controller-coupled run with an O(T²) custom VJP.
# ---------------------------------------------------------------------------


def _split_ints(tree):
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  is_float = [jnp.issubdtype(jnp.asarray(l).dtype, jnp.inexact)
              for l in leaves]
  return leaves, treedef, is_float


def _coupled_step(step_fn, params, carry, x_t, state, j):
  """Controller step j (sees ρ_{j−1}) and update j; returns new pieces."""
  reading, _ = readings(state, j - 1)
  carry, (push, repl, pop, log_vec), out = step_fn(params, carry, x_t,
                                                   reading)
  col = _column(state, j, push, repl, pop, log_vec)
  return carry, col, out


def time_blocks_of(num_steps, max_blocks=None):
  """Static blocks [j0, j1) of updates 1..T; block [j0, j1) only reads and
  writes the tables' rows / columns < j1 (its live region).

  Each block is its own `lax.scan` over tables sliced to that region, so the
  O(j²) pop contraction of update j runs over a j1 x j1 square instead of
  the full (T+1) x (T+1) one: nb blocks do ~1/3 + 1/(2 nb) of the padded
  work (0.47 for 4 blocks, 0.40 for 8); more blocks cost compile time.

  Args:
    num_steps: T.
    max_blocks: at most this many blocks (None: min(8, T // 8), at least 1).
  """
  if max_blocks is None:
    max_blocks = min(_MAX_BLOCKS, num_steps // 8)
  elif (isinstance(max_blocks, bool)
        or not isinstance(max_blocks, (int, np.integer)) or max_blocks < 1):
    raise ValueError(f"time_blocks must be a positive integer or None, "
                     f"got {max_blocks!r}")
  # The same near-equal edges as the other stacks' blocks (at least one
  # block, at most one per update).
  return ns_stack.time_blocks(num_steps, int(max_blocks))


_MAX_BLOCKS = 8


def _slice_state(state, n):
  """The tables restricted to times < n (rows and columns; a static prefix)."""
  return VectorStackState(state.log_table[:, :n, :n],
                          state.log_forward[:, :n], state.log_bottom[:, :n])


def _unslice_state(full, part):
  """Writes a prefix state (from `_slice_state`) back into the full one."""
  n = part.log_forward.shape[1]
  return VectorStackState(full.log_table.at[:, :n, :n].set(part.log_table),
                          full.log_forward.at[:, :n].set(part.log_forward),
                          full.log_bottom.at[:, :n].set(part.log_bottom))


def _coupled_forward(step_fn, params, init_carry, init, xs_T, blocks):
  """Blocked forward scans; returns (carry, final tables, carries, outs)."""

  def body(c, inp):
    carry, state, pending = c
    j, x_t = inp
    # Column j−1 (computed by the previous step) is written here, before the
    # tables are read, and fenced: written after the reads, the in-place
    # update makes XLA copy the whole table every step.
    state = lax.optimization_barrier(_write(state, j - 1, pending))
    new_carry, col, out = _coupled_step(step_fn, params, carry, x_t, state, j)
    return (new_carry, state, col), (carry, out)

  carry, state, ys = init_carry, init, []
  for j0, j1 in blocks:
    part = _slice_state(state, j1)
    xs_blk = jax.tree_util.tree_map(lambda l: l[j0 - 1:j1 - 1], xs_T)
    # The first step rewrites column j0 − 1 with its own values.
    (carry, part, last), y = lax.scan(
        body, (carry, part, _read_column(part, j0 - 1)),
        (jnp.arange(j0, j1), xs_blk))
    state = _unslice_state(state, _write(part, j1 - 1, last))
    ys.append(y)
  carries, outs = jax.tree_util.tree_map(
      lambda *a: jnp.concatenate(a, axis=0), *ys)
  return carry, state, carries, outs


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5))
def _coupled(step_fn, params, init_carry, init, xs_T, blocks):
  carry, state, _, outs = _coupled_forward(step_fn, params, init_carry, init,
                                           xs_T, blocks)
  return carry, state, outs


def _coupled_fwd(step_fn, params, init_carry, init, xs_T, blocks):
  carry, state, carries, outs = _coupled_forward(step_fn, params, init_carry,
                                                 init, xs_T, blocks)
  return (carry, state, outs), (params, state, carries, xs_T)


def _coupled_bwd(step_fn, blocks, res, cts):
  params, final, carries, xs_T = res
  carry_ct, state_ct, outs_ct = cts
  leaves, treedef, is_float = _split_ints(xs_T)
  float_leaves = [l for l, f in zip(leaves, is_float) if f]
  int_leaves = [l for l, f in zip(leaves, is_float) if not f]

  def body(part_final, c, inp):
    carry_ct, state_ct, params_ct = c
    j, carry_prev, out_ct, x_float, x_int = inp

    def f(p, cy, xf, st):
      it_f, it_i = iter(xf), iter(x_int)
      x_t = treedef.unflatten([next(it_f) if fl else next(it_i)
                               for fl in is_float])
      return _coupled_step(step_fn, p, cy, x_t, st, j)

    _, vjp = jax.vjp(f, params, carry_prev, list(x_float), part_final)
    p_ct, cy_ct, xf_ct, st_ct = vjp(
        (carry_ct, _read_column(state_ct, j), out_ct))
    state_ct = jax.tree_util.tree_map(jnp.add, state_ct, st_ct)
    params_ct = jax.tree_util.tree_map(jnp.add, params_ct, p_ct)
    return (cy_ct, state_ct, params_ct), xf_ct

  params_ct = jax.tree_util.tree_map(jnp.zeros_like, params)
  xf_parts = []
  # Blocks in reverse; block [j0, j1) reads and adds to times < j1 only.
  for j0, j1 in reversed(blocks):
    sl = lambda l: l[j0 - 1:j1 - 1]  # pylint: disable=cell-var-from-loop
    (carry_ct, part_ct, params_ct), xf_ct = lax.scan(
        functools.partial(body, _slice_state(final, j1)),
        (carry_ct, _slice_state(state_ct, j1), params_ct),
        (jnp.arange(j0, j1), jax.tree_util.tree_map(sl, carries),
         jax.tree_util.tree_map(sl, outs_ct), [sl(l) for l in float_leaves],
         [sl(l) for l in int_leaves]),
        reverse=True)
    state_ct = _unslice_state(state_ct, part_ct)
    xf_parts.append(xf_ct)
  xf_cts = [jnp.concatenate(p[::-1], axis=0) for p in zip(*xf_parts)]
  # Only time 0 of the initial tables reaches the result (later columns are
  # overwritten), so only its cotangent flows back (to v_⊥).
  times = jnp.arange(final.log_forward.shape[1]) == 0
  keep = times.reshape((1, -1, 1, 1, 1))
  init_ct = VectorStackState(
      log_table=jnp.zeros_like(state_ct.log_table),
      log_forward=jnp.where(keep, state_ct.log_forward, 0.0),
      log_bottom=jnp.where(keep, state_ct.log_bottom, 0.0))
  it_f = iter(xf_cts)
  xs_ct = treedef.unflatten([
      next(it_f) if fl else np.zeros(l.shape, jax.dtypes.float0)
      for l, fl in zip(leaves, is_float)])
  return params_ct, carry_ct, init_ct, xs_ct


_coupled.defvjp(_coupled_fwd, _coupled_bwd)


def _check_inputs(num_states, num_symbols, log_bottom_vector, b, m=None):
  """log v_⊥ as [B, M] (checked; `m`: the vectors' M where known)."""
  ns_stack.check_sizes(num_states=num_states, num_symbols=num_symbols)
  lv = jnp.asarray(log_bottom_vector)
  if lv.ndim == 1:
    lv = jnp.broadcast_to(lv[None], (b, lv.shape[0]))
  if lv.ndim != 2 or lv.shape[0] != b or lv.shape[1] < 1:
    raise ValueError(f"log_bottom_vector must be [M] or [B={b}, M] with "
                     f"M >= 1, got shape {jnp.shape(log_bottom_vector)}")
  if m is not None and lv.shape[1] != m:
    raise ValueError(f"log_bottom_vector has M = {lv.shape[1]}, the pushed "
                     f"vectors (log_vectors) M = {m}")
  rns_stack.check_no_nan_or_inf("log_bottom_vector", log_bottom_vector)
  return lv


def run_coupled(step_fn, params, init_carry, xs, log_bottom_vector,
                num_states, num_symbols, broadcast_bottom=False,
                time_blocks=None, log_space=False, precision="highest"):
  """Runs a controller and the vector stack together, t = 1..T.

  Controller step t sees the reading ρ_{t−1} (flattened, [B, Q·S·M]), and
  update t uses the actions it returns.

  Args:
    step_fn: (params, carry, x_t, reading_prev) -> (carry_t, (push_t,
      repl_t, pop_t, log_vector_t), out_t) with push/repl [B,Q,S,Q,S], pop
      [B,Q,S,Q] log-weights and log_vector [B,M] = log v_t. Must be a
      hashable pure function (it is a static argument of the custom VJP).
    params: pytree of controller parameters (differentiable).
    init_carry: the controller's initial carry (differentiable).
    xs: pytree of batch-major inputs [B, T, ...]; integer leaves get float0
      cotangents.
    log_bottom_vector: log v_⊥, [M] or [B, M] (differentiable).
    num_states: Q.
    num_symbols: S.
    broadcast_bottom: the authors' broadcast bottom vector (module
      docstring); default False (run-consistent).
    time_blocks: at most this many static time blocks of the log-space
      sweeps (`time_blocks_of`; None = automatic). Same values for any
      setting; only speed and compile time change.
    log_space: the log-space tables of this module also for the
      run-consistent bottom (the reference; the broadcast bottom always
      uses them). By default the run-consistent bottom runs on
      `rns_stack.run_coupled_vectors` (shares; the vectors' work is
      column-sized there, m-fold table-sized here): same values.
    precision: matmul precision name of the share sweep's contractions
      (`ns_stack.MATMUL_PRECISIONS`).

  Returns:
    (outs [B, T, ...], readings [B, T+1, Q, S, M], log_mass [B, T+1]).
  """
  leaves = jax.tree_util.tree_leaves(xs)
  if not leaves or any(jnp.ndim(l) < 2 for l in leaves):
    raise ValueError("xs must be a pytree of [B, T, ...] arrays")
  b, t = jnp.shape(leaves[0])[:2]
  lv = _check_inputs(num_states, num_symbols, log_bottom_vector, b)
  if not broadcast_bottom and not log_space:
    return rns_stack.run_coupled_vectors(
        step_fn, params, init_carry, xs, jnp.exp(lv), int(num_states),
        int(num_symbols), precision)
  init = init_state(lv, t, int(num_states), int(num_symbols),
                    broadcast_bottom)
  if not t:
    # No update: ρ_0 alone, and outs [B, 0, ...] shaped as step_fn's.
    x0 = jax.tree_util.tree_map(lambda l: jax.ShapeDtypeStruct(
        (l.shape[0],) + l.shape[2:], l.dtype), xs)
    out = jax.eval_shape(lambda x: step_fn(params, init_carry, x, readings(
        init, 0)[0])[2], x0)
    outs = jax.tree_util.tree_map(
        lambda o: jnp.zeros((b, 0) + o.shape[1:], o.dtype), out)
    return (outs,) + readings(init)
  xs_T = jax.tree_util.tree_map(lambda l: jnp.swapaxes(l, 0, 1), xs)
  blocks = tuple(time_blocks_of(t, time_blocks))
  _, state, outs_T = _coupled(step_fn, params, init_carry, init, xs_T, blocks)
  outs = jax.tree_util.tree_map(lambda o: jnp.swapaxes(o, 0, 1), outs_T)
  rho, log_mass = readings(state)
  return outs, rho, log_mass


def _given_actions(params, carry, x_t, reading):
  """step_fn of `run`: the actions are the inputs."""
  del params, reading
  return carry, x_t, jnp.zeros(x_t[3].shape[:1], x_t[3].dtype)


def _check_actions(push, repl, pop, log_vectors):
  # The actions as rns_stack checks them: shapes, one float dtype, no NaN
  # or +inf (the share sweep would turn them into finite, wrong numbers).
  b, t, q, s = rns_stack._check_actions(push, repl, pop)  # pylint: disable=protected-access
  shape = tuple(jnp.shape(log_vectors))
  if len(shape) != 3 or shape[:2] != (b, t) or shape[2] < 1:
    raise ValueError(f"log_vectors must be [B={b}, T={t}, M>=1], got "
                     f"{shape}")
  rns_stack.check_no_nan_or_inf("log_vectors", log_vectors)
  return b, t, q, s


def run(push, repl, pop, log_vectors, log_bottom_vector,
        broadcast_bottom=False, time_blocks=None, log_space=False,
        precision="highest"):
  """The vector stack for given actions and vectors (custom O(T²) VJP).

  Args:
    push, repl: [B, T, Q, S, Q, S] log-weights (q, x, r, y); any finite
      values or −inf, unnormalised.
    pop: [B, T, Q, S, Q] log-weights (q, x, r).
    log_vectors: [B, T, M], log v_j of the vector pushed at update j.
    log_bottom_vector: [M] or [B, M], log v_⊥.
    broadcast_bottom: the authors' broadcast bottom (module docstring).
    time_blocks: at most this many static time blocks (None = automatic;
      see `time_blocks_of`).
    log_space, precision: as for `run_coupled`.

  Returns:
    (readings [B, T+1, Q, S, M], log_mass [B, T+1]); readings[:, j] is ρ_j
    (ρ_0 from the initial stack), log_mass[:, j] = log Σ α_j.
  """
  b, _, q, s = _check_actions(push, repl, pop, log_vectors)
  _check_inputs(q, s, log_bottom_vector, b, jnp.shape(log_vectors)[2])
  _, rho, log_mass = run_coupled(
      _given_actions, (), (), (push, repl, pop, log_vectors),
      log_bottom_vector, q, s, broadcast_bottom, time_blocks, log_space,
      precision)
  return rho, log_mass


def run_autodiff(push, repl, pop, log_vectors, log_bottom_vector,
                 broadcast_bottom=False):
  """`run` without the custom VJP (plain autodiff of the scan; O(T³) memory).

  A reference for tests and benchmarks.
  """
  b, t, q, s = _check_actions(push, repl, pop, log_vectors)
  lv = _check_inputs(q, s, log_bottom_vector, b, jnp.shape(log_vectors)[2])
  state = init_state(lv, t, q, s, broadcast_bottom)

  def body(st, inp):
    j, p, r, o, v = inp
    return step(st, j, p, r, o, v), None

  xs = [jnp.swapaxes(a, 0, 1) for a in (push, repl, pop, log_vectors)]
  state, _ = lax.scan(body, state, (jnp.arange(1, t + 1), *xs))
  return readings(state)
