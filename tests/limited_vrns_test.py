"""Tests for nsrnn_jax.limited_vrns (the memory-limited vector stack).

Oracles: `vrns_oracle` (explicit PDA runs with vector-carrying elements and
the window rule, float64), the unlimited `vrns_stack` (window ≥ T + 1), a
Python loop that detaches every chunk (truncated BPTT), and the float64
run of the same stack (float32 on long streams).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import stack_helpers
import vrns_oracle
from nsrnn_jax import limited_stack
from nsrnn_jax import limited_vrns
from nsrnn_jax import models
from nsrnn_jax import rns_stack
from nsrnn_jax import vrns_stack


def _inputs(rng, u, q, s, m, scale=1.0, neginf=0.0):
  """Unnormalised log-weights (−inf with probability `neginf`), log vectors
  in (0, 1) and log v_⊥."""
  def w(*shape):
    a = scale * rng.normal(size=shape)
    return np.where(rng.random(shape) < neginf, -np.inf, a)
  return (w(u, q, s, q, s), w(u, q, s, q, s), w(u, q, s, q),
          np.log(rng.uniform(0.05, 0.95, (u, m))),
          np.log(rng.uniform(0.05, 0.95, m)))


@pytest.mark.parametrize("q,s,m,u,window,broadcast,neginf", [
    (2, 2, 2, 5, 1, False, 0.0),
    (2, 2, 2, 5, 2, False, 0.2),
    (2, 2, 3, 6, 3, True, 0.0),
    (1, 3, 2, 6, 2, True, 0.2),
    (2, 3, 2, 5, 4, False, 0.0),
])
def test_matches_windowed_enumeration(x64, q, s, m, u, window, broadcast,
                                      neginf):
  rng = np.random.default_rng(window * 10 + u)
  push, repl, pop, log_vec, log_bot = _inputs(rng, u, q, s, m, 1.5, neginf)
  rho, log_mass = vrns_oracle.vector_readings(
      np.exp(push), np.exp(repl), np.exp(pop), np.exp(log_vec),
      np.exp(log_bot), broadcast, window=window)
  got_rho, got_mass, _ = limited_vrns.run(
      push[None], repl[None], pop[None], log_vec[None], log_bot[None],
      window, broadcast)
  np.testing.assert_allclose(got_rho[0], rho, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(got_mass[0], log_mass, rtol=1e-10, atol=1e-10)
  # The window matters here: the unlimited stack reads otherwise.
  full, _ = vrns_oracle.vector_readings(
      np.exp(push), np.exp(repl), np.exp(pop), np.exp(log_vec),
      np.exp(log_bot), broadcast)
  assert np.abs(full - rho).max() > 1e-3


@pytest.mark.parametrize("broadcast", [False, True])
def test_window_beyond_the_string_equals_unlimited(x64, broadcast):
  q, s, m, u = 2, 2, 2, 6
  rng = np.random.default_rng(5)
  push, repl, pop, log_vec, log_bot = (
      a[None] for a in _inputs(rng, u, q, s, m, 2.0, 0.1))
  want_rho, want_mass = vrns_stack.run(push, repl, pop, log_vec, log_bot,
                                       broadcast_bottom=broadcast)
  for window in (u + 1, u + 4):
    rho, log_mass, _ = limited_vrns.run(push, repl, pop, log_vec, log_bot,
                                        window, broadcast)
    np.testing.assert_allclose(rho, want_rho, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(log_mass, want_mass, rtol=1e-10, atol=1e-10)


def test_incremental_runs_continue_the_stream(x64):
  q, s, m, u, window = 2, 2, 2, 9, 3
  rng = np.random.default_rng(7)
  acts = [a[None] for a in _inputs(rng, u, q, s, m)]
  rho, log_mass, _ = limited_vrns.run(*acts, window)
  first = [a[:, :4] for a in acts[:4]]
  rest = [a[:, 4:] for a in acts[:4]]
  rho1, lm1, state = limited_vrns.run(*first, acts[4], window)
  rho2, lm2, _ = limited_vrns.run(*rest, acts[4], window, state=state)
  np.testing.assert_allclose(rho1, rho[:, :5], rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(rho2[:, 1:], rho[:, 5:], rtol=1e-12,
                             atol=1e-14)
  np.testing.assert_allclose(lm2, log_mass[:, 4:], rtol=1e-12)
  with pytest.raises(ValueError, match="state has window 3, not 4"):
    limited_vrns.run(*rest, acts[4], 4, state=state)
  with pytest.raises(ValueError, match="window must be an integer D >= 1"):
    limited_vrns.run(*rest, acts[4], 0)
  # Bad shapes are one-line errors; log v_⊥ may be [M].
  one = limited_vrns.run(*first, acts[4][0], window)
  np.testing.assert_array_equal(one[0], rho1)
  with pytest.raises(ValueError, match=r"pop must be \[B, T, Q, S, Q\] = "
                     r"\(1, 4, 2, 2, 2\), got \(1, 4, 2, 2, 3\)"):
    limited_vrns.run(*first[:2], np.zeros((1, 4, 2, 2, 3)), first[3],
                     acts[4], window)
  with pytest.raises(ValueError, match="log_bottom_vector has M = 3, the pushed"):
    limited_vrns.run(*first, np.zeros((1, 3)), window)


@pytest.mark.parametrize("q,s,m,u,window,vec_shift", [
    (2, 2, 2, 6, 3, 0.0),    # vectors in (0, 1): σ stays 0
    (1, 3, 3, 7, 4, 8.0),    # vectors up to e^14: the table is rescaled
    (2, 3, 2, 5, 2, 3.0),
])
def test_shares_equal_log_space_values_and_gradients(x64, q, s, m, u, window,
                                                     vec_shift):
  # The default share representation against the log-space one on the same
  # (run-consistent) bottom, any vectors: values and every input's gradient.
  rng = np.random.default_rng(u * 7 + window)
  push, repl, pop, log_vec, log_bot = (
      a[None] for a in _inputs(rng, u, q, s, m, 1.5, 0.15))
  log_vec = log_vec + vec_shift * rng.normal(size=log_vec.shape)
  log_vec[0, 2, 0] = -np.inf
  log_bot = log_bot + vec_shift

  def readings(log_space):
    def f(*a):
      rho, lm, st = limited_vrns.run(*a, window, log_space=log_space)
      return rho, lm, st
    return f

  (rho_s, lm_s, st), (rho_l, lm_l, _) = (
      readings(ls)(push, repl, pop, log_vec, log_bot) for ls in (False, True))
  assert isinstance(st, limited_vrns.VectorShareState)
  np.testing.assert_allclose(rho_s, rho_l, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(lm_s, lm_l, rtol=1e-10, atol=1e-12)
  assert (np.asarray(st.scale).max() > 0) == (vec_shift > 0)
  if u <= 6:  # and both against explicit PDA runs
    want, _ = vrns_oracle.vector_readings(
        *(np.exp(a[0]) for a in (push, repl, pop, log_vec, log_bot)),
        window=window)
    np.testing.assert_allclose(rho_s[0], want, rtol=1e-9, atol=1e-12)
  c = rng.normal(size=rho_s.shape)

  def loss(log_space):
    def f(*a):
      rho, lm, _ = readings(log_space)(*a)
      return jnp.sum(c * rho / (1 + jnp.abs(rho))) + 0.1 * jnp.sum(lm)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(
        push, repl, pop, log_vec, log_bot)

  for name, g, w in zip(("push", "repl", "pop", "log_vec", "log_bot"),
                        loss(False), loss(True)):
    assert np.all(np.isfinite(g)), name
    np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-10, err_msg=name)
  # A broadcast bottom needs the log-space state.
  with pytest.raises(ValueError, match="VectorShareState .* broadcast_bottom"):
    limited_vrns.run(push, repl, pop, log_vec, log_bot, window, True,
                     state=st)
  # The cutoff basis is a window's: a table in time order is refused.
  with pytest.raises(ValueError, match="vectors need ring=True"):
    models.rns_stack.update(st.g, st.head, st.a_hat, push[:, 0], repl[:, 0],
                            pop[:, 0], vectors=(st.gv, np.exp(log_vec[:, 0])))


def test_shares_float32_with_large_vectors():
  # Vectors up to ~e^40 (a float32 e^σ rescale) and unnormalised weights:
  # float32 shares keep the float64 values to float32 precision.
  q, s, m, u, window = 1, 3, 4, 60, 6
  rng = np.random.default_rng(19)
  push, repl, pop, log_vec, log_bot = (
      a[None] for a in _inputs(rng, u, q, s, m, 2.0, 0.05))
  log_vec = log_vec + np.linspace(0, 40, u)[None, :, None]
  with jax.enable_x64(True):
    want_rho, want_mass, _ = limited_vrns.run(push, repl, pop, log_vec,
                                              log_bot, window, log_space=True)
    want_rho, want_mass = np.asarray(want_rho), np.asarray(want_mass)
  f32 = lambda a: np.asarray(a, np.float32)
  rho, log_mass, st = limited_vrns.run(f32(push), f32(repl), f32(pop),
                                       f32(log_vec), f32(log_bot), window)
  assert rho.dtype == jnp.float32 and np.asarray(st.scale).max() > 35
  np.testing.assert_allclose(rho, want_rho, rtol=2e-4,
                             atol=2e-5 * np.abs(want_rho).max())
  np.testing.assert_allclose(log_mass, want_mass, rtol=1e-5, atol=1e-4)


def test_long_stream_float32_keeps_float64_values():
  # Unnormalised weights whose log Σα grows by ~25 nats per update: the
  # window's α is kept normalised, so float32 stays as exact as float64.
  q, s, m, u, window = 2, 2, 2, 400, 4
  rng = np.random.default_rng(11)
  push, repl, pop, log_vec, log_bot = (
      a[None] for a in _inputs(rng, u, q, s, m, 3.0, 0.05))
  push, repl, pop = push + 20, repl + 20, pop + 20
  with jax.enable_x64(True):
    want_rho, want_mass, _ = limited_vrns.run(push, repl, pop, log_vec,
                                              log_bot, window)
    want_rho, want_mass = np.asarray(want_rho), np.asarray(want_mass)
  f32 = lambda a: np.asarray(a, np.float32)
  rho, log_mass, _ = limited_vrns.run(f32(push), f32(repl), f32(pop),
                                      f32(log_vec), f32(log_bot), window)
  assert rho.dtype == jnp.float32
  assert np.all(np.isfinite(rho)) and want_mass[0, -1] > 5000
  np.testing.assert_allclose(rho, want_rho, atol=2e-5)
  np.testing.assert_allclose(log_mass, want_mass, rtol=1e-5)


_H, _V = 4, 3


def _controller(q, s, m):
  def actions(p, h):
    logits = h @ p["wa"] * 3
    push, repl, pop = models.rns_stack.split_action_logits(logits, q, s,
                                                           False)
    return push, repl, pop, jax.nn.log_sigmoid(h @ p["wv"])

  def step_fn(p, h, x, rho):
    h = jnp.tanh(jax.nn.one_hot(x, _V, dtype=rho.dtype) @ p["wx"]
                 + rho @ p["wr"] + h @ p["wh"])
    return h, actions(p, h), h @ p["wo"]
  return step_fn, actions


def test_truncated_bptt_equals_a_detaching_loop(x64):
  # Chunked forward = unchunked; gradients = a Python loop that detaches
  # (h, state) every `chunk` steps and makes update j at the start of step
  # j + 1 from h_j (the ICLR 2023 boundary).
  q, s, m, b, t, window = 2, 2, 2, 2, 5, 2
  rng = np.random.default_rng(3)
  step_fn, actions_of = _controller(q, s, m)
  params = {"wx": rng.normal(size=(_V, _H)),
            "wr": rng.normal(size=(q * s * m, _H)),
            "wh": 0.5 * rng.normal(size=(_H, _H)),
            "wa": rng.normal(size=(_H, q * s * (2 * q * s + q))),
            "wv": rng.normal(size=(_H, m)),
            "wo": rng.normal(size=(_H, _V)),
            "bot": rng.normal(size=(m,))}
  h0 = jnp.zeros((b, _H))
  xs = jnp.asarray(rng.integers(0, _V, size=(b, t)))
  c1, c2 = rng.normal(size=(b, t, _V)), rng.normal(size=(b, t + 1, q, s, m))

  def chunked(p, chunk):
    log_bot = jnp.broadcast_to(jax.nn.log_sigmoid(p["bot"]), (b, m))
    return limited_vrns.run_coupled(step_fn, p, h0, xs, log_bot, q, s,
                                    window, truncation_length=chunk,
                                    actions_fn=actions_of)

  def naive(p, chunk):
    log_bot = jnp.broadcast_to(jax.nn.log_sigmoid(p["bot"]), (b, m))
    h = h0
    st = limited_vrns.initial_state(log_bot, window, q, s)
    rho = limited_vrns.initial_reading(log_bot, q, s)
    outs, rhos, masses = [], [rho], [st.log_mass]
    for j in range(t):
      if chunk and j and j % chunk == 0:   # not the start: v_⊥ trains
        h, st, rho = lax.stop_gradient((h, st, rho))
      if j:
        st, rho, lm = limited_vrns.step(st, *actions_of(p, h))
        rhos.append(rho)
        masses.append(lm)
      h, _, out = step_fn(p, h, xs[:, j], limited_vrns.reading(rho))
      outs.append(out)
    st, rho, lm = limited_vrns.step(st, *actions_of(p, h))
    rhos.append(rho)
    masses.append(lm)
    return jnp.stack(outs, 1), jnp.stack(rhos, 1), jnp.stack(masses, 1)

  grads = {}

  def loss(fn, chunk):  # The gradient, each compiled once.
    def f(p):
      outs, rho, lm = fn(p, chunk)
      return (jnp.sum(c1 * outs) + jnp.sum(c2 * rho) + 0.01 * jnp.sum(lm))
    key = (fn.__name__, chunk)
    if key not in grads:
      grads[key] = jax.jit(jax.grad(f))(params)
    return grads[key]

  whole = jax.jit(chunked, static_argnums=1)(params, 0)
  # Chunks of 2 steps: 3 chunks, the last padded by one step (chunks of one
  # step, every update a boundary's, run through the same `run_chunks` in
  # limited_stack_test.py).
  for chunk in (2,):
    for g, w, n in zip(jax.jit(chunked, static_argnums=1)(params, chunk),
                       whole, jax.jit(naive, static_argnums=1)(params, chunk)):
      np.testing.assert_allclose(g, w, atol=1e-12)
      np.testing.assert_allclose(g, n, atol=1e-12)
    got, want = loss(chunked, chunk), loss(naive, chunk)
    for key in params:
      np.testing.assert_allclose(got[key], want[key], rtol=1e-9, atol=1e-9,
                                 err_msg=key)
  # Truncation changes the gradient (else the test could not tell), and
  # the bottom vector, read from the start, trains in every case.
  diff = loss(chunked, 2)["wh"] - loss(chunked, 0)["wh"]
  assert np.abs(diff).max() > 1e-4
  for chunk in (0, 2):
    assert np.abs(loss(chunked, chunk)["bot"]).max() > 1e-3


def test_vrns_model_with_a_window(x64):
  # The model's readings are the windowed stack of its own traced actions,
  # a window beyond the string is the unlimited model, and truncation
  # changes no value.
  common = dict(hidden_size=4, num_states=2, num_stack_symbols=2,
                stack_vector_size=2, dtype=jnp.float64)
  symbols = np.array([[0, 1, 2, 1, 0, 2, 2], [2, 2, 0, 1, 1, 0, 1]],
                     np.int32)
  unlimited = models.get("vrns", 3, **common)
  params = jax.tree.map(lambda a: a * 20,
                        models.init_params(unlimited, jax.random.key(1)))
  # Jitted: eagerly, each of the sweeps' small ops compiles on its own.
  trace = lambda m: jax.jit(functools.partial(m.apply, method="trace"))(
      {"params": params}, symbols)
  want = trace(unlimited)
  limited = models.get("vrns", 3, stack_window=2, **common)
  out = trace(limited)
  acts = out["action_log_weights"]
  for b in range(2):
    rho, log_mass = vrns_oracle.vector_readings(
        np.exp(acts["push"][b]), np.exp(acts["repl"][b]),
        np.exp(acts["pop"][b]), out["push_vectors"][b],
        out["bottom_vector"][b], window=2)
    np.testing.assert_allclose(out["readings"][b], rho, rtol=1e-9,
                               atol=1e-12)
    np.testing.assert_allclose(out["log_mass"][b], log_mass, rtol=1e-9)
  assert np.abs(out["logits"] - want["logits"]).max() > 1e-4
  chunked = models.get("vrns", 3, stack_window=2, truncation_length=2,
                       **common)
  np.testing.assert_allclose(
      jax.jit(chunked.apply)({"params": params}, symbols), out["logits"],
      rtol=1e-12, atol=1e-13)
  with pytest.raises(ValueError, match="truncation_length needs"):
    models.get("vrns", 3, truncation_length=2, **common)
  # A window beyond the string is the unlimited model: its gradients, every
  # parameter (the learned bottom vector included; the values: the stack's
  # own test above).
  def grads(model):
    def f(p):
      return jnp.sum(jnp.sin(model.apply({"params": p}, symbols)))
    return jax.jit(jax.grad(f))(params)
  got = grads(models.get("vrns", 3, stack_window=7, **common))
  want = grads(unlimited)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12,
                               err_msg=jax.tree_util.keystr(path))
  assert np.abs(got["bottom_vector"]).max() > 1e-4


def _margin_inputs(rng, b, t, q, s, m, scales):
  acts = [np.concatenate([sc * rng.normal(size=(b,) + sh) for sc in scales])
          for sh in [(t, q, s, q, s)] * 2 + [(t, q, s, q)]]
  n = len(acts[0])
  log_v = np.log(1 / (1 + np.exp(-2 * rng.normal(size=(n, t, m)))))
  log_bottom = np.log(rng.uniform(0.05, 1, size=(n, m)))
  return acts + [log_v, log_bottom]


def test_window_vector_margin_adds_the_vector_factors_to_the_scalar_one():
  # The scalar stack's factors are the same update's (limited_stack's
  # margin); the vector shares and vectors can only lower the minimum. Some
  # elements are lowered here (vectors down to ~e^-8 against scalar
  # margins of ~-7 at the smallest scale).
  rng = np.random.default_rng(2)
  acts = [jnp.asarray(a, jnp.float32)
          for a in _margin_inputs(rng, 2, 7, 2, 2, 3, (1, 10, 40))]
  vector = np.asarray(limited_vrns.share_margin(*acts, window=4))
  scalar = np.asarray(limited_stack.share_margin(*acts[:3], window=4))
  assert np.all(vector <= scalar + 1e-6)
  assert np.any(vector < scalar - 1e-3) and np.any(
      np.isclose(vector, scalar, rtol=1e-6))


def test_margin_sweep_reads_both_tables_row_minima(x64):
  """D = 3 over 7 updates, pushed vectors above 1 at some updates (the
  vector table is rescaled there): what the margin sweep reads of its
  carried minima is each row's least entry of g and of gv (as a sweep
  that takes them again reads), and each update's margin equals that of
  a step from freshly taken minima."""
  del x64
  rng = np.random.default_rng(6)
  q, s, m, steps = 2, 2, 3, 7
  push, repl, pop, log_v, log_bottom = _margin_inputs(
      rng, 2, steps, q, s, m, (2.0,))
  log_v[:, 2] += 1.5         # some entries above 0: σ grows
  log_v[1, 5] += 3.0
  acts = [jnp.asarray(a) for a in (push, repl, pop, log_v)]
  state = limited_vrns.initial_state(jnp.asarray(log_bottom), 3, q, s)
  mst = limited_vrns.with_minima(state)
  grew = 0
  for j in range(steps):
    act = [a[:, j] for a in acts]
    st = mst.state
    fresh = limited_vrns.with_minima(st)
    for low, low_fresh, table in zip(mst.lows, fresh.lows, (st.g, st.gv)):
      read = np.asarray(limited_stack.read_minima(low, st.head))
      np.testing.assert_array_equal(
          read, np.asarray(limited_stack.read_minima(low_fresh, st.head)))
      flat = np.asarray(table).reshape(table.shape[:4] + (-1,))
      np.testing.assert_array_equal(
          read, np.min(np.where(flat > 0, flat, np.inf), axis=-1))
    whole = limited_vrns.margin_step(fresh, *act)[3]
    mst, _, _, lo_j = limited_vrns.margin_step(mst, *act)
    grew += int(np.any(np.asarray(mst.state.scale) > np.asarray(st.scale)))
    np.testing.assert_array_equal(np.asarray(lo_j), np.asarray(whole))
  assert grew == 2


def test_window_share_margin_promises_only_exact_readings():
  """D = 3, float32, scales 1 to 30: the elements the margin proves have
  the float64 window's readings (proven by its own margin); both sides
  occur."""
  rng = np.random.default_rng(3)
  inputs = _margin_inputs(rng, 2, 8, 2, 2, 3, (1, 3, 10, 20, 30))
  with jax.enable_x64(True):
    a64 = [jnp.asarray(a, jnp.float64) for a in inputs]
    want_rho, want_mass = (np.asarray(a) for a in
                           limited_vrns.run(*a64, window=3)[:2])
    assert np.all(np.asarray(limited_vrns.share_margin(*a64, window=3))
                  > rns_stack.exact_margin(np.float64))
  a32 = [jnp.asarray(a, jnp.float32) for a in inputs]
  rho, mass = (np.asarray(a, np.float64)
               for a in limited_vrns.run(*a32, window=3)[:2])
  stack_helpers.assert_margin_promise(
      limited_vrns.share_margin(*a32, window=3), rho, want_rho, mass,
      want_mass)
