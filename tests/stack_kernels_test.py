"""Tests for nsrnn_jax.stack_kernels (the stack's updates as Pallas kernels).

On CPU the kernels run in Pallas's interpreter, which executes the same
kernel bodies (index arithmetic, masks, gathers and scatters) on the host.
Oracles: `rns_stack`'s XLA ops for the same work (`_local` + the pop
product on tables that real sweeps produced; the reverse sweep's W-table
and table products), the brute-force PDA (`pda_oracle`), and the XLA
sweeps' gradients. Whether the kernels compile for a GPU is checked by
lowering them for CUDA, which runs the Triton lowering (unsupported
operations and non-power-of-two shapes fail there) without a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pda_oracle
from nsrnn_jax import models
from nsrnn_jax import rns_stack
from nsrnn_jax import stack_kernels


def _actions(rng, batch, steps, q, s, kind):
  """'unnorm' (N(0,1)·3), 'huge' (N(0,1)·10 + 50) or 'neginf' (with −inf
  entries: zero weights) log-weights for `steps` updates."""
  shapes = [(batch, steps, q, s, q, s)] * 2 + [(batch, steps, q, s, q)]
  acts = [rng.normal(size=sh) for sh in shapes]
  if kind == "unnorm":
    return tuple(3 * a for a in acts)
  if kind == "huge":
    return tuple(10 * a + 50 for a in acts)
  assert kind == "neginf"
  return tuple(np.where(rng.random(a.shape) < p, -np.inf, 3 * a)
               for a, p in zip(acts, (0.15, 0.3, 0.3)))


@jax.jit
def _xla_update(g, cs, p, a_prev, push, repl, pop):
  """Update p of the forward sweep as rns_stack computes it with XLA ops."""
  prec = lax.Precision.HIGHEST
  prev = g[:, :, p]
  # pylint: disable=protected-access
  col, mt, a_hat, inc, res = rns_stack._local(
      prev, cs, p, a_prev, push, repl, pop, prec, residuals=True)
  col = col + rns_stack._pop_matmul(g, mt, prec)
  return (g.at[:, :, p + 1].set(col),
          cs.at[:, :, p + 1].set(jnp.sum(col, axis=(3, 4, 5))),
          mt, a_hat, inc, res)


def _table_after(push, repl, pop, done, bottom, num_points):
  """The table, column sums and log α̂ after `done` updates of a real
  sweep, zero-padded to `num_points` time points."""
  g, cs, la, _, _, _ = rns_stack._forward(  # pylint: disable=protected-access
      push[:, :done], repl[:, :done], pop[:, :done], bottom, "highest")
  pad = num_points - g.shape[2]
  g = jnp.pad(g, [(0, 0), (0, 0), (0, pad), (0, 0), (0, pad), (0, 0), (0, 0)])
  cs = jnp.pad(cs, [(0, 0), (0, 0), (0, pad), (0, 0)])
  return g, cs, la[:, -1]


def _assert_same(got, want, atol):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape
  np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
  fin = np.isfinite(want)
  np.testing.assert_allclose(got[fin], want[fin], rtol=0, atol=atol)


# (batch, Q, S, updates done, free columns after column j, actions, bottom)
_UPDATES = [
    (2, 2, 2, 4, 3, "unnorm", "frozen"),  # Q = S = 2; free columns after it
    (2, 2, 3, 0, 2, "neginf", "fixed"),   # update 1, Q ≠ S, zero weights
    (1, 3, 2, 6, 1, "huge", "frozen"),    # column j is the table's last
    (1, 3, 3, 20, 5, "unnorm", "fixed"),  # rows over two tiles, KT chunks
]


def _update_inputs(b, q, s, done, extra, kind, bottom):
  """(g, cs, p, a_prev, push, repl, pop) of update done + 1 of a sweep."""
  rng = np.random.default_rng(7 * done + q + 10 * s)
  push, repl, pop = (jnp.asarray(a) for a in
                     _actions(rng, b, done + 1, q, s, kind))
  num_points = done + 2 + extra    # time points −1 .. done, and more
  g, cs, a_prev = _table_after(push, repl, pop, done, bottom, num_points)
  p = done + 1                       # axis index of time j − 1 = done
  return g, cs, p, a_prev, push[:, done], repl[:, done], pop[:, done]


# The table kernels' layouts: a loop over row tiles in each program, or
# a program per row tile (ROW_GRID; small tiles, so that several are past
# the triangle's last row and several gather each column's sums).
_LAYOUTS = {"row_loop": {}, "row_grid": {"ROW_GRID": True, "ROW_TILE": 16}}


@pytest.fixture(params=list(_LAYOUTS))
def layout(request, monkeypatch):
  for name, value in _LAYOUTS[request.param].items():
    monkeypatch.setattr(stack_kernels, name, value)
  return request.param


@pytest.mark.parametrize("b,q,s,done,extra,kind,bottom", _UPDATES)
def test_update_equals_the_xla_update(x64, layout, b, q, s, done, extra,
                                      kind, bottom):
  del layout                        # set by its fixture
  g, cs, p, a_prev, *acts = _update_inputs(b, q, s, done, extra, kind,
                                           bottom)
  want = _xla_update(g, cs, p, a_prev, *acts)
  got = jax.jit(stack_kernels.forward_update)(g, cs, p, a_prev, *acts)
  for w, x in zip(jax.tree_util.tree_leaves(want),
                  jax.tree_util.tree_leaves(got)):
    _assert_same(x, w, 1e-12)
  # A kernel that wrote nothing but column p + 1 leaves the rest as it was.
  np.testing.assert_array_equal(np.delete(np.asarray(got[0]), p + 1, 2),
                                np.delete(np.asarray(g), p + 1, 2))


def test_update_float32():
  rng = np.random.default_rng(3)
  push, repl, pop = (jnp.asarray(a, jnp.float32) for a in
                     _actions(rng, 1, 5, 2, 3, "unnorm"))
  g, cs, a_prev = _table_after(push, repl, pop, 4, "frozen", 7)
  acts = (push[:, 4], repl[:, 4], pop[:, 4])
  want = _xla_update(g, cs, 5, a_prev, *acts)
  got = jax.jit(stack_kernels.forward_update)(g, cs, 5, a_prev, *acts)
  for w, x in zip(jax.tree_util.tree_leaves(want),
                  jax.tree_util.tree_leaves(got)):
    assert x.dtype == jnp.float32
    _assert_same(x, w, 2e-6)


def test_vmapped_update_equals_separate_updates(x64, layout):
  # grid.py vmaps K models' train steps: the kernel batched over models
  # (with ROW_GRID, a grid of four axes).
  del layout                        # set by its fixture
  rng = np.random.default_rng(4)
  inputs = []
  for _ in range(2):
    push, repl, pop = (jnp.asarray(a) for a in
                       _actions(rng, 2, 5, 2, 3, "unnorm"))
    g, cs, a_prev = _table_after(push, repl, pop, 4, "frozen", 7)
    inputs.append((g, cs, a_prev, push[:, 4], repl[:, 4], pop[:, 4]))
  stacked = [jnp.stack(a) for a in zip(*inputs)]
  update = lambda g, cs, a, *acts: stack_kernels.forward_update(
      g, cs, 5, a, *acts)
  got = jax.jit(jax.vmap(update))(*stacked)
  for k, (g, cs, a_prev, *acts) in enumerate(inputs):
    want = _xla_update(g, cs, 5, a_prev, *acts)
    for w, x in zip(jax.tree_util.tree_leaves(want),
                    jax.tree_util.tree_leaves(got)):
      _assert_same(x[k], w, 1e-12)


@pytest.mark.parametrize("b,q,s,done,extra,kind,bottom", _UPDATES)
def test_local_bwd_equals_the_xla_vjp(x64, b, q, s, done, extra, kind,
                                      bottom):
  # On the residuals of a real update and random cotangents.
  g, cs, p, a_prev, *acts = _update_inputs(b, q, s, done, extra, kind,
                                           bottom)
  g, cs, mt, a_hat, inc, res = _xla_update(g, cs, p, a_prev, *acts)
  rng = np.random.default_rng(done)
  cts = tuple(jnp.asarray(rng.normal(size=x.shape))
              for x in (g[:, :, p + 1], mt, a_hat, inc))
  prev = g[:, :, p]
  want = jax.jit(lambda *a: rns_stack._local_bwd(  # pylint: disable=protected-access
      *a, lax.Precision.HIGHEST))(prev, cs, p, a_hat, res, cts)
  got = jax.jit(stack_kernels.local_bwd)(prev, cs, p, a_hat, res, cts)
  for w, x in zip(want, got):
    assert x.shape == w.shape
    np.testing.assert_allclose(x, w, rtol=1e-12, atol=1e-12)


@jax.jit
def _xla_backward_table(g_t, w_tab, w_next, e_p, prev_hat, cs_bar, j, row0,
                        num_steps):
  """The reverse sweep's table-sized work for update j, as rns_stack's XLA
  ops do it (`_backward_blocks`)."""
  b, y, r, n = prev_hat.shape[:4]
  w_tab = lax.dynamic_update_slice_in_dim(
      w_tab, w_next.reshape(b * y, r, -1),
      (jnp.minimum(j + 1, num_steps) - row0) * r, axis=1)
  e_col = lax.dynamic_index_in_dim(e_p, j + 1, axis=2, keepdims=False)
  hi = lax.Precision.HIGHEST
  left = lax.dot_general(e_col.reshape(b * y, r, -1), w_tab,
                         (((2,), (1,)), ((0,), (0,))), precision=hi)
  cs_k = lax.dynamic_index_in_dim(cs_bar, j + 1, axis=2, keepdims=False)
  col_ct = prev_hat + left.reshape(prev_hat.shape) + cs_k[..., None, None,
                                                           None]
  mt = lax.dot_general(g_t, col_ct.reshape(b * y, r, -1),
                       (((2,), (2,)), ((0,), (0,))), precision=hi)
  return w_tab, col_ct, jnp.transpose(mt.reshape(b, y, n, r, r),
                                      (0, 1, 4, 2, 3))


@pytest.mark.parametrize("b,q,s,n,steps,row0,j", [
    (2, 2, 2, 9, 12, 5, 7),
    (1, 3, 2, 12, 11, 4, 10),      # the sweep's first update: j + 1 = T
    (2, 2, 3, 30, 40, 20, 25),     # rows over tiles, W rows over chunks
])
def test_backward_table_update_equals_the_xla_ops(x64, layout, b, q, s, n,
                                                  steps, row0, j):
  del layout                        # set by its fixture
  rng = np.random.default_rng(n + j)
  rows = (steps - row0 + 1) * q
  arrays = [rng.normal(size=sh) for sh in [
      (b * s, n * q, n * q * s), (b * s, rows, n * q * s),
      (b, s, q, n, q, s), (b, s, n, q, rows), (b, s, q, n, q, s),
      (b, s, n, q)]]
  # A sweep's structure, which the kernel skips: the table is a triangle
  # (column k's rows i < k) and M̃_{j'} is zero at columns k ≥ j'.
  col_k = np.arange(n)
  arrays[0] *= np.repeat(np.repeat(col_k[:, None] > col_k[None, :], q, 0),
                         q * s, 1)
  j_of_row = row0 + np.arange(rows) // q
  arrays[3] *= (col_k[:, None, None] < j_of_row[None, None, :])
  arrays = [jnp.asarray(a) for a in arrays]
  want = list(_xla_backward_table(*arrays, j, row0, steps))
  # M̃_j's cotangent at the columns k ≥ j is unused (M̃_j is zero there):
  # the kernel writes zero.
  want[2] = want[2] * (col_k[:, None] < j)
  got = jax.jit(stack_kernels.backward_table_update, static_argnums=(7, 8))(
      *arrays, j, row0, steps)
  for w, x in zip(want, got):
    assert x.shape == w.shape
    np.testing.assert_allclose(x, w, rtol=1e-13, atol=1e-11)


@pytest.fixture
def pallas_kernels(monkeypatch):
  """rns_stack's sweeps on the Pallas kernels; JAX's caches are cleared
  around it, so that no trace under the other setting is reused."""
  jax.clear_caches()
  monkeypatch.setattr(rns_stack, "UPDATE_KERNELS", "pallas")
  yield
  monkeypatch.undo()
  jax.clear_caches()


@pytest.mark.parametrize("bottom", ["frozen", "fixed"])
def test_sweep_on_the_kernels_matches_explicit_stacks(x64, pallas_kernels,
                                                     bottom):
  q, s, steps = 2, 2, 5
  rng = np.random.default_rng(5)
  push, repl, pop = _actions(rng, 2, steps, q, s, "neginf")
  hat, mass = (np.asarray(a) for a in rns_stack.run(push, repl, pop, bottom))
  got = hat + mass[..., None, None]
  for b in range(2):
    want = pda_oracle.alpha(push[b], repl[b], pop[b], bottom=bottom)
    fin = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got[b]), fin)
    np.testing.assert_allclose(got[b][fin], want[fin], rtol=0, atol=1e-9)


def _assert_kernels_give_the_same(compute, monkeypatch, rtol):
  """`compute()` (a pytree) traced afresh on the XLA sweeps, then on the
  kernels (rns_stack.UPDATE_KERNELS = "pallas"): the same to 1e-12."""
  jax.clear_caches()
  want = compute()
  monkeypatch.setattr(rns_stack, "UPDATE_KERNELS", "pallas")
  jax.clear_caches()
  got = compute()
  monkeypatch.setattr(rns_stack, "UPDATE_KERNELS", "xla")
  jax.clear_caches()
  for x, w in zip(jax.tree_util.tree_leaves(got),
                  jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(x, w, rtol=rtol, atol=1e-12)


def test_gradients_through_the_kernels_equal_the_xla_sweeps(x64, layout,
                                                            monkeypatch):
  # Both kernels in a sweep: the reverse sweep's must read the forward
  # kernel's residuals, table and column sums as the XLA ops do, and hand
  # on the same column cotangents (3 uneven time blocks: the W table and
  # the carries are cut at every block boundary).
  q, s, steps = 2, 3, 10
  rng = np.random.default_rng(9)
  push, repl, pop = (jnp.asarray(a) for a in
                     _actions(rng, 2, steps, q, s, "unnorm"))
  c = jnp.asarray(rng.normal(size=(2, steps + 1, q * s)))

  def loss(push, repl, pop):
    hat, mass = rns_stack.run(push, repl, pop, "frozen")
    return jnp.sum(c * rns_stack.readout(hat)[0]) + 0.01 * jnp.sum(mass)

  del layout                        # set by its fixture
  monkeypatch.setattr(rns_stack, "_time_blocks",
                      lambda t: [(1, 4), (4, 7), (7, t + 1)])
  # (The grid's atomic column sums may add in another order: 1e-12.)
  _assert_kernels_give_the_same(
      lambda: jax.value_and_grad(loss, argnums=(0, 1, 2))(push, repl, pop),
      monkeypatch, rtol=1e-12)


def test_coupled_gradients_through_the_kernels_equal_the_xla_sweeps(
    x64, monkeypatch):
  # The NS-RNN's recurrence: a controller reads ρ_{j−1} and emits update
  # j's actions (frozen bottom, symbol reading, as models.run_ns_stack).
  q, s, b, t, h, v = 2, 2, 2, 9, 4, 3
  rng = np.random.default_rng(12)
  params = {"wx": rng.normal(size=(v, h)), "wr": rng.normal(size=(s, h)),
            "wh": 0.5 * rng.normal(size=(h, h)),
            "wa": rng.normal(size=(h, q * s * (2 * q * s + q))),
            "wo": rng.normal(size=(h, v))}

  def step_fn(p, c, x, rho):
    c = jnp.tanh(jax.nn.one_hot(x, v, dtype=rho.dtype) @ p["wx"]
                 + rho @ p["wr"] + c @ p["wh"])
    acts = rns_stack.split_action_logits(c @ p["wa"], q, s, True)
    return c, acts, c @ p["wo"]

  xs = jnp.asarray(rng.integers(0, v, size=(b, t)))
  h0 = jnp.asarray(0.1 * rng.normal(size=(b, h)))
  c = jnp.asarray(rng.normal(size=(b, t, v)))

  def loss(p, h0):
    outs, hat, lm = rns_stack.run_coupled(step_fn, p, h0, xs, q, s,
                                          "frozen", "symbol")
    return (jnp.sum(c * outs) + jnp.sum(rns_stack.readout(hat, "symbol")[0])
            + 0.01 * jnp.sum(lm))

  _assert_kernels_give_the_same(
      lambda: jax.value_and_grad(loss, argnums=(0, 1))(params, h0),
      monkeypatch, rtol=1e-10)


def test_ns_rnn_on_the_kernels_equals_the_xla_sweeps(x64, monkeypatch):
  # The NS-RNN language model (Flax LSTM controller, the stack on chunks of
  # 2 strings under lax.map): its loss and parameter gradient.
  vocab = 3
  model = models.get("ns", vocab, hidden_size=4, dtype=jnp.float64,
                     stack_batch_chunk=2)
  rng = np.random.default_rng(6)
  symbols = jnp.asarray(rng.integers(0, vocab, size=(4, 7)), jnp.int32)
  params = model.init(jax.random.key(0), symbols)["params"]
  params = jax.tree.map(
      lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params)

  def loss(p):
    return -jnp.sum(models.sequence_log_prob(
        model.apply({"params": p}, symbols), symbols))

  _assert_kernels_give_the_same(lambda: jax.value_and_grad(loss)(params),
                                monkeypatch, rtol=1e-10)


def test_unknown_update_kernels_is_a_clear_error(monkeypatch):
  monkeypatch.setattr(rns_stack, "UPDATE_KERNELS", "triton")
  jax.clear_caches()
  z = np.zeros((1, 2, 1, 1, 1, 1))
  with pytest.raises(ValueError, match="UPDATE_KERNELS must be one of"):
    rns_stack.run(z, z, np.zeros((1, 2, 1, 1, 1)))
  monkeypatch.undo()
  jax.clear_caches()


@pytest.mark.parametrize("b,q,s,n", [(10, 2, 2, 82), (10, 3, 3, 82),
                                     (2, 2, 3, 7)])
def test_kernels_lower_to_triton_for_cuda(layout, b, q, s, n):
  del layout                        # set by its fixture
  # The paper's n = 80 (82 time points) at Q = S = 2 and 3, and a ragged
  # shape: lowering for CUDA runs the Triton lowering on this machine.
  f32 = jnp.float32
  shapes = [(b, s, n, q, n, q, s), (b, s, n, q), (), (b, q, s),
            (b, q, s, q, s), (b, q, s, q, s), (b, q, s, q)]
  args = [jax.ShapeDtypeStruct(sh, jnp.int32 if sh == () else f32)
          for sh in shapes]
  forward = lambda *a: stack_kernels.forward_update(*a, interpret=False)
  assert _triton_calls(forward, args) == 1
  # The reverse sweep's kernel in the last of 3 time blocks of T = n − 2.
  steps, row0 = n - 2, max(1, 2 * (n - 2) // 3)
  rows = (steps - row0 + 1) * q
  args = [jax.ShapeDtypeStruct(sh, f32) for sh in [
      (b * s, n * q, n * q * s), (b * s, rows, n * q * s),
      (b, s, q, n, q, s), (b, s, n, q, rows), (b, s, q, n, q, s),
      (b, s, n, q)]] + [jax.ShapeDtypeStruct((), jnp.int32)]
  backward = lambda *a: stack_kernels.backward_table_update(
      *a[:6], a[6], row0, steps, interpret=False)
  assert _triton_calls(backward, args) == 1
  sd = lambda *sh: jax.ShapeDtypeStruct(sh, f32)
  args = (sd(b, s, q, n, q, s), sd(b, s, n, q),
          jax.ShapeDtypeStruct((), jnp.int32), sd(b, q, s),
          (sd(3, b, q, s, 3 * q * s), sd(b, s, q, s)),
          (sd(b, s, q, n, q, s), sd(b, s, q, n, q), sd(b, q, s), sd(b)))
  local = lambda *a: stack_kernels.local_bwd(*a, interpret=False)
  assert _triton_calls(local, args) == 1


def _triton_calls(fn, args):
  """Triton kernels in `fn` lowered for CUDA (runs the Triton lowering)."""
  exported = jax.export.export(
      jax.jit(fn), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
          "__gpu$xla.gpu.triton")])(*args)
  return exported.mlir_module().count("xla.gpu.triton")


def test_vmapped_kernels_lower_to_triton_for_cuda(layout):
  # grid.py's model axis adds a grid axis: four with ROW_GRID, more than
  # Triton's three, which Pallas's lowering must fold.
  del layout                        # set by its fixture
  k, b, q, s, n = 3, 2, 2, 3, 10
  sd = lambda *sh: jax.ShapeDtypeStruct((k,) + sh, jnp.float32)
  args = [sd(b, s, n, q, n, q, s), sd(b, s, n, q),
          jax.ShapeDtypeStruct((k,), jnp.int32), sd(b, q, s),
          sd(b, q, s, q, s), sd(b, q, s, q, s), sd(b, q, s, q)]
  forward = jax.vmap(
      lambda *a: stack_kernels.forward_update(*a, interpret=False))
  assert _triton_calls(forward, args) == 1
