"""Shared pieces of the generalised-stack tests (rns_stack, log_stack).

* `readings_loss`: a scalar of a table's readings and log Σα whose gradient
  reaches every action (a weighted sum, a square, the log-mass).
* `reference_mass_and_readings`: log Σα and state readings of a batch from
  the float64 NumPy reference (`log_space_reference`, fixed bottom).
* `run_that_comes_back`: actions where a run falls e^-big behind and then
  overtakes (the share table's flush limit), with the oracle's answer.
* `tanh_controller` / `tanh_params`: a small tanh controller for the coupled
  sweeps (`run_coupled`), unnormalised actions scaled by 4, vocabulary `V`,
  hidden size `H`.
* `three_kinds_of_actions`: unnormalised, huge and holed log-weights.
* `log_alpha`, `assert_log_close`: log α from (log α̂, log Σα), and a
  comparison of log-weights that needs −inf exactly where expected.
* `check_window_covering_equals_unlimited`: a window stack with D ≥ T + 1
  is the unlimited one, and a small window drops runs.
* `check_worked_example_window`: a window stack's run on
  rns-vrns-reference.md §6's example against the windowed oracle, whole
  and fed in pieces.
"""

import jax
import jax.numpy as jnp
import numpy as np

import log_space_reference
import pda_oracle
from nsrnn_jax import rns_stack

H, V = 5, 3


def readings_loss(fn, c, e, bottom):
  """loss(push, repl, pop) = Σ c·ρ + 0.3 Σ ρ² + 0.1 Σ e·log Σα of
  `fn(push, repl, pop, bottom)` (state readings; a dead log-mass is 0)."""
  def loss(push, repl, pop):
    hat, log_mass = fn(push, repl, pop, bottom)
    rho, _ = rns_stack.readout(hat)
    safe = jnp.where(jnp.isfinite(log_mass), log_mass, 0)
    return (jnp.sum(c * rho) + 0.3 * jnp.sum(rho ** 2)
            + 0.1 * jnp.sum(e * safe))
  return loss


def tanh_controller(q, s, reading):
  """(step_fn, reading size) for `run_coupled`."""
  size = q * s if reading == "state" else s

  def step_fn(p, h, x, rho):
    assert rho.shape[-1] == size
    h = jnp.tanh(jax.nn.one_hot(x, V, dtype=rho.dtype) @ p["wx"]
                 + rho @ p["wr"] + h @ p["wh"] + p["b"])
    acts = rns_stack.split_action_logits(h @ p["wa"] * 4.0, q, s, False)
    return h, acts, h @ p["wo"]

  return step_fn, size


def tanh_params(rng, q, s, size):
  """N(0, 1) parameters of `tanh_controller` (recurrence scaled by 0.5)."""
  return {"wx": rng.normal(size=(V, H)), "wr": rng.normal(size=(size, H)),
          "wh": 0.5 * rng.normal(size=(H, H)), "b": rng.normal(size=H),
          "wa": rng.normal(size=(H, q * s * (2 * q * s + q))),
          "wo": rng.normal(size=(H, V))}


def run_that_comes_back(big, dtype):
  """Q = 1, S = 3, fixed bottom: update 2 reaches (0, 2) by a push of
  weight 1 from the run with 1 on top and by a replace of weight e^big;
  update 3 pops; update 4 pushes with weight e^(2 big) from (0, 1), which
  only the push run of update 2 left under its top.

  Returns:
    ((push, repl, pop) [1, 4, ...] of `dtype`, the brute-force oracle's
    symbol reading and log Σα at update 4).
  """
  ninf = -np.inf
  push = np.full((1, 4, 1, 3, 1, 3), ninf)
  repl, pop = np.full_like(push, ninf), np.full((1, 4, 1, 3, 1), ninf)
  push[0, 0, 0, 0, 0, 1] = 0.0
  push[0, 1, 0, 1, 0, 2], repl[0, 1, 0, 1, 0, 2] = 0.0, big
  pop[0, 2, 0, 2, 0] = 0.0
  push[0, 3, 0, 1, 0, 1], push[0, 3, 0, 0, 0, 2] = 2 * big, 0.0
  want_reading, want_mass = pda_oracle.readings_and_log_mass(
      push[0], repl[0], pop[0], bottom="fixed")
  return (tuple(a.astype(dtype) for a in (push, repl, pop)),
          want_reading[4], want_mass[4])


def reference_mass_and_readings(push, repl, pop):
  """(log Σα [B, T+1], state readings [B, T+1, Q·S]) of [B, T, ...]
  actions by `log_space_reference` (float64, fixed bottom)."""
  want = [log_space_reference.log_alpha(push[b], repl[b], pop[b])
          for b in range(len(push))]
  mass = np.stack([np.logaddexp.reduce(w.reshape(len(w), -1), 1)
                   for w in want])
  rho = np.stack([np.exp(w.reshape(len(w), -1) - m[:, None])
                  for w, m in zip(want, mass)])
  return mass, rho


def three_kinds_of_actions(rng, steps, q, s):
  """(push, repl, pop) [3, steps, ...]: batch element 0 unnormalised
  N(0, 3²), 1 huge (N(0, 10²) + 50), 2 unnormalised with −inf entries."""
  shapes = [(steps, q, s, q, s)] * 2 + [(steps, q, s, q)]
  unnorm = [3 * rng.normal(size=sh) for sh in shapes]
  huge = [10 * rng.normal(size=sh) + 50 for sh in shapes]
  holes = [np.where(rng.random(sh) < p, -np.inf, 3 * rng.normal(size=sh))
           for sh, p in zip(shapes, (0.15, 0.3, 0.3))]
  return tuple(np.stack(a) for a in zip(unnorm, huge, holes))


def log_alpha(hat, mass):
  """log α = log α̂ + log Σα, as a NumPy array."""
  return np.asarray(hat) + np.asarray(mass)[..., None, None]


def assert_log_close(got, want, atol):
  """−inf exactly where `want` has it; elsewhere within `atol`."""
  got, want = np.asarray(got), np.asarray(want)
  np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
  fin = np.isfinite(want)
  np.testing.assert_allclose(got[fin], want[fin], rtol=0, atol=atol)


def check_window_covering_equals_unlimited(run_window, run_unlimited, acts,
                                           bottom, windows, rtol):
  """`run_window(push, repl, pop, D, bottom)` with each D of `windows`
  (all ≥ T + 1) gives `run_unlimited(push, repl, pop, bottom)`'s log α̂
  (to 1e-12) and log Σα (to `rtol`) at times 1..T; with D = 3 it differs."""
  hat_u, mass_u = run_unlimited(*acts, bottom)
  for window in windows:
    hat, mass, _ = run_window(*acts, window, bottom)
    assert_log_close(hat, hat_u[:, 1:], 1e-12)
    np.testing.assert_allclose(mass, mass_u[:, 1:], rtol=rtol)
  # A smaller window really does drop runs.
  hat, _, _ = run_window(*acts, 3, bottom)
  assert np.abs(np.nan_to_num(np.asarray(hat - hat_u[:, 1:]))).max() > 1e-3


def check_worked_example_window(run, dtype, atol, bottom, splits):
  """rns-vrns-reference.md §6: D = 3, U = 6, sin(row·C + col + j) logits.

  `run(push, repl, pop, window, bottom, state=None) -> (log α̂, log Σα,
  state)` (a window stack's `run`) must give the windowed oracle's state
  readings and log Σα, and the same log α fed in the pieces of each of
  `splits` (tuples of piece lengths summing to 6) with the state carried.
  """
  with jax.enable_x64(dtype == "float64"):
    q = s = 2
    c = 2 * q * s + q
    row, col = np.meshgrid(np.arange(q * s), np.arange(c), indexing="ij")
    logits = np.stack([np.sin(row * c + col + j) for j in range(1, 7)])
    acts = rns_stack.split_action_logits(
        jnp.asarray(logits.reshape(1, 6, -1), jnp.dtype(dtype)), q, s, False)
    hat, mass, _ = run(*acts, 3, bottom)
    acts64 = [np.asarray(a, np.float64)[0] for a in acts]
    want_rho, want_la = pda_oracle.state_readings(*acts64, bottom=bottom,
                                                  window=3)
    np.testing.assert_allclose(rns_stack.readout(hat)[0][0], want_rho[1:],
                               rtol=0, atol=atol)
    want_mass = np.logaddexp.reduce(want_la.reshape(7, -1), axis=1)[1:]
    np.testing.assert_allclose(mass[0], want_mass, rtol=atol)
    for split in splits:
      state, parts = None, []
      for lo, hi in zip(np.cumsum((0,) + split)[:-1], np.cumsum(split)):
        h, m, state = run(*[a[:, lo:hi] for a in acts], 3, bottom,
                          state=state)
        parts.append(log_alpha(h, m))
      np.testing.assert_allclose(np.concatenate(parts, 1),
                                 log_alpha(hat, mass), rtol=0,
                                 atol=10 * atol)


def assert_margin_promise(margin, rho, want_rho, mass, want_mass):
  """The product margin's promise on a float32 batch: both sides of
  `rns_stack.exact_margin` occur, and every element above it has the exact
  readings (to 2e-5) and log Σα (to 1e-5 relative, at least 1e-5).

  Args:
    margin: [B] float32 margins.
    rho, want_rho: readings [B, ...] (float32 run, exact reference).
    mass, want_mass: log Σα [B, ...] likewise.
  """
  margin = np.asarray(margin)
  n = len(margin)
  promised = margin > rns_stack.exact_margin(np.float32)
  assert 0 < promised.sum() < n, margin
  err_rho = np.abs(np.asarray(rho, np.float64)
                   - np.asarray(want_rho)).reshape(n, -1).max(1)
  mass, want_mass = (np.asarray(a, np.float64).reshape(n, -1)
                     for a in (mass, want_mass))
  err_mass = np.abs(mass - want_mass).max(1)
  scale = np.maximum(1, np.abs(want_mass).max(1))
  assert np.all(err_rho[promised] < 2e-5), (err_rho, margin)
  assert np.all(err_mass[promised] < 1e-5 * scale[promised]), (err_mass,
                                                               margin)


def naive_product_margin(push, repl, pop, bottom):
  """The product margin of one element's [T, ...] float64 log-weights by
  the module docstring's recurrence in plain loops, every product formed
  one by one (no min-reduction trick): half the least log of any nonzero
  product of W, the replace rows, M̃ and the pop term, half the log of
  each push-row share (stored as it is), and each kernel exp(x) by its
  headroom exact_margin + cap − x (`rns_stack._local_margin`)."""
  t, q, s = push.shape[:3]
  flush = float(np.finfo(np.float64).tiny) * 1e3
  exact = 0.5 * np.log(flush)
  cap = -np.log(flush) - 2.0
  logs = []                          # log-products, then ½ min
  halves = []                        # values already in margin units
  # h[(i, k)][q, x, t, y] = H_{i,k}; time −1 is the bottom row.
  h = {(-1, 0): np.zeros((q, s, q, s))}
  if bottom == "fixed":
    h[(-1, 0)][0, 0, 0, 0] = 1.0
  a = np.full((q, s), -np.inf)
  a[0, 0] = 0.0

  def col_sum(k):
    return sum(h[(i, k)] for i in range(-1, k)).sum(axis=(0, 1))  # [t, y]

  for j in range(1, t + 1):
    pu, re, po = push[j - 1], repl[j - 1], pop[j - 1]
    c = {k: col_sum(k) for k in range(0, j)}
    w = np.zeros((s, q, s))                                  # [y, s, z]
    for k in range(0, j - 1):
      for tt, y, ss, z in np.ndindex(q, s, q, s):
        f, g = c[k][tt, y], h[(k, j - 1)][tt, y, ss, z]
        w[y, ss, z] += f * g
        if f > 0 and g > 0:
          logs.append(np.log(f) + np.log(g))
    terms = np.full((q, s, 3 * q * s), -np.inf)             # [r, y, F]
    for r, y, qq, x in np.ndindex(q, s, q, s):
      f = qq * s + x
      terms[r, y, f] = a[qq, x] + pu[qq, x, r, y]
      if c[j - 1][qq, x] > flush:
        terms[r, y, q * s + f] = a[qq, x] + np.log(c[j - 1][qq, x]) + re[
            qq, x, r, y]
      if w[y, qq, x] > flush:
        terms[r, y, 2 * q * s + f] = a[qq, x] + np.log(w[y, qq, x]) + po[
            qq, x, r]
    peak = np.max(terms)
    a_j = np.log(np.sum(np.exp(terms - peak), axis=2)) + peak   # [r, y]

    def kernel(r, y, zs, family):
      """exp(x) of a kernel whose term is nonzero (else None), headroom
      counted."""
      qq, x = divmod(zs, s)
      if not np.isfinite(terms[r, y, family * q * s + zs]):
        return None
      act = (pu[qq, x, r, y], re[qq, x, r, y], po[qq, x, r])[family]
      ex = a[qq, x] + act - a_j[r, y]
      halves.append(exact + cap - ex)
      return ex

    new = {}
    push_row = np.zeros((q, s, q, s))
    for r, y, qq, x in np.ndindex(q, s, q, s):
      ex = kernel(r, y, qq * s + x, 0)
      if ex is not None:
        push_row[qq, x, r, y] = np.exp(ex)
        halves.append(0.5 * ex)
    kr = np.zeros((q, s, q, s))                              # [s,z,r,y]
    kp = np.zeros((s, q, s, q))                              # [y,s,z,r]
    for r, y, ss, z in np.ndindex(q, s, q, s):
      ex = kernel(r, y, ss * s + z, 1)
      if ex is not None:
        kr[ss, z, r, y] = np.exp(ex)
      ex = kernel(r, y, ss * s + z, 2)
      if ex is not None:
        kp[y, ss, z, r] = np.exp(ex)
    # M̃_k[t,y,r] for the columns whose sums are nonzero.
    mt = {}
    for k in range(0, j - 1):
      mt[k] = np.zeros((q, s, q))
      for tt, y, r, ss, z in np.ndindex(q, s, q, q, s):
        if c[k][tt, y] <= flush:
          continue
        f, g = h[(k, j - 1)][tt, y, ss, z], kp[y, ss, z, r]
        mt[k][tt, y, r] += f * g
        if f > 0 and g > 0:
          logs.append(np.log(f) + np.log(g))
    for i in range(-1, j - 1):
      col = np.zeros((q, s, q, s))
      for qq, x, r, y, ss, z in np.ndindex(q, s, q, s, q, s):
        f, g = h[(i, j - 1)][qq, x, ss, z], kr[ss, z, r, y]
        col[qq, x, r, y] += f * g
        if f > 0 and g > 0:
          logs.append(np.log(f) + np.log(g))
      for k in range(i + 1, j - 1):
        for qq, x, r, y, tt in np.ndindex(q, s, q, s, q):
          f, g = h[(i, k)][qq, x, tt, y], mt[k][tt, y, r]
          col[qq, x, r, y] += f * g
          if f > 0 and g > 0:
            logs.append(np.log(f) + np.log(g))
      new[(i, j)] = col
    new[(j - 1, j)] = push_row
    h.update(new)
    a = a_j - (np.log(np.sum(np.exp(a_j - np.max(a_j)))) + np.max(a_j))
  return min(([0.5 * min(logs)] if logs else []) + halves + [np.inf])
