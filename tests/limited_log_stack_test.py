"""Tests for nsrnn_jax.limited_log_stack (window D in log space: exact).

Oracles: `pda_oracle` with a window (explicit stacks whose elements carry
their push time), the unlimited `log_stack.run` (D ≥ T + 1), plain autodiff
of `rns_stack.run_log_space` with a window (raw log γ, independent code),
and `limited_stack` (the share window) inside its flush limit. The models'
log window (value, gradient, truncated BPTT, streams) is tested in
models_test and models_stream_test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import limited_stack_test as window_helpers
import pda_oracle
import stack_helpers
from nsrnn_jax import limited_log_stack
from nsrnn_jax import limited_stack
from nsrnn_jax import log_stack
from nsrnn_jax import rns_stack


_actions = stack_helpers.three_kinds_of_actions


_log_alpha = stack_helpers.log_alpha
_assert_log_close = stack_helpers.assert_log_close


@pytest.mark.parametrize("bottom,q,s,steps", [("fixed", 2, 2, 6),
                                              ("frozen", 1, 3, 6)])
def test_matches_windowed_enumeration(x64, bottom, q, s, steps):
  del x64
  rng = np.random.default_rng(10 * q + s)
  push, repl, pop = _actions(rng, steps, q, s)
  for window in (1, 2, 3):
    hat, mass, _ = limited_log_stack.run(push, repl, pop, window, bottom)
    got = _log_alpha(hat, mass)
    for b in range(3):
      want = pda_oracle.alpha(push[b], repl[b], pop[b], bottom=bottom,
                              window=window)[1:]
      _assert_log_close(got[b], want, 1e-9)


@pytest.mark.parametrize("bottom", ["fixed", "frozen"])
def test_window_at_least_n_equals_the_unlimited_log_stack(x64, bottom):
  del x64
  stack_helpers.check_window_covering_equals_unlimited(
      limited_log_stack.run, log_stack.run,
      _actions(np.random.default_rng(1), 7, 2, 2), bottom, (8, 10), 1e-13)


@pytest.mark.parametrize("big,dtype", [(100.0, np.float32),
                                       (800.0, np.float64)])
@pytest.mark.parametrize("window", [3, 5])
def test_a_run_beyond_the_share_flush_that_comes_back_is_exact(
    x64, big, dtype, window):
  """`stack_helpers.run_that_comes_back`: a run e^-big behind comes back at
  update 4. The share window flushes it (its reading says symbol 2); here
  the reading and log Σα are the windowed oracle's (symbol 1)."""
  del x64
  acts, _, _ = stack_helpers.run_that_comes_back(big, dtype)
  want_reading, want_mass = pda_oracle.readings_and_log_mass(
      *(np.asarray(a[0], np.float64) for a in acts), bottom="fixed",
      window=window)
  np.testing.assert_allclose(want_reading[4], [0, 1, 0], atol=1e-9)
  hat, mass, _ = limited_log_stack.run(*acts, window)
  reading = rns_stack.readout(hat, reading="symbol")[0][0, 3]
  np.testing.assert_allclose(reading, want_reading[4], atol=1e-6)
  assert float(mass[0, 3]) == pytest.approx(want_mass[4], rel=1e-6)
  shares = rns_stack.readout(limited_stack.run(*acts, window)[0],
                             reading="symbol")[0][0, 3]
  assert abs(shares[1] - 1) > 0.5


@pytest.mark.parametrize("dtype,atol", [("float64", 1e-12),
                                        ("float32", 3e-6)])
@pytest.mark.parametrize("bottom", ["fixed", "frozen"])
def test_worked_example_whole_and_in_pieces(dtype, atol, bottom):
  stack_helpers.check_worked_example_window(limited_log_stack.run, dtype,
                                            atol, bottom, ((1, 4, 1),))


@pytest.mark.parametrize("bottom", ["fixed", "frozen"])
def test_gradient_equals_autodiff_of_the_plain_transcription(x64, bottom):
  del x64
  steps, q, s, window = 7, 2, 2, 3
  rng = np.random.default_rng(5)
  push, repl, pop = _actions(rng, steps, q, s)
  c = rng.normal(size=(3, steps + 1, q * s))
  e = rng.normal(size=(3, steps + 1))

  def windowed(push, repl, pop, bottom):
    hat, mass, _ = limited_log_stack.run(push, repl, pop, window, bottom)
    return (jnp.concatenate([jnp.full_like(hat[:, :1], -jnp.inf).at[
        :, :, 0, 0].set(0), hat], 1),
            jnp.concatenate([jnp.zeros_like(mass[:, :1]), mass], 1))

  def plain(push, repl, pop, bottom):
    return rns_stack.run_log_space(push, repl, pop, bottom, window)

  got, want = (jax.jit(jax.grad(stack_helpers.readings_loss(f, c, e, bottom),
                                argnums=(0, 1, 2)))(push, repl, pop)
               for f in (windowed, plain))
  for g, w in zip(got, want):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-9)
  # −inf weights (zero weight) get a zero gradient, not NaN.
  assert np.all(np.asarray(got[0])[~np.isfinite(push)] == 0)
  assert np.abs(np.asarray(got[0])).max() > 1e-3


def test_long_stream_with_huge_weights_keeps_float32_readings():
  """120 updates of weights ~1e3 (log Σα reaches ~1e5): float32 readings
  as the float64 plain transcription's, and log Σα to float32 rounding of
  the running sum."""
  steps, q, s, window = 120, 1, 2, 4
  # Rounded to float32 first: the reference gets the inputs the float32
  # run gets (their rounding, ~1e-4 at 2e3, alone moves readings by 1e-4).
  push, repl, pop = ((a * 20 + 1e3).astype(np.float32).astype(np.float64)
                     for a in _actions(np.random.default_rng(3), steps, q, s))
  with jax.enable_x64(True):
    want_hat, want_mass = rns_stack.run_log_space(push, repl, pop,
                                                  "fixed", window)
    want_rho = np.asarray(rns_stack.readout(want_hat)[0])[:, 1:]
  assert np.asarray(want_mass).max() > 1e5
  acts = [jnp.asarray(a, jnp.float32) for a in (push, repl, pop)]
  hat, mass, _ = limited_log_stack.run(*acts, window)
  np.testing.assert_allclose(rns_stack.readout(hat)[0], want_rho, rtol=0,
                             atol=3e-5)
  np.testing.assert_allclose(mass, np.asarray(want_mass)[:, 1:],
                             rtol=steps * float(jnp.finfo(jnp.float32).eps))
  # The share window loses runs that come back on this input (a reading
  # off by 1.0 and log Σα by ~200 when this test was written).
  shares = rns_stack.readout(limited_stack.run(*acts, window)[0])[0]
  assert np.abs(np.asarray(shares) - want_rho).max() > 0.5


def test_gradient_memory_is_linear_in_length():
  """An incremental stack: the gradient's compiled temporaries grow ~2x from
  T = 24 to 48 (one window per update), not ~4x or ~8x."""
  def temp_bytes(steps):
    shapes = [(2, steps, 1, 2, 1, 2)] * 2 + [(2, steps, 1, 2, 1)]
    acts = [jnp.zeros(sh) for sh in shapes]
    loss = lambda *a: jnp.sum(limited_log_stack.run(*a, 6)[0][..., 0, 1])
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
        *acts).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  ratio = temp_bytes(48) / temp_bytes(24)
  assert 1.5 < ratio < 2.6, ratio


def test_bad_input_is_a_clear_error():
  push = np.zeros((1, 3, 1, 2, 1, 2), np.float32)
  pop = np.zeros((1, 3, 1, 2, 1), np.float32)
  for bad in (0, 2.0, True):
    with pytest.raises(ValueError, match="window must be an integer"):
      limited_log_stack.run(push, push, pop, bad)
  with pytest.raises(ValueError, match="bottom"):
    limited_log_stack.run(push, push, pop, 2, bottom="floating")
  with pytest.raises(ValueError, match="NaN"):
    limited_log_stack.run(np.full_like(push, np.nan), push, pop, 2)
  share_state = limited_stack.initial_state(1, 2, 1, 2)
  with pytest.raises(ValueError, match="LogWindowState"):
    limited_log_stack.run(push, push, pop, 2, state=share_state)
  state = limited_log_stack.initial_state(1, 3, 1, 2)
  with pytest.raises(ValueError, match="state has window 3, not 2"):
    limited_log_stack.run(push, push, pop, 2, state=state)


@pytest.mark.parametrize("bottom,boundary", [("fixed", "iclr2023"),
                                             ("frozen", "iclr2022")])
def test_reversible_window_gradients_equal_autodiff(x64, monkeypatch, bottom,
                                                    boundary):
  # A chunk of coupled steps runs as the reverse sweep that rebuilds each
  # window from the next one and the two slices its update overwrote
  # (WINDOW_VJP "custom", the default) against autodiff of the generic scan
  # of the same steps ("autodiff"): the window wrapping around its ring,
  # chunks of 3 steps with either boundary, gradients of the controller's
  # parameters and initial carry.
  q, s, b, t, window = 2, 2, 2, 9, 3
  rng = np.random.default_rng(23)
  step_fn = window_helpers._controller(q, s)
  params = window_helpers._controller_params(rng, q, s)
  h0 = jnp.asarray(rng.normal(size=(b, window_helpers._H)))
  xs = jnp.asarray(rng.integers(0, window_helpers._V, size=(b, t)))
  c1 = rng.normal(size=(b, t, window_helpers._V))
  c2 = rng.normal(size=(b, t + 1, q * s))

  def coupled():
    def loss(p, h):
      outs, hat, lm = limited_log_stack.run_coupled(
          step_fn, p, h, xs, q, s, window, bottom, truncation_length=3,
          actions_fn=(window_helpers._actions_of(q, s)
                      if boundary == "iclr2023" else None))
      return (jnp.sum(c1 * outs) + jnp.sum(c2 * jnp.exp(hat).reshape(
          b, t + 1, q * s)) + 0.01 * jnp.sum(lm))
    return jax.value_and_grad(loss, (0, 1))(params, h0)

  got = window_helpers._with_window_vjp(monkeypatch, "custom", coupled)
  want = window_helpers._with_window_vjp(monkeypatch, "autodiff", coupled)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
  for g, w in zip(jax.tree_util.tree_leaves(got[1]),
                  jax.tree_util.tree_leaves(want[1])):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
  assert np.any(np.asarray(got[1][1]) != 0)  # the initial carry is trained


def test_reversible_window_keeps_linear_memory_in_the_window(monkeypatch):
  # What one more step of a chunk adds to the gradient's memory, at D = 16
  # (one chunk of L = 40 steps against 80): a D × D window under autodiff
  # of the scan, two D-sized slices (1/8 of a window) under the reverse
  # sweep.
  q, s, b, window = 2, 2, 2, 16
  rng = np.random.default_rng(3)
  step_fn = window_helpers._controller(q, s)
  params = window_helpers._controller_params(rng, q, s, np.float32)
  h0 = jnp.zeros((b, window_helpers._H), jnp.float32)

  def temp_bytes(mode, t):
    monkeypatch.setattr(limited_stack, "WINDOW_VJP", mode)
    xs = jnp.asarray(rng.integers(0, window_helpers._V, size=(b, t)))
    loss = lambda p: jnp.sum(limited_log_stack.run_coupled(
        step_fn, p, h0, xs, q, s, window)[1])
    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  per_step = {mode: (temp_bytes(mode, 80) - temp_bytes(mode, 40)) / 40
              for mode in ("custom", "autodiff")}
  window_bytes = 4 * b * s * window * q * s * window * q
  assert per_step["autodiff"] >= window_bytes, (per_step, window_bytes)
  assert per_step["custom"] <= window_bytes / 4, (per_step, window_bytes)
