"""Tests for the models' `stream` (one token stream in chunks, carried state).

Oracles: the model's own whole-string forward (`__call__`), which must give
the same logits as the chunks fed in order; and, for gradients, the same
model trained on the whole stream with `truncation_length` = the chunk
length (`limited_stack.run_chunks`: one scan over chunks with the
boundaries detached), whose gradient must equal the sum of the chunks'
gradients. Float64, so both agree to rounding.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsrnn_jax import models

pytestmark = pytest.mark.usefixtures("x64")

V, B, N, T = 5, 2, 11, 4  # 11 tokens in chunks of 4, 4, 3.

# name -> models.get options; every model that can stream.
STREAMING = {
    "lstm": {},
    "rns_fixed": dict(name="rns", stack_window=3, stack_bottom="fixed"),
    "rns_frozen_symbol": dict(name="rns", stack_window=2,
                              stack_bottom="frozen", stack_reading="symbol"),
    "vrns": dict(name="vrns", stack_window=3, num_stack_symbols=2),
    # The exact (log-space) window of limited_log_stack.
    "rns_log": dict(name="rns", stack_window=3, stack_table="log"),
}


def _model(key, **overrides):
  opts = dict(STREAMING[key])
  name = opts.pop("name", key)
  opts.update(overrides)
  return models.get(name, V, hidden_size=6, dtype=jnp.float64, **opts)


def _stream(model, params, tokens_BxN, chunk):
  carry = model.apply(params, tokens_BxN.shape[0],
                      method="initial_stream_state")
  stream = jax.jit(functools.partial(model.apply, method="stream"))
  out = []
  for lo in range(0, tokens_BxN.shape[1], chunk):
    logits, carry = stream(params, tokens_BxN[:, lo:lo + chunk], carry)
    out.append(logits)
  return jnp.concatenate(out, axis=1)


def _params(model):
  params = model.init(jax.random.key(0), method="declare_params")
  # Larger weights than the initialiser's, so the stack is really used.
  return jax.tree_util.tree_map(
      lambda p: p * 4 if p.ndim >= 1 else p, params)


@pytest.mark.parametrize("key", sorted(STREAMING))
def test_chunks_give_the_whole_stream_logits(key):
  model = _model(key)
  params = _params(model)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, V, (B, N)))
  want = jax.jit(model.apply)(params, jnp.concatenate(
      [tokens, tokens[:, :1]], axis=1))[:, 1:]
  for chunk in (T, 1):
    np.testing.assert_allclose(_stream(model, params, tokens, chunk), want,
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("key", ["rns_fixed", "rns_frozen_symbol", "vrns"])
def test_chunk_gradients_sum_to_the_truncated_gradient(key):
  n = 2 * T  # Two chunks of one shape: one compilation.
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, V, (B, n)))
  weights = jnp.asarray(np.random.default_rng(3).normal(size=(B, n, V)))
  streamer = _model(key)
  params = _params(streamer)

  @jax.jit
  @functools.partial(jax.grad, has_aux=True)
  def chunk_grad(p, tokens_chunk, weights_chunk, carry):
    logits, carry = streamer.apply(p, tokens_chunk, carry, method="stream")
    return jnp.sum(logits * weights_chunk), carry

  carry = streamer.apply(params, B, method="initial_stream_state")
  got = jax.tree_util.tree_map(jnp.zeros_like, params)
  for lo in range(0, n, T):
    g, carry = chunk_grad(params, tokens[:, lo:lo + T],
                          weights[:, lo:lo + T], carry)
    got = jax.tree_util.tree_map(jnp.add, got, g)

  whole = _model(key, truncation_length=T)
  full = jnp.concatenate([tokens, tokens[:, :1]], axis=1)
  want = jax.jit(jax.grad(
      lambda p: jnp.sum(whole.apply(p, full)[:, 1:] * weights)))(params)
  for g, w in zip(jax.tree_util.tree_leaves(got),
                  jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-10)
  if key != "rns_fixed":
    return
  # Truncation matters here: the untruncated gradient differs.
  untruncated = jax.jit(jax.grad(
      lambda p: jnp.sum(streamer.apply(p, full)[:, 1:] * weights)))(params)
  assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree_util.tree_leaves(got),
      jax.tree_util.tree_leaves(untruncated))) > 1e-6


def test_lstm_chunk_gradient_stops_at_the_boundary():
  model = _model("lstm")
  params = _params(model)
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, V, (B, 2 * T)))
  carry = model.apply(params, B, method="initial_stream_state")
  _, carry = model.apply(params, tokens[:, :T], carry, method="stream")
  # The second chunk's gradient is that of a model started from the
  # carried (h, c) as constants: compare with a direct lstm_step loop.

  def loss(p):
    return jnp.sum(model.apply(p, tokens[:, T:], carry, method="stream")[0])

  def oracle(p):
    h = carry["state"]
    total = 0.0
    for t in range(T, 2 * T):
      h, out = models.lstm_step(p["params"]["controller"] if "params" in p
                                else p["controller"], h,
                                jax.nn.one_hot(tokens[:, t], V,
                                               dtype=jnp.float64))
      total += jnp.sum(models.affine(
          (p["params"] if "params" in p else p)["output"], out))
    return total

  flat = {"params": {"controller": params["params"]["controller"],
                     "output": params["params"]["output"]}}
  got, want = jax.grad(loss)(params), jax.grad(oracle)(flat)
  for part in ("controller", "output"):
    for name in got["params"][part]:
      np.testing.assert_allclose(got["params"][part][name],
                                 want["params"][part][name], rtol=1e-10,
                                 atol=1e-12)


@pytest.mark.parametrize("name, opts", [
    ("jm", {}), ("gref", {}), ("ns", {}), ("rns", {}), ("vrns", {})])
def test_models_whose_stack_grows_cannot_stream(name, opts):
  model = models.get(name, V, hidden_size=4, **opts)
  params = model.init(jax.random.key(0), method="declare_params")
  with pytest.raises(ValueError, match="cannot carry its state across"):
    model.apply(params, B, method="initial_stream_state")


# The windowed stacks and the unlimited RNS (its custom VJP) read the input
# matrix split outside the time loop (models.split_input_matrix).
@pytest.mark.parametrize("key,window", [("lstm", None), ("rns_fixed", None),
                                        ("vrns", None), ("rns_fixed", 0),
                                        ("vrns", 0)])
def test_input_lookup_gives_the_one_hot_values_and_gradients(key, window):
  extra = {} if window is None else {"stack_window": window}
  one_hot, lookup = (_model(key, **extra),
                     _model(key, input_lookup=True, **extra))
  params = _params(one_hot)
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, V, (B, N)))
  weights = jnp.asarray(np.random.default_rng(6).normal(size=(B, N, V)))
  values = [jax.jit(m.apply)(params, tokens) for m in (one_hot, lookup)]
  np.testing.assert_allclose(values[1], values[0], rtol=1e-12, atol=1e-12)
  grads = [jax.jit(jax.grad(lambda p, m=m: jnp.sum(m.apply(p, tokens)
                                                   * weights)))(params)
           for m in (one_hot, lookup)]
  for g, w in zip(jax.tree_util.tree_leaves(grads[1]),
                  jax.tree_util.tree_leaves(grads[0])):
    np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
  # The streamed chunks of the lookup model too.
  if window is None:
    np.testing.assert_allclose(_stream(lookup, params, tokens, T)[:, :-1],
                               values[0][:, 1:], rtol=1e-10, atol=1e-12)
  # Inputs beyond the vocabulary are refused, not silently clamped.
  with pytest.raises(ValueError, match=r"symbol ids must lie in \[0, 5\)"):
    lookup.apply(params, tokens.at[0, 0].set(V))


def test_input_lookup_is_refused_where_it_does_not_apply():
  with pytest.raises(ValueError, match="input_lookup applies to models"):
    models.get("jm", V, input_lookup=True)


@pytest.mark.parametrize("key", ["rns_fixed", "rns_frozen_symbol", "vrns"])
def test_stream_margins_are_the_stack_margin_of_each_prefix(key):
  """Fed in order, the chunks give `stream`'s logits and carries, and the
  minimum of the margins so far is `stack_margin` of the stream so far at
  once: of the updates it made (with the fixed (ICLR 2023) bottom and the
  VRNS-RNN's the last token's update is still pending, with the frozen one
  it is made)."""
  model = _model(key)
  # Larger still, so the margin keeps falling after the first chunk.
  params = jax.tree_util.tree_map(lambda p: p * 3 if p.ndim >= 1 else p,
                                  _params(model))
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, V, (B, N)))
  whole_margin = jax.jit(functools.partial(model.apply, method="stack_margin"))

  def want(end):
    made = tokens[:, :end]
    if key == "rns_frozen_symbol":
      made = jnp.concatenate([made, tokens[:, :1]], axis=1)
    return whole_margin(params, made)

  with_margin = jax.jit(functools.partial(model.apply,
                                          method="stream_with_margin"))
  stream = jax.jit(functools.partial(model.apply, method="stream"))
  for chunk in (T, 1):
    carry = model.apply(params, B, method="initial_stream_state")
    plain = carry
    so_far = []
    for lo in range(0, N, chunk):
      logits, carry, lo_B = with_margin(params, tokens[:, lo:lo + chunk],
                                        carry)
      want_logits, plain = stream(params, tokens[:, lo:lo + chunk], plain)
      np.testing.assert_array_equal(logits, want_logits)
      so_far.append(lo_B if not so_far else jnp.minimum(so_far[-1], lo_B))
      if chunk == T:
        np.testing.assert_allclose(so_far[-1], want(lo + chunk), rtol=1e-12)
    for a, b in zip(jax.tree_util.tree_leaves(carry),
                    jax.tree_util.tree_leaves(plain)):
      np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(so_far[-1], want(N), rtol=1e-12)
    if chunk == 1:
      # Later chunks count: the margin so far goes down after the first.
      assert bool(jnp.any(so_far[-1] < so_far[0] - 0.1))


@pytest.mark.parametrize("key", ["rns_fixed", "rns_frozen_symbol", "vrns"])
def test_stream_margin_leaves_out_a_row_s_padding(key):
  """With a mask, a padded row's margin is that of its real inputs streamed
  alone; the row ends inside a chunk and at a chunk's end."""
  model = _model(key)
  params = jax.tree_util.tree_map(lambda p: p * 3 if p.ndim >= 1 else p,
                                  _params(model))
  tokens = jnp.asarray(np.random.default_rng(6).integers(0, V, (B, N)))
  with_margin = jax.jit(functools.partial(model.apply,
                                          method="stream_with_margin"))

  def streamed(inputs, mask):
    carry = model.apply(params, inputs.shape[0],
                        method="initial_stream_state")
    lo = jnp.inf
    for start in range(0, inputs.shape[1], T):
      _, carry, lo_B = with_margin(
          params, inputs[:, start:start + T], carry,
          None if mask is None else mask[:, start:start + T])
      lo = jnp.minimum(lo, lo_B)
    return lo

  for real in (6, 2 * T):
    mask = jnp.asarray(np.arange(N)[None] < np.array([[N], [real]]),
                       jnp.float32)
    got = streamed(tokens, mask)
    np.testing.assert_allclose(got[0], streamed(tokens, None)[0], rtol=1e-12)
    alone = streamed(tokens[1:, :real], None)[0]
    np.testing.assert_allclose(got[1], alone, rtol=1e-12)
    if key != "rns_frozen_symbol":  # Its margin (D = 2) settles early.
      # The padding's updates would count otherwise.
      assert float(streamed(tokens, None)[1]) < float(alone) - 1e-3


@pytest.mark.parametrize("name, opts", [
    ("rns", dict(stack_window=3, stack_table="log")),
    ("vrns", dict(stack_window=3, broadcast_bottom_vector=True)),
    ("ns", {})])
def test_stream_margin_of_a_stack_without_one_is_a_clear_error(name, opts):
  model = models.get(name, V, hidden_size=4, **opts)
  params = model.init(jax.random.key(0), method="declare_params")
  carry = {"first": jnp.asarray(True), "state": None}
  with pytest.raises(ValueError, match=r"stack_margin applies|cannot carry"):
    model.apply(params, jnp.zeros((B, T), jnp.int32), carry,
                method="stream_with_margin")
