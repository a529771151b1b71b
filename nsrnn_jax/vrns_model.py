"""The VRNS-RNN language model: an LSTM controller with the vector NS stack.

`models.get('vrns', ...)` / `models.build(config)` with `config.model =
'vrns'` build `VRNSLM`. Controller interface as the other models
(`nsrnn_jax.models` docstring: no BOS/EOS, h_0 = 0, update t uses actions
from h_t, one update per controller step) with the later papers' stack
(rns-vrns-reference.md §3):

  * action log-weights: the raw affine output W_a h_t + b_a (unnormalised,
    no softmax), rows q·S + x, columns [push r·S+y | replace | pop r];
  * pushed vector v_t = σ(W_v h_t + b_v) ∈ (0, 1)^M;
  * bottom vector v_⊥: 'learned' (σ(b_⊥), b_⊥ ~ U[−0.1, 0.1], the authors'
    effective initialisation), 'one' (all ones) or 'zero' (all zeros);
  * reading ρ_t (Q·S·M, order (r, y, k)) fed with x_{t+1}; ρ_0 is
    e_{0,⊥} ⊗ v_⊥ (or v_⊥ everywhere with the broadcast bottom);
  * ``stack_window`` D >= 1: the memory-limited vector stack
    (`limited_vrns`), trained with truncated BPTT in chunks of
    ``truncation_length`` steps (0 = whole string) with the ICLR 2023
    chunk boundary (a chunk's last update trains the action and push-vector
    layers from the next chunk, not h).

Parameters: controller, output, action (H x Q·S·(2QS+Q)), push_vector
(H x M), and bottom_vector [M] when learned; all stack layers U[−0.1, 0.1].
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nsrnn_jax import limited_vrns
from nsrnn_jax import models
from nsrnn_jax import rns_stack
from nsrnn_jax import vrns_stack

BOTTOM_VECTORS = ("learned", "one", "zero")


def vrns_action_log_weights(action_params, h_BxH, num_states, num_symbols,
                            precision: str = 'highest'):
  """Unnormalised log-weights (push, repl, pop) from the hidden state.

  precision: matmul precision name of the action layer
  (``ns_stack.MATMUL_PRECISIONS``).
  """
  q, s = num_states, num_symbols
  logits = models.affine(action_params, h_BxH, precision).reshape(
      -1, q * s, 2 * q * s + q)
  b = logits.shape[0]
  push = logits[..., :q * s].reshape(b, q, s, q, s)
  repl = logits[..., q * s:2 * q * s].reshape(b, q, s, q, s)
  pop = logits[..., 2 * q * s:].reshape(b, q, s, q)
  return push, repl, pop


def vrns_stack_inputs(params, carry, num_states, num_symbols,
                      precision: str = 'highest'):
  """(push, repl, pop, log v) of the update made from controller `carry`:
  the action log-weights and the log of the pushed vector, from its h."""
  h_BxH = carry[0]
  push, repl, pop = vrns_action_log_weights(params['action'], h_BxH,
                                            num_states, num_symbols,
                                            precision)
  log_vec = jax.nn.log_sigmoid(
      models.affine(params['push_vector'], h_BxH, precision))
  return push, repl, pop, log_vec


def vrns_controller_step(params, carry, x_B, reading_BxR, *, vocab_size,
                         num_states, num_symbols, precision='highest',
                         input_lookup=False):
  """`step_fn` of `vrns_stack.run_coupled` (pure; params passed in).

  precision: matmul precision name of the LSTM, action and push-vector
  layers (``ns_stack.MATMUL_PRECISIONS``); input_lookup: see
  `models.controller_lstm_step`.

  Returns:
    (carry_t, (push, repl, pop, log_vector), h_t).
  """
  carry, h_BxH = models.controller_lstm_step(
      params['controller'], carry, x_B, reading_BxR, vocab_size, precision,
      input_lookup)
  return carry, vrns_stack_inputs(params, carry, num_states, num_symbols,
                                  precision), h_BxH


def log_bottom_vector(params, kind: str, size: int, dtype):
  """log v_⊥ [M] for a bottom-vector option."""
  if kind == 'learned':
    return jax.nn.log_sigmoid(params['bottom_vector'])
  if kind == 'one':
    return jnp.zeros((size,), dtype)
  return jnp.full((size,), -jnp.inf, dtype)


class VRNSLM(models.PDAStackLM):
  """LSTM + vector nondeterministic stack (`vrns_stack`).

  `trace` adds `actions` (weights exp(log-weight): `push`, `repl` [B, T, Q,
  S, Q, S], `pop` [B, T, Q, S, Q]), `action_log_weights` (the same as
  log-weights, exact where exp over/underflows), `push_vectors` [B, T, M], `readings`
  [B, N, Q, S, M] (ρ_0 .. ρ_T), `log_mass` [B, N] and `bottom_vector` [B, M]
  (v_⊥, the same for every string; batch-major like every trace entry).
  """

  num_stack_symbols: int = 3
  stack_vector_size: int = 3
  stack_bottom_vector: str = 'learned'
  broadcast_bottom_vector: bool = False
  window: int = 0
  truncation_length: int = 0
  # models.RNS_TABLES: 'shares' (the run-consistent bottom on share tables)
  # or 'log' (the log-space tables: exact where shares flush, slower; the
  # broadcast bottom always runs on them).
  table: str = models.DEFAULT_NS_TABLE

  def _reading_size(self) -> int:
    return self.num_states * self.num_stack_symbols * self.stack_vector_size

  def _stack_params(self):
    out = {**super()._stack_params(), 'push_vector': self.push_vector()}
    if self.stack_bottom_vector == 'learned':
      out['bottom_vector'] = self.bottom_vector
    return out

  def setup(self):
    super().setup()  # Controller, output and the PDA's action layer.
    self.push_vector = models.AffineParams(
        self.hidden_size, self.stack_vector_size, models.uniform_init(),
        models.uniform_init(), dtype=self.dtype)
    if self.stack_bottom_vector == 'learned':
      # b_⊥ ~ U[−0.1, 0.1]: the authors' trainer re-initialises it so.
      self.bottom_vector = self.param(
          'bottom_vector', models.uniform_init(), (self.stack_vector_size,),
          self.dtype)

  def _log_bottom(self, params):
    return log_bottom_vector(params, self.stack_bottom_vector,
                             self.stack_vector_size, self.dtype)

  def _no_step_internals(self, batch):
    q, s, m, dt = (self.num_states, self.num_stack_symbols,
                   self.stack_vector_size, self.dtype)
    params = self._params()
    state = vrns_stack.init_state(
        jnp.broadcast_to(self._log_bottom(params), (batch, m)), 0, q, s,
        self.broadcast_bottom_vector)
    rho, log_mass = vrns_stack.readings(state)
    none = {'push': jnp.zeros((batch, 0, q, s, q, s), dt),
            'repl': jnp.zeros((batch, 0, q, s, q, s), dt),
            'pop': jnp.zeros((batch, 0, q, s, q), dt)}
    return {'actions': none, 'action_log_weights': none,
            'push_vectors': jnp.zeros((batch, 0, m), dt),
            'readings': rho, 'log_mass': log_mass,
            'bottom_vector': jnp.broadcast_to(
                jnp.exp(self._log_bottom(params)), (batch, m))}

  def _controller(self, params):
    """(step_fn, its params, actions_fn) for the stack's coupled loops."""
    step_fn = functools.partial(
        vrns_controller_step, vocab_size=self.vocab_size,
        num_states=self.num_states, num_symbols=self.num_stack_symbols,
        precision=self.matmul_precision, input_lookup=self.input_lookup)
    controller = params['controller']
    if self.input_lookup:
      controller = models.split_input_matrix(controller, self.vocab_size)
    step_params = {'controller': controller, 'action': params['action'],
                   'push_vector': params['push_vector']}
    actions_fn = functools.partial(
        vrns_stack_inputs, num_states=self.num_states,
        num_symbols=self.num_stack_symbols, precision=self.matmul_precision)
    return step_fn, step_params, actions_fn

  def _window_parts(self, params, batch, margin=False):
    log_bottom_BxM = jnp.broadcast_to(self._log_bottom(params),
                                      (batch, self.stack_vector_size))
    return limited_vrns.coupled_parts(
        log_bottom_BxM, self.num_states, self.num_stack_symbols, self.window,
        self.broadcast_bottom_vector, self.matmul_precision,
        self.table == 'log', margin)

  def _start_margin(self, state0):
    # The bottom vector's shares are stored values (`limited_vrns.share_margin`).
    return limited_vrns.initial_margin(state0[0])

  def _run(self, params, inputs_BxT):
    batch = inputs_BxT.shape[0]
    zeros_BxH = jnp.zeros((batch, self.hidden_size), self.dtype)
    step_fn, step_params, actions_fn = self._controller(params)
    log_bottom = self._log_bottom(params)
    log_bottom_BxM = jnp.broadcast_to(log_bottom,
                                      (batch, self.stack_vector_size))
    if self.window:
      h_BxTxH, rho, log_mass = limited_vrns.run_coupled(
          step_fn, step_params, (zeros_BxH, zeros_BxH), inputs_BxT,
          log_bottom_BxM, self.num_states, self.num_stack_symbols,
          self.window, self.broadcast_bottom_vector, self.truncation_length,
          actions_fn=actions_fn, precision=self.matmul_precision,
          log_space=self.table == 'log')
    else:
      h_BxTxH, rho, log_mass = vrns_stack.run_coupled(
          step_fn, step_params, (zeros_BxH, zeros_BxH), inputs_BxT,
          log_bottom_BxM, self.num_states, self.num_stack_symbols,
          self.broadcast_bottom_vector, log_space=self.table == 'log',
          precision=self.matmul_precision)
    push, repl, pop = self._stack_log_weights(params, h_BxTxH)[:3]
    vectors = jax.nn.sigmoid(models.affine(
        params['push_vector'], h_BxTxH, self.matmul_precision))
    return h_BxTxH, {
        'actions': {'push': jnp.exp(push), 'repl': jnp.exp(repl),
                    'pop': jnp.exp(pop)},
        'action_log_weights': {'push': push, 'repl': repl, 'pop': pop},
        'push_vectors': vectors, 'readings': rho, 'log_mass': log_mass,
        'bottom_vector': jnp.broadcast_to(
            jnp.exp(log_bottom), (batch, self.stack_vector_size))}


  def _stack_log_weights(self, params, h_BxTxH):
    push, repl, pop = jax.vmap(
        lambda h: vrns_action_log_weights(params['action'], h,
                                          self.num_states,
                                          self.num_stack_symbols,
                                          self.matmul_precision),
        in_axes=1, out_axes=1)(h_BxTxH)
    log_vectors = jax.nn.log_sigmoid(models.affine(
        params['push_vector'], h_BxTxH, self.matmul_precision))
    log_bottom = jnp.broadcast_to(self._log_bottom(params),
                                  (h_BxTxH.shape[0], self.stack_vector_size))
    return push, repl, pop, log_vectors, log_bottom

  def _margin_fn(self):
    if self.table != 'shares' or self.broadcast_bottom_vector:
      raise ValueError(
          "stack_margin applies to the VRNS-RNN's 'shares' table with the "
          "run-consistent bottom, not to table "
          f"{self.table!r}, broadcast_bottom_vector "
          f"{self.broadcast_bottom_vector}")
    if self.window:
      return functools.partial(limited_vrns.share_margin, window=self.window,
                               precision=self.matmul_precision)
    return lambda push, repl, pop, log_v, log_bottom, num_updates=None: (
        rns_stack.vector_share_margin(push, repl, pop, jnp.exp(log_v),
                                      jnp.exp(log_bottom),
                                      self.matmul_precision, num_updates))


def check_options(stack_vector_size, stack_bottom_vector,
                  broadcast_bottom_vector, prefix: str = '') -> None:
  """One-line ValueErrors for bad VRNS options (`prefix` names the fields)."""
  m = stack_vector_size
  if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
    raise ValueError(f'{prefix}stack_vector_size must be an integer >= 1 '
                     f'(got {m!r})')
  if stack_bottom_vector not in BOTTOM_VECTORS:
    raise ValueError(f'{prefix}stack_bottom_vector is '
                     f'{stack_bottom_vector!r}; expected one of '
                     f'{", ".join(BOTTOM_VECTORS)}')
  if not isinstance(broadcast_bottom_vector, (bool, np.bool_)):
    raise ValueError(f'{prefix}broadcast_bottom_vector must be a bool (got '
                     f'{broadcast_bottom_vector!r})')


# The VRNS fields' defaults (configs/default.py): another model's config
# leaves them there (set otherwise they would be ignored without a word).
VRNS_FIELD_DEFAULTS = {'stack_vector_size': 3,
                       'stack_bottom_vector': 'learned',
                       'broadcast_bottom_vector': False}


def validate_config(config) -> None:
  """Checks a config's VRNS fields: valid for model 'vrns', at their
  defaults for the other models."""
  model = config.get('model')
  if model != 'vrns':
    for field, default in VRNS_FIELD_DEFAULTS.items():
      value = config.get(field, default)
      if value != default:
        raise ValueError(
            f'config.{field} is {value!r} but applies to model \'vrns\' '
            f'only (model is {model!r}); leave it at {default!r}')
    return
  for field in ('stack_vector_size', 'stack_bottom_vector',
                'broadcast_bottom_vector'):
    if field not in config:
      raise ValueError(f'config.{field} is missing (start from '
                       'configs/default.py)')
  check_options(config.stack_vector_size, config.stack_bottom_vector,
                config.broadcast_bottom_vector, prefix='config.')


def make(vocab_size: int, hidden_size: int, num_states: int,
         num_stack_symbols: int, stack_vector_size: int = 3,
         stack_bottom_vector: str = 'learned',
         broadcast_bottom_vector: bool = False, stack_window: int = 0,
         truncation_length: int = 0, dtype: Any = jnp.float32,
         matmul_precision: str = 'highest', input_lookup: bool = False,
         stack_table: str = models.DEFAULT_NS_TABLE):
  """A validated `VRNSLM` (called by `models.get`); `stack_window` D >= 1
  selects the memory-limited stack, `truncation_length` its chunks,
  `stack_table` (``models.RNS_TABLES``) its tables."""
  check_options(stack_vector_size, stack_bottom_vector,
                broadcast_bottom_vector)
  return VRNSLM(vocab_size=vocab_size, hidden_size=hidden_size,
                num_states=num_states, num_stack_symbols=num_stack_symbols,
                stack_vector_size=int(stack_vector_size),
                stack_bottom_vector=stack_bottom_vector,
                broadcast_bottom_vector=bool(broadcast_bottom_vector),
                window=int(stack_window),
                truncation_length=int(truncation_length),
                dtype=dtype, matmul_precision=matmul_precision,
                input_lookup=input_lookup, table=stack_table)
