"""Tests for nsrnn_jax.limited_stack (window D, incremental, truncated BPTT).

Oracles: `pda_oracle` with a window (explicit stacks whose elements carry
their push time; a run dies when its top is older than D steps), the
unlimited `rns_stack.run` (D ≥ T + 1), `rns_stack.run_log_space` with a
window (plain log-space autodiff), and a hand-written Python loop of
chunks with `stop_gradient` at the boundaries.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pda_oracle
import stack_helpers
from nsrnn_jax import limited_stack
from nsrnn_jax import rns_stack


def _actions(rng, batch, steps, q, s, scale=3.0, neginf=0.0):
  shapes = [(batch, steps, q, s, q, s)] * 2 + [(batch, steps, q, s, q)]
  out = [scale * rng.normal(size=sh) for sh in shapes]
  return [np.where(rng.random(a.shape) < neginf, -np.inf, a) for a in out]


_log_alpha = stack_helpers.log_alpha
_assert_log_close = stack_helpers.assert_log_close


@pytest.mark.parametrize("bottom,q,s,steps", [("fixed", 2, 2, 6),
                                              ("frozen", 1, 3, 5)])
def test_matches_windowed_enumeration(x64, bottom, q, s, steps):
  rng = np.random.default_rng(7 * q + s + steps)
  push, repl, pop = (np.concatenate(a) for a in zip(
      _actions(rng, 1, steps, q, s), _actions(rng, 1, steps, q, s, 10.0,
                                              0.25)))
  for window in (1, 2, 3):
    hat, mass, _ = limited_stack.run(push, repl, pop, window, bottom)
    got = _log_alpha(hat, mass)
    for b in range(2):
      want = pda_oracle.alpha(push[b], repl[b], pop[b], bottom=bottom,
                              window=window)[1:]
      _assert_log_close(got[b], want, 1e-9)
    ref = _log_alpha(*rns_stack.run_log_space(push, repl, pop, bottom,
                                              window))[:, 1:]
    _assert_log_close(ref, got, 1e-9)


@pytest.mark.parametrize("bottom", ["fixed", "frozen"])
def test_window_at_least_n_equals_unlimited(x64, bottom):
  rng = np.random.default_rng(1)
  stack_helpers.check_window_covering_equals_unlimited(
      limited_stack.run, rns_stack.run,
      _actions(rng, 2, 8, 2, 2, 10.0, 0.2), bottom, (9, 12), 1e-14)


@pytest.mark.parametrize("dtype,atol", [("float64", 1e-12),
                                        ("float32", 3e-6)])
@pytest.mark.parametrize("bottom", ["fixed", "frozen"])
def test_worked_example_whole_and_chunked(dtype, atol, bottom):
  stack_helpers.check_worked_example_window(limited_stack.run, dtype, atol,
                                            bottom, ((3, 3), (1, 4, 1)))


def test_long_string_float32_is_finite():
  # Unnormalised, huge weights over 2000 updates in a D = 5 window.
  rng = np.random.default_rng(2)
  push, repl, pop = (jnp.asarray(a, jnp.float32)
                     for a in _actions(rng, 1, 2000, 2, 2, 10.0))
  push = push + 50
  hat, mass, _ = limited_stack.run(push, repl, pop, 5)
  rho, _ = rns_stack.readout(hat)
  assert np.all(np.isfinite(mass)) and float(mass[0, -1]) > 1e5
  np.testing.assert_allclose(np.sum(rho, -1), 1.0, atol=1e-5)
  # Values: the first 6 updates against explicit windowed PDA runs (α_j
  # depends on updates 1..j only).
  want_rho, want_log_alpha = pda_oracle.state_readings(
      *(np.asarray(a[0, :6], np.float64) for a in (push, repl, pop)),
      bottom="fixed", window=5)
  want_mass = np.logaddexp.reduce(want_log_alpha.reshape(7, -1), axis=1)
  np.testing.assert_allclose(rho[0, :6], want_rho[1:], rtol=0, atol=1e-5)
  np.testing.assert_allclose(mass[0, :6], want_mass[1:], rtol=1e-6)
  # log α_j up to ~380 here: float32 keeps it to ~380·2^-23 ≈ 5e-5.
  _assert_log_close(_log_alpha(hat, mass)[0, :6], want_log_alpha[1:], 1e-4)


_H, _V = 4, 3


def _controller(q, s):
  def step_fn(p, h, x, rho):
    h = jnp.tanh(jax.nn.one_hot(x, _V, dtype=rho.dtype) @ p["wx"]
                 + rho @ p["wr"] + h @ p["wh"])
    return h, rns_stack.split_action_logits(h @ p["wa"] * 3, q, s,
                                            False), h @ p["wo"]
  return step_fn


def _controller_params(rng, q, s, dtype=np.float64):
  """Random parameters of `_controller`'s step."""
  shapes = {"wx": (_V, _H), "wr": (q * s, _H), "wh": (_H, _H),
            "wa": (_H, q * s * (2 * q * s + q)), "wo": (_H, _V)}
  params = {k: rng.normal(size=sh) for k, sh in shapes.items()}
  params["wh"] *= 0.5
  return {k: jnp.asarray(v, dtype) for k, v in params.items()}


def _actions_of(q, s):
  # The log-weights _controller's step computes from its carry h.
  return lambda p, h: rns_stack.split_action_logits(h @ p["wa"] * 3, q, s,
                                                    False)


@pytest.mark.parametrize("window", [3, 6])
@pytest.mark.parametrize("big,exact", [(30.0, True), (78.0, True),
                                       (83.0, False), (100.0, False)])
def test_share_margin_flags_the_window_run_that_comes_back(window, big,
                                                           exact):
  """The window's margin is −big / 2 on the run that falls e^−big behind
  (rns_stack_test's case): it proves 30 and 78 nats, which come back
  exact, and not 83 or 100, which the window loses as the unlimited table
  does (log Σα off by up to 100 nats)."""
  acts, _, _ = stack_helpers.run_that_comes_back(big, np.float32)
  margin = float(limited_stack.share_margin(*acts, window=window)[0])
  exact_margin = rns_stack.exact_margin(np.float32)
  # Where the run survives, the kernel e^big that brings it back counts
  # by its headroom below the clamp (flushed, it is never formed).
  headroom = exact_margin + (-2 * exact_margin - 2) - big
  want = min(-big / 2, headroom) if exact else -big / 2
  assert margin == pytest.approx(want, rel=1e-6)
  assert (margin > exact_margin) == exact
  with jax.enable_x64(True):
    want = limited_stack.run(*(jnp.asarray(a, jnp.float64) for a in acts),
                             window=window)[1]
  got = limited_stack.run(*acts, window=window)[1]
  lost = np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want)))
  assert (lost < 1e-4) == exact, lost


@pytest.mark.parametrize("bottom", ["fixed", "frozen"])
def test_window_margin_covering_every_row_is_the_unlimited_one(bottom, x64):
  """float64, D = T + 1 (no row ever leaves the window): the window's
  product margin equals the unlimited table's (itself checked against
  naive loops in rns_stack_test), Q = 2, S = 3, scales 0.5 to 20."""
  del x64
  rng = np.random.default_rng(4)
  steps = 6
  acts = [np.concatenate(a) for a in zip(*[
      _actions(rng, 2, steps, 2, 3, scale) for scale in (0.5, 3, 20)])]
  acts = [jnp.asarray(a, jnp.float64) for a in acts]
  np.testing.assert_allclose(
      np.asarray(limited_stack.share_margin(*acts, window=steps + 1,
                                            bottom=bottom)),
      np.asarray(rns_stack.share_margin(*acts, bottom=bottom)), rtol=1e-9)


def _naive_row_minima(table):
  """Plain loops: the least positive entry of each row (b, y, k, t) of a
  table [B, Y, D, T, D, ...], +inf where none."""
  table = np.asarray(table)
  out = np.full(table.shape[:4], np.inf)
  for idx in np.ndindex(*table.shape[:4]):
    for v in table[idx].ravel():
      if v > 0:
        out[idx] = min(out[idx], v)
  return out


@pytest.mark.parametrize("bottom", ["fixed", "frozen"])
def test_margin_sweep_reads_each_rows_least_entry(bottom, x64):
  """D = 3 over 9 updates (rows leave the ring; −inf holes): what a margin
  sweep reads of its carried minima is each table row's least entry
  (naive loops) before every update, each update's margin equals the one
  reduced from the whole ring (`rns_stack.update` without row_mins), and
  a sweep that takes its minima again at any update (a stream's next
  chunk) reads the same."""
  del x64
  rng = np.random.default_rng(5)
  q, s, steps, window = 2, 2, 9, 3
  acts = [jnp.asarray(a) for a in _actions(rng, 2, steps, q, s, 3.0, 0.3)]
  mst = limited_stack.with_minima(
      limited_stack.initial_state(2, window, q, s, bottom, jnp.float64))
  margins = []
  for j in range(steps):
    act = [a[:, j] for a in acts]
    st = mst.state
    read = np.asarray(limited_stack.read_minima(mst.lows[0], st.head))
    np.testing.assert_array_equal(read, _naive_row_minima(st.g))
    np.testing.assert_array_equal(
        read, np.asarray(limited_stack.read_minima(
            limited_stack.with_minima(st).lows[0], st.head)))
    whole = rns_stack.update(st.g, st.head, st.a_hat, *act, ring=True,
                             margin=True)[-1]
    mst, _, _, lo_j = limited_stack.margin_step(mst, *act)
    np.testing.assert_array_equal(np.asarray(lo_j), np.asarray(whole))
    margins.append(np.asarray(lo_j))
  assert np.all(np.isfinite(margins))
  np.testing.assert_allclose(
      np.asarray(limited_stack.share_margin(*acts, window=window,
                                            bottom=bottom)),
      np.min(margins, axis=0), rtol=1e-12)


def _carried_copies(fn, *args):
  """Lines of fn's compiled program (XLA:CPU) that copy a loop-carried
  value (a get-tuple-element) of rank ≥ 5: a table, or its minima."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  shape = re.compile(r"= [a-z0-9]+\[([0-9,]*)\]\S* copy\(%get-tuple-element")
  return [line.strip() for line in text.splitlines()
          if (m := shape.search(line)) and m.group(1).count(",") >= 4]


@pytest.mark.optimized
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's program")
def test_window_margin_sweep_does_not_copy_its_ring_each_update():
  """The margin's reads of the carried ring and minima come before the
  update overwrites them in place (`limited_stack.after`): the compiled
  sweep copies neither (it did without `after`, 2-2.6x the time). The
  VRNS window's margin still copies one array of minima (its vector
  table's, through the rescale's cond), not its tables."""
  rng = np.random.default_rng(0)
  acts = [jnp.asarray(a, jnp.float32) for a in _actions(rng, 2, 6, 2, 2)]
  assert _carried_copies(
      lambda *a: limited_stack.share_margin(*a, window=4), *acts) == []
  from nsrnn_jax import limited_vrns  # pylint: disable=g-import-not-at-top
  log_v = jnp.asarray(np.log(rng.uniform(0.1, 0.9, (2, 6, 3))), jnp.float32)
  bottom = jnp.zeros((2, 3), jnp.float32)
  copies = _carried_copies(lambda *a: limited_vrns.share_margin(*a, window=4),
                           *acts, log_v, bottom)
  assert [c.split("=")[1].split("{")[0].strip() for c in copies] == [
      "f32[2,2,4,2,4]"], copies


@pytest.mark.optimized
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's program")
def test_window_gradient_copies_the_window_four_times_not_eight():
  """The chunk gradient's compiled program (XLA:CPU) has 4 copy
  instructions of the window's size: 2 in the forward loop's body, 1 in
  the backward's and 1 of the initial window. With the reverse sweep's
  window carried as [B, Y, D, T, D, Q, X] instead of flat it had 8 (4
  more in the backward's body, each run once per update: 1.3x the time
  at D = 35, window_vjp_before_after.json)."""
  q, s, b, t, window = 2, 2, 2, 6, 4
  rng = np.random.default_rng(0)
  params = _controller_params(rng, q, s, np.float32)
  xs = jnp.asarray(rng.integers(0, _V, size=(b, t)))
  weights = jnp.asarray(rng.normal(size=(b, t + 1, q, s)), jnp.float32)

  def loss(p):
    outs, hat, lm = limited_stack.run_coupled(
        _controller(q, s), p, jnp.zeros((b, _H), jnp.float32), xs, q, s,
        window)
    return jnp.sum(outs) + jnp.sum(weights * jnp.exp(hat)) + jnp.sum(lm)

  text = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
  size = b * s * window * s * window * q * s
  copied = [int(np.prod([int(n) for n in m.group(1).split(",") if n]))
            for m in re.finditer(r"= [a-z0-9]+\[([0-9,]*)\]\S* copy\(",
                                 text)]
  assert copied.count(size) == 4, copied


def test_window_share_margin_promises_only_exact_values():
  """Random float32 log-weights, N(0, 1) to N(0, 60²), D = 4: the
  elements whose margin is above exact_margin match the float64 window
  (which flushes only ~700 nats down: exact for these weights), and both
  sides occur."""
  rng = np.random.default_rng(11)
  steps, q, s = 10, 2, 2
  acts = [np.concatenate(a) for a in zip(*[
      _actions(rng, 2, steps, q, s, scale) for scale in (1, 3, 10, 30, 60)])]
  margin = np.asarray(limited_stack.share_margin(
      *(jnp.asarray(a, jnp.float32) for a in acts), window=4))
  hat, mass, _ = limited_stack.run(
      *(jnp.asarray(a, jnp.float32) for a in acts), 4)
  with jax.enable_x64(True):
    want_hat, want_mass, _ = limited_stack.run(
        *(jnp.asarray(a, jnp.float64) for a in acts), 4)
    want_rho = np.asarray(rns_stack.readout(want_hat)[0])
    want_mass = np.asarray(want_mass)
    # The float64 reference is itself proven exact.
    assert np.all(np.asarray(limited_stack.share_margin(
        *(jnp.asarray(a, jnp.float64) for a in acts), window=4))
                  > rns_stack.exact_margin(np.float64))
  stack_helpers.assert_margin_promise(margin, rns_stack.readout(hat)[0],
                                      want_rho, mass, want_mass)


@pytest.mark.parametrize("boundary", ["iclr2022", "iclr2023"])
def test_truncated_bptt(x64, boundary):
  q, s, b, t, window = 2, 2, 2, 5, 2
  rng = np.random.default_rng(3)
  step_fn = _controller(q, s)
  actions_of = _actions_of(q, s)
  params = _controller_params(rng, q, s)
  h0 = jnp.zeros((b, _H))
  xs = jnp.asarray(rng.integers(0, _V, size=(b, t)))
  c1, c2 = rng.normal(size=(b, t, _V)), rng.normal(size=(b, t + 1, q * s))

  def chunked(p, chunk, bookkeeping=boundary):
    return limited_stack.run_coupled(
        step_fn, p, h0, xs, q, s, window, truncation_length=chunk,
        actions_fn=actions_of if bookkeeping == "iclr2023" else None)

  def naive(p, chunk):
    # A Python loop over steps; detach (h, state) every `chunk` steps.
    # ICLR 2022: update j right after step j. ICLR 2023: update j at the
    # start of step j + 1 (or after the loop), its actions recomputed from
    # h_j, which a chunk boundary between them has detached.
    h = h0
    st = limited_stack.initial_state(b, window, q, s, "fixed", jnp.float64)
    outs, hats, masses = [], [st.a_hat], [st.log_mass]

    def update(st, acts):
      st, a_hat, lm = limited_stack.step(st, *acts)
      hats.append(a_hat)
      masses.append(lm)
      return st

    for j in range(t):
      if chunk and j % chunk == 0:
        h, st = lax.stop_gradient((h, st))
      if boundary == "iclr2023" and j:
        st = update(st, actions_of(p, h))
      h, acts, out = step_fn(p, h, xs[:, j], rns_stack.readout(st.a_hat)[0])
      if boundary == "iclr2022":
        st = update(st, acts)
      outs.append(out)
    if boundary == "iclr2023":
      update(st, actions_of(p, h))
    return jnp.stack(outs, 1), jnp.stack(hats, 1), jnp.stack(masses, 1)

  grads = {}

  def grad(fn, chunk, with_stack=True, bookkeeping=boundary):
    # Memoised: each gradient compiled once.
    key = (fn.__name__, chunk, with_stack, bookkeeping)
    if key not in grads:
      kw = {"bookkeeping": bookkeeping} if fn is chunked else {}

      def f(p):
        outs, hat, lm = fn(p, chunk, **kw)
        if not with_stack:   # What a language model's loss reads.
          return jnp.sum(c1 * outs)
        return (jnp.sum(c1 * outs)
                + jnp.sum(c2 * rns_stack.readout(hat)[0])
                + 0.01 * jnp.sum(lm))
      grads[key] = jax.jit(jax.grad(f))(params)
    return grads[key]

  def assert_same(a, b):
    for g, w in zip(jax.tree_util.tree_leaves(a),
                    jax.tree_util.tree_leaves(b)):
      np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9)

  # Jitted: run eagerly, each of the sweep's small ops compiles on its own.
  whole = jax.jit(chunked, static_argnums=1)(params, 0)
  for chunk in (1, 2):  # 5 chunks; 3 chunks, the last one padded by 1 step.
    for g, w in zip(jax.jit(chunked, static_argnums=1)(params, chunk), whole):
      np.testing.assert_allclose(g, w, atol=1e-12)
  for g, n in zip(whole, jax.jit(naive, static_argnums=1)(params, 2)):
    np.testing.assert_allclose(g, n, atol=1e-12)
  for chunk in (1, 2):
    # Chunks of one step: every update is a chunk's last (the boundary
    # alone); the LM loss is the one that can miss it.
    for with_stack in (True, False) if chunk == 2 else (False,):
      assert_same(grad(chunked, chunk, with_stack),
                  grad(naive, chunk, with_stack))
  # Truncation changes the gradient (it is not a no-op).
  assert np.abs(grad(chunked, 0)["wh"] - grad(chunked, 2)["wh"]).max() > 1e-6
  # The two boundaries differ in what trains the action layer; without
  # truncation they are the same function (checked once, from iclr2023).
  if boundary == "iclr2023":
    assert np.abs(grad(chunked, 2, False)["wa"]
                  - grad(chunked, 2, False, "iclr2022")["wa"]).max() > 1e-3
    assert_same(grad(chunked, 0, False), grad(chunked, 0, False, "iclr2022"))


def test_viterbi_with_window_is_best_windowed_run(x64):
  rng = np.random.default_rng(4)
  push, repl, pop = _actions(rng, 1, 5, 2, 2)
  for bottom in ("fixed", "frozen"):
    ((actions, weight),) = rns_stack.viterbi(push, repl, pop, bottom,
                                             window=2)
    best = max(pda_oracle.configurations(push[0], repl[0], pop[0], "max",
                                         bottom, 2)[-1].values())
    assert math.isclose(weight, best, abs_tol=1e-9)
    _, replayed = rns_stack.replay_run(actions, push[0], repl[0], pop[0],
                                       bottom)
    assert math.isclose(replayed, best, abs_tol=1e-9)


@pytest.mark.parametrize("sizes, match", [
    ((0, 3, 2, 2), "batch_size must be an integer >= 1, got 0"),
    ((2.5, 3, 2, 2), "batch_size must be an integer >= 1, got 2.5"),
    ((1, 3, 0, 2), "num_states must be an integer >= 1, got 0"),
    ((1, 3, 2.0, 2), "num_states must be an integer >= 1, got 2.0"),
    ((1, 3, 2, 0), "num_symbols must be an integer >= 1, got 0"),
])
def test_bad_initial_state_sizes_are_one_line_errors(sizes, match):
  """They failed inside JAX (a broadcast shape, an index out of bounds)."""
  with pytest.raises(ValueError, match=match):
    limited_stack.initial_state(*sizes)


def test_bad_window_raises_value_error():
  push = np.zeros((1, 3, 2, 2, 2, 2), np.float32)
  pop = np.zeros((1, 3, 2, 2, 2), np.float32)
  for bad in (0, -2, 2.5, True):
    with pytest.raises(ValueError, match="window must be"):
      limited_stack.run(push, push, pop, bad)
  state = limited_stack.initial_state(1, 4, 2, 2)
  with pytest.raises(ValueError, match="state has window"):
    limited_stack.run(push, push, pop, 3, state=state)
  # The exact window's state (log shares) is not this stack's.
  from nsrnn_jax import limited_log_stack  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="state must be a "
                     "limited_stack.WindowState, got LogWindowState"):
    limited_stack.run(push, push, pop, 4,
                      state=limited_log_stack.initial_state(1, 4, 2, 2))
  with pytest.raises(ValueError, match="truncation_length"):
    limited_stack.run_coupled(lambda *a: a, {}, (), np.zeros((1, 3), int),
                              2, 2, 3, truncation_length=-1)


def _with_window_vjp(monkeypatch, mode, fn):
  """`fn` jitted afresh with limited_stack.WINDOW_VJP = mode while tracing."""
  monkeypatch.setattr(limited_stack, "WINDOW_VJP", mode)
  traced = jax.jit(fn).lower().compile()
  monkeypatch.setattr(limited_stack, "WINDOW_VJP", "custom")
  return traced()


@pytest.mark.parametrize("bottom,boundary", [("fixed", "iclr2023"),
                                             ("frozen", "iclr2022")])
def test_hand_written_window_gradients_equal_autodiff(x64, monkeypatch,
                                                      bottom, boundary):
  # The default (each update's hand-written VJP; in a chunk of coupled
  # steps, the reverse sweep that rebuilds the window) against JAX's
  # autodiff of the same forward: actions with −inf entries, the window
  # wrapping around its ring several times, chunks of 3 steps with either
  # boundary, gradients of the controller's parameters and initial carry,
  # and of the given actions and the final window for `step`.
  q, s, b, t, window = 2, 2, 2, 9, 3
  rng = np.random.default_rng(21)
  acts = [jnp.asarray(a) for a in _actions(rng, b, t, q, s, neginf=0.1)]
  w_hat = rng.normal(size=(b, t, q, s))
  w_g = rng.normal(size=(b, s, window, q, window, q, s))

  def given_actions():
    def loss(push, repl, pop):
      st = limited_stack.initial_state(b, window, q, s, bottom, jnp.float64)

      def body(st, a):
        st, a_hat, lm = limited_stack.step(st, *a)
        return st, (a_hat, lm)

      st, (hat, lm) = lax.scan(body, st, tuple(jnp.swapaxes(x, 0, 1)
                                               for x in (push, repl, pop)))
      return (jnp.sum(w_hat * jnp.exp(jnp.swapaxes(hat, 0, 1)))
              + 0.01 * jnp.sum(lm) + jnp.sum(w_g * st.g))
    return jax.grad(loss, (0, 1, 2))(*acts)

  step_fn = _controller(q, s)
  params = _controller_params(rng, q, s)
  h0 = jnp.asarray(rng.normal(size=(b, _H)))
  xs = jnp.asarray(rng.integers(0, _V, size=(b, t)))
  c1, c2 = rng.normal(size=(b, t, _V)), rng.normal(size=(b, t + 1, q * s))

  def coupled():
    def loss(p, h):
      outs, hat, lm = limited_stack.run_coupled(
          step_fn, p, h, xs, q, s, window, bottom, truncation_length=3,
          actions_fn=_actions_of(q, s) if boundary == "iclr2023" else None)
      return (jnp.sum(c1 * outs) + jnp.sum(c2 * rns_stack.readout(hat)[0])
              + 0.01 * jnp.sum(lm))
    return jax.grad(loss, (0, 1))(params, h0)

  for fn in (given_actions, coupled):
    got = _with_window_vjp(monkeypatch, "custom", fn)
    want = _with_window_vjp(monkeypatch, "autodiff", fn)
    for g, wt in zip(jax.tree_util.tree_leaves(got),
                     jax.tree_util.tree_leaves(want)):
      assert np.all(np.isfinite(g))
      np.testing.assert_allclose(g, wt, rtol=1e-10, atol=1e-12)
  assert np.any(np.asarray(got[1]) != 0)  # the initial carry is trained


@pytest.mark.parametrize("bottom", ["fixed", "frozen"])
def test_the_column_an_update_overwrites_is_empty(bottom):
  # What lets the reverse sweep keep only the overwritten row: before
  # update j the ring's oldest column (time j−D, in the slot column j
  # takes) holds rows of earlier times only, all cleared already. Windows
  # 1 to 5 over 9 updates with −inf holes; with D ≥ 2 the window is not
  # empty elsewhere.
  rng = np.random.default_rng(8)
  acts = [jnp.asarray(a) for a in _actions(rng, 2, 9, 2, 2, neginf=0.2)]
  for window in (1, 2, 3, 5):
    st = limited_stack.initial_state(2, window, 2, 2, bottom)
    for j in range(9):
      g = np.asarray(st.g)
      nxt = (int(st.head) + 1) % window
      assert not np.any(g[:, :, nxt]), (window, j)
      assert j == 0 or window == 1 or np.any(g)
      st = limited_stack.step(st, *(a[:, j] for a in acts))[0]


def test_chunk_gradient_keeps_one_slice_per_update(monkeypatch):
  # XLA's temporary memory of a chunk's gradient: autodiff keeps the whole
  # D × D window at every update, the reverse sweep one row (the column an
  # update overwrites is always empty: 5.0x with a column kept too).
  q, s, b, t, window = 2, 2, 2, 48, 24
  step_fn = _controller(q, s)
  params = _controller_params(np.random.default_rng(0), q, s, np.float32)
  xs = jnp.zeros((b, t), jnp.int32)

  def temp_bytes(mode):
    monkeypatch.setattr(limited_stack, "WINDOW_VJP", mode)
    loss = lambda p: jnp.sum(limited_stack.run_coupled(
        step_fn, p, jnp.zeros((b, _H)), xs, q, s, window)[0])
    out = jax.jit(jax.grad(loss)).lower(params).compile()
    return out.memory_analysis().temp_size_in_bytes

  c, a = temp_bytes("custom"), temp_bytes("autodiff")
  assert c * 5.5 < a  # 6.1x here (D = 24); grows with D


def test_bad_window_vjp_is_a_one_line_error(monkeypatch):
  monkeypatch.setattr(limited_stack, "WINDOW_VJP", "fast")
  st = limited_stack.initial_state(1, 2, 1, 2)
  acts = [jnp.zeros((1, 1, 2, 1, 2)), jnp.zeros((1, 1, 2, 1, 2)),
          jnp.zeros((1, 1, 2, 1))]
  with pytest.raises(ValueError, match="WINDOW_VJP") as info:
    limited_stack.step(st, *acts)
  assert "\n" not in str(info.value)
