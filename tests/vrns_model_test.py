"""Tests for nsrnn_jax.vrns_model: the VRNS-RNN language model and config."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from nsrnn_jax import models
from nsrnn_jax import train
from nsrnn_jax import vrns_stack


def _model(**kw):
  args = dict(hidden_size=4, num_states=2, num_stack_symbols=2,
              stack_vector_size=2)
  args.update(kw)
  return models.get('vrns', 3, **args)


def test_parameters_and_reading_size():
  v, h, q, s, m = 3, 5, 2, 3, 4
  model = models.get('vrns', v, hidden_size=h, num_states=q,
                     num_stack_symbols=s, stack_vector_size=m)
  params = models.init_params(model, jax.random.key(0))
  assert params['controller']['w_ih'].shape == (v + q * s * m, 4 * h)
  assert params['action']['kernel'].shape == (h, q * s * (2 * q * s + q))
  assert params['push_vector']['kernel'].shape == (h, m)
  assert params['bottom_vector'].shape == (m,)
  for leaf in (params['action']['bias'], params['push_vector']['kernel'],
               params['bottom_vector']):
    assert np.abs(leaf).max() <= 0.1 and np.abs(leaf).max() > 0.0
  fixed = models.init_params(_model(stack_bottom_vector='one'),
                             jax.random.key(0))
  assert 'bottom_vector' not in fixed


def test_trace_readings_are_the_stack_of_the_traced_actions():
  model = _model()
  symbols = np.array([[0, 1, 2, 1, 0, 2], [2, 2, 0, 1, 1, 0]], np.int32)
  params = models.init_params(model, jax.random.key(1))
  # Larger weights than the initialisation so the stack does something.
  params = jax.tree.map(lambda a: a * 20, params)
  out = model.apply({'params': params}, symbols, method='trace')
  acts = out['actions']
  rho, log_mass = vrns_stack.run(
      jnp.log(acts['push']), jnp.log(acts['repl']), jnp.log(acts['pop']),
      jnp.log(out['push_vectors']), jnp.log(out['bottom_vector']))
  np.testing.assert_allclose(out['readings'], rho, rtol=2e-4, atol=1e-6)
  np.testing.assert_allclose(out['log_mass'], log_mass, rtol=1e-4, atol=1e-4)
  assert out['readings'].shape == (2, 6, 2, 2, 2)
  # The readings reach the controller: changing the stack's parameters
  # changes later logits but not the first two (rho_0 is fixed).
  other = dict(params, push_vector=jax.tree.map(lambda a: -a,
                                                params['push_vector']))
  logits2 = model.apply({'params': other}, symbols)
  np.testing.assert_array_equal(logits2[:, :2], out['logits'][:, :2])
  assert np.abs(logits2 - out['logits']).max() > 1e-5


@pytest.mark.parametrize('broadcast', [False, True])
def test_initial_reading_holds_the_bottom_vector(broadcast):
  model = _model(broadcast_bottom_vector=broadcast)
  params = models.init_params(model, jax.random.key(2))
  out = model.apply({'params': params}, np.zeros((1, 1), np.int32),
                    method='trace')
  v_bot = jax.nn.sigmoid(params['bottom_vector'])
  rho0 = np.asarray(out['readings'][0, 0])
  if broadcast:
    np.testing.assert_allclose(rho0, np.broadcast_to(v_bot, rho0.shape),
                               rtol=1e-6)
  else:
    want = np.zeros_like(rho0)
    want[0, 0] = v_bot
    np.testing.assert_allclose(rho0, want, rtol=1e-6)
  zero = _model(stack_bottom_vector='zero')
  out = zero.apply({'params': models.init_params(zero, jax.random.key(2))},
                   np.zeros((1, 1), np.int32), method='trace')
  np.testing.assert_array_equal(out['readings'], 0.0)


@pytest.mark.parametrize('variant', [
    {}, dict(stack_window=3, truncation_length=3)])
def test_log_table_agrees_in_value_and_gradient_float64(variant):
  # stack_table='log' runs the log-space tables (vrns_stack / limited_vrns
  # log_space) for the run-consistent bottom: the same function as the
  # shares inside their flush limit, in loss and every gradient.
  symbols = jnp.asarray(np.array([[0, 1, 2, 1, 0, 2, 2], [2, 2, 0, 1, 1, 0,
                                                          1]], np.int32))
  with jax.enable_x64(True):
    get = lambda table: _model(dtype=jnp.float64, stack_table=table,
                               **variant)
    params = jax.tree.map(lambda a: a * 20, models.init_params(
        get('shares'), jax.random.key(2)))

    def loss(model):
      return lambda p: jnp.sum(jnp.sin(model.apply({'params': p}, symbols)))

    (v1, g1), (v2, g2) = (jax.jit(jax.value_and_grad(loss(get(t))))(params)
                          for t in models.RNS_TABLES)
    np.testing.assert_allclose(v1, v2, rtol=1e-12)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
      np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    assert get('log').table == 'log'


@pytest.mark.parametrize('field,value,message', [
    ('stack_vector_size', 0, 'config.stack_vector_size must be an integer >= 1'),
    ('stack_vector_size', -1, 'config.stack_vector_size'),
    ('stack_bottom_vector', 'fixed',
     "config.stack_bottom_vector is 'fixed'; expected one of learned, one"),
])
def test_config_errors_are_one_line(field, value, message):
  config = default.get_config()
  config.model = 'vrns'
  train.validate_config(config)
  config[field] = value
  with pytest.raises(ValueError) as info:
    train.validate_config(config)
  assert message in str(info.value) and '\n' not in str(info.value)


def test_model_errors_and_quick_config():
  with pytest.raises(ValueError, match='stack_vector_size must be'):
    _model(stack_vector_size=0)
  with pytest.raises(ValueError, match='stack_bottom_vector'):
    _model(stack_bottom_vector='learnt')
  with pytest.raises(ValueError, match="stack_table 'scaled' does not apply "
                     "to model vrns; use 'shares' or 'log'"):
    _model(stack_table='scaled')
  from configs import quick_vrns  # pylint: disable=g-import-not-at-top
  config = quick_vrns.get_config()
  train.validate_config(config)
  model = models.build(config)
  assert (model.num_states, model.num_stack_symbols,
          model.stack_vector_size) == (2, 3, 3)
  assert model.stack_bottom_vector == 'learned'
  assert not model.broadcast_bottom_vector
