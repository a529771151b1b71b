"""Tests for nsrnn_jax.vrns_stack against explicit PDA runs (float64)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from nsrnn_jax import limited_vrns
from nsrnn_jax import rns_stack
from nsrnn_jax import vrns_stack

try:  # tests/ as a package (rootdir on sys.path) or as a plain directory.
  from tests import stack_helpers  # pylint: disable=g-import-not-at-top
  from tests import vrns_oracle  # pylint: disable=g-import-not-at-top
except ImportError:
  import stack_helpers  # pylint: disable=g-import-not-at-top
  import vrns_oracle  # pylint: disable=g-import-not-at-top


# One compiled function per input shape and flag, shared by the tests.
_run = jax.jit(vrns_stack.run, static_argnames=("broadcast_bottom",
                                                "time_blocks"))


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


def _log_sigmoid(x):
  return -np.log1p(np.exp(-x))


def _random_inputs(rng, b, t, q, s, m, scale=2.0, neg_inf=True):
  push = rng.normal(size=(b, t, q, s, q, s)) * scale
  repl = rng.normal(size=(b, t, q, s, q, s)) * scale
  pop = rng.normal(size=(b, t, q, s, q)) * scale
  if neg_inf:  # impossible actions, including a whole update's pops
    push[0, 0, 0, 0, -1, -1] = -np.inf
    repl[-1, t // 2, 0, 0] = -np.inf
    pop[0, -1] = -np.inf
  log_vectors = _log_sigmoid(rng.normal(size=(b, t, m)))
  log_bottom = _log_sigmoid(rng.normal(size=(b, m)))
  return push, repl, pop, log_vectors, log_bottom


def _oracle(push, repl, pop, log_vectors, log_bottom, broadcast):
  return vrns_oracle.vector_readings(np.exp(push), np.exp(repl), np.exp(pop),
                                     np.exp(log_vectors), np.exp(log_bottom),
                                     broadcast)


@pytest.mark.parametrize("q,s,m,t,broadcast,blocks", [
    (2, 2, 3, 4, False, None), (2, 2, 3, 4, True, 2), (1, 3, 2, 5, False, 3),
    (3, 2, 1, 4, True, None), (2, 3, 2, 3, False, 3), (1, 2, 2, 7, True, 3)])
def test_matches_explicit_runs(x64, q, s, m, t, broadcast, blocks):
  # blocks: static time blocks over sliced tables (the live region); the
  # pop's row chunks are exercised at every size.
  rng = np.random.default_rng(q * 100 + s * 10 + t)
  inputs = _random_inputs(rng, 2, t, q, s, m)
  rho, log_mass = _run(*inputs, broadcast_bottom=broadcast,
                       time_blocks=blocks)
  assert rho.shape == (2, t + 1, q, s, m) and log_mass.shape == (2, t + 1)
  for b in range(2):
    want, want_mass = _oracle(*(x[b] for x in inputs), broadcast)
    np.testing.assert_allclose(rho[b], want, rtol=1e-11, atol=1e-14)
    np.testing.assert_allclose(log_mass[b], want_mass, rtol=1e-11, atol=1e-12)


def test_masked_bottom_is_an_expectation(x64):
  # Run-consistent readings are a convex combination of vectors: with all
  # vectors equal to one, the m components are the state readings and sum
  # to one; the authors' broadcast adds phantom starts, so it exceeds one.
  rng = np.random.default_rng(2)
  push, repl, pop, _, _ = _random_inputs(rng, 1, 4, 2, 2, 1, neg_inf=False)
  ones_v, ones_b = np.zeros((1, 4, 1)), np.zeros((1, 1))
  rho, _ = _run(push, repl, pop, ones_v, ones_b)
  np.testing.assert_allclose(rho.sum((2, 3, 4)), 1.0, rtol=1e-12)
  rho_b, _ = _run(push, repl, pop, ones_v, ones_b, broadcast_bottom=True)
  assert np.all(rho_b.sum((2, 3, 4))[:, 1:] > 1.0 + 1e-6)
  np.testing.assert_allclose(rho_b[0, 0, :, :, 0], 1.0)  # v_⊥ everywhere


@pytest.mark.parametrize("t", [3, 5])
def test_m1_constant_vectors_reduce_to_rns_state_readings(x64, t):
  rng = np.random.default_rng(t)
  push, repl, pop, _, _ = _random_inputs(rng, 1, t, 2, 3, 1, neg_inf=False)
  rho, _ = _run(push, repl, pop, np.zeros((1, t, 1)), np.zeros((1, 1)))
  want = vrns_oracle.state_readings(np.exp(push[0]), np.exp(repl[0]),
                                    np.exp(pop[0]))
  np.testing.assert_allclose(rho[0, ..., 0], want, rtol=1e-11, atol=1e-14)
  # Update 1 of the bottom fix: push or replace ⊥ (not push-only).
  p, r = np.exp(push[0, 0, 0, 0]), np.exp(repl[0, 0, 0, 0])
  np.testing.assert_allclose(rho[0, 1, ..., 0], (p + r) / (p + r).sum(),
                             rtol=1e-12)


def _worked_example(dtype):
  push, repl, pop, log_vectors, bottom_param = (
      vrns_oracle.worked_example_inputs())
  log_bottom = _log_sigmoid(bottom_param)
  args = [jnp.asarray(x[None], dtype) for x in (push, repl, pop, log_vectors)]
  return args, jnp.asarray(log_bottom, dtype), (push, repl, pop, log_vectors,
                                                 log_bottom)


@pytest.mark.parametrize("broadcast", [False, True])
def test_worked_example_float64_and_float32(broadcast):
  with jax.enable_x64(True):
    args, log_bottom, raw = _worked_example(jnp.float64)
    want, want_mass = _oracle(*raw, broadcast)
    rho, log_mass = _run(*args, log_bottom, broadcast_bottom=broadcast)
    np.testing.assert_allclose(rho[0], want, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(log_mass[0], want_mass, rtol=1e-12)
  args, log_bottom, _ = _worked_example(jnp.float32)
  rho32, log_mass32 = _run(*args, log_bottom, broadcast_bottom=broadcast)
  assert rho32.dtype == jnp.float32
  np.testing.assert_allclose(rho32[0], want, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(log_mass32[0], want_mass, rtol=2e-5, atol=1e-5)


def test_invariant_to_a_constant_per_update(x64):
  rng = np.random.default_rng(4)
  push, repl, pop, lv, lb = _random_inputs(rng, 1, 5, 2, 2, 2)
  rho, log_mass = _run(push, repl, pop, lv, lb)
  shift = np.array([0.0, 30.0, -25.0, 7.0, 100.0])[None, :]
  rho2, log_mass2 = _run(
      push + shift[..., None, None, None, None],
      repl + shift[..., None, None, None, None],
      pop + shift[..., None, None, None], lv, lb)
  np.testing.assert_allclose(rho2, rho, rtol=1e-11, atol=1e-14)
  np.testing.assert_allclose(log_mass2 - log_mass,
                             np.concatenate([[0], np.cumsum(shift[0])])[None],
                             rtol=1e-11, atol=1e-9)


def test_large_unnormalised_weights_float32_match_float64():
  rng = np.random.default_rng(5)
  t = 30
  push, repl, pop, lv, lb = _random_inputs(rng, 1, t, 2, 2, 2, scale=10.0)
  push, repl, pop = push + 50, repl + 50, pop + 50
  with jax.enable_x64(True):  # the log-space tables as the reference
    rho64, mass64 = vrns_stack.run(push, repl, pop, lv, lb, log_space=True)
    rho64, mass64 = np.asarray(rho64), np.asarray(mass64)
  args = [jnp.asarray(x, jnp.float32) for x in (push, repl, pop, lv, lb)]
  rho32, mass32 = _run(*args)  # the default: the share sweep
  assert np.all(np.isfinite(rho32)) and np.all(np.isfinite(mass32))
  assert mass64[0, -1] > 1500  # far beyond float32's exp range
  np.testing.assert_allclose(rho32, rho64, atol=2e-4)
  np.testing.assert_allclose(mass32, mass64, rtol=1e-5)
  loss32, grads = jax.jit(jax.value_and_grad(
      lambda *a: jnp.sum(vrns_stack.run(*a)[0] ** 2),
      argnums=(0, 1, 2, 3, 4)))(*args)
  assert all(np.all(np.isfinite(g)) for g in grads)
  g64 = [np.asarray(g, np.float64) for g in grads]
  # Adding c to every action log-weight of update j scales every run's
  # weight by e^c from then on: ρ does not change, so each update's action
  # gradients sum to 0.
  total = sum(g.reshape(t, -1).sum(1) for g in g64[:3])
  size = sum(np.abs(g).reshape(t, -1).sum(1) for g in g64[:3])
  assert np.all(size > 0)
  np.testing.assert_array_less(np.abs(total), 1e-4 * size + 1e-7)
  # ρ is linear in the vectors: adding c to every log v_j and to log v_⊥
  # scales ρ by e^c and the loss Σρ² by e^{2c}, so the vector gradients sum
  # to 2·loss (Euler's identity), and the loss is Σ ρ64².
  np.testing.assert_allclose(float(loss32), np.sum(rho64 ** 2), rtol=1e-4)
  np.testing.assert_allclose(g64[3].sum() + g64[4].sum(), 2 * float(loss32),
                             rtol=1e-4)


@pytest.mark.parametrize("big", [100.0, 300.0])
def test_log_space_keeps_a_run_the_shares_flush(big):
  """float32, `stack_helpers.run_that_comes_back`: a run e^-big behind comes
  back at update 4. The share tables (unlimited and window 3) flush it and
  read the wrong vector; the log-space tables (config.stack_table = 'log')
  read the brute-force oracle's."""
  acts, _, _ = stack_helpers.run_that_comes_back(big, np.float32)
  vectors = np.array([[0.9, 0.1], [0.2, 0.7], [0.5, 0.5], [0.3, 0.3]])
  bottom = np.array([0.4, 0.6])
  log_v = np.log(vectors)[None].astype(np.float32)
  log_b = np.log(bottom).astype(np.float32)
  real = [np.exp(np.asarray(a[0], np.float64)) for a in acts]
  for window in (None, 3):
    want, want_mass = vrns_oracle.vector_readings(*real, vectors, bottom,
                                                  window=window)
    for log_space in (False, True):
      if window is None:
        rho, mass = vrns_stack.run(*acts, log_v, log_b, log_space=log_space)
      else:
        rho, mass, _ = limited_vrns.run(*acts, log_v, log_b, window,
                                        log_space=log_space)
        rho, mass = rho[:, -1:], mass[:, -1:]
      err = np.abs(np.asarray(rho[0, -1]) - want[4]).max()
      if log_space:
        assert err < 1e-5, (window, err)
        assert float(mass[0, -1]) == pytest.approx(want_mass[4], rel=1e-6)
      else:
        assert err > 0.1, (window, err)


def test_share_sweep_equals_log_space_values_and_gradients(x64):
  # The default (rns_stack.run_coupled_vectors) against this module's
  # log-space tables: unnormalised weights spread over tens of nats, −inf
  # actions, vectors from e^-30 to e^14 with zero entries, a zero bottom
  # component; values and the gradients of all five inputs.
  rng = np.random.default_rng(11)
  b, t, q, s, m = 2, 7, 2, 3, 3
  push, repl, pop, _, _ = _random_inputs(rng, b, t, q, s, m, scale=5.0)
  lv = rng.uniform(-30, 14, size=(b, t, m))
  lv[0, 2, 1] = -np.inf
  lb = rng.normal(size=(b, m))
  lb[1, 0] = -np.inf
  w = rng.normal(size=(b, t + 1, q, s, m)) * np.exp(-10)
  wm = rng.normal(size=(b, t + 1))

  def loss(log_space):
    def f(*a):
      rho, log_mass = vrns_stack.run(*a, log_space=log_space)
      return jnp.sum(rho * w) + jnp.sum(log_mass * wm), (rho, log_mass)
    return jax.jit(jax.value_and_grad(f, tuple(range(5)), has_aux=True))

  inputs = (push, repl, pop, lv, lb)
  (_, (rho, mass)), grads = loss(False)(*inputs)
  (_, (want_rho, want_mass)), want_grads = loss(True)(*inputs)
  np.testing.assert_allclose(rho, want_rho, rtol=1e-10, atol=1e-300)
  np.testing.assert_allclose(mass, want_mass, rtol=1e-11, atol=1e-11)
  for g, want in zip(grads, want_grads):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, want, rtol=1e-8,
                               atol=1e-10 * np.max(np.abs(want)))
  assert grads[3][0, 2, 1] == 0 and grads[4][1, 0] == 0  # zero vectors


def test_run_consistent_bottom_runs_on_the_share_sweep(monkeypatch):
  # Which implementation answers: the share sweep for the run-consistent
  # bottom unless log_space is asked for; the log-space tables for the
  # authors' broadcast bottom (its phantom starts have no α to share).
  calls = []
  real = vrns_stack.rns_stack.run_coupled_vectors

  def spy(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)

  monkeypatch.setattr(vrns_stack.rns_stack, "run_coupled_vectors", spy)
  inputs = _random_inputs(np.random.default_rng(0), 1, 3, 2, 2, 2)
  inputs = [jnp.asarray(x, jnp.float32) for x in inputs]
  for kwargs, want in [({}, 1), ({"log_space": True}, 0),
                       ({"broadcast_bottom": True}, 0)]:
    calls.clear()
    vrns_stack.run(*inputs, **kwargs)
    assert len(calls) == want, kwargs


def _loss(fn, weights, broadcast):
  w_rho, w_mass = weights

  def f(*args):
    rho, log_mass = fn(*args, broadcast_bottom=broadcast)
    return jnp.sum(rho * w_rho) + jnp.sum(log_mass * w_mass)
  return f


@pytest.mark.parametrize("broadcast,blocks", [(False, None), (True, 3)])
def test_gradients_equal_autodiff_and_finite_differences(x64, broadcast,
                                                          blocks):
  rng = np.random.default_rng(6)
  b, t, q, s, m = 2, 5, 2, 2, 2
  inputs = _random_inputs(rng, b, t, q, s, m)
  weights = (rng.normal(size=(b, t + 1, q, s, m)),
             rng.normal(size=(b, t + 1)))
  argnums = tuple(range(5))
  f = jax.jit(_loss(functools.partial(vrns_stack.run, time_blocks=blocks),
                    weights, broadcast))
  grad_f = jax.jit(jax.grad(f, argnums))
  got = grad_f(*inputs)
  want = jax.jit(jax.grad(_loss(vrns_stack.run_autodiff, weights, broadcast),
                          argnums))(*inputs)
  for g, w in zip(got, want):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
  # −inf inputs get zero gradient.
  assert got[0][0, 0, 0, 0, -1, -1] == 0 and np.all(got[2][0, -1] == 0)
  # Central finite differences on finite inputs, in random directions.
  finite = _random_inputs(rng, b, t, q, s, m, neg_inf=False)
  grads = grad_f(*finite)
  for _ in range(2):
    dirs = [rng.normal(size=x.shape) for x in finite]
    eps = 1e-5
    plus = f(*[x + eps * d for x, d in zip(finite, dirs)])
    minus = f(*[x - eps * d for x, d in zip(finite, dirs)])
    fd = (plus - minus) / (2 * eps)
    analytic = sum(np.sum(g * d) for g, d in zip(grads, dirs))
    np.testing.assert_allclose(fd, analytic, rtol=1e-6)


def _toy_controller(params, carry, x_t, reading):
  """A tiny differentiable controller: actions depend on the reading."""
  h = jnp.tanh(carry @ params["w_h"] + reading @ params["w_r"] + x_t)
  q, s, m = 2, 2, 2
  n = q * s * q * s
  push = (h @ params["a"][:, :n]).reshape(-1, q, s, q, s)
  repl = (h @ params["a"][:, n:2 * n]).reshape(-1, q, s, q, s)
  pop = (h @ params["a"][:, 2 * n:2 * n + q * s * q]).reshape(-1, q, s, q)
  log_vec = jax.nn.log_sigmoid(h @ params["v"])
  del m
  return h, (push, repl, pop, log_vec), h.sum(-1)


def _coupled_autodiff(params, carry, xs, log_bottom):
  b, t = xs.shape[:2]
  state = vrns_stack.init_state(jnp.broadcast_to(log_bottom, (b, 2)), t, 2, 2)

  def body(c, inp):
    cy, st = c
    j, x_t = inp
    reading, _ = vrns_stack.readings(st, j - 1)
    cy, acts, out = _toy_controller(params, cy, x_t, reading)
    return (cy, vrns_stack.step(st, j, *acts)), out

  (_, state), outs = lax.scan(body, (carry, state),
                              (jnp.arange(1, t + 1), jnp.swapaxes(xs, 0, 1)))
  rho, log_mass = vrns_stack.readings(state)
  return jnp.swapaxes(outs, 0, 1), rho, log_mass


@pytest.mark.parametrize("blocks", [None, 2])
def test_run_coupled_equals_plain_autodiff(x64, blocks):
  rng = np.random.default_rng(7)
  h, b, t = 3, 2, 5
  params = {"w_h": rng.normal(size=(h, h)), "w_r": rng.normal(size=(8, h)),
            "a": rng.normal(size=(h, 40)) * 2, "v": rng.normal(size=(h, 2))}
  carry = rng.normal(size=(b, h))
  xs = rng.normal(size=(b, t, h))
  log_bottom = _log_sigmoid(rng.normal(size=(2,)))
  w = [rng.normal(size=(b, t)), rng.normal(size=(b, t + 1, 2, 2, 2)),
       rng.normal(size=(b, t + 1))]

  def loss(fn):
    def f(p, c, x, lb):
      outs = fn(p, c, x, lb)
      return sum(jnp.sum(o * wi) for o, wi in zip(outs, w))
    return f

  def custom(p, c, x, lb):
    return vrns_stack.run_coupled(_toy_controller, p, c, x, lb, 2, 2,
                                  time_blocks=blocks)

  np.testing.assert_allclose(
      jax.jit(loss(custom))(params, carry, xs, log_bottom),
      jax.jit(loss(_coupled_autodiff))(params, carry, xs, log_bottom),
      rtol=1e-12)
  got = jax.jit(jax.grad(loss(custom), (0, 1, 2, 3)))(params, carry, xs,
                                                      log_bottom)
  want = jax.jit(jax.grad(loss(_coupled_autodiff), (0, 1, 2, 3)))(
      params, carry, xs, log_bottom)
  for g, wt in zip(jax.tree_util.tree_leaves(got),
                   jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(g, wt, rtol=1e-9, atol=1e-12)


def _grad_temp_bytes(fn, t):
  rng = np.random.default_rng(0)
  shapes = [(1, t, 2, 2, 2, 2), (1, t, 2, 2, 2, 2), (1, t, 2, 2, 2), (1, t, 2),
            (2,)]
  args = [jnp.asarray(rng.normal(size=sh), jnp.float32) for sh in shapes]
  grad = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a)[0]), tuple(range(5))))
  return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.optimized
def test_gradient_memory_is_quadratic():
  # XLA's temporary buffers of the compiled gradient (no run needed).
  # A fixed number of time blocks, so that only the length changes; two
  # keep a block boundary and compile in half the time of four (same
  # growth: 3.8x at 1, 2 or 4 blocks).
  blocked = functools.partial(vrns_stack.run, time_blocks=2)
  custom = [_grad_temp_bytes(blocked, t) for t in (32, 64)]
  plain = _grad_temp_bytes(vrns_stack.run_autodiff, 32)
  assert custom[1] / custom[0] < 4.4  # O(T^2): ~4x for twice the length
  assert custom[0] * 5 < plain        # autodiff saves the tables per step


def test_bad_inputs_give_one_line_errors():
  rng = np.random.default_rng(0)
  push, repl, pop, lv, lb = _random_inputs(rng, 1, 3, 2, 2, 2)
  def poke(a, value):
    a = np.array(a)
    a.flat[1] = value
    return a

  for args, match in [
      ((push, repl[..., :1], pop, lv, lb), "repl must have push's shape"),
      ((push, repl, pop, lv[..., :0], lb), "log_vectors must be"),
      ((push[0], repl, pop, lv, lb), "push must be"),
      ((push, repl, pop, lv, np.zeros((3, 2))), "log_bottom_vector must be"),
      ((push, repl, pop, lv, np.zeros(5)), "log_bottom_vector has M = 5"),
      ((push[:0], repl[:0], pop[:0], lv[:0], lb), "B, Q and S must be >= 1"),
      # NaN or +inf: as rns_stack refuses them (the share sweep turned them
      # into finite, wrong numbers).
      ((poke(push, np.nan), repl, pop, lv, lb), "push contains NaN or +inf"),
      ((push, repl, poke(pop, np.inf), lv, lb), "pop contains NaN or +inf"),
      ((push, repl, pop, poke(lv, np.nan), lb),
       "log_vectors contains NaN or +inf"),
      ((push, repl, pop, lv, poke(lb, np.inf)),
       "log_bottom_vector contains NaN or +inf"),
      ((np.zeros(push.shape, np.int32), np.zeros(repl.shape, np.int32),
        np.zeros(pop.shape, np.int32), lv, lb),
       "actions must be float log-weights"),
  ]:
    for run in (vrns_stack.run,
                lambda *a: limited_vrns.run(*a, window=2)):
      with pytest.raises(ValueError, match=re.escape(match)) as info:
        run(*args)
      assert "\n" not in str(info.value)


def test_time_blocks_cover_every_update_once():
  for t in (1, 2, 7, 23, 79, 200):
    for nb in (None, 1, 3, 8, 500):
      blocks = vrns_stack.time_blocks_of(t, nb)
      assert blocks[0][0] == 1 and blocks[-1][1] == t + 1
      assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
      assert all(j1 > j0 for j0, j1 in blocks)
      if nb is not None:
        assert len(blocks) == min(nb, t)
  assert len(vrns_stack.time_blocks_of(79)) == 8  # the automatic choice
  for bad in (0, -2, 1.5, True, "4"):
    with pytest.raises(ValueError, match="time_blocks must be a positive"):
      vrns_stack.time_blocks_of(10, bad)


def test_share_sweep_under_pallas_update_kernels(monkeypatch):
  # With rns_stack.UPDATE_KERNELS = "pallas" (interpreted on CPU) the
  # forward's vector column stays on XLA ops and the backward's table part
  # runs as a kernel: the gradients still equal the log-space tables'.
  rng = np.random.default_rng(12)
  inputs = [jnp.asarray(x, jnp.float32)
            for x in _random_inputs(rng, 2, 5, 2, 2, 2)]

  def loss(log_space):
    return lambda *a: jnp.sum(vrns_stack.run(*a, log_space=log_space)[0] ** 2)

  want = jax.grad(loss(True), tuple(range(5)))(*inputs)
  monkeypatch.setattr(vrns_stack.rns_stack, "UPDATE_KERNELS", "pallas")
  got = jax.grad(loss(False), tuple(range(5)))(*inputs)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("log_space,broadcast", [(False, False),
                                                 (True, False), (True, True)])
def test_no_updates_reads_the_bottom_vector(log_space, broadcast):
  # T = 0: ρ_0 alone (e_{0,⊥} ⊗ v_⊥, or v_⊥ everywhere when broadcast), on
  # every path; its gradient is that of ρ_0 in v_⊥.
  b, q, s, m = 2, 2, 2, 3
  acts = [jnp.zeros((b, 0) + sh) for sh in ((q, s, q, s), (q, s, q, s),
                                            (q, s, q), (m,))]
  lb = jnp.asarray(np.linspace(-1.0, 0.0, b * m).reshape(b, m), jnp.float32)
  kw = {"log_space": log_space, "broadcast_bottom": broadcast}
  rho, log_mass = vrns_stack.run(*acts, lb, **kw)
  want = np.zeros((b, 1, q, s, m), np.float32)
  if broadcast:
    want[:] = np.exp(lb)[:, None, None, None]
  else:
    want[:, 0, 0, 0] = np.exp(lb)
  np.testing.assert_allclose(rho, want, rtol=1e-6)
  np.testing.assert_array_equal(log_mass, np.zeros((b, 1)))
  grad = jax.grad(lambda v: jnp.sum(vrns_stack.run(*acts, v, **kw)[0]))(lb)
  np.testing.assert_allclose(grad, np.exp(lb) * (q * s if broadcast else 1),
                             rtol=1e-6)


def test_bad_initial_state_inputs_give_one_line_errors():
  """`init_state` and the window's `initial_state` check what they build
  shapes from (they failed inside JAX, or unpacked a [B, M, 1] vector)."""
  lb = np.zeros((1, 2))
  for call, match in [
      (lambda: vrns_stack.init_state(lb, 3, 0, 2),
       "num_states must be an integer >= 1, got 0"),
      (lambda: vrns_stack.init_state(lb, 3, 2, 2.0),
       "num_symbols must be an integer >= 1, got 2.0"),
      (lambda: vrns_stack.init_state(lb, -1, 2, 2),
       "num_steps must be an integer >= 0, got -1"),
      (lambda: vrns_stack.init_state(np.zeros((1, 2, 1)), 3, 2, 2),
       r"log bottom vector must be a float array \[B, M\]"),
      (lambda: vrns_stack.init_state(np.zeros((1, 0)), 3, 2, 2),
       r"log bottom vector must be a float array \[B, M\]"),
      (lambda: limited_vrns.initial_state(np.zeros(2), 3, 2, 2),
       r"log bottom vector must be a float array \[B, M\]"),
      (lambda: limited_vrns.initial_state(lb, 3, 0, 2),
       "num_states must be an integer >= 1, got 0"),
      (lambda: limited_vrns.initial_state(lb, 3, 2, 2, log_space=True),
       None),
  ]:
    if match is None:
      call()  # valid: builds
      continue
    with pytest.raises(ValueError, match=match):
      call()


def test_share_sweep_bad_inputs_give_one_line_errors():
  step = vrns_stack._given_actions  # pylint: disable=protected-access
  xs = tuple(jnp.zeros((1, 2) + sh) for sh in ((2, 2, 2, 2), (2, 2, 2, 2),
                                               (2, 2, 2), (3,)))
  for args, match in [
      ((xs, jnp.ones((2, 3)), 2, 2), "bottom_vector must be"),
      ((jnp.zeros((3,)), jnp.ones((1, 3)), 2, 2), "xs must be"),
      ((xs, jnp.ones((1, 3)), 0, 2), "num_states and num_symbols"),
  ]:
    with pytest.raises(ValueError, match=match) as info:
      vrns_stack.rns_stack.run_coupled_vectors(step, (), (), *args)
    assert "\n" not in str(info.value)


def test_vector_share_margin_promises_only_exact_readings():
  """Random float32 log-weights, N(0, 1) to N(0, 30²), positive vectors:
  every element whose vector margin is above exact_margin has the float64
  sweep's readings and log Σα (that sweep proven by its own margin), both
  sides occur, and the margin is at most the scalar stack's."""
  rng = np.random.default_rng(5)
  steps, q, s, m = 8, 2, 2, 3
  shapes = [(steps, q, s, q, s)] * 2 + [(steps, q, s, q)]
  elements = [[scale * rng.normal(size=sh) for sh in shapes]
              for scale in (1, 3, 10, 20, 30) for _ in range(2)]
  push, repl, pop = (np.stack(a) for a in zip(*elements))
  b = len(push)
  log_v = np.log(1 / (1 + np.exp(-3 * rng.normal(size=(b, steps, m)))))
  log_bottom = np.log(rng.uniform(0.05, 1, size=(b, m)))
  with jax.enable_x64(True):
    acts64 = [jnp.asarray(a, jnp.float64)
              for a in (push, repl, pop, log_v, log_bottom)]
    want_rho, want_mass = (np.asarray(a) for a in vrns_stack.run(*acts64))
    assert np.all(np.asarray(rns_stack.vector_share_margin(
        *acts64[:3], jnp.exp(acts64[3]), jnp.exp(acts64[4])))
                  > rns_stack.exact_margin(np.float64))
  acts = [jnp.asarray(a, jnp.float32)
          for a in (push, repl, pop, log_v, log_bottom)]
  rho, mass = (np.asarray(a, np.float64) for a in vrns_stack.run(*acts))
  margin = np.asarray(rns_stack.vector_share_margin(
      *acts[:3], jnp.exp(acts[3]), jnp.exp(acts[4])))
  assert np.all(margin <= np.asarray(rns_stack.share_margin(*acts[:3]))
                + 1e-6)
  stack_helpers.assert_margin_promise(margin, rho, want_rho, mass,
                                      want_mass)
