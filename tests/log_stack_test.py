"""Tests for nsrnn_jax.log_stack (the stack in log space: exact, no flush).

Oracles: `pda_oracle` (explicit stacks, any finite log-weights),
`log_space_reference` (float64 NumPy transcription, independent code),
plain autodiff of `rns_stack.run_log_space` (O(T³) memory, same function),
and `rns_stack.run_coupled` for the coupled controller. float64 only inside
tests that enable it (`x64` fixture).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pda_oracle
import stack_helpers
from nsrnn_jax import log_stack
from nsrnn_jax import rns_stack


_actions = stack_helpers.three_kinds_of_actions


@pytest.mark.parametrize("bottom", ["fixed", "frozen"])
@pytest.mark.parametrize("q,s,steps", [(1, 2, 6), (2, 2, 5), (2, 3, 4)])
def test_matches_explicit_stack_enumeration(x64, bottom, q, s, steps):
  del x64
  rng = np.random.default_rng(100 * q + 10 * s + steps)
  push, repl, pop = _actions(rng, steps, q, s)
  hat, mass = log_stack.run(push, repl, pop, bottom)
  got = np.asarray(hat) + np.asarray(mass)[..., None, None]
  for b in range(3):
    want = pda_oracle.alpha(push[b], repl[b], pop[b], bottom=bottom)
    np.testing.assert_array_equal(np.isfinite(got[b]), np.isfinite(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[b][fin], want[fin], rtol=0, atol=1e-9)


def _flushed_run_comes_back(big, dtype):
  """`stack_helpers.run_that_comes_back` (rns_stack_test's flush case):
  (our symbol reading, log Σα at update 4, the oracle's, the share
  table's reading)."""
  acts, want_reading, want_mass = stack_helpers.run_that_comes_back(big,
                                                                    dtype)
  hat, mass = log_stack.run(*acts)
  reading = rns_stack.readout(hat, reading="symbol")[0][0, 4]
  shares = rns_stack.readout(rns_stack.run(*acts)[0], reading="symbol")[0]
  return (np.asarray(reading), float(mass[0, 4]), want_reading, want_mass,
          np.asarray(shares[0, 4]))


@pytest.mark.parametrize("big,dtype", [(100.0, np.float32),
                                       (5000.0, np.float32),
                                       (800.0, np.float64),
                                       (1e5, np.float64)])
def test_a_run_far_beyond_the_share_flush_that_comes_back_is_exact(
    big, dtype, x64):
  """Where rns_stack loses the run (its strict xfail test), this is exact."""
  del x64
  reading, mass, want_reading, want_mass, shares = _flushed_run_comes_back(
      big, dtype)
  np.testing.assert_allclose(want_reading, [0, 1, 0], atol=1e-9)
  np.testing.assert_allclose(reading, want_reading, atol=1e-6)
  assert mass == pytest.approx(want_mass, rel=1e-6)
  # The same input on the share table: the run is gone (the reading says 2).
  assert abs(shares[1] - 1) > 0.5


@pytest.mark.parametrize("dtype,atol", [("float32", 2e-5), ("float64", 1e-9)])
def test_large_weights_keep_float32_readings(dtype, atol):
  """Unnormalised weights whose log Σα reaches ~1e5: the readings keep
  their digits (log shares near 0), and log Σα is the running sum."""
  steps, q, s = 40, 1, 2
  rng = np.random.default_rng(3)
  push, repl, pop = _actions(rng, steps, q, s)
  push, repl, pop = (a * 20 + 1e3 for a in (push, repl, pop))
  want_mass, want_rho = stack_helpers.reference_mass_and_readings(
      push, repl, pop)
  assert want_mass.max() > 3e4
  with jax.enable_x64(dtype == "float64"):
    acts = [jnp.asarray(a, jnp.dtype(dtype)) for a in (push, repl, pop)]
    hat, mass = log_stack.run(*acts)
    rho, _ = rns_stack.readout(hat)
  np.testing.assert_allclose(rho, want_rho, rtol=0, atol=atol)
  np.testing.assert_allclose(mass, want_mass,
                             rtol=steps * float(jnp.finfo(dtype).eps))


@pytest.mark.parametrize("bottom,q,s,steps", [("fixed", 2, 2, 7),
                                              ("frozen", 1, 3, 7)])
def test_gradient_equals_autodiff_of_the_plain_transcription(x64, bottom, q,
                                                             s, steps):
  """The final-table reverse sweep against plain autodiff through the
  scan of `rns_stack.run_log_space` (raw log γ, O(T³) memory)."""
  del x64
  rng = np.random.default_rng(q + 3 * s + steps)
  push, repl, pop = _actions(rng, steps, q, s)
  c = rng.normal(size=(3, steps + 1, q * s))
  e = rng.normal(size=(3, steps + 1))
  got = jax.jit(jax.grad(stack_helpers.readings_loss(log_stack.run, c, e, bottom),
                         argnums=(0, 1, 2)))(push, repl, pop)
  want = jax.jit(jax.grad(stack_helpers.readings_loss(rns_stack.run_log_space, c, e, bottom),
                          argnums=(0, 1, 2)))(push, repl, pop)
  for g, w in zip(got, want):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-9)
  # −inf weights (zero weight) get a zero gradient, not NaN.
  assert np.all(np.asarray(got[0])[~np.isfinite(push)] == 0)


@pytest.mark.parametrize("bottom,reading", [("fixed", "state"),
                                            ("frozen", "symbol")])
def test_run_coupled_equals_the_share_table(x64, bottom, reading):
  """Inside the share table's flush limit both compute the same function:
  outputs, readings, log Σα and every gradient agree in float64."""
  del x64
  q, s, b, t = 2, 2, 2, 6
  rng = np.random.default_rng(7)
  step_fn, size = stack_helpers.tanh_controller(q, s, reading)
  params = stack_helpers.tanh_params(rng, q, s, size)
  h0 = 0.1 * rng.normal(size=(b, stack_helpers.H))
  xs = jnp.asarray(rng.integers(0, stack_helpers.V, size=(b, t)))
  c1 = rng.normal(size=(b, t, stack_helpers.V))
  c2 = rng.normal(size=(b, t + 1, size))

  def run(module):
    def f(p, h):
      return module.run_coupled(step_fn, p, h, xs, q, s, bottom, reading)
    return f

  def loss(fn):
    def f(p, h):
      outs, hat, lm = fn(p, h)
      return (jnp.sum(c1 * outs) + jnp.sum(c2 * rns_stack.readout(
          hat, reading)[0]) + 0.01 * jnp.sum(lm))
    return f

  got, want = jax.jit(run(log_stack))(params, h0), jax.jit(run(rns_stack))(
      params, h0)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=1e-10)
  got = jax.jit(jax.grad(loss(run(log_stack)), argnums=(0, 1)))(params, h0)
  want = jax.jit(jax.grad(loss(run(rns_stack)), argnums=(0, 1)))(params, h0)
  for g, w in zip(jax.tree_util.tree_leaves(got),
                  jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-8)


def test_gradient_memory_is_quadratic_in_length():
  """The reverse sweep keeps no per-update table: the compiled gradient's
  temporaries grow ~4x from T = 24 to 48 (O(T²)); autodiff through a scan
  that carries the table would grow ~8x (O(T³))."""
  def temp_bytes(steps):
    shapes = [(2, steps, 1, 2, 1, 2)] * 2 + [(2, steps, 1, 2, 1)]
    acts = [jnp.zeros(sh) for sh in shapes]
    loss = lambda *a: jnp.sum(log_stack.run(*a)[0][..., 0, 1])
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
        *acts).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  ratio = temp_bytes(48) / temp_bytes(24)
  assert 2.5 < ratio < 5.5, ratio


def test_no_updates():
  # T = 0: α_0 only (log Σα_0 = 0), as rns_stack; the gradient has the
  # (empty) shapes of the actions.
  acts = [jnp.zeros((2, 0, 2, 3, 2, 3)), jnp.zeros((2, 0, 2, 3, 2, 3)),
          jnp.zeros((2, 0, 2, 3, 2))]
  for got, want in zip(log_stack.run(*acts), rns_stack.run(*acts)):
    np.testing.assert_array_equal(got, want)
  grads = jax.grad(lambda *a: log_stack.run(*a)[1].sum(),
                   argnums=(0, 1, 2))(*acts)
  assert [g.shape for g in grads] == [a.shape for a in acts]
  # Coupled, both tables: the gradient (zero) once failed on the carry
  # after the last step, which T = 0 does not have.
  step_fn, size = stack_helpers.tanh_controller(2, 2, "state")
  params = stack_helpers.tanh_params(np.random.default_rng(0), 2, 2, size)
  h0 = jnp.ones((2, stack_helpers.H))
  for module in (log_stack, rns_stack):
    loss = lambda p, h, m=module: m.run_coupled(
        step_fn, p, h, jnp.zeros((2, 0), jnp.int32), 2, 2)[2].sum()
    grads = jax.grad(loss, argnums=(0, 1))(params, h0)
    assert all(not np.any(g) for g in jax.tree_util.tree_leaves(grads))
    assert grads[1].shape == h0.shape


def test_bad_input_is_a_clear_error():
  push = np.zeros((1, 3, 1, 2, 1, 2), np.float32)
  pop = np.zeros((1, 3, 1, 2, 1), np.float32)
  with pytest.raises(ValueError, match="bottom"):
    log_stack.run(push, push, pop, bottom="floating")
  with pytest.raises(ValueError, match="NaN"):
    log_stack.run(np.full_like(push, np.nan), push, pop)
  with pytest.raises(ValueError, match="pop"):
    log_stack.run(push, push, pop[..., 0])
  with pytest.raises(ValueError, match="reading"):
    log_stack.run_coupled(lambda *a: a, {}, None, np.zeros((1, 3), int),
                          1, 2, reading="top")


def test_time_blocks_change_nothing(x64, monkeypatch):
  """Values and gradients, plain and coupled, on 2 uneven time blocks
  (T = 9: updates 1-4, 5-9) against one block."""
  del x64
  q, s, b, t = 2, 2, 2, 9
  rng = np.random.default_rng(9)
  push, repl, pop = _actions(rng, t, q, s)
  step_fn, size = stack_helpers.tanh_controller(q, s, "state")
  params = stack_helpers.tanh_params(rng, q, s, size)
  h0 = 0.1 * rng.normal(size=(b, stack_helpers.H))
  xs = jnp.asarray(rng.integers(0, stack_helpers.V, size=(b, t)))
  c = rng.normal(size=(3, t + 1, q * s))

  def plain(pu, re, po):
    hat, delta = log_stack._tables(pu, re, po, "fixed", "highest")  # pylint: disable=protected-access
    return jnp.sum(c * rns_stack.readout(hat)[0]) + 0.1 * jnp.sum(delta)

  def coupled(p, h):
    outs, hat, lm = log_stack.run_coupled(step_fn, p, h, xs, q, s)
    return (jnp.sum(outs ** 2) + jnp.sum(c[:b] * rns_stack.readout(hat)[0])
            + 0.01 * jnp.sum(lm))

  results = []
  for min_block, blocks in ((100, [(1, 10)]), (4, [(1, 5), (5, 10)])):
    monkeypatch.setattr(log_stack, "MIN_TIME_BLOCK", min_block)
    assert log_stack._time_blocks(t) == blocks  # pylint: disable=protected-access
    results.append([
        jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2)))(push, repl,
                                                              pop),
        jax.jit(jax.value_and_grad(coupled, argnums=(0, 1)))(params, h0)])
  for got, want in zip(*(jax.tree_util.tree_leaves(r) for r in results)):
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def _pop_inputs(rng, dtype, b=2, y=2, i=5, q=2, k=4, t=2, r=2):
  table = rng.normal(size=(b, y, i, q, y, k, t)) * 3 - 2
  table = np.where(rng.random(table.shape) < 0.2, -np.inf, table)
  m = rng.normal(size=(b, y, r, k, t)) * 3
  m[:, :, :, -1] = -np.inf        # a column outside the sum
  cols = np.arange(k) < k - 1
  return jnp.asarray(table, dtype), jnp.asarray(m, dtype), jnp.asarray(cols)


@pytest.mark.parametrize("dtype,atol", [("float32", 2e-6), ("float64", 1e-13)])
def test_pop_matmul_equals_the_logsumexp_in_value_and_gradient(
    monkeypatch, dtype, atol):
  with jax.enable_x64(dtype == "float64"):
    table, m, cols = _pop_inputs(np.random.default_rng(4), dtype)
    w = jnp.asarray(np.random.default_rng(5).normal(size=(2, 2, 5, 2, 2, 2)),
                    dtype)

    def value_and_grad():
      f = lambda tb, mm: log_stack.pop_rows_of(tb, mm, cols)
      out = jax.jit(f)(table, m)
      g = jax.jit(jax.grad(lambda tb, mm: jnp.sum(
          w * jnp.where(jnp.isfinite(f(tb, mm)), jnp.exp(f(tb, mm)), 0)),
                           argnums=(0, 1)))(table, m)
      return out, g

    got = value_and_grad()
    monkeypatch.setattr(log_stack, "POP_CONTRACTION", "logsumexp")
    want = value_and_grad()
  np.testing.assert_array_equal(np.isfinite(got[0]), np.isfinite(want[0]))
  fin = np.isfinite(want[0])
  np.testing.assert_allclose(got[0][fin], want[0][fin], rtol=0, atol=atol)
  for g, v in zip(got[1], want[1]):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, v, rtol=10 * atol, atol=atol)


def test_pop_gradient_keeps_at_most_one_terms_tensor():
  # The fallback's materialised terms (Q times the table) are the largest
  # thing the pop term's gradient may hold, once (the backward's logsumexp
  # branch). Autodiff through the forward's lax.cond kept both branches'
  # residuals: 271 kB here, against 110 kB written out (bound: 154 kB).
  b, y, i, q, k, t, r = 2, 2, 20, 2, 20, 2, 2
  table = jnp.zeros((b, y, i, q, y, k, t))
  m = jnp.zeros((b, y, r, k, t))
  cols = jnp.arange(k) < k - 1
  loss = lambda tb, mm: jnp.sum(jnp.exp(log_stack.pop_rows_of(tb, mm, cols)))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(table, m).compile()
  terms_bytes = 4 * table.size * r
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp <= terms_bytes + 4 * table.size, (temp, terms_bytes)


def test_pop_matmul_falls_back_where_its_products_underflow():
  """Row (0, −200) against column (−200, 0): both products are e^−200, below
  float32's range, so the matmul's sum is 0 (checked in NumPy below); the
  result is still ln 2 − 200. Disjoint supports (a true −inf with a live
  row and column) also take the fallback: −inf, zero gradient."""
  table = np.full((1, 1, 2, 1, 1, 2, 1), -np.inf, np.float32)
  m = np.full((1, 1, 1, 2, 1), -np.inf, np.float32)
  table[0, 0, 0, 0, 0, :, 0] = [0, -200]
  m[0, 0, 0, :, 0] = [-200, 0]
  table[0, 0, 1, 0, 0, :, 0] = [0, -np.inf]     # disjoint from m's support
  m2 = m.copy()
  m2[0, 0, 0, :, 0] = [-np.inf, 0]
  products = np.exp(np.float32([0, -200])) * np.exp(np.float32([-200, 0]))
  assert products.sum() == 0                    # what the matmul alone gives
  cols = jnp.asarray([True, True])
  out = log_stack.pop_rows_of(jnp.asarray(table), jnp.asarray(m), cols)
  assert float(out[0, 0, 0, 0, 0, 0]) == pytest.approx(np.log(2) - 200,
                                                       abs=1e-4)
  out2 = log_stack.pop_rows_of(jnp.asarray(table), jnp.asarray(m2), cols)
  assert out2[0, 0, 1, 0, 0, 0] == -np.inf
  grad = jax.grad(lambda tb: jnp.where(
      jnp.isfinite(log_stack.pop_rows_of(tb, jnp.asarray(m2), cols)),
      log_stack.pop_rows_of(tb, jnp.asarray(m2), cols), 0).sum())(
          jnp.asarray(table))
  assert np.all(np.isfinite(grad))
  assert np.all(np.asarray(grad)[0, 0, 1] == 0)


def test_bad_pop_contraction_is_a_clear_error(monkeypatch):
  monkeypatch.setattr(log_stack, "POP_CONTRACTION", "fft")
  with pytest.raises(ValueError, match="POP_CONTRACTION must be one of"):
    log_stack.pop_rows_of(jnp.zeros((1, 1, 1, 1, 1, 1, 1)),
                          jnp.zeros((1, 1, 1, 1, 1)), jnp.asarray([True]))
