"""Tests for nsrnn_jax.models against naive NumPy references.

Oracles (none tuned to the implementation):
  * a NumPy LSTM written from PyTorch's gate equations;
  * JM: the growing list of vectors with a zero bottom, cell by cell;
  * Gref: the literal top-down walk of reference-behaviour section 2.2;
  * NS-RNN: controller steps in NumPy feeding a brute-force PDA over explicit
    stacks with the frozen-bottom semantics of section 1.5;
  * the reference protocol of exactly n - 2 stack updates (the models do one
    extra, unused update; matching the oracle shows that it is harmless).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsrnn_jax import limited_stack
from nsrnn_jax import models
from nsrnn_jax import ns_stack
from nsrnn_jax import rns_stack
import action_weights  # tests/action_weights.py, on sys.path under pytest
import pda_oracle  # tests/pda_oracle.py, on sys.path under pytest


# ---------------------------------------------------------------------------
# NumPy references.
# ---------------------------------------------------------------------------


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _np_lstm_step(p, h, c, x):
  """PyTorch LSTM equations, gate blocks i, f, g, o of the 4H axis."""
  hidden = h.shape[-1]

  def pre(k):
    sl = slice(k * hidden, (k + 1) * hidden)
    return x @ p['w_ih'][:, sl] + p['b_ih'][sl] + h @ p['w_hh'][:, sl] + p[
        'b_hh'][sl]

  i, f, g, o = _sigmoid(pre(0)), _sigmoid(pre(1)), np.tanh(pre(2)), _sigmoid(
      pre(3))
  c = f * c + i * g
  return o * np.tanh(c), c


def _np_affine(p, x):
  return x @ p['kernel'] + p['bias']


class _JMStack:
  """Naive JM stack: a Python list of vectors, top first, zero below."""

  def __init__(self, params, m):
    self.params, self.m, self.cells = params, m, []
    self.reading = np.zeros(m)

  def update(self, h):
    push, pop, noop = _softmax(_np_affine(self.params['action'], h))
    v = _sigmoid(_np_affine(self.params['push'], h))
    old = self.cells
    get = lambda i: old[i] if 0 <= i < len(old) else np.zeros(self.m)
    new = []
    for i in range(len(old) + 1):
      above = v if i == 0 else get(i - 1)
      new.append(push * above + noop * get(i) + pop * get(i + 1))
    self.cells = new
    self.reading = new[0]


class _MultiJMStack:
  """K naive JM stacks (`_JMStack`'s lists) with their own actions.

  Stack k takes softmax block k of the action layer and columns
  [k m, (k + 1) m) of the pushed vector: sigmoid(push layer), or h itself
  with ``push_hidden``. The reading is the K tops concatenated.
  """

  def __init__(self, params, m, k, push_hidden):
    self.params, self.m, self.k, self.push_hidden = params, m, k, push_hidden
    self.stacks = [[] for _ in range(k)]
    self.reading = np.zeros(k * m)

  def update(self, h):
    logits = _np_affine(self.params['action'], h).reshape(self.k, 3)
    v = h if self.push_hidden else _sigmoid(_np_affine(self.params['push'],
                                                       h))
    tops = []
    for j in range(self.k):
      push, pop, noop = _softmax(logits[j])
      old = self.stacks[j]
      get = lambda i, old=old: old[i] if 0 <= i < len(old) else np.zeros(
          self.m)
      vj = v[j * self.m:(j + 1) * self.m]
      self.stacks[j] = [push * (vj if i == 0 else get(i - 1))
                        + noop * get(i) + pop * get(i + 1)
                        for i in range(len(old) + 1)]
      tops.append(self.stacks[j][0])
    self.reading = np.concatenate(tops)


class _GrefStack:
  """Naive Gref stack: the literal walk of section 2.2, bottom first."""

  def __init__(self, params, m):
    self.params, self.m = params, m
    self.values, self.strengths = [], []
    self.reading = np.zeros(m)

  def update(self, h):
    d, u = _sigmoid(_np_affine(self.params['action'], h))
    v = np.tanh(_np_affine(self.params['push'], h))
    rho = u
    for i in reversed(range(len(self.strengths))):
      old = self.strengths[i]
      self.strengths[i] = max(0.0, old - max(0.0, rho))
      rho -= old
    self.values.append(v)
    self.strengths.append(d)
    reading, remaining = np.zeros(self.m), 1.0
    for i in reversed(range(len(self.strengths))):
      reading += min(self.strengths[i], max(0.0, remaining)) * self.values[i]
      remaining -= self.strengths[i]
    self.reading = reading


def _ns_action_log_probs(action_params, h, q, s):
  """Section 1.1 layout: per (q, x) row one log-softmax over 2QS + Q."""
  logits = _np_affine(action_params, h).reshape(q * s, 2 * q * s + q)
  log_p = np.log(_softmax(logits))
  return (log_p[:, :q * s].reshape(q, s, q, s),
          log_p[:, q * s:2 * q * s].reshape(q, s, q, s),
          log_p[:, 2 * q * s:].reshape(q, s, q))


class _PDAStack:
  """NS stack by brute force: every update re-runs tests/pda_oracle.py.

  The oracle enumerates explicit (state, stack) configurations with the
  frozen-bottom semantics of reference-behaviour 1.5 for all updates so far.
  """

  def __init__(self, params, q, s):
    self.params, self.q, self.s = params, q, s
    self.actions = ([], [], [])
    self.reading = np.eye(s)[0]
    self.log_mass = 0.0

  def update(self, h):
    for store, a in zip(self.actions, _ns_action_log_probs(
        self.params['action'], h, self.q, self.s)):
      store.append(a)
    readings, log_mass = pda_oracle.readings_and_log_mass(
        *(np.stack(a) for a in self.actions))
    self.reading, self.log_mass = readings[-1], log_mass[-1]


def _reference_logits(params, symbols, vocab_size, make_stack=None,
                      reading_size=0, initial_reading=None):
  """Slow LM: reference time indexing with exactly n - 2 stack updates.

  Returns:
    (logits [n, V], readings fed r_0 .. r_{n-2}, per-update log masses of
    the stack (NS only, else empty)).
  """
  p = jax.tree.map(np.asarray, params)
  hidden = p['controller']['w_hh'].shape[0]
  h, c = np.zeros(hidden), np.zeros(hidden)
  stack = make_stack(p) if make_stack else None
  reading = (initial_reading if initial_reading is not None
             else np.zeros(reading_size))
  logits, readings = [_np_affine(p['output'], h)], [reading]
  log_masses = [0.0]
  n = len(symbols)
  for t in range(1, n):
    x = np.concatenate([np.eye(vocab_size)[symbols[t - 1]], reading])
    h, c = _np_lstm_step(p['controller'], h, c, x)
    logits.append(_np_affine(p['output'], h))
    if stack is not None and t <= n - 2:
      stack.update(h)
      reading = stack.reading
      readings.append(reading)
      log_masses.append(getattr(stack, 'log_mass', np.nan))
  return np.stack(logits), np.stack(readings), np.array(log_masses)


def _log_prob_from_logits(logits, symbols):
  log_p = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(
      -1, keepdims=True)) - logits.max(-1, keepdims=True)
  return float(sum(log_p[t, w] for t, w in enumerate(symbols)))


def _randomize(params, seed, scale=1.0):
  """Replaces every parameter by N(0, scale^2) so no value is special."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda a: jnp.asarray(scale * rng.standard_normal(a.shape), a.dtype),
      params)


def _init(model, symbols=None):
  del symbols  # init_params needs no forward pass (keeps the file fast)
  return models.init_params(model, jax.random.key(0))


def _apply(model, params, symbols, method=None):
  return jax.jit(functools.partial(model.apply, method=method))(
      {'params': params}, jnp.asarray(symbols))


# ---------------------------------------------------------------------------
# Stack updates on their own.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('num_updates', [1, 2, 7, 8])
def test_jm_update_fixed_depth_equals_growing_list(num_updates):
  rng = np.random.default_rng(num_updates)
  m = 3
  # Push for the first half, pop afterwards (the worst case for truncation),
  # mixed with random soft actions on a second batch row.
  hard = np.array([[1.0, 0, 0] if t < num_updates // 2 + 1 else [0, 1.0, 0]
                   for t in range(num_updates)])
  soft = _softmax(2 * rng.standard_normal((num_updates, 3)))
  actions_BxTx3 = np.stack([hard, soft])
  push_BxTxM = rng.uniform(size=(2, num_updates, m))
  stack = jnp.zeros((2, models.jm_depth(num_updates), m), jnp.float32)
  ref = [[], []]  # naive stacks, top first, growing by one cell per update
  for t in range(num_updates):
    stack = models.jm_update(stack, jnp.asarray(actions_BxTx3[:, t]),
                             jnp.asarray(push_BxTxM[:, t]))
    for b in range(2):
      cells = ref[b]
      get = lambda i, c=cells: c[i] if 0 <= i < len(c) else np.zeros(m)
      push, pop, noop = actions_BxTx3[b, t]
      ref[b] = [push * (push_BxTxM[b, t] if i == 0 else get(i - 1))
                + noop * get(i) + pop * get(i + 1)
                for i in range(len(cells) + 1)]
      np.testing.assert_allclose(stack[b, 0], ref[b][0], atol=1e-6)
  # The hard row ends with the pushed vectors popped back to the top.
  if num_updates > 2:
    assert np.abs(np.asarray(stack[0, 0])).max() > 0.05


def test_gref_update_equals_walk_on_random_stacks():
  rng = np.random.default_rng(0)
  capacity, m, filled = 6, 2, 4
  values = rng.standard_normal((3, capacity, m))
  strengths = rng.uniform(0, 0.8, (3, capacity))
  values[:, filled:] = 0
  strengths[:, filled:] = 0
  d = rng.uniform(size=3)
  u = np.array([0.3, 1.7, 0.0])
  v = rng.standard_normal((3, m))
  new_values, new_strengths, reading = models.gref_update(
      jnp.asarray(values), jnp.asarray(strengths), filled, jnp.asarray(d),
      jnp.asarray(u), jnp.asarray(v))
  for b in range(3):
    s = list(strengths[b, :filled])
    rho = u[b]
    for i in reversed(range(filled)):
      old = s[i]
      s[i] = max(0.0, old - max(0.0, rho))
      rho -= old
    s.append(d[b])
    vals = list(values[b, :filled]) + [v[b]]
    expected, remaining = np.zeros(m), 1.0
    for i in reversed(range(filled + 1)):
      expected += min(s[i], max(0.0, remaining)) * vals[i]
      remaining -= s[i]
    np.testing.assert_allclose(new_strengths[b, :filled + 1], s, atol=1e-6)
    np.testing.assert_allclose(new_values[b, filled], v[b], atol=1e-6)
    np.testing.assert_allclose(reading[b], expected, atol=1e-6)
  # Only the pop of row 1 (u = 1.7) reaches into the stack.
  assert not np.allclose(new_strengths[1, :filled], strengths[1, :filled])
  np.testing.assert_allclose(new_strengths[2, :filled], strengths[2, :filled])


# ---------------------------------------------------------------------------
# Whole models against the slow references (float64).
# ---------------------------------------------------------------------------

_VOCAB = 3
_SYMBOLS = np.array([[0, 1, 2, 2, 1, 0, 0, 1, 2, 1, 1, 0, 2],
                     [2, 2, 2, 0, 1, 1, 0, 2, 0, 0, 1, 2, 1]], np.int32)


@pytest.mark.parametrize('name', ['lstm', 'jm', 'gref'])
def test_model_matches_numpy_reference(name):
  m = 4
  with jax.enable_x64(True):
    model = models.get(name, _VOCAB, hidden_size=5, stack_embedding_size=m,
                       dtype=jnp.float64)
    params = _randomize(_init(model, _SYMBOLS), seed=1, scale=0.8)
    out = _apply(model, params, _SYMBOLS, method='trace')
    for b, string in enumerate(_SYMBOLS):
      make_stack = {'lstm': None,
                    'jm': lambda p: _JMStack(p, m),
                    'gref': lambda p: _GrefStack(p, m)}[name]
      logits, readings, _ = _reference_logits(
          params, string, _VOCAB, make_stack, reading_size=m if make_stack
          else 0)
      np.testing.assert_allclose(out['logits'][b], logits, rtol=1e-10,
                                 atol=1e-10)
      if name != 'lstm':
        n = len(string)
        np.testing.assert_allclose(out['readings'][b, :n - 1], readings,
                                   atol=1e-10)
    if name != 'lstm':
      # Non-trivial stacks: readings vary and the actions are not uniform.
      assert np.ptp(np.asarray(out['readings'][:, 1:])) > 0.1
      assert np.ptp(np.asarray(out['actions'])) > 0.1


@pytest.mark.parametrize('k,m,hidden,push_hidden', [
    (3, 2, 5, False),   # JM-3.3.3's form: K stacks with their own actions
    (1, 5, 5, True),    # JM with a pushed hidden state (the paper's form)
    (2, 2, 4, True)])   # both at once
def test_jm_variants_match_numpy_reference(k, m, hidden, push_hidden):
  with jax.enable_x64(True):
    model = models.get('jm', _VOCAB, hidden_size=hidden,
                       stack_embedding_size=m, jm_num_stacks=k,
                       jm_push_hidden_state=push_hidden, dtype=jnp.float64)
    params = _randomize(_init(model, _SYMBOLS), seed=k + m, scale=0.8)
    assert ('push' in params) != push_hidden
    out = _apply(model, params, _SYMBOLS, method='trace')
    n = _SYMBOLS.shape[1]
    assert out['actions'].shape == ((2, n - 1, 3) if k == 1
                                    else (2, n - 1, k, 3))
    for b, string in enumerate(_SYMBOLS):
      logits, readings, _ = _reference_logits(
          params, string, _VOCAB,
          lambda p: _MultiJMStack(p, m, k, push_hidden), reading_size=k * m)
      np.testing.assert_allclose(out['logits'][b], logits, rtol=1e-10,
                                 atol=1e-10)
      np.testing.assert_allclose(out['readings'][b, :n - 1], readings,
                                 atol=1e-10)
    if push_hidden:
      np.testing.assert_array_equal(out['push_vectors'],
                                    out['hidden'][:, 1:])
    # The stacks act differently (not one synchronised stack).
    if k > 1:
      assert np.abs(np.asarray(out['actions'][:, :, 0] -
                               out['actions'][:, :, 1])).max() > 0.1


def test_jm_stacks_with_equal_actions_are_one_wide_stack():
  # K stacks of width m whose action layers are equal compute what one
  # synchronised stack of width K m computes with that action layer.
  k, m = 3, 2
  wide = models.get('jm', _VOCAB, hidden_size=5, stack_embedding_size=k * m)
  split = models.get('jm', _VOCAB, hidden_size=5, stack_embedding_size=m,
                     jm_num_stacks=k)
  params = _randomize(_init(wide, _SYMBOLS), seed=5, scale=0.8)
  tiled = dict(params, action={
      'kernel': jnp.tile(params['action']['kernel'], (1, k)),
      'bias': jnp.tile(params['action']['bias'], (k,))})
  np.testing.assert_allclose(_apply(split, tiled, _SYMBOLS),
                             _apply(wide, params, _SYMBOLS), rtol=1e-6,
                             atol=1e-6)
  # ...and different action layers give a different model.
  other = dict(tiled, action=dict(tiled['action'], kernel=tiled['action'][
      'kernel'].at[:, 3:].multiply(-1.0)))
  assert np.abs(np.asarray(_apply(split, other, _SYMBOLS)
                           - _apply(wide, params, _SYMBOLS))).max() > 1e-3


def test_jm_variant_parameters_and_initialisation():
  v, h = 4, 20
  for k, m, push_hidden in [(3, 3, False), (1, 20, True), (4, 5, True)]:
    model = models.get('jm', v, hidden_size=h, stack_embedding_size=m,
                       jm_num_stacks=k, jm_push_hidden_state=push_hidden)
    params = models.init_params(model, jax.random.key(k))
    # Reference counts: controller input V + K m; K softmax layers of 3;
    # one sigmoid push layer H -> K m unless h itself is pushed.
    assert _count(params['controller']) == 80 * (v + k * m) + 80 * h + 160
    assert _count(params['action']) == 21 * 3 * k
    assert _count(params.get('push', {})) == (0 if push_hidden
                                              else 21 * k * m)
    # Xavier per stack's layer: bound sqrt(6 / (H + 3)), not
    # sqrt(6 / (H + 3K)) of one [H, 3K] layer.
    kernel = np.abs(np.asarray(params['action']['kernel']))
    bound = np.sqrt(6 / (h + 3))
    assert kernel.max() <= bound and kernel.max() > 0.9 * bound
  with pytest.raises(ValueError, match=r'jm_num_stacks \* '
                     r'stack_embedding_size must equal hidden_size \(got 3 '
                     r'\* 3 != 20\)'):
    models.get('jm', v, stack_embedding_size=3, jm_num_stacks=3,
               jm_push_hidden_state=True)
  for bad in (0, 1.5, True):
    with pytest.raises(ValueError, match='jm_num_stacks must be'):
      models.get('jm', v, jm_num_stacks=bad)
  with pytest.raises(ValueError, match='jm_push_hidden_state must be True'):
    models.get('jm', v, stack_embedding_size=20, jm_push_hidden_state=1)


@pytest.mark.parametrize('table', models.NS_TABLES)
@pytest.mark.parametrize('q,s', [(2, 2), (3, 2), (2, 3)])
def test_ns_log_likelihood_matches_pda_composition(q, s, table):
  symbols = np.array([[0, 2, 1, 1, 0, 2, 1], [1, 1, 1, 2, 0, 0, 2]],
                     np.int32)
  with jax.enable_x64(True):
    model = models.get('ns', _VOCAB, hidden_size=4, num_states=q,
                       num_stack_symbols=s, dtype=jnp.float64,
                       stack_table=table)
    params = _randomize(_init(model, symbols), seed=q * 10 + s, scale=1.0)
    out = _apply(model, params, symbols, method='trace')
    log_prob = models.sequence_log_prob(out['logits'], jnp.asarray(symbols))
    for b, string in enumerate(symbols):
      logits, readings, log_masses = _reference_logits(
          params, string, _VOCAB, lambda p: _PDAStack(p, q, s),
          initial_reading=np.eye(s)[0])
      n = len(string)
      np.testing.assert_allclose(log_prob[b],
                                 _log_prob_from_logits(logits, string),
                                 rtol=1e-10)
      np.testing.assert_allclose(out['logits'][b], logits, atol=1e-10)
      np.testing.assert_allclose(out['readings'][b, :n - 1], readings,
                                 atol=1e-10)
      np.testing.assert_allclose(out['log_mass'][b, :n - 1], log_masses,
                                 rtol=1e-10, atol=1e-12)
      # Update 1 is push-only (frozen bottom), so mass is lost at once.
      assert log_masses[1] < -1e-3
      # Traced actions are the section 1.1 softmaxes of the hidden states.
      for t in range(n - 1):
        expected = _ns_action_log_probs(
            jax.tree.map(np.asarray, params['action']),
            np.asarray(out['hidden'][b, t + 1]), q, s)
        for key, e in zip(('push', 'repl', 'pop'), expected):
          np.testing.assert_allclose(out['actions'][key][b, t], np.exp(e),
                                     atol=1e-12)
    rows = (out['actions']['push'].sum((-2, -1))
            + out['actions']['repl'].sum((-2, -1))
            + out['actions']['pop'].sum(-1))
    np.testing.assert_allclose(rows, 1.0, atol=1e-12)
    # The readings are far from the initial one-hot: the stack matters.
    assert np.ptp(np.asarray(out['readings'][:, 2:])) > 0.05


@pytest.mark.parametrize('name,extra', [
    ('ns', {}), ('ns', {'stack_batch_chunk': 1}),
    ('rns', {'stack_bottom': 'fixed'}),
    ('rns', {'stack_bottom': 'frozen', 'stack_window': 3,
             'truncation_length': 5})])
def test_stack_margin_is_the_share_margin_of_the_traced_actions(name, extra):
  """stack_margin = the share margin of the actions trace reports, which
  are the ones the stack saw: the stack run on them alone gives the
  trace's readings."""
  window = extra.get('stack_window', 0)
  with jax.enable_x64(True):
    model = models.get(name, _VOCAB, hidden_size=4, num_states=2,
                       num_stack_symbols=3, dtype=jnp.float64, **extra)
    params = _randomize(_init(model), seed=5, scale=3.0)
    out = _apply(model, params, _SYMBOLS, method='trace')
    margin = _apply(model, params, _SYMBOLS, method='stack_margin')
    if name == 'ns':
      acts = [jnp.log(out['actions'][k]) for k in ('push', 'repl', 'pop')]
      bottom, reading = rns_stack.FROZEN, rns_stack.SYMBOL
    else:
      acts = [out['action_log_weights'][k] for k in ('push', 'repl', 'pop')]
      bottom, reading = extra['stack_bottom'], rns_stack.STATE
    if window:
      la = limited_stack.run(*acts, window, bottom)[0]
      want = limited_stack.share_margin(*acts, window, bottom)
    else:
      la = rns_stack.run(*acts, bottom)[0][:, 1:]
      want = rns_stack.share_margin(*acts, bottom=bottom)
    np.testing.assert_allclose(rns_stack.readout(la, reading)[0],
                               out['readings'][:, 1:], atol=1e-9)
    np.testing.assert_allclose(margin, want, rtol=1e-9)
    assert np.all(np.asarray(margin) < -1)
    # A string of one symbol makes no update: no factor, margin +inf.
    one = _apply(model, params, _SYMBOLS[:, :1], method='stack_margin')
    assert np.all(np.isposinf(np.asarray(one)))
    _check_masked_margin(model, params, margin)


def _check_masked_margin(model, params, full):
  """With a padded batch's mask, each string's margin is that of its real
  symbols run alone (lengths 3 and 1 here): the padding is left out."""
  mask = np.zeros(_SYMBOLS.shape, np.float32)
  mask[0, :3], mask[1, :1] = 1, 1
  masked = np.asarray(jax.jit(functools.partial(
      model.apply, method='stack_margin'))({'params': params}, _SYMBOLS,
                                           mask))
  short = _apply(model, params, _SYMBOLS[:1, :3], method='stack_margin')
  np.testing.assert_allclose(masked[0], short[0], rtol=1e-12)
  assert np.isposinf(masked[1])
  # The padding's updates would have lowered it: the mask is what counts.
  assert masked[0] > full[0] + 0.1


@pytest.mark.parametrize('name,extra,match', [
    ('ns', {'stack_table': 'log'}, "'shares' table, not 'log'"),
    ('rns', {'stack_table': 'log', 'stack_window': 3},
     "'shares' table, not 'log'"),
    ('vrns', {'broadcast_bottom_vector': True}, 'run-consistent bottom')])
def test_stack_margin_of_a_stack_without_one_is_a_clear_error(name, extra,
                                                              match):
  model = models.get(name, _VOCAB, hidden_size=3, **extra)
  with pytest.raises(ValueError, match=match):
    _apply(model, _init(model), _SYMBOLS, method='stack_margin')
  assert not models.has_stack_margin(model)


@pytest.mark.parametrize('window', [0, 4])
def test_vrns_stack_margin_is_the_vector_margin_of_the_traced_inputs(window):
  """The VRNS-RNN's margin: the vector stack's on the actions, pushed
  vectors and bottom vector trace reports (which give its readings)."""
  from nsrnn_jax import limited_vrns  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import vrns_stack  # pylint: disable=g-import-not-at-top
  with jax.enable_x64(True):
    model = models.get('vrns', _VOCAB, hidden_size=4, num_states=2,
                       num_stack_symbols=2, stack_vector_size=2,
                       stack_window=window, dtype=jnp.float64)
    assert models.has_stack_margin(model)
    params = _randomize(_init(model), seed=8, scale=3.0)
    out = _apply(model, params, _SYMBOLS, method='trace')
    margin = _apply(model, params, _SYMBOLS, method='stack_margin')
    acts = [out['action_log_weights'][k] for k in ('push', 'repl', 'pop')]
    log_v, log_b = jnp.log(out['push_vectors']), jnp.log(out['bottom_vector'])
    if window:
      rho = limited_vrns.run(*acts, log_v, log_b, window)[0]
      want = limited_vrns.share_margin(*acts, log_v, log_b, window)
    else:
      rho = vrns_stack.run(*acts, log_v, log_b)[0]
      want = rns_stack.vector_share_margin(*acts, out['push_vectors'],
                                           out['bottom_vector'])
    np.testing.assert_allclose(rho, out['readings'], atol=1e-9)
    np.testing.assert_allclose(margin, want, rtol=1e-9)
    assert np.all(np.asarray(margin) < -1)
    _check_masked_margin(model, params, margin)


def test_lstm_log_prob_equals_manual_sum():
  symbols = _SYMBOLS[:, :6]
  with jax.enable_x64(True):
    model = models.get('lstm', _VOCAB, hidden_size=3, dtype=jnp.float64)
    params = _randomize(_init(model, symbols), seed=3)
    logits = _apply(model, params, symbols)
    mask = np.ones(symbols.shape)
    mask[1, 4:] = 0
    got = models.sequence_log_prob(logits, jnp.asarray(symbols),
                                   jnp.asarray(mask))
    for b in range(2):
      n = int(mask[b].sum())
      expected = _log_prob_from_logits(np.asarray(logits[b, :n]),
                                       symbols[b, :n])
      np.testing.assert_allclose(got[b], expected, rtol=1e-12)


# ---------------------------------------------------------------------------
# Protocol details: causality, first row, parameter counts, initialisation.
# ---------------------------------------------------------------------------

_ALL = list(models.MODEL_NAMES)


@pytest.mark.parametrize('name', _ALL)
def test_right_padding_does_not_change_earlier_logits(name):
  model = models.get(name, _VOCAB, hidden_size=6, stack_embedding_size=3)
  short = _SYMBOLS[:, :7]
  padded = np.concatenate([short, np.full((2, 5), 2, np.int32)], axis=1)
  params = _randomize(_init(model, padded), seed=4)
  logits_short = _apply(model, params, short)
  logits_padded = _apply(model, params, padded)
  np.testing.assert_allclose(logits_padded[:, :7], logits_short, rtol=1e-5,
                             atol=1e-5)
  # ... and the masked log-likelihood of the padded batch is the same number.
  mask = np.zeros(padded.shape, np.float32)
  mask[:, :7] = 1
  np.testing.assert_allclose(
      models.sequence_log_prob(logits_padded, jnp.asarray(padded),
                               jnp.asarray(mask)),
      models.sequence_log_prob(logits_short, jnp.asarray(short)), rtol=1e-5)
  # The later positions do depend on the padding symbols (sanity of the test).
  other = padded.copy()
  other[:, 8:] = 0
  logits_other = _apply(model, params, other)
  assert np.abs(logits_other[:, 9:] - logits_padded[:, 9:]).max() > 1e-4


@pytest.mark.parametrize('name', _ALL)
def test_first_logit_row_is_output_bias(name):
  model = models.get(name, _VOCAB, hidden_size=6, stack_embedding_size=3)
  params = _randomize(_init(model, _SYMBOLS), seed=5)
  logits = _apply(model, params, _SYMBOLS)
  np.testing.assert_array_equal(
      logits[:, 0], np.broadcast_to(params['output']['bias'], (2, _VOCAB)))
  # Length-1 strings: nothing is fed, the only row is the bias, and trace
  # has the same keys as for longer strings, with T = 0 steps.
  one = _apply(model, params, _SYMBOLS[:, :1], method='trace')
  np.testing.assert_array_equal(one['logits'], logits[:, :1])
  two = _apply(model, params, _SYMBOLS[:, :2], method='trace')
  assert jax.tree.map(np.ndim, one) == jax.tree.map(np.ndim, two)
  if name != 'lstm':
    np.testing.assert_array_equal(one['readings'], two['readings'][:, :1])


@pytest.mark.parametrize('name', ['gref', 'ns'])
def test_init_params_equals_init_with_symbols(name):
  model = models.get(name, _VOCAB, hidden_size=3, stack_embedding_size=2)
  full = jax.jit(model.init)(jax.random.key(3), jnp.asarray(_SYMBOLS[:, :3]))
  fast = models.init_params(model, jax.random.key(3))
  # Eager vs jitted: equal up to float32 rounding, which depends on XLA flags
  # (other test modules compile with optimisations off).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6,
                                                       atol=1e-8),
               fast, full['params'])
  assert set(full) == {'params'}  # no other variable collections


def _count(params):
  return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))


@pytest.mark.parametrize('name,v,q,s,m', [
    ('lstm', 3, 2, 2, 20), ('jm', 4, 2, 2, 2), ('jm', 7, 2, 2, 40),
    ('gref', 2, 2, 2, 20), ('ns', 3, 2, 2, 20), ('ns', 2, 3, 2, 20),
    ('ns', 7, 3, 3, 20)])
def test_parameter_counts_match_reference_formulas(name, v, q, s, m):
  model = models.get(name, v, num_states=q, num_stack_symbols=s,
                     stack_embedding_size=m)
  shapes = jax.eval_shape(model.init, jax.random.key(0),
                          jnp.zeros((1, 3), jnp.int32))['params']
  reading = {'lstm': 0, 'jm': m, 'gref': m, 'ns': s}[name]
  expected = {'controller': 80 * (v + reading) + 80 * 20 + 160,
              'output': 21 * v}
  expected.update({'lstm': {}, 'jm': {'stack': 63 + 21 * m},
                   'gref': {'stack': 42 + 21 * m},
                   'ns': {'stack': 21 * q * s * (2 * q * s + q)}}[name])
  got = {'controller': _count(shapes['controller']),
         'output': _count(shapes['output'])}
  if name != 'lstm':
    got['stack'] = _count({k: shapes[k] for k in ('action', 'push')
                           if k in shapes})
  assert got == expected


def test_initialisation_statistics():
  v, m = 4, 40
  init = {name: models.init_params(
      models.get(name, v, stack_embedding_size=m), jax.random.key(7))
          for name in models.MODEL_NAMES}

  def check_uniform(a, scale):
    a = np.asarray(a).ravel()
    assert np.abs(a).max() <= scale
    assert a.max() > 0.8 * scale and a.min() < -0.8 * scale  # spread out
    # U[-c, c] has standard deviation c / sqrt(3).
    assert abs(a.std() - scale / np.sqrt(3)) < 0.25 * scale / np.sqrt(3)

  for name, params in init.items():
    ctrl = params['controller']
    check_uniform(np.concatenate([np.ravel(a) for a in ctrl.values()]), 0.1)
    # Two independent bias vectors, not one duplicated.
    assert not np.allclose(ctrl['b_ih'], ctrl['b_hh'])
    h = 20
    check_uniform(params['output']['kernel'], np.sqrt(6 / (h + v)))
    np.testing.assert_array_equal(params['output']['bias'], 0)
  for name, out, gain in [('jm', 3, 1.0), ('gref', 2, 1.0)]:
    kernel = np.asarray(init[name]['action']['kernel'])
    assert np.abs(kernel).max() <= gain * np.sqrt(6 / (20 + out))
    np.testing.assert_array_equal(init[name]['action']['bias'], 0)
  check_uniform(init['jm']['push']['kernel'], np.sqrt(6 / (20 + m)))
  check_uniform(init['gref']['push']['kernel'], 5 / 3 * np.sqrt(6 / (20 + m)))
  for name in ('jm', 'gref'):
    np.testing.assert_array_equal(init[name]['push']['bias'], 0)
  check_uniform(init['ns']['action']['kernel'], 0.1)
  check_uniform(init['ns']['action']['bias'], 0.1)
  # The paper's text instead: Xavier uniform (gain 1), bias 0; nothing else
  # changes.
  xavier = models.init_params(models.get('ns', v, ns_action_init='xavier'),
                              jax.random.key(7))
  check_uniform(xavier['action']['kernel'], np.sqrt(6 / (20 + 40)))
  np.testing.assert_array_equal(xavier['action']['bias'], 0)
  for key in ('controller', 'output'):
    for a, b in zip(jax.tree_util.tree_leaves(xavier[key]),
                    jax.tree_util.tree_leaves(init['ns'][key])):
      np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match='ns_action_init must be one of'):
    models.get('ns', v, ns_action_init='glorot')
  with pytest.raises(ValueError, match="applies to model 'ns' only"):
    models.get('rns', v, ns_action_init='xavier')


# ---------------------------------------------------------------------------
# Gradients.
# ---------------------------------------------------------------------------


def _loss(model, symbols):

  def loss(params):
    logits = model.apply({'params': params}, symbols)
    return -jnp.sum(models.sequence_log_prob(logits, symbols))

  return loss


def _replay_step(params, carry, actions_t, reading_BxS):
  """A controller step that emits given actions (and sums the readings)."""
  del params
  return carry + reading_BxS.sum(), actions_t, reading_BxS


def _float32_table_error(table):
  # 3 × per-(q, x) log-softmax of N(0, 1) logits: sharp and sub-normalised.
  # (Normalised random actions, even log-softmax of N(0, 20²) logits, stay
  # within 3e-6 on both tables: the scaled table's flush needs a mass that
  # decays faster than the weights it keeps, as sharpened weights do here
  # and a trained model's do on strings outside its language.)
  acts = [3.0 * a for a in action_weights.log_weights(
      np.random.default_rng(7), 4, 80, 2, 2)]
  with jax.enable_x64(True):
    want = [np.asarray(w) for w in ns_stack.run_reference(
        *(jnp.asarray(a) for a in acts))]
  xs = tuple(jnp.asarray(a, jnp.float32) for a in acts)
  outs, readings, log_mass = jax.jit(functools.partial(
      models.run_ns_stack, _replay_step, num_states=2, num_symbols=2,
      table=table))({}, jnp.zeros((), jnp.float32), xs)
  # The controller saw the readings the stack returned (τ_0 .. τ_{T−1}).
  np.testing.assert_allclose(outs, readings[:, :-1], atol=1e-6)
  return (np.max(np.abs(np.asarray(readings, np.float64) - want[0])),
          np.max(np.abs(np.asarray(log_mass, np.float64) - want[1])
                 / np.maximum(1, np.abs(want[1]))))


def test_ns_default_table_is_exact_in_float32_for_sharp_actions():
  # The NS-RNN's default recurrence, fed sharp log-weights (n = 80),
  # against the float64 log-space reference: ns_stack's scaled table is
  # off by ~0.12 here (the xfail below).
  reading_err, mass_err = _float32_table_error(
      models.get('ns', _VOCAB).table)
  assert reading_err < 1e-5
  assert mass_err < 1e-6


@pytest.mark.xfail(strict=True, reason="known limit of stack_table='scaled' "
                   "(ns_stack module docstring): float32 flushes entries "
                   "that dominate α once the actions are sharp")
def test_ns_scaled_table_is_exact_in_float32_for_sharp_actions():
  assert _float32_table_error('scaled')[0] < 1e-5


def test_ns_tables_agree_in_value_and_gradient_float64():
  symbols = jnp.asarray(_SYMBOLS[:, :8])
  with jax.enable_x64(True):
    get = lambda table: models.get('ns', _VOCAB, hidden_size=5, num_states=3,
                                   num_stack_symbols=2, dtype=jnp.float64,
                                   stack_table=table)
    shares = get('shares')
    params = _randomize(_init(shares), seed=11, scale=1.0)
    value_and_grad = lambda m: jax.jit(jax.value_and_grad(_loss(m, symbols)))(
        params)
    v1, g1 = value_and_grad(shares)
    for other in ('scaled', 'log'):
      v2, g2 = value_and_grad(get(other))
      np.testing.assert_allclose(v1, v2, rtol=1e-12)
      for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    assert max(np.abs(np.asarray(g)).max() for g in jax.tree.leaves(g1)) > 0


@pytest.mark.parametrize('variant', [
    {},
    # The memory-limited stack (limited_log_stack against limited_stack)
    # with truncated BPTT in 2 chunks (the ICLR 2023 boundary; both
    # boundaries run the same chunk loop, limited_stack_test).
    dict(stack_window=3, truncation_length=4),
])
def test_rns_log_table_agrees_in_value_and_gradient_float64(variant):
  # The RNS-RNN (unnormalised actions, state reading, fixed bottom) on
  # log_stack against rns_stack: the same function inside the flush limit.
  symbols = jnp.asarray(_SYMBOLS[:, :8])
  with jax.enable_x64(True):
    get = lambda table: models.get('rns', _VOCAB, hidden_size=5,
                                   num_states=2, num_stack_symbols=3,
                                   dtype=jnp.float64, stack_table=table,
                                   **variant)
    params = _randomize(_init(get('shares')), seed=12, scale=1.0)
    (v1, g1), (v2, g2) = (jax.jit(jax.value_and_grad(_loss(get(t), symbols)))(
        params) for t in models.RNS_TABLES)
    np.testing.assert_allclose(v1, v2, rtol=1e-12)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
      np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize('name,kwargs,match', [
    ('lstm', dict(stack_table='log'), 'applies to models ns, rns and vrns '
     'only'),
    ('gref', dict(stack_table='scaled'), 'applies to models ns, rns and '
     'vrns'),
    ('rns', dict(stack_table='scaled'), "use 'shares' or 'log'"),
    ('rns', dict(stack_table='scaled', stack_window=4), "use 'shares' or "
     "'log'"),
])
def test_a_table_the_model_cannot_run_is_a_clear_error(name, kwargs, match):
  with pytest.raises(ValueError, match=match):
    models.get(name, _VOCAB, **kwargs)


def test_ns_unknown_stack_table_is_a_clear_error():
  with pytest.raises(ValueError, match='stack_table must be one of shares, '
                     'scaled, log'):
    models.get('ns', _VOCAB, stack_table='fast')


@pytest.mark.parametrize('table', models.NS_TABLES)
def test_ns_batch_chunks_give_the_same_values_and_gradients(table):
  # The stack run on chunks of 1 or 2 strings (lax.map) against the whole
  # batch at once, on one table each, in float64: logits and the gradient
  # (the custom VJPs under a scan over chunks).
  rng = np.random.default_rng(5)
  symbols = jnp.asarray(rng.integers(0, _VOCAB, size=(4, 9)), jnp.int32)
  _assert_same_loss_and_gradient_float64(
      [dict(stack_table=table, stack_batch_chunk=c) for c in (4, 2, 1)],
      symbols, name='ns', seed=3)


def _assert_same_loss_and_gradient_float64(variants, symbols, name,
                                           seed, **common):
  """The summed NLL and its gradient agree (float64) for every variant.

  Each variant is a dict of `models.get` keywords (plus `common`); all are
  built with hidden size 4 and the same randomised parameters.
  """
  with jax.enable_x64(True):
    results = []
    for kw in variants:
      model = models.get(name, _VOCAB, hidden_size=4, dtype=jnp.float64,
                         **common, **kw)
      params = _randomize(_init(model, symbols), seed=seed, scale=1.0)
      loss = lambda p, model=model: -jnp.sum(models.sequence_log_prob(
          model.apply({'params': p}, symbols), symbols))
      results.append(jax.jit(jax.value_and_grad(loss))(params))
    for value, grad in results[1:]:
      np.testing.assert_allclose(value, results[0][0], rtol=1e-12)
      for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(results[0][1])):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize('name,extra', [
    ('lstm', {}), ('jm', {}), ('gref', {}),
    ('ns', dict(stack_table='shares')), ('ns', dict(stack_table='scaled')),
    ('rns', {})])
def test_scan_unroll_gives_the_same_values_and_gradients(name, extra):
  # The time loop unrolled by 2 (9 updates: four whole blocks and a
  # remainder) against unroll 1, in float64: loss and gradient. (Unroll 2
  # tests the same blocks-and-remainder logic as 4 in half the compile
  # time, which dominates.)
  rng = np.random.default_rng(2)
  symbols = jnp.asarray(rng.integers(0, _VOCAB, size=(2, 10)), jnp.int32)
  _assert_same_loss_and_gradient_float64(
      [dict(scan_unroll=u) for u in (1, 2)], symbols, name=name, seed=4,
      stack_embedding_size=3, **extra)
  # ...and the factor reaches the time loop's scans, forward and backward
  # (equal values alone would also hold if it were dropped).
  model = models.get(name, _VOCAB, hidden_size=4, stack_embedding_size=3,
                     scan_unroll=2, **extra)
  loss = lambda p: jnp.sum(model.apply({'params': p}, symbols))
  program = str(jax.make_jaxpr(jax.grad(loss))(_init(model, symbols)))
  assert program.count('unroll=2') >= 2


def test_scan_unroll_must_be_a_positive_integer_and_where_supported():
  for bad in (-2, 1.5, True):
    with pytest.raises(ValueError, match=r'scan_unroll must be 0 \(automatic'
                       r'\) or a positive integer'):
      models.get('lstm', _VOCAB, scan_unroll=bad)
  with pytest.raises(ValueError, match="scan_unroll must be 1 for 'rns' "
                     'with a window'):
    models.get('rns', _VOCAB, stack_window=3, scan_unroll=2)
  with pytest.raises(ValueError, match="scan_unroll must be 1 for 'vrns'"):
    models.get('vrns', _VOCAB, scan_unroll=2)


def test_automatic_scan_unroll_unrolls_lstm_and_jm_on_gpus_only(
    monkeypatch):
  # scan_unroll = 0 (the config default): 8 for the LSTM and JM on a GPU
  # backend (measured 0.54x / 0.53x the step time there), 1 for Gref and the
  # NS-RNN everywhere and for everything on CPUs; an explicit value wins.
  def unroll(name, **kw):
    return models.get(name, _VOCAB, scan_unroll=0, **kw).scan_unroll
  monkeypatch.setattr(jax, 'default_backend', lambda: 'cpu')
  assert [unroll(n) for n in ('lstm', 'jm', 'gref', 'ns', 'rns')] == [1] * 5
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  assert [unroll(n) for n in ('lstm', 'jm', 'gref', 'ns', 'rns')] == [
      8, 8, 1, 1, 1]
  assert unroll('rns', stack_window=3) == 1
  assert models.get('lstm', _VOCAB, scan_unroll=2).scan_unroll == 2
  assert models.auto_scan_unroll('jm', 'cpu') == 1
  assert models.auto_scan_unroll('jm', 'gpu') == models.GPU_UNROLL == 8


@pytest.mark.parametrize('dtype,itemsize', [(jnp.float32, 4),
                                              (jnp.float64, 8)])
def test_ns_stack_chunk_is_sized_by_the_model_float_type(monkeypatch, dtype,
                                                         itemsize):
  seen = []
  choose = models.stack_batch_chunk
  monkeypatch.setattr(models, 'stack_batch_chunk',
                      lambda *a: seen.append(a) or choose(*a))
  symbols = jnp.asarray(_SYMBOLS[:, :6])
  with jax.enable_x64(True):
    model = models.get('ns', _VOCAB, hidden_size=4, dtype=dtype)
    model.apply({'params': _init(model, symbols)}, symbols)
  assert seen and {a[-1] for a in seen} == {itemsize}


def _with_l3(monkeypatch, l3_bytes):
  """models' CPU table budget as on a host whose L3 holds `l3_bytes`."""
  monkeypatch.setattr(models.parallel, 'host_l3_cache_bytes', lambda: l3_bytes)
  models.cpu_table_budget_bytes.cache_clear()


def test_cpu_table_budget_is_a_share_of_the_l3(monkeypatch):
  monkeypatch.setattr(jax, 'default_backend', lambda: 'cpu')
  try:
    for l3, budget in [(None, 10 * 2**20), (16 * 2**20, 10 * 2**20),
                       (8 * 2**20, 5 * 2**20), (32 * 2**20, 20 * 2**20)]:
      _with_l3(monkeypatch, l3)
      assert models.cpu_table_budget_bytes() == budget, l3
    # On an 8 MiB L3 (5 MiB): Q = S = 3 at T = 47 is 0.78 MB a string (6
    # fit: 5 of 10), at T = 60 1.25 MB (4: 2); Q = 3, S = 2 at T = 80
    # 0.97 MB (5); Q = S = 2 at T = 80 0.43 MB (12: all 10).
    _with_l3(monkeypatch, 8 * 2**20)
    assert models.stack_batch_chunk(0, 10, 47, 3, 3) == 5
    assert models.stack_batch_chunk(0, 10, 60, 3, 3) == 2
    assert models.stack_batch_chunk(0, 10, 80, 3, 2) == 5
    assert models.stack_batch_chunk(0, 10, 80, 2, 2) == 10
    # A device's 5 strings at T = 80 (11 MB) still run at once (within 4
    # budgets), not one by one.
    assert models.stack_batch_chunk(0, 5, 80, 3, 3) == 5
  finally:
    models.cpu_table_budget_bytes.cache_clear()


def test_stack_batch_chunk_choice(monkeypatch):
  monkeypatch.setattr(jax, 'default_backend', lambda: 'cpu')
  _with_l3(monkeypatch, None)      # the budget where the L3 is unknown
  # Automatic on CPU: the largest divisor of the batch whose float32 table,
  # B·(T+2)²·Q²·S²·4 bytes, fits 10 MiB: Q = S = 3 at T = 80 is 2.2 MB a
  # string (4, so 2 of 10), Q = 3, S = 2 0.97 MB (all 10), Q = S = 2
  # 0.43 MB (all 10).
  assert models.stack_batch_chunk(0, 10, 80, 3, 3) == 2
  assert models.stack_batch_chunk(0, 10, 80, 3, 2) == 10
  assert models.stack_batch_chunk(0, 10, 80, 2, 2) == 10
  # Not one string where the next divisor's table is within 4 budgets: a
  # device's 5 strings (11 MB) run at once; 7 strings at T = 400 (366 MB)
  # one by one.
  assert models.stack_batch_chunk(0, 5, 80, 3, 3) == 5
  assert models.stack_batch_chunk(0, 7, 400, 3, 3) == 1
  assert models.stack_batch_chunk(0, 1, 400, 3, 3) == 1
  # float64 tables take twice the bytes: Q = S = 3 (4.4 MB a string) fits
  # 2 strings; Q = 3, S = 2 (1.9 MB) 5; Q = S = 2 (0.86 MB) 12, so 10.
  assert models.stack_batch_chunk(0, 10, 80, 3, 3, itemsize=8) == 2
  assert models.stack_batch_chunk(0, 10, 80, 3, 2, itemsize=8) == 5
  assert models.stack_batch_chunk(0, 10, 80, 2, 2, itemsize=8) == 10
  # Requested: the largest divisor <= N.
  assert models.stack_batch_chunk(3, 10, 80, 2, 2) == 2
  assert models.stack_batch_chunk(20, 10, 80, 3, 3) == 10
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  assert models.stack_batch_chunk(0, 10, 80, 3, 3) == 10
  models.cpu_table_budget_bytes.cache_clear()
  for bad in (-1, 1.5, True, '2'):
    with pytest.raises(ValueError, match='stack_batch_chunk must be 0 '
                       r'\(automatic\) or a positive integer'):
      models.get('ns', _VOCAB, stack_batch_chunk=bad)


def test_ns_gradients_finite_for_length_60_float32():
  rng = np.random.default_rng(0)
  symbols = jnp.asarray(rng.integers(0, _VOCAB, (1, 60)), jnp.int32)
  model = models.get('ns', _VOCAB)
  params = _randomize(_init(model, symbols), seed=6, scale=0.5)
  loss32, grads = jax.jit(jax.value_and_grad(_loss(model, symbols)))(params)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert np.all(np.isfinite(g)), path
  # The stack is actually in the gradient path.
  assert np.abs(grads['action']['kernel']).max() > 0
  # float32 training precision: the loss agrees with a float64 run.
  with jax.enable_x64(True):
    model64 = models.get('ns', _VOCAB, dtype=jnp.float64)
    params64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
    loss64 = jax.jit(_loss(model64, symbols))(params64)
  np.testing.assert_allclose(loss32, loss64, rtol=1e-5)


@pytest.mark.parametrize('name,extra', [(n, {}) for n in _ALL] + [
    ('jm', dict(jm_num_stacks=3)),
    ('jm', dict(stack_embedding_size=3, jm_push_hidden_state=True))])
def test_gradient_matches_finite_differences(name, extra):
  symbols = jnp.asarray(_SYMBOLS[:, :6])
  with jax.enable_x64(True):
    model = models.get(name, _VOCAB, dtype=jnp.float64,
                       **{'hidden_size': 3, 'stack_embedding_size': 2,
                          **extra})
    params = _randomize(_init(model, symbols), seed=8, scale=0.7)
    loss = jax.jit(_loss(model, symbols))
    grads = jax.jit(jax.grad(_loss(model, symbols)))(params)
    direction = _randomize(params, seed=9)
    eps = 1e-5
    shifted = lambda sign: jax.tree.map(lambda p, d: p + sign * eps * d,
                                        params, direction)
    numeric = (loss(shifted(1)) - loss(shifted(-1))) / (2 * eps)
    analytic = sum(jnp.vdot(g, d) for g, d in zip(
        jax.tree.leaves(grads), jax.tree.leaves(direction)))
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6)


@pytest.mark.parametrize('name', ['lstm', 'jm', 'gref'])
def test_loop_storing_only_products_gives_the_same_gradient(name,
                                                            monkeypatch):
  # models.keep_products_only (the time loop stores only its matmuls'
  # outputs; the backward recomputes the rest) against plain autodiff of
  # the loop, which stores every residual: each baseline both ways
  # (models.PRODUCTS_ONLY_LOOPS says which way it runs by default).
  symbols = jnp.asarray(_SYMBOLS)
  with jax.enable_x64(True):
    model = models.get(name, _VOCAB, hidden_size=4, stack_embedding_size=3,
                       dtype=jnp.float64)
    params = _randomize(_init(model, symbols), seed=3, scale=0.8)
    grads = {}
    for only_products in (True, False):
      loops = models.PRODUCTS_ONLY_LOOPS - {name}
      monkeypatch.setattr(models, 'PRODUCTS_ONLY_LOOPS',
                          loops | {name} if only_products else loops)
      jaxpr = str(jax.make_jaxpr(jax.grad(_loss(model, symbols)))(params))
      assert ('checkpoint' in jaxpr or 'remat' in jaxpr) == only_products
      grads[only_products] = jax.jit(jax.grad(_loss(model, symbols)))(params)
  for g, w in zip(jax.tree.leaves(grads[True]),
                  jax.tree.leaves(grads[False])):
    assert np.abs(w).max() > 0
    np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------
# Construction and errors.
# ---------------------------------------------------------------------------


def test_unknown_model_lists_valid_names():
  with pytest.raises(ValueError, match='lstm, jm, gref, ns'):
    models.get('transformer', 3)


@pytest.mark.parametrize('kwargs,field', [
    ({'vocab_size': 0}, 'vocab_size'), ({'hidden_size': -1}, 'hidden_size'),
    ({'num_states': 0}, 'num_states'),
    ({'num_stack_symbols': 1.5}, 'num_stack_symbols'),
    ({'stack_embedding_size': True}, 'stack_embedding_size'),
    ({'dtype': jnp.int32}, 'dtype')])
def test_invalid_sizes_raise(kwargs, field):
  args = {'vocab_size': 3, **kwargs}
  with pytest.raises(ValueError, match=field):
    models.get('ns', **args)


def test_float64_without_x64_is_a_clear_error():
  if jax.config.jax_enable_x64:
    pytest.skip('x64 is on globally')
  with pytest.raises(ValueError, match='jax_enable_x64'):
    models.get('lstm', 3, dtype=jnp.float64)


def test_bad_symbols_raise():
  model = models.get('jm', 3)
  params = _init(model, _SYMBOLS)
  with pytest.raises(ValueError, match=r'\[0, 3\)'):
    model.apply({'params': params}, jnp.asarray([[0, 3, 1]]))
  with pytest.raises(ValueError, match='2-D'):
    model.apply({'params': params}, jnp.asarray([0, 1, 1]))
  with pytest.raises(ValueError, match='integer'):
    model.apply({'params': params}, jnp.asarray([[0.0, 1.0]]))
  with pytest.raises(ValueError, match='does not match'):
    models.sequence_log_prob(jnp.zeros((2, 4, 3)), jnp.zeros((2, 5), int))
  # Ids outside [0, V): -1 was scored as the last symbol, V as NaN.
  for bad in (-1, 3):
    with pytest.raises(ValueError, match=r'symbol ids must lie in \[0, 3\)'):
      models.sequence_log_prob(jnp.zeros((1, 2, 3)), jnp.asarray([[0, bad]]))
  with pytest.raises(ValueError, match='mask must hold 0/1 weights'):
    models.sequence_log_prob(jnp.zeros((1, 2, 3)), jnp.asarray([[0, 1]]),
                             jnp.asarray([[1.0, -1.0]]))


def test_build_reads_flat_config():
  config = {'model': 'gref', 'hidden_size': 7, 'num_states': 3,
            'num_stack_symbols': 3, 'stack_embedding_size': 5}
  model = models.build(config, vocab_size=4)
  assert isinstance(model, models.GrefLM)
  assert (model.hidden_size, model.stack_embedding_size,
          model.vocab_size) == (7, 5, 4)
  with pytest.raises(ValueError, match='valid models'):
    models.build({**config, 'model': 'rnn'}, vocab_size=4)
  ns = models.build({**config, 'model': 'ns'}, vocab_size=4)
  assert (ns.num_states, ns.num_stack_symbols) == (3, 3)


def test_build_from_config_dict_takes_vocab_from_task():
  import ml_collections  # pylint: disable=g-import-not-at-top
  config = ml_collections.ConfigDict(
      {'model': 'ns', 'task': 'dyck', 'hidden_size': 20, 'num_states': 2,
       'num_stack_symbols': 3, 'stack_embedding_size': 20})
  model = models.build(config)
  assert (model.vocab_size, model.num_stack_symbols) == (4, 3)  # ( ) [ ]
  config.vocab_size = 9
  assert models.build(config).vocab_size == 9


def test_vmap_over_model_axis_equals_separate_models():
  """Training vmaps a stacked K axis of parameters through the stack DP."""
  model = models.get('ns', _VOCAB, hidden_size=3)
  symbols = jnp.asarray(_SYMBOLS[:, :5])
  per_model = [_randomize(_init(model), seed=20 + k) for k in range(2)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_model)
  value_and_grad = jax.value_and_grad(_loss(model, symbols))
  losses, grads = jax.jit(jax.vmap(value_and_grad))(stacked)
  for k, params in enumerate(per_model):
    loss, grad = jax.jit(value_and_grad)(params)
    np.testing.assert_allclose(losses[k], loss, rtol=1e-5)
    jax.tree.map(lambda a, b, k=k: np.testing.assert_allclose(
        a[k], b, rtol=1e-4, atol=1e-6), grads, grad)
  assert abs(float(losses[0] - losses[1])) > 1e-3


def test_jit_matches_eager():
  model = models.get('lstm', _VOCAB, hidden_size=4)
  symbols = jnp.asarray(_SYMBOLS[:, :5])
  params = _randomize(_init(model, symbols), seed=10)
  eager = model.apply({'params': params}, symbols)
  jitted = jax.jit(model.apply)({'params': params}, symbols)
  np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# Matmul precision (full float32 on GPUs / TPUs unless asked otherwise).
# ---------------------------------------------------------------------------


def _dot_precisions(text):
  """The precision attribute of every stablehlo.dot_general in `text`."""
  out = []
  for line in text.splitlines():
    if 'stablehlo.dot_general' in line:
      m = re.search(r'precision = \[(\w+), (\w+)\]', line)
      out.append(m.groups() if m else ('DEFAULT', 'DEFAULT'))
  return out


@pytest.mark.parametrize('name', _ALL)
@pytest.mark.parametrize('precision,attr', [('highest', 'HIGHEST'),
                                            ('default', 'DEFAULT')])
def test_every_matmul_of_the_gradient_carries_the_precision(
    name, precision, attr):
  # Under a reduced global default (what GPUs / TPUs use), the model's own
  # setting decides every contraction: LSTM, stack, action / output layers,
  # forward and backward (including ns_stack's custom VJP).
  kwargs = {} if precision == 'highest' else {'matmul_precision': precision}
  _assert_gradient_precision(models.get(name, _VOCAB, **kwargs), attr)


def _assert_gradient_precision(model, attr):
  """Every dot of the lowered gradient program carries precision `attr`."""
  symbols = jnp.asarray(_SYMBOLS[:, :6])
  params = _init(model, symbols)
  with jax.default_matmul_precision('bfloat16'):
    text = jax.jit(jax.grad(_loss(model, symbols))).lower(params).as_text()
  dots = _dot_precisions(text)
  assert len(dots) >= 4
  assert set(dots) == {(attr, attr)}


@pytest.mark.parametrize('precision,attr', [('highest', 'HIGHEST'),
                                            ('default', 'DEFAULT')])
def test_ns_scaled_table_carries_the_precision(precision, attr):
  # The opt-in table (ns_stack's custom VJP); the default is in _ALL.
  _assert_gradient_precision(
      models.get('ns', _VOCAB, stack_table='scaled',
                 matmul_precision=precision), attr)


@pytest.mark.parametrize('precision,attr', [('highest', 'HIGHEST'),
                                            ('default', 'DEFAULT')])
def test_memory_limited_rns_carries_the_precision(precision, attr):
  # The window-D stack (limited_stack, plain autodiff within a chunk).
  _assert_gradient_precision(
      models.get('rns', _VOCAB, stack_window=3, truncation_length=4,
                 matmul_precision=precision), attr)


@pytest.mark.parametrize('name,kwargs', [
    ('ns', {}), ('rns', {}), ('rns', dict(stack_window=3, truncation_length=4)),
    ('vrns', {}), ('vrns', dict(stack_window=3, truncation_length=4))])
@pytest.mark.parametrize('precision,attr', [('highest', 'HIGHEST'),
                                            ('default', 'DEFAULT')])
def test_log_tables_carry_the_precision(name, kwargs, precision, attr):
  # The exact tables' one matmul (log_stack.pop_rows_of), in log_stack's
  # custom VJP and limited_log_stack's rematerialised window.
  _assert_gradient_precision(
      models.get(name, _VOCAB, stack_table='log', matmul_precision=precision,
                 **kwargs), attr)


def test_bad_matmul_precision_is_a_one_line_error():
  with pytest.raises(ValueError, match='matmul_precision') as e:
    models.get('ns', _VOCAB, matmul_precision='tf32')
  assert '\n' not in str(e.value)
  with pytest.raises(ValueError, match='matmul_precision'):
    models.build({'model': 'lstm', 'matmul_precision': 'fast'}, vocab_size=3)
  assert models.build({'model': 'lstm', 'matmul_precision': 'high'},
                      vocab_size=3).matmul_precision == 'high'


# ---------------------------------------------------------------------------
# RNS-RNN (model 'rns') against the brute-force PDA with its variants.
# ---------------------------------------------------------------------------


class _RNSPDAStack:
  """RNS stack by brute force: each update re-runs the explicit-stack oracle
  with unnormalised (or row-normalised) weights, the given bottom and
  window, and reads over (state, top) or top only."""

  def __init__(self, params, q, s, normalize, reading, bottom, window):
    self.params, self.q, self.s = params, q, s
    self.normalize, self.reading_kind = normalize, reading
    self.bottom, self.window = bottom, window or None
    self.actions = ([], [], [])
    self.reading = np.eye(q * s if reading == 'state' else s)[0]
    self.log_mass = 0.0

  def update(self, h):
    q, s = self.q, self.s
    logits = _np_affine(self.params['action'], h).reshape(q * s, -1)
    if self.normalize:
      logits = np.log(_softmax(logits))
    acts = (logits[:, :q * s].reshape(q, s, q, s),
            logits[:, q * s:2 * q * s].reshape(q, s, q, s),
            logits[:, 2 * q * s:].reshape(q, s, q))
    for store, a in zip(self.actions, acts):
      store.append(a)
    rho, log_alpha = pda_oracle.state_readings(
        *(np.stack(a) for a in self.actions), bottom=self.bottom,
        window=self.window)
    self.reading = (rho[-1] if self.reading_kind == 'state'
                    else rho[-1].reshape(q, s).sum(0))
    self.log_mass = np.logaddexp.reduce(log_alpha[-1].ravel())


@pytest.mark.parametrize('bottom', ['frozen', 'fixed'])
def test_rns_truncation_boundary_follows_the_bottoms_tag(bottom):
  # rns-vrns-reference.md section 2.2. With chunks of one step, every update
  # is its chunk's last: in ICLR 2022 (frozen bottom) each is detached before
  # anything reads it, so a language-model loss gives the action layer no
  # gradient at all; in ICLR 2023 (the fix) each is made in the next chunk
  # from the detached h with the live action layer, which it trains.
  symbols = np.array([[0, 2, 1, 1, 0, 2, 1], [1, 1, 1, 2, 0, 0, 2]],
                     np.int32)
  with jax.enable_x64(True):
    grads = {}
    for trunc in (1, 0):
      model = models.get('rns', _VOCAB, hidden_size=4, num_states=2,
                         num_stack_symbols=2, dtype=jnp.float64,
                         stack_bottom=bottom, stack_window=3,
                         truncation_length=trunc)
      params = _randomize(_init(model, symbols), seed=3, scale=1.0)
      grads[trunc] = jax.grad(lambda p: jnp.sum(
          jax.nn.log_softmax(_apply(model, p, symbols))[..., 0]))(params)
    action = np.concatenate([np.ravel(a) for a in
                             jax.tree_util.tree_leaves(grads[1]['action'])])
    if bottom == 'frozen':
      np.testing.assert_array_equal(action, 0.0)
    else:
      assert np.abs(action).max() > 1e-3
    # Without truncation the action layer is trained either way.
    assert max(np.abs(a).max() for a in
               jax.tree_util.tree_leaves(grads[0]['action'])) > 1e-3


@pytest.mark.parametrize('normalize,reading,bottom,window,trunc', [
    (False, 'state', 'fixed', 0, 0),
    (True, 'symbol', 'frozen', 0, 0),
    # The ICLR 2022 variants NS+S and NS+U (frozen bottom).
    (True, 'state', 'frozen', 0, 0),
    (False, 'symbol', 'frozen', 0, 0),
    (False, 'state', 'frozen', 3, 2),
    (False, 'state', 'fixed', 3, 2),
])
def test_rns_matches_pda_composition(normalize, reading, bottom, window,
                                     trunc):
  q, s = 2, 2
  symbols = np.array([[0, 2, 1, 1, 0, 2, 1], [1, 1, 1, 2, 0, 0, 2]],
                     np.int32)
  with jax.enable_x64(True):
    model = models.get('rns', _VOCAB, hidden_size=4, num_states=q,
                       num_stack_symbols=s, dtype=jnp.float64,
                       stack_normalize=normalize, stack_reading=reading,
                       stack_bottom=bottom, stack_window=window,
                       truncation_length=trunc)
    params = _randomize(_init(model, symbols), seed=3, scale=1.0)
    out = _apply(model, params, symbols, method='trace')
    for b, string in enumerate(symbols):
      size = q * s if reading == 'state' else s
      logits, readings, log_masses = _reference_logits(
          params, string, _VOCAB,
          lambda p: _RNSPDAStack(p, q, s, normalize, reading, bottom, window),
          initial_reading=np.eye(size)[0])
      n = len(string)
      np.testing.assert_allclose(out['logits'][b], logits, atol=1e-10)
      np.testing.assert_allclose(out['readings'][b, :n - 1], readings,
                                 atol=1e-10)
      np.testing.assert_allclose(out['log_mass'][b, :n - 1], log_masses,
                                 rtol=1e-10, atol=1e-12)
    assert np.ptp(np.asarray(out['readings'][:, 2:])) > 0.05
    if normalize and reading == 'symbol' and bottom == 'frozen':
      # The CoNLL 2020 variant of 'rns' is the 'ns' model (either table).
      for table in models.NS_TABLES:
        ns = models.get('ns', _VOCAB, hidden_size=4, num_states=q,
                        num_stack_symbols=s, dtype=jnp.float64,
                        stack_table=table)
        np.testing.assert_allclose(_apply(ns, params, symbols),
                                   out['logits'], atol=1e-12)


def test_rns_window_covering_the_string_equals_unlimited():
  symbols = np.array([[0, 2, 1, 1, 0, 2, 1, 1, 0]], np.int32)
  with jax.enable_x64(True):
    get = lambda **kw: models.get('rns', _VOCAB, hidden_size=4,
                                  dtype=jnp.float64, **kw)
    unlimited, limited = get(), get(stack_window=9)
    params = _randomize(_init(unlimited, symbols), seed=5, scale=1.0)
    grad = lambda m: jax.jit(jax.grad(_loss(m, jnp.asarray(symbols))))(params)
    np.testing.assert_allclose(_apply(limited, params, symbols),
                               _apply(unlimited, params, symbols), atol=1e-12)
    for g, w in zip(jax.tree_util.tree_leaves(grad(limited)),
                    jax.tree_util.tree_leaves(grad(unlimited))):
      np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize('kwargs,field', [
    ({'stack_window': -1}, 'stack_window'),
    ({'stack_bottom': 'sticky'}, 'stack_bottom'),
    ({'stack_reading': 'vector'}, 'stack_reading'),
    ({'truncation_length': 4}, 'truncation_length'),
    ({'stack_normalize': 1}, 'stack_normalize')])
def test_rns_invalid_variants_raise(kwargs, field):
  with pytest.raises(ValueError, match=field) as info:
    models.get('rns', 3, **kwargs)
  assert '\n' not in str(info.value)
