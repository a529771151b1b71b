"""Flax Linen language models: LSTM, JM, Gref, the NS-RNN and the RNS-RNN.

Every model maps whole strings to next-symbol logits with the time indexing of
the authors' code (reference-behaviour.md section 0):

  * no BOS, and no EOS unless ``config.predict_eos`` (later papers: one
    more output, EOS = V, predicted from ``h_n``; ``build``);
    ``logits[:, 0]`` comes from ``h_0 = 0`` and therefore equals the output
    bias; ``logits[:, t]`` predicts ``symbols[:, t]``;
  * only ``symbols[:, :-1]`` are fed to the controller;
  * ``h_t = LSTM(h_{t-1}, [one_hot(x_t); r_{t-1}])`` and update ``t`` of the
    stack uses actions computed from ``h_t`` (never from ``c_t``);
  * ``r_0`` is ``one_hot(bottom)`` for the NS-RNN and zeros for JM and Gref.

The reference performs ``n - 2`` stack updates for a length-``n`` string. Here
each of the ``n - 1`` controller steps is followed by an update, so the last
update is computed and never read: it cannot change any logit (every logit
comes from ``h_0 .. h_{n-1}``, and ``h_{n-1}`` only sees ``r_{n-2}``).

Why Flax Linen (and not NNX): Linen keeps parameters as a plain nested dict
that lives outside the module, and ``apply`` is a pure function of that dict.
The training code can therefore ``jax.vmap`` over a stacked model axis K,
shard the dict over a mesh and hand it to Orbax without any module state
conversion. Parameters are declared once with ``self.param`` (with the
reference initialisers); all the maths is written as pure functions of those
arrays (``lstm_step``, ``jm_update``, ``gref_update``, ``ns_controller_step``)
so the NS model can give a pure ``step_fn`` to its stack's ``run_coupled``
(``run_ns_stack``: ``rns_stack`` or ``ns_stack``, which have custom VJPs and
must not close over traced parameters) and tests can call
the pieces directly.

Parameter tree of every model (kernels are ``[in, out]``):

  controller: w_ih [V + R, 4H], w_hh [H, 4H], b_ih [4H], b_hh [4H]
              (PyTorch gate order i, f, g, o and PyTorch's two bias vectors;
              R = reading size: 0 lstm, M jm/gref, S ns)
  output:     kernel [H, V], bias [V]
  action:     kernel [H, A], bias [A]   (A = 3 jm, 2 gref, QS(2QS+Q) ns)
  push:       kernel [H, M], bias [M]   (jm, gref)

Deviations from the reference code (none changes a logit):
  * one stack update per controller step (``n - 1``, the last one unread)
    instead of ``n - 2``;
  * kernels are stored ``[in, out]`` (PyTorch stores ``[out, in]``);
  * JM keeps a fixed stored depth ``T // 2 + 1`` (see ``jm_depth``) instead of
    the reference's per-step ``min(t, L - t)``; Gref a fixed capacity of T
    slots with zero strength until written.

Shape legend: B batch, N string length, T = N - 1 controller steps / stack
updates, H hidden size, V vocabulary size, M stack embedding size, D JM stack
depth, Q PDA states, S stack symbols (0 = bottom), A action logits.
"""

import functools
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from nsrnn_jax import limited_log_stack
from nsrnn_jax import limited_stack
from nsrnn_jax import log_stack
from nsrnn_jax import ns_stack
from nsrnn_jax import parallel
from nsrnn_jax import rns_stack

MODEL_NAMES = ('lstm', 'jm', 'gref', 'ns', 'rns', 'vrns')  # vrns: vrns_model.py
# Models whose controller can read its input by row lookup (input_lookup).
INPUT_LOOKUP_MODELS = ('lstm', 'rns', 'vrns')

# How the NS-RNN computes its stack (``config.stack_table``). All compute the
# same function (tested to 1e-12 in float64):
#   'shares': ``rns_stack`` with the frozen bottom and the symbol reading (γ
#     stored as posterior shares): exact for finite log-weights up to its
#     flush limit (rns_stack docstring), in float32 too; ``stack_margin``
#     proves it exact per string (``rns_stack.share_margin``). The default.
#   'log': ``log_stack`` (the same shares as logarithms): exact for any
#     finite log-weights, no flush; ~20x slower stack DP on CPU
#     (benchmarks/log_stack.py). For checking and evaluating; also the RNS-RNN's
#     opt-in table (with a window: ``limited_log_stack``).
#   'scaled': ``ns_stack`` (γ as linear mantissas with one scale per column):
#     1.3x slower per train step on CPU (docs/benchmarks.md, "Later CPU runs"), and in
#     float32 it flushes entries that dominate α when the weights decay fast
#     (readings off by 0.12 for 3 × log-softmax weights at n = 80; a trained
#     marked-reversal model on random strings: 0.19; ns_stack docstring).
NS_TABLES = ('shares', 'scaled', 'log')
# The tables the RNS-RNN can run: ``rns_stack`` or ``log_stack`` with its
# bottom and reading; with a window ``limited_stack`` or ``limited_log_stack``.
# The VRNS-RNN's: ``vrns_stack`` / ``limited_vrns`` on shares or in log space.
RNS_TABLES = ('shares', 'log')
# Also the table of a config stored before ``stack_table`` existed (same
# function as the 'scaled' table those runs used).
DEFAULT_NS_TABLE = 'shares'
# The NS-RNN's action-layer initialisations: the authors' code draws the bare
# nn.Linear from U[-0.1, 0.1] (reference-behaviour.md §4); the paper's text
# (§5.5) has every fully-connected layer but the LSTM's Xavier-initialised.
NS_ACTION_INITS = ('uniform', 'xavier')


def has_stack_margin(model: Any) -> bool:
  """Whether ``model.stack_margin`` applies: an NS-, RNS- or VRNS-RNN (with
  or without a window) on the 'shares' table (the VRNS-RNN's run-consistent
  bottom)."""
  if not isinstance(model, PDAStackLM):
    return False
  try:
    model._margin_fn()  # pylint: disable=protected-access
  except ValueError:
    return False
  return True


def can_run_table(model: str, table: str) -> bool:
  """Whether `model` runs on `table`: every model takes the default; ns
  any of ``NS_TABLES``; rns and vrns, with or without a window, any of
  ``RNS_TABLES``."""
  if table == DEFAULT_NS_TABLE:
    return True
  if model == 'ns':
    return table in NS_TABLES
  return model in ('rns', 'vrns') and table in RNS_TABLES


def check_stack_table(table: str) -> str:
  """Validates an NS-RNN table name (``NS_TABLES``); returns it."""
  if table not in NS_TABLES:
    raise ValueError(f'stack_table must be one of {", ".join(NS_TABLES)}; '
                     f'got {table!r}')
  return table

Params = Mapping[str, Any]
Carry = tuple[jax.Array, jax.Array]

_LSTM_INIT_SCALE = 0.1


# ---------------------------------------------------------------------------
# Initialisers.
# ---------------------------------------------------------------------------


def uniform_init(scale: float = _LSTM_INIT_SCALE) -> Callable[..., jax.Array]:
  """Returns an initialiser drawing i.i.d. from U[-scale, scale].

  This is PyTorch's ``--init-scale 0.1`` rule used for every LSTM parameter
  and for the NS-RNN action layer (weight and bias).
  """

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -scale, scale)

  return init


def xavier_uniform(gain: float = 1.0) -> Callable[..., jax.Array]:
  """Xavier/Glorot uniform with bound ``gain * sqrt(6 / (fan_in + fan_out))``.

  Matches the reference ``Layer`` class (gain 1 for softmax/sigmoid/none,
  5/3 for tanh); kernels are ``[fan_in, fan_out]``.
  """
  return nn.initializers.variance_scaling(gain**2, 'fan_avg', 'uniform')


# ---------------------------------------------------------------------------
# Pure maths: LSTM cell, affine layers, stack updates, NS controller.
# ---------------------------------------------------------------------------


def _mm(a, b, precision):
  """``a @ b`` at a named matmul precision (see ``ns_stack.MATMUL_PRECISIONS``).

  Explicit, so that GPUs / TPUs do not silently drop to TF32 / bf16 passes.
  """
  return jnp.matmul(a, b, precision=ns_stack.lax_precision(precision))


def affine(params: Params, x_BxI: jax.Array, precision: str = 'highest'
           ) -> jax.Array:
  """``x @ kernel + bias`` for a ``{'kernel', 'bias'}`` dict."""
  return _mm(x_BxI, params['kernel'], precision) + params['bias']


def lstm_step(params: Params, carry: Carry, x_BxI: jax.Array,
              precision: str = 'highest') -> tuple[Carry, jax.Array]:
  """One step of PyTorch's LSTM (gate order i, f, g, o; biases b_ih + b_hh).

  Args:
    params: ``{'w_ih': [I, 4H], 'w_hh': [H, 4H], 'b_ih': [4H], 'b_hh': [4H]}``.
    carry: ``(h_BxH, c_BxH)``.
    x_BxI: the input vector.
    precision: matmul precision name (``ns_stack.MATMUL_PRECISIONS``).

  Returns:
    ``((h_BxH, c_BxH), h_BxH)`` after the step.
  """
  h_BxH, c_BxH = carry
  # One product of [x, h] with [w_ih; w_hh] instead of two added: one
  # matmul fewer per step forward and backward (each a separate op on
  # XLA:CPU and a kernel on a GPU; the weights' concatenation does not
  # depend on the step, and XLA hoists it out of the time loop).
  gates_Bx4H = _mm(jnp.concatenate([x_BxI, h_BxH], axis=-1),
                   jnp.concatenate([params['w_ih'], params['w_hh']], axis=0),
                   precision) + (params['b_ih'] + params['b_hh'])
  return _lstm_cell(gates_Bx4H, c_BxH)


def lstm_step_ids(params: Params, carry: Carry, ids_B: jax.Array,
                  extra_BxR: jax.Array, vocab_size: int,
                  precision: str = 'highest') -> tuple[Carry, jax.Array]:
  """``lstm_step`` on the input ``[one_hot(ids); extra]``, by row lookup.

  The one-hot product picks row ``ids`` of ``w_ih[:V]``; gathering it
  instead costs B·4H rather than B·V·4H per step (LSTM-256 train step at
  PTB size, V = 10k, 3.2-5.5x faster on CPU: benchmarks/corpus_step.py,
  docs/benchmarks.md). Same values up to the order of the float
  additions. Its
  gradient is a scatter-add, whose summation order GPUs do not fix, so the
  one-hot product stays the default (``input_lookup``).
  """
  h_BxH, c_BxH = carry
  if 'w_ih_vocab' in params:                   # split_input_matrix
    w_vocab, w_extra = params['w_ih_vocab'], params['w_ih_extra']
  else:
    w_vocab, w_extra = (params['w_ih'][:vocab_size],
                        params['w_ih'][vocab_size:])
  gates_Bx4H = (jnp.take(w_vocab, ids_B, axis=0)
                + _mm(jnp.concatenate([extra_BxR, h_BxH], axis=-1),
                      jnp.concatenate([w_extra, params['w_hh']], axis=0),
                      precision)
                + (params['b_ih'] + params['b_hh']))
  return _lstm_cell(gates_Bx4H, c_BxH)


def split_input_matrix(params: Params, vocab_size: int) -> Params:
  """LSTM params with ``w_ih`` as ``w_ih_vocab`` (its first V rows) and
  ``w_ih_extra`` (the rest: the stack reading's rows), for
  ``lstm_step_ids`` inside a time loop.

  Split once outside the loop, each part's cotangent accumulates in place;
  sliced at every step, autodiff pads each step's cotangent of a slice to
  the whole [V + R, 4H] matrix and adds it (PTB size: 40 MB zeroed and
  added twice per step; PTB train steps of the RNS-RNN 2-3 and the VRNS-RNN
  1-5-20 1.11x and 1.36x faster: benchmarks/corpus_step.py). Same values.
  """
  params = dict(params)
  w_ih = params.pop('w_ih')
  params['w_ih_vocab'], params['w_ih_extra'] = (w_ih[:vocab_size],
                                                w_ih[vocab_size:])
  return params


def _lstm_cell(gates_Bx4H, c_BxH):
  """The LSTM's nonlinearity: gates (i, f, g, o) and c -> ((h, c), h)."""
  i_BxH, f_BxH, g_BxH, o_BxH = jnp.split(gates_Bx4H, 4, axis=-1)
  c_BxH = (jax.nn.sigmoid(f_BxH) * c_BxH
           + jax.nn.sigmoid(i_BxH) * jnp.tanh(g_BxH))
  h_BxH = jax.nn.sigmoid(o_BxH) * jnp.tanh(c_BxH)
  return (h_BxH, c_BxH), h_BxH


def jm_update(stack_BxDxM: jax.Array, actions_Bx3: jax.Array,
              push_BxM: jax.Array) -> jax.Array:
  """Joulin-Mikolov superposition update of a fixed-depth stack.

  Index 0 is the top; cells below the stored depth are zero (the reference's
  conceptually infinite stack of zero vectors). ``new[0] = push * v + noop *
  old[0] + pop * old[1]`` and ``new[i] = push * old[i-1] + noop * old[i] + pop
  * old[i+1]``, written as two shifts instead of a loop over cells.

  Args:
    stack_BxDxM: the stack before the update.
    actions_Bx3: probabilities in the reference order (push, pop, no-op),
      one row per string; or ``[B, K, 3]``: K stacks side by side, stack k
      the k-th M / K columns of every cell, each with its own actions.
    push_BxM: the pushed vector ``v``.

  Returns:
    The updated ``stack_BxDxM``; its top ``[:, 0]`` is the new reading.
  """
  if actions_Bx3.ndim == 3:
    # [B, K, 3] -> one (push, pop, no-op) per column: [B, M, 3].
    num_stacks = actions_Bx3.shape[1]
    actions_BxMx3 = jnp.repeat(actions_Bx3,
                               stack_BxDxM.shape[-1] // num_stacks, axis=1)
    push_Bx1x1, pop_Bx1x1, noop_Bx1x1 = (
        a[:, None, :] for a in jnp.moveaxis(actions_BxMx3, -1, 0))
  else:
    push_Bx1x1, pop_Bx1x1, noop_Bx1x1 = (
        a[:, None, None] for a in jnp.moveaxis(actions_Bx3, -1, 0))
  # The cell above the top is v (what a push moves into place); the cell
  # below the stored depth is zero.
  pushed_BxDxM = jnp.concatenate(
      [push_BxM[:, None, :], stack_BxDxM[:, :-1]], axis=1)
  popped_BxDxM = jnp.concatenate(
      [stack_BxDxM[:, 1:], jnp.zeros_like(stack_BxDxM[:, :1])], axis=1)
  return (push_Bx1x1 * pushed_BxDxM + noop_Bx1x1 * stack_BxDxM
          + pop_Bx1x1 * popped_BxDxM)


def _exclusive_sum_above(strength_BxT: jax.Array,
                         precision: str = 'highest') -> jax.Array:
  """``out[:, i] = sum_{j > i} strength[:, j]`` (index grows towards the top).

  One matmul with the strictly lower-triangular ones matrix ([T, T], a
  constant): a sum of the strengths themselves, so no subtraction of nearly
  equal sums spoils small strengths, in one op where `lax.cumsum` lowers to
  several (reduce-window passes, or an associative scan) in every update of
  the time loop, forward and backward.
  """
  steps = strength_BxT.shape[1]
  above_TxT = jnp.asarray(np.tril(np.ones((steps, steps)), -1),
                          strength_BxT.dtype)        # [j, i] = 1 if j > i
  return jnp.matmul(strength_BxT, above_TxT,
                    precision=ns_stack.lax_precision(precision))


def gref_update(values_BxTxM: jax.Array, strength_BxT: jax.Array,
                position: jax.Array, push_strength_B: jax.Array,
                pop_strength_B: jax.Array, push_BxM: jax.Array,
                precision: str = 'highest'
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Grefenstette et al. stratification-stack update followed by the read.

  The stack is a fixed-capacity array, bottom at index 0; element ``k``
  (0-based) is written by update ``k + 1``, unwritten slots have strength 0
  and so never change any sum. Pop first, then push (section 2.2):
  ``s_i' = relu(s_i - relu(u - sum_{j above i} s_j))``; then ``(v, d)`` goes
  to slot ``position``; the reading is
  ``sum_i min(s_i', relu(1 - sum_{j above i} s_j')) v_i``. Both "sums above"
  are one matmul each (`_exclusive_sum_above`), so there is no loop over
  elements.

  Args:
    values_BxTxM: stored vectors.
    strength_BxT: their strengths.
    position: scalar int, the slot of the new element (= number of earlier
      updates).
    push_strength_B: ``d``.
    pop_strength_B: ``u``.
    push_BxM: ``v``.
    precision: matmul precision name of the read-out contraction.

  Returns:
    ``(values_BxTxM, strength_BxT, reading_BxM)`` after the update.
  """
  above_BxT = _exclusive_sum_above(strength_BxT, precision)
  strength_BxT = jax.nn.relu(
      strength_BxT - jax.nn.relu(pop_strength_B[:, None] - above_BxT))
  values_BxTxM = jax.lax.dynamic_update_slice_in_dim(
      values_BxTxM, push_BxM[:, None, :], position, axis=1)
  strength_BxT = jax.lax.dynamic_update_slice_in_dim(
      strength_BxT, push_strength_B[:, None], position, axis=1)
  above_BxT = _exclusive_sum_above(strength_BxT, precision)
  weight_BxT = jnp.minimum(strength_BxT, jax.nn.relu(1.0 - above_BxT))
  reading_BxM = jnp.einsum('bt,btm->bm', weight_BxT, values_BxTxM,
                           precision=ns_stack.lax_precision(precision))
  return values_BxTxM, strength_BxT, reading_BxM


def ns_action_log_probs(action_params: Params, h_BxH: jax.Array,
                        num_states: int, num_symbols: int,
                        precision: str = 'highest'
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """NS-RNN transition log-weights from the hidden state (section 1.1).

  The affine output is laid out as rows ``q * S + x`` and columns
  ``[push(r, y) | replace(r, y) | pop(r)]`` with ``r * S + y`` inside a block;
  each row is one log-softmax over all ``2QS + Q`` columns.

  Returns:
    ``(push_BxQxSxQxS, repl_BxQxSxQxS, pop_BxQxSxQ)``, log-probabilities.
  """
  q, s = num_states, num_symbols
  logits_BxA = affine(action_params, h_BxH, precision)
  log_p_BxQSxC = jax.nn.log_softmax(
      logits_BxA.reshape(-1, q * s, 2 * q * s + q), axis=-1)
  batch = log_p_BxQSxC.shape[0]
  push = log_p_BxQSxC[..., :q * s].reshape(batch, q, s, q, s)
  repl = log_p_BxQSxC[..., q * s:2 * q * s].reshape(batch, q, s, q, s)
  pop = log_p_BxQSxC[..., 2 * q * s:].reshape(batch, q, s, q)
  return push, repl, pop


def ns_controller_step(params: Params, carry: Carry, x_B: jax.Array,
                       reading_BxS: jax.Array, *, vocab_size: int,
                       num_states: int, num_symbols: int,
                       precision: str = 'highest'):
  """The NS-RNN's ``step_fn`` for ``run_ns_stack`` (either table).

  Args:
    params: ``{'controller': LSTM params, 'action': action layer}``.
    carry: ``(h_BxH, c_BxH)`` before the step.
    x_B: int id of the input symbol ``x_t`` (integer inputs get no
      cotangent in ``run_coupled``'s backward, unlike a float one-hot).
    reading_BxS: ``tau_{t-1}``, the reading after ``t - 1`` updates.
    vocab_size: V.
    num_states: Q.
    num_symbols: S.
    precision: matmul precision name of the LSTM and action layer.

  Returns:
    ``(carry_t, (push, repl, pop), h_BxH)``: the new carry, the log-weights of
    update ``t`` (computed from ``h_t``) and ``h_t`` for the output layer.
  """
  x_BxV = jax.nn.one_hot(x_B, vocab_size, dtype=reading_BxS.dtype)
  x_BxI = jnp.concatenate([x_BxV, reading_BxS], axis=-1)
  carry, h_BxH = lstm_step(params['controller'], carry, x_BxI, precision)
  actions = ns_action_log_probs(params['action'], h_BxH, num_states,
                                num_symbols, precision)
  return carry, actions, h_BxH


def controller_lstm_step(params: Params, carry: Carry, x_B: jax.Array,
                         reading_BxR: jax.Array, vocab_size: int,
                         precision: str = 'highest',
                         input_lookup: bool = False):
  """The controller's LSTM on ``[one_hot(x_t); reading]``: ``(carry, h)``.

  ``input_lookup``: gather the input matrix's row (``lstm_step_ids``)
  instead of the one-hot product; same values, for large vocabularies.
  """
  if input_lookup:
    return lstm_step_ids(params, carry, x_B, reading_BxR, vocab_size,
                         precision)
  x_BxV = jax.nn.one_hot(x_B, vocab_size, dtype=reading_BxR.dtype)
  x_BxI = jnp.concatenate([x_BxV, reading_BxR], axis=-1)
  return lstm_step(params, carry, x_BxI, precision)


def rns_controller_step(params: Params, carry: Carry, x_B: jax.Array,
                        reading_BxR: jax.Array, *, vocab_size: int,
                        num_states: int, num_symbols: int, normalize: bool,
                        precision: str = 'highest',
                        input_lookup: bool = False):
  """The RNS-RNN's ``step_fn`` for ``rns_stack.run_coupled``.

  Same as :func:`ns_controller_step` except that the reading has size Q·S
  (state reading) or S, and the action logits are used as log-weights
  directly unless ``normalize`` (rns-vrns-reference.md section 1.1).
  ``precision`` is the matmul precision of the LSTM and action layer;
  ``input_lookup`` see :func:`controller_lstm_step`.
  """
  carry, h_BxH = controller_lstm_step(params['controller'], carry, x_B,
                                      reading_BxR, vocab_size, precision,
                                      input_lookup)
  actions = rns_stack.split_action_logits(
      affine(params['action'], h_BxH, precision), num_states, num_symbols,
      normalize)
  return carry, actions, h_BxH


# ---------------------------------------------------------------------------
# Parameter-holding submodules.
# ---------------------------------------------------------------------------


class LSTMParams(nn.Module):
  """Declares a PyTorch-style LSTM's parameters, all U[-0.1, 0.1]."""

  input_size: int
  hidden_size: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self) -> dict[str, jax.Array]:
    """Returns the parameter dict consumed by :func:`lstm_step`."""
    init = uniform_init()
    four_h = 4 * self.hidden_size
    return {
        'w_ih': self.param('w_ih', init, (self.input_size, four_h),
                           self.dtype),
        'w_hh': self.param('w_hh', init, (self.hidden_size, four_h),
                           self.dtype),
        'b_ih': self.param('b_ih', init, (four_h,), self.dtype),
        'b_hh': self.param('b_hh', init, (four_h,), self.dtype),
    }


class AffineParams(nn.Module):
  """Declares ``kernel [in, out]`` and ``bias [out]`` with given inits."""

  in_size: int
  out_size: int
  kernel_init: Callable[..., jax.Array]
  bias_init: Callable[..., jax.Array] = nn.initializers.zeros
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self) -> dict[str, jax.Array]:
    """Returns ``{'kernel', 'bias'}`` for :func:`affine`."""
    return {
        'kernel': self.param('kernel', self.kernel_init,
                             (self.in_size, self.out_size), self.dtype),
        'bias': self.param('bias', self.bias_init, (self.out_size,),
                           self.dtype),
    }


# ---------------------------------------------------------------------------
# Language models.
# ---------------------------------------------------------------------------


def _check_symbols(symbols_BxN, vocab_size: int) -> jax.Array:
  """Validates a batch of symbol ids; returns it as a JAX int array."""
  shape = np.shape(symbols_BxN)
  if len(shape) != 2:
    raise ValueError(
        f'symbols must be a 2-D [batch, length] array, got shape {shape}')
  if shape[1] < 1:
    raise ValueError('symbols must have length >= 1 (got length 0)')
  if not hasattr(symbols_BxN, 'dtype'):
    symbols_BxN = np.asarray(symbols_BxN)
  dtype = np.dtype(symbols_BxN.dtype)
  if not np.issubdtype(dtype, np.integer):
    raise ValueError(f'symbols must be integer ids, got dtype {dtype}')
  if not isinstance(symbols_BxN, jax.core.Tracer) and shape[0] * shape[1]:
    values = np.asarray(symbols_BxN)
    if values.min() < 0 or values.max() >= vocab_size:
      raise ValueError(
          f'symbol ids must lie in [0, {vocab_size}), got values in '
          f'[{values.min()}, {values.max()}]')
  return jnp.asarray(symbols_BxN)


class LanguageModel(nn.Module):
  """Base of the four models: LSTM controller + output layer.

  Subclasses add the stack (its parameters, reading size and recurrence).

  Subclasses implement ``_run(params, inputs_BxT)`` (the fed ids
  ``symbols[:, :-1]``) returning the hidden states
  ``h_1 .. h_T`` ``[B, T, H]`` and a dict of per-step internals.
  """

  vocab_size: int
  hidden_size: int = 20
  dtype: Any = jnp.float32
  # Matmul precision of every contraction (ns_stack.MATMUL_PRECISIONS).
  matmul_precision: str = 'highest'
  # `lax.scan` unroll factor of the time loop (same values; fewer loop
  # iterations, hence fewer kernel launches and syncs, on accelerators).
  scan_unroll: int = 1
  # Input by row lookup instead of a one-hot product (`lstm_step_ids`;
  # lstm, rns and vrns: for large vocabularies).
  input_lookup: bool = False

  def _reading_size(self) -> int:
    return 0

  def _stack_params(self) -> dict[str, Any]:
    return {}

  def setup(self):
    self.controller = LSTMParams(
        self.vocab_size + self._reading_size(), self.hidden_size, self.dtype)
    self.output = AffineParams(
        self.hidden_size, self.vocab_size, xavier_uniform(1.0),
        dtype=self.dtype)

  def _params(self) -> dict[str, Any]:
    return {'controller': self.controller(), 'output': self.output(),
            **self._stack_params()}

  def declare_params(self) -> dict[str, Any]:
    """Returns the parameter tree; used with ``init`` it skips the forward.

    ``model.init(rng, method='declare_params')`` gives the same values as
    ``model.init(rng, symbols_BxN)`` (Flax derives each parameter's key from
    its path, not from the call) without tracing the recurrence.
    """
    return self._params()

  def _run(self, params, inputs_BxT):
    raise NotImplementedError

  def _no_step_internals(self, batch: int) -> dict[str, Any]:
    """``trace`` internals of a length-1 string (no step, no update)."""
    del batch
    return {}

  def _one_hot(self, inputs_BxT):
    return jax.nn.one_hot(inputs_BxT, self.vocab_size, dtype=self.dtype)

  def _forward(self, symbols_BxN):
    symbols_BxN = _check_symbols(symbols_BxN, self.vocab_size)
    params = self._params()
    batch, length = symbols_BxN.shape
    if length > 1:
      h_BxTxH, internals = self._run(params, symbols_BxN[:, :-1])
    else:
      h_BxTxH = jnp.zeros((batch, 0, self.hidden_size), self.dtype)
      internals = self._no_step_internals(batch)
    # h_0 = 0, so the first row is A 0 + b = b.
    h_BxNxH = jnp.concatenate(
        [jnp.zeros((batch, 1, self.hidden_size), h_BxTxH.dtype), h_BxTxH],
        axis=1)
    logits_BxNxV = affine(params['output'], h_BxNxH, self.matmul_precision)
    return logits_BxNxV, h_BxNxH, internals

  def __call__(self, symbols_BxN) -> jax.Array:
    """Next-symbol logits ``[B, N, V]``; ``logits[:, t]`` predicts ``w_{t+1}``.

    Args:
      symbols_BxN: int ids; only ``symbols[:, :-1]`` are fed.
    """
    return self._forward(symbols_BxN)[0]

  # -- Streams (corpus language modelling) ----------------------------------
  #
  # A corpus is one long token stream cut into chunks of T tokens; each
  # chunk is one call, and the model's state (controller and stack) is
  # carried from one call to the next by value only: truncated BPTT, no
  # gradient crosses a chunk boundary. Only models whose state has a fixed
  # size can do this: the LSTM and the memory-limited (windowed) RNS and
  # VRNS stacks; the others' stacks grow with the stream.

  def initial_stream_state(self, batch: int) -> dict[str, Any]:
    """The carry of a stream's first chunk: ``{'first': True, 'state'}``.

    Use as ``model.apply(params, B, method='initial_stream_state')``.

    Raises:
      ValueError: (one line) the model cannot carry its state across
        chunks.
    """
    return {'first': jnp.asarray(True),
            'state': self._stream_start(self._params(), batch)}

  def stream(self, inputs_BxT, carry) -> tuple[jax.Array, dict[str, Any]]:
    """One chunk of a token stream: logits ``[B, T, V]`` and the next carry.

    ``logits[:, t]`` predicts the token after ``inputs[:, t]`` (every input
    is fed; unlike ``__call__`` there is no ``h_0`` row). The chunks of a
    stream, fed in order from ``initial_stream_state``, give the same
    logits as ``__call__`` on the whole stream (``[:, 1:]``); gradients stop
    at chunk boundaries. With the ICLR 2023 bottom a chunk's last stack
    update is made by the next chunk (as in training on strings).
    """
    inputs_BxT = _check_symbols(inputs_BxT, self.vocab_size)
    params = self._params()
    start = self._stream_start(params, inputs_BxT.shape[0])
    h_BxTxH, state = self._stream(params, inputs_BxT, start, carry['state'],
                                  jnp.asarray(carry['first']))
    logits_BxTxV = affine(params['output'], h_BxTxH, self.matmul_precision)
    return logits_BxTxV, {'first': jnp.asarray(False), 'state': state}

  def _stream_start(self, params, batch: int):
    """The state before a stream's first token (values and gradients)."""
    del params, batch
    raise ValueError(
        f'model {type(self).__name__} cannot carry its state across chunks '
        'of a stream (its stack grows with the stream); use lstm, or rns / '
        'vrns with stack_window >= 1')

  def _stream(self, params, inputs_BxT, start, carried, first):
    """(h [B, T, H], state after the chunk); see ``stream``."""
    raise NotImplementedError

  def trace(self, symbols_BxN) -> dict[str, jax.Array]:
    """Logits plus per-step internals, for inspection.

    Always contains ``logits`` [B, N, V] and ``hidden`` [B, N, H] (row 0 is
    ``h_0 = 0``); model-specific keys are documented on each model. Per-step
    entries have T = N - 1 rows, row ``t - 1`` belonging to update ``t`` (the
    last row belongs to the extra update whose reading is never fed).
    """
    logits_BxNxV, h_BxNxH, internals = self._forward(symbols_BxN)
    return {'logits': logits_BxNxV, 'hidden': h_BxNxH, **internals}


class LSTMLM(LanguageModel):
  """The LSTM baseline (no stack); ``trace`` adds nothing model-specific."""

  def _lstm_scan(self, params, carry, inputs_BxT, step_wrapper=None):
    """The LSTM over the inputs: (carry, h [T, B, H])."""
    batch = inputs_BxT.shape[0]
    if self.input_lookup:
      none_Bx0 = jnp.zeros((batch, 0), self.dtype)
      xs = jnp.swapaxes(inputs_BxT, 0, 1)

      def step(carry, ids_B):
        return lstm_step_ids(params['controller'], carry, ids_B, none_Bx0,
                             self.vocab_size, self.matmul_precision)
    else:
      xs = jnp.swapaxes(self._one_hot(inputs_BxT), 0, 1)

      def step(carry, x_BxV):
        return lstm_step(params['controller'], carry, x_BxV,
                         self.matmul_precision)
    if step_wrapper is not None:
      step = step_wrapper(step)
    return jax.lax.scan(step, carry, xs, unroll=self.scan_unroll)

  def _run(self, params, inputs_BxT):
    zeros_BxH = jnp.zeros((inputs_BxT.shape[0], self.hidden_size),
                          self.dtype)
    _, h_TxBxH = self._lstm_scan(params, (zeros_BxH, zeros_BxH), inputs_BxT,
                                 functools.partial(_loop_step, 'lstm'))
    return jnp.swapaxes(h_TxBxH, 0, 1), {}

  def _stream_start(self, params, batch):
    del params
    zeros_BxH = jnp.zeros((batch, self.hidden_size), self.dtype)
    return (zeros_BxH, zeros_BxH)

  def _stream(self, params, inputs_BxT, start, carried, first):
    carry = limited_stack.chunk_start(start, carried, first)
    carry, h_TxBxH = self._lstm_scan(params, carry, inputs_BxT)
    return jnp.swapaxes(h_TxBxH, 0, 1), carry


def keep_products_only(step_fn):
  """``step_fn`` of a time loop, keeping only its matmuls' outputs for the
  backward.

  Under autodiff ``lax.scan`` otherwise stores every intermediate of the
  step that the backward reads (an LSTM step: a dozen gate activations),
  each one more write per step into the loop's outputs (one more op on
  XLA:CPU, one more kernel on a GPU). With this, the loop stores the
  step's inputs and its matmuls' outputs, and the backward recomputes the
  elementwise rest, fused into its own elementwise work. Values and
  gradients are the same (up to rounding of the recomputation: none in
  practice, as the same ops run again).
  """
  return jax.checkpoint(step_fn, policy=jax.checkpoint_policies.dots_saveable)


# The baselines whose time loop stores only its matmuls' outputs
# (`keep_products_only`). Measured per model on 2 CPU cores, best wall time
# (`train_step_cpu_keep_products.json`): JM's train step 1.27-1.30x faster;
# the LSTM's 1.04-1.13x and Gref's 1.23-1.24x slower (their backwards grow
# by more than their forwards shrink), so they store every residual.
PRODUCTS_ONLY_LOOPS = frozenset({'jm'})


def _loop_step(model: str, step_fn):
  """``step_fn`` as ``model``'s time loop runs it (`PRODUCTS_ONLY_LOOPS`)."""
  return keep_products_only(step_fn) if model in PRODUCTS_ONLY_LOOPS else step_fn


def jm_depth(num_updates: int) -> int:
  """Stored JM depth that is exact for ``num_updates`` updates.

  A cell lost below depth D at update t had to exist (t >= D + 1) and needs D
  pops to reach the top (reading t + D >= 2D + 1); with 2D + 1 > T it can
  never be read. The reference's height truncation ``min(t, L - t)`` is the
  same observation.
  """
  return num_updates // 2 + 1


class _VectorStackLM(LanguageModel):
  """The baselines' shared layers: an action layer and a push layer.

  The stack holds vectors of size M = ``stack_embedding_size``; the reading
  is one such vector. Subclasses set the action layer's width and the push
  layer's Xavier gain (class constants, not module fields).
  """

  stack_embedding_size: int = 20
  NUM_ACTIONS = 0
  PUSH_GAIN = 1.0

  def _reading_size(self) -> int:
    return self.stack_embedding_size

  def _stack_params(self):
    return {'action': self.action(), 'push': self.push()}

  def setup(self):
    super().setup()
    self.action = AffineParams(self.hidden_size, self.NUM_ACTIONS,
                               xavier_uniform(1.0), dtype=self.dtype)
    self.push = AffineParams(self.hidden_size, self.stack_embedding_size,
                             xavier_uniform(self.PUSH_GAIN), dtype=self.dtype)


def _per_stack_xavier(num_stacks: int, width: int):
  """Xavier (gain 1) for a ``[H, K * width]`` kernel of K separate layers.

  Each stack's ``[H, width]`` block gets the bound of a layer of its own,
  ``sqrt(6 / (H + width))``: the reference declares one action layer per
  stack (``MultiLayer``); that its Xavier fans are per layer is our reading
  (its source is not in our notes). K = 1 is plain `xavier_uniform`, the
  documented single-stack initialisation.
  """
  if num_stacks == 1:
    return xavier_uniform(1.0)
  per_block = nn.initializers.variance_scaling(
      1.0, 'fan_avg', 'uniform', in_axis=0, out_axis=-1, batch_axis=(1,))

  def init(key, shape, dtype=jnp.float32):
    fan_in, out = shape
    return per_block(key, (fan_in, num_stacks, out // num_stacks),
                     dtype).reshape(shape)

  return init


class JMLM(_VectorStackLM):
  """LSTM + Joulin-Mikolov superposition stack (actions push, pop, no-op).

  With ``num_stacks`` K > 1 (the ICLR 2023 paper's JM-3.3.3: K = 3 stacks
  of M = 3), K stacks of width M run side by side, each with its own
  softmax over (push, pop, no-op); one sigmoid layer gives all K pushed
  vectors, and the reading is the K tops concatenated (K * M). With
  ``push_hidden_state`` the pushed vector is the controller's hidden state
  h_t itself (no push layer; needs K * M = H), the paper's "JM with a pushed
  hidden state".

  ``trace`` adds ``actions`` [B, T, 3] (push, pop, no-op probabilities;
  [B, T, K, 3] with K > 1 stacks), ``push_vectors`` [B, T, K * M] and
  ``readings`` [B, N, K * M] (``r_0 = 0`` .. ``r_T``).
  """

  NUM_ACTIONS = 3         # push, pop, no-op (softmax)
  PUSH_GAIN = 1.0         # sigmoid push vectors
  # Stacks of width stack_embedding_size, each with its own actions.
  num_stacks: int = 1
  # Push h_t itself instead of a learned sigmoid projection of it.
  push_hidden_state: bool = False

  def _reading_size(self) -> int:
    return self.num_stacks * self.stack_embedding_size

  def _stack_params(self):
    if self.push_hidden_state:
      return {'action': self.action()}
    return super()._stack_params()

  def setup(self):
    LanguageModel.setup(self)
    k = self.num_stacks
    self.action = AffineParams(self.hidden_size, self.NUM_ACTIONS * k,
                               _per_stack_xavier(k, self.NUM_ACTIONS),
                               dtype=self.dtype)
    if not self.push_hidden_state:
      self.push = AffineParams(self.hidden_size, self._reading_size(),
                               xavier_uniform(self.PUSH_GAIN),
                               dtype=self.dtype)

  def _action_shape(self, batch, steps):
    k = self.num_stacks
    return (batch, steps, 3) if k == 1 else (batch, steps, k, 3)

  def _no_step_internals(self, batch):
    width, dt = self._reading_size(), self.dtype
    return {'actions': jnp.zeros(self._action_shape(batch, 0), dt),
            'push_vectors': jnp.zeros((batch, 0, width), dt),
            'readings': jnp.zeros((batch, 1, width), dt)}

  def _run(self, params, inputs_BxT):
    x_BxTxV = self._one_hot(inputs_BxT)
    batch, steps, _ = x_BxTxV.shape
    m, k = self._reading_size(), self.num_stacks
    zeros_BxH = jnp.zeros((batch, self.hidden_size), self.dtype)
    stack_BxDxM = jnp.zeros((batch, jm_depth(steps), m), self.dtype)

    def step(carry, x_BxV):
      lstm_carry, stack_BxDxM = carry
      reading_BxM = stack_BxDxM[:, 0]
      lstm_carry, h_BxH = lstm_step(
          params['controller'], lstm_carry,
          jnp.concatenate([x_BxV, reading_BxM], axis=-1),
          self.matmul_precision)
      logits_Bx3K = affine(params['action'], h_BxH, self.matmul_precision)
      actions = jax.nn.softmax(
          logits_Bx3K if k == 1 else logits_Bx3K.reshape(batch, k, 3),
          axis=-1)
      if self.push_hidden_state:
        push_BxM = h_BxH
      else:
        push_BxM = jax.nn.sigmoid(
            affine(params['push'], h_BxH, self.matmul_precision))
      stack_BxDxM = jm_update(stack_BxDxM, actions, push_BxM)
      return (lstm_carry, stack_BxDxM), (h_BxH, actions, push_BxM,
                                         stack_BxDxM[:, 0])

    _, (h, actions, push, readings) = jax.lax.scan(
        _loop_step('jm', step), ((zeros_BxH, zeros_BxH), stack_BxDxM),
        jnp.swapaxes(x_BxTxV, 0, 1), unroll=self.scan_unroll)
    h, actions, push, readings = (jnp.swapaxes(a, 0, 1)
                                  for a in (h, actions, push, readings))
    readings = jnp.concatenate(
        [jnp.zeros((batch, 1, m), readings.dtype), readings], axis=1)
    return h, {'actions': actions, 'push_vectors': push, 'readings': readings}


class GrefLM(_VectorStackLM):
  """LSTM + Grefenstette et al. stratification stack (push/pop strengths).

  ``trace`` adds ``actions`` [B, T, 2] (push strength d, pop strength u),
  ``push_vectors`` [B, T, M], ``strengths`` [B, T, T] (row t - 1: all slot
  strengths after update t) and ``readings`` [B, N, M] (``r_0 = 0`` .. ``r_T``).
  """

  NUM_ACTIONS = 2         # push strength, pop strength (sigmoid)
  PUSH_GAIN = 5.0 / 3.0   # tanh push vectors

  def _no_step_internals(self, batch):
    m, dt = self.stack_embedding_size, self.dtype
    return {'actions': jnp.zeros((batch, 0, 2), dt),
            'push_vectors': jnp.zeros((batch, 0, m), dt),
            'strengths': jnp.zeros((batch, 0, 0), dt),
            'readings': jnp.zeros((batch, 1, m), dt)}

  def _run(self, params, inputs_BxT):
    x_BxTxV = self._one_hot(inputs_BxT)
    batch, steps, _ = x_BxTxV.shape
    m = self.stack_embedding_size
    zeros_BxH = jnp.zeros((batch, self.hidden_size), self.dtype)
    init = ((zeros_BxH, zeros_BxH),
            jnp.zeros((batch, steps, m), self.dtype),
            jnp.zeros((batch, steps), self.dtype),
            jnp.zeros((batch, m), self.dtype))

    def step(carry, inputs):
      lstm_carry, values_BxTxM, strength_BxT, reading_BxM = carry
      position, x_BxV = inputs
      lstm_carry, h_BxH = lstm_step(
          params['controller'], lstm_carry,
          jnp.concatenate([x_BxV, reading_BxM], axis=-1),
          self.matmul_precision)
      actions_Bx2 = jax.nn.sigmoid(
          affine(params['action'], h_BxH, self.matmul_precision))
      push_BxM = jnp.tanh(affine(params['push'], h_BxH,
                                 self.matmul_precision))
      values_BxTxM, strength_BxT, reading_BxM = gref_update(
          values_BxTxM, strength_BxT, position, actions_Bx2[:, 0],
          actions_Bx2[:, 1], push_BxM, self.matmul_precision)
      return ((lstm_carry, values_BxTxM, strength_BxT, reading_BxM),
              (h_BxH, actions_Bx2, push_BxM, strength_BxT, reading_BxM))

    _, outs = jax.lax.scan(
        _loop_step('gref', step), init,
        (jnp.arange(steps), jnp.swapaxes(x_BxTxV, 0, 1)),
        unroll=self.scan_unroll)
    h, actions, push, strengths, readings = (jnp.swapaxes(a, 0, 1)
                                             for a in outs)
    readings = jnp.concatenate(
        [jnp.zeros((batch, 1, m), readings.dtype), readings], axis=1)
    return h, {'actions': actions, 'push_vectors': push,
               'strengths': strengths, 'readings': readings}


class PDAStackLM(LanguageModel):
  """Base of the models whose stack is driven by a PDA's actions (NS, RNS, VRNS).

  Holds the PDA's size and its action layer h -> push, repl, pop logits
  (Q·S·(2·Q·S + Q) outputs, U[-0.1, 0.1] init as the authors' code, or
  with ``action_init='xavier'`` Xavier uniform and bias 0, as the paper's
  text has every fully-connected layer); subclasses add the reading and the
  recurrence, and extend ``_stack_params`` and ``setup`` for parameters of
  their own.
  """

  num_states: int = 2
  num_stack_symbols: int = 2
  action_init: str = 'uniform'

  def _stack_params(self):
    return {'action': self.action()}

  def stack_margin(self, symbols_BxN, mask_BxN=None) -> jax.Array:
    """The share sweep's product margin on these strings: [B] nats.

    ``rns_stack.share_margin`` (with a window ``limited_stack``'s) of the
    action log-weights the stack saw:
    where it is above ``rns_stack.exact_margin(dtype)`` (about -40 nats in
    float32) the readings, log masses and so the logits are those of exact
    arithmetic up to rounding; below it they may have lost PDA runs that
    fell that far behind, and ``stack_table='log'`` gives the exact ones.
    Use as ``model.apply(params, symbols, method='stack_margin')``.
    With ``mask_BxN`` (a padded batch's target mask, `train.make_batch`)
    string b's margin is that of its first sum(mask_BxN[b]) symbols alone:
    the updates that read padding are left out.

    Raises:
      ValueError: (one line) the model's stack is not a share sweep (the
        'log' table cannot flush; 'scaled' and the VRNS-RNN's broadcast
        bottom have no margin).
    """
    symbols_BxN = _check_symbols(symbols_BxN, self.vocab_size)
    margin_fn = self._margin_fn()
    if symbols_BxN.shape[1] < 2:
      return jnp.full(symbols_BxN.shape[:1], jnp.inf, self.dtype)
    num_updates = None
    if mask_BxN is not None:
      if jnp.shape(mask_BxN) != symbols_BxN.shape:
        raise ValueError(f'mask_BxN must have the shape of the symbols '
                         f'{symbols_BxN.shape}, got {jnp.shape(mask_BxN)}')
      # Symbols 1..L are read by updates 1..L−1 (the first is predicted
      # from the initial state).
      num_updates = jnp.maximum(
          jnp.sum(mask_BxN > 0, axis=1).astype(jnp.int32) - 1, 0)
    margin_fn = functools.partial(margin_fn, num_updates=num_updates)
    params = self._params()
    h_BxTxH = self._run(params, symbols_BxN[:, :-1])[0]
    acts = self._stack_log_weights(params, h_BxTxH)
    if num_updates is not None:
      # A string of one symbol has no update: +inf, as unpadded.
      finish = lambda lo: jnp.where(num_updates > 0, lo, jnp.inf)
    else:
      finish = lambda lo: lo
    if getattr(self, 'window', 0):
      return finish(margin_fn(*acts))
    # The unlimited table in batch chunks that fit the caches, as the
    # model's own sweep (`stack_batch_chunk`): a large batch of one length
    # (evaluate.stack_margins) would otherwise hold its whole table.
    batch, steps = symbols_BxN.shape[0], symbols_BxN.shape[1] - 1
    chunk = stack_batch_chunk(getattr(self, 'batch_chunk', 0), batch, steps,
                              self.num_states, self.num_stack_symbols,
                              jnp.dtype(self.dtype).itemsize)
    if chunk == batch:
      return finish(margin_fn(*acts))
    split = lambda a: a.reshape((batch // chunk, chunk) + a.shape[1:])
    if num_updates is None:
      chunk_fn = lambda a: margin_fn(*a)
    else:
      chunk_fn = lambda a: margin_fn(*a[:-1], num_updates=a[-1])
      acts = tuple(acts) + (num_updates,)
    return finish(jax.lax.map(chunk_fn, tuple(split(a) for a in acts))
                  .reshape(batch))

  def _margin_fn(self):
    """push, repl, pop -> the share sweep's margin, or a ValueError."""
    raise ValueError(f'stack_margin applies to the share table of ns, rns '
                     f'and vrns, not to {type(self).__name__}')

  def _stack_log_weights(self, params, h_BxTxH):
    """Update t's stack inputs from h_t: the action log-weights push, repl,
    pop (and the VRNS-RNN's log vectors, log bottom vector): what
    ``_margin_fn``'s function takes."""
    raise NotImplementedError

  def setup(self):
    super().setup()
    q, s = self.num_states, self.num_stack_symbols
    kernel, bias = ((xavier_uniform(1.0), nn.initializers.zeros)
                    if self.action_init == 'xavier'
                    else (uniform_init(), uniform_init()))
    self.action = AffineParams(self.hidden_size, q * s * (2 * q * s + q),
                               kernel, bias, dtype=self.dtype)

  # Streams (see LanguageModel.stream), for the windowed stacks: subclasses
  # with a `window` D >= 1 give `_controller(params)` -> (step_fn, its
  # params, actions_fn), `_window_parts(params, batch, margin=False)` ->
  # (update, read, state0) for `limited_stack.stream_chunk` (with `margin`
  # the update's outputs end with its product margin [B]) and
  # `_start_margin(state0)` -> the start state's margin [B].

  def _stream_start(self, params, batch):
    if not getattr(self, 'window', 0):
      return super()._stream_start(params, batch)
    zeros_BxH = jnp.zeros((batch, self.hidden_size), self.dtype)
    return ((zeros_BxH, zeros_BxH), self._window_parts(params, batch)[2])

  def _stream(self, params, inputs_BxT, start, carried, first, margin=False,
              real_BxT=None):
    """(h [B, T, H], state after the chunk), with `margin` also the
    chunk's product margin [B] (see ``stream_with_margin``; `real_BxT`: its
    mask as bools, or None)."""
    step_fn, step_params, actions_fn = self._controller(params)
    update, read, _ = self._window_parts(params, inputs_BxT.shape[0],
                                         margin=margin)
    state, (outs_TxBxH, stack_out) = limited_stack.stream_chunk(
        step_fn, update, read, step_params, start, carried, first,
        jnp.swapaxes(inputs_BxT, 0, 1), actions_fn)
    h_BxTxH = jnp.swapaxes(outs_TxBxH, 0, 1)
    if not margin:
      return h_BxTxH, state
    real_TxB = (jnp.ones(inputs_BxT.shape[::-1], bool) if real_BxT is None
                else jnp.swapaxes(real_BxT, 0, 1))
    if actions_fn is None:
      # The update from h_t is made after input t.
      lo_B = jnp.min(jnp.where(real_TxB, stack_out[-1], jnp.inf), axis=0)
    else:
      # ICLR 2023 boundary: the update from h_t is made before input t + 1,
      # so the previous chunk's last update is made here first (a stream's
      # first chunk has none: its slot is a placeholder), and this chunk's
      # last update is left to the next chunk.
      boundary, inner = stack_out
      lo_B = jnp.min(jnp.where(real_TxB[1:], inner[-1], jnp.inf), axis=0,
                     initial=jnp.inf)
      lo_B = jnp.minimum(lo_B, jnp.where(first | ~real_TxB[0], jnp.inf,
                                         boundary[-1]))
    lo_B = jnp.where(first,
                     jnp.minimum(lo_B, self._start_margin(start[1])), lo_B)
    return h_BxTxH, state, lo_B

  def _start_margin(self, state0):
    """The product margin [B] of a stream's start state (+inf: none)."""
    return jnp.full(jax.tree_util.tree_leaves(state0)[0].shape[:1], jnp.inf,
                    self.dtype)

  def stream_with_margin(self, inputs_BxT, carry, mask_BxT=None):
    """``stream`` plus the share stack's product margin of this chunk.

    For corpus runs (`config.valid_stack_margin`): the chunks of a stream,
    fed in order, give the logits and carries of ``stream`` and margins
    whose minimum is ``stack_margin`` of the whole stream at once (the
    updates it made: with the ICLR 2023 bottom a chunk's last update is
    made by the next chunk). Above ``rns_stack.exact_margin(dtype)`` the
    stream's values so far are exact up to rounding. Forward only.

    Args:
      inputs_BxT, carry: as for ``stream``.
      mask_BxT: None, or which inputs are real (> 0), each row's real
        inputs first (`corpus.make_rows`' padded rows): the margin then
        counts only the updates that a stream of the real inputs alone
        makes.

    Returns:
      (logits [B, T, V], next carry, margin [B]): margin[b] is the smallest
      product margin of the updates made in this chunk (and, in a stream's
      first chunk, of its start state); +inf when there are none.

    Raises:
      ValueError: (one line) the model has no window or no share table.
    """
    inputs_BxT = _check_symbols(inputs_BxT, self.vocab_size)
    self._margin_fn()
    real_BxT = None
    if mask_BxT is not None:
      if jnp.shape(mask_BxT) != inputs_BxT.shape:
        raise ValueError(f'mask_BxT must have the shape of the inputs '
                         f'{inputs_BxT.shape}, got {jnp.shape(mask_BxT)}')
      real_BxT = jnp.asarray(mask_BxT) > 0
    params = self._params()
    start = self._stream_start(params, inputs_BxT.shape[0])
    h_BxTxH, state, lo_B = self._stream(
        params, inputs_BxT, start, carry['state'], jnp.asarray(carry['first']),
        margin=True, real_BxT=real_BxT)
    logits_BxTxV = affine(params['output'], h_BxTxH, self.matmul_precision)
    return logits_BxTxV, {'first': jnp.asarray(False), 'state': state}, lo_B


def run_ns_stack(step_fn: Callable[..., Any], params, init_carry, xs,
                 num_states: int, num_symbols: int,
                 table: str = DEFAULT_NS_TABLE,
                 precision: str = 'highest', unroll: int = 1,
                 batch_chunk: int = 0):
  """The NS-RNN's controller + stack recurrence on the chosen table.

  Args:
    step_fn, params, init_carry, xs: as for ``ns_stack.run_coupled`` (the
      controller step sees the reading tau_{t-1} and returns update t's
      log-weights).
    num_states, num_symbols: Q, S.
    table: one of ``NS_TABLES``: 'shares' runs ``rns_stack.run_coupled``
      with the frozen bottom and the top-symbol reading (the CoNLL 2020
      semantics, exact up to its flush limit); 'log' runs
      ``log_stack.run_coupled`` with the same semantics (exact, slower);
      'scaled' runs ``ns_stack.run_coupled``.
    precision: matmul precision of the stack's contractions.
    unroll: the stack's `lax.scan` unroll factor (same values; for
      launch-bound accelerators).
    batch_chunk: strings per stack run (``stack_batch_chunk``; 0 =
      automatic); chunks run one after another, same values.

  Returns:
    ``(outs [B, T, ...], readings [B, T+1, S], log_mass [B, T+1])`` with
    ``tau_0 = one_hot(bottom)``, whichever table computed them.
  """
  check_stack_table(table)
  batch, steps = jax.tree_util.tree_leaves(xs)[0].shape[:2]
  # The table's entries have the float type of the controller's parameters.
  itemsize = jnp.dtype(rns_stack._float_dtype(params)).itemsize  # pylint: disable=protected-access
  chunk = stack_batch_chunk(batch_chunk, batch, steps, num_states,
                            num_symbols, itemsize)

  def run(carry, x):
    if table == 'scaled':
      return ns_stack.run_coupled(step_fn, params, carry, x,
                                  num_states=num_states,
                                  num_symbols=num_symbols,
                                  precision=precision, unroll=unroll)
    if table == 'log':
      outs, la, log_mass = log_stack.run_coupled(
          step_fn, params, carry, x, num_states, num_symbols,
          rns_stack.FROZEN, rns_stack.SYMBOL, precision=precision)
    else:
      outs, la, log_mass = rns_stack.run_coupled(
          step_fn, params, carry, x, num_states, num_symbols,
          rns_stack.FROZEN, rns_stack.SYMBOL, precision=precision,
          unroll=unroll)
    return outs, rns_stack.readout(la, rns_stack.SYMBOL)[0], log_mass

  if chunk == batch:
    return run(init_carry, xs)
  # The batch in chunks, one after another (lax.map): every chunk's table
  # stays within the cache budget. Same values, same gradient memory.
  split = lambda a: a.reshape((batch // chunk, chunk) + a.shape[1:])
  merge = lambda a: a.reshape((batch,) + a.shape[2:])
  outs = jax.lax.map(lambda args: run(*args),
                     jax.tree_util.tree_map(split, (init_carry, xs)))
  return jax.tree_util.tree_map(merge, outs)


# On CPU the stack runs the batch in chunks whose table fits this many bytes:
# larger tables ran slower per string (2 AMD EPYC cores, L2 1 MiB per core,
# L3 16 MiB; train step at n = 80): Q = S = 2 fastest at 10-20 strings
# (4-9 MiB); Q = S = 3 at 2 strings (4.4 MB), since the fewer-ops update
# 1.07-1.26x faster than 5 (10.9 MB) and 1.6x faster than 10: cache-bound.
# 10 MiB (was 6) since the sweeps keep the table in column chunks: Q = 3,
# S = 2 (padded reversal) then ran fastest on its whole batch (9.7 MB) on one
# core, and Q = S = 3 still at 2 strings (train_step_cpu_table_budget.json).
# That machine's L3 held 16 MiB: the budget is that share of the host's L3
# (`cpu_table_budget_bytes`), and this where its size cannot be read. On an
# 8 MiB L3 (2 AMD EPYC cores, the other running a second NS-RNN, as two
# reproduce workers do; time blocks of >= 12 updates) the 10 MiB budget's
# chunks ran slower than smaller ones: Q = S = 3 1.12-1.35x slower than 2
# strings at n = 41-74 (its 5 or 10), Q = 3, S = 2 1.37x at n = 80 (its
# 10), while Q = S = 2 ran fastest on its whole batch at n = 47 and 80
# (train_step_cpu_chunks_l3_8mib_*.json).
CPU_TABLE_BUDGET_BYTES = 10 * 2**20
CPU_TABLE_BUDGET_L3_SHARE = CPU_TABLE_BUDGET_BYTES / (16 * 2**20)
# ... except that a chunk of one string is taken only when the next divisor
# of the batch would exceed this many budgets: on two CPU devices (5 strings
# each) Q = S = 3 at n = 80 ran faster in chunks of 5 (11 MB) than of 1, on
# the column-chunked table (train_step_cpu_chunk_of_five.json).
CPU_SINGLE_STRING_LIMIT = 4


@functools.lru_cache(maxsize=None)
def cpu_table_budget_bytes() -> int:
  """The automatic chunk's table budget on this host's CPU: a share of its
  L3 cache (CPU_TABLE_BUDGET_L3_SHARE), or CPU_TABLE_BUDGET_BYTES where the
  cache size cannot be read."""
  l3 = parallel.host_l3_cache_bytes()
  if not l3:
    return CPU_TABLE_BUDGET_BYTES
  return int(CPU_TABLE_BUDGET_L3_SHARE * l3)


def stack_batch_chunk(requested: int, batch: int, steps: int,
                      num_states: int, num_symbols: int,
                      itemsize: int = 4) -> int:
  """How many strings the NS stack runs at once (a divisor of `batch`).

  requested: 0 = automatic: on CPU the largest divisor of the batch whose
    table, B·(T+2)²·Q²·S² entries of `itemsize` bytes (4 float32, 8
    float64), fits the budget (`cpu_table_budget_bytes`: 10 MiB on a 16 MiB
    L3), but not 1 where the next divisor fits CPU_SINGLE_STRING_LIMIT
    budgets; on accelerators the whole batch.
    N >= 1: the largest divisor of the batch <= N
    (``config.stack_batch_chunk``).
  """
  divisors = [d for d in range(1, batch + 1) if batch % d == 0]
  if requested:
    return max(d for d in divisors if d <= requested)
  if jax.default_backend() != 'cpu':
    return batch
  per_string = itemsize * (steps + 2)**2 * (num_states * num_symbols)**2
  budget = cpu_table_budget_bytes()
  limit = max(1, budget // per_string)
  chunk = max(d for d in divisors if d <= limit)
  if chunk == 1 and batch > 1:
    # One string per run is slower per string than a few over the budget:
    # the next divisor, unless its table is far beyond the cache.
    bigger = divisors[1]
    if bigger * per_string <= CPU_SINGLE_STRING_LIMIT * budget:
      chunk = bigger
  return chunk


class NSLM(PDAStackLM):
  """LSTM + nondeterministic stack (Lang's algorithm).

  ``table`` picks the dynamic program (``NS_TABLES``): 'shares'
  (``rns_stack`` with the CoNLL 2020 semantics: frozen bottom, top-symbol
  reading; exact up to its flush limit), 'log' (``log_stack``, the same
  semantics with no flush; slower) or 'scaled' (``ns_stack``; slower on
  CPU since the shares update runs in fewer ops, and can flush in
  float32).

  ``trace`` adds ``actions``: a dict of probabilities ``push`` and
  ``repl`` [B, T, Q, S, Q, S] and ``pop`` [B, T, Q, S, Q]; ``readings``
  [B, N, S] (``tau_0 = one_hot(bottom)`` .. ``tau_T``) and ``log_mass`` (the
  log total weight after each update, as returned by ``ns_stack``).
  """

  table: str = DEFAULT_NS_TABLE
  batch_chunk: int = 0

  def _reading_size(self) -> int:
    return self.num_stack_symbols

  def _no_step_internals(self, batch):
    q, s, dt = self.num_states, self.num_stack_symbols, self.dtype
    return {'actions': {'push': jnp.zeros((batch, 0, q, s, q, s), dt),
                        'repl': jnp.zeros((batch, 0, q, s, q, s), dt),
                        'pop': jnp.zeros((batch, 0, q, s, q), dt)},
            'readings': jnp.zeros((batch, 1, s), dt).at[:, 0, 0].set(1),
            'log_mass': jnp.zeros((batch, 1), dt)}

  def _run(self, params, inputs_BxT):
    batch = inputs_BxT.shape[0]
    zeros_BxH = jnp.zeros((batch, self.hidden_size), self.dtype)
    step_fn = functools.partial(
        ns_controller_step, vocab_size=self.vocab_size,
        num_states=self.num_states, num_symbols=self.num_stack_symbols,
        precision=self.matmul_precision)
    step_params = {'controller': params['controller'],
                   'action': params['action']}
    h_BxTxH, readings, log_mass = run_ns_stack(
        step_fn, step_params, (zeros_BxH, zeros_BxH), inputs_BxT,
        self.num_states, self.num_stack_symbols, self.table,
        self.matmul_precision, unroll=self.scan_unroll,
        batch_chunk=self.batch_chunk)
    push, repl, pop = self._stack_log_weights(params, h_BxTxH)
    actions = {'push': jnp.exp(push), 'repl': jnp.exp(repl),
               'pop': jnp.exp(pop)}
    return h_BxTxH, {'actions': actions, 'readings': readings,
                     'log_mass': log_mass}

  def _stack_log_weights(self, params, h_BxTxH):
    return jax.vmap(
        lambda h: ns_action_log_probs(params['action'], h, self.num_states,
                                      self.num_stack_symbols,
                                      self.matmul_precision),
        in_axes=1, out_axes=1)(h_BxTxH)

  def _margin_fn(self):
    if self.table != 'shares':
      raise ValueError(f"stack_margin applies to the 'shares' table, not "
                       f"{self.table!r} ('log' is exact)")
    return functools.partial(rns_stack.share_margin, bottom=rns_stack.FROZEN,
                             precision=self.matmul_precision)


class RNSLM(PDAStackLM):
  """LSTM + the generalised nondeterministic stack (RNS-RNN and variants).

  rns-vrns-reference.md sections 1-2: ``normalize=False`` and
  ``reading='state'`` is the RNS-RNN (NS+S+U); ``bottom='fixed'`` is the
  ICLR 2023 bottom-symbol fix ('frozen' = CoNLL 2020 / ICLR 2022);
  ``window`` D >= 1 selects the memory-limited stack, trained with
  truncated BPTT in chunks of ``truncation_length`` steps (0 = whole
  string; the chunk boundary's gradient follows the bottom's tag, see
  ``limited_stack``). ``table`` (``RNS_TABLES``) runs the stack on shares
  (``rns_stack``; with a window ``limited_stack``) or in log space ('log':
  ``log_stack``, ``limited_log_stack``; exact for any finite log-weights,
  slower). Same time indexing as
  :class:`NSLM`; EOS, when the config predicts it, is one more symbol
  (``from_config``).

  ``trace`` adds ``action_log_weights`` (dict ``push``, ``repl`` [B, T, Q, S,
  Q, S], ``pop`` [B, T, Q, S, Q]), ``readings`` [B, N, R] (what the
  controller reads: R = Q·S or S), ``state_readings`` [B, N, Q·S] (flattened
  (r, y)) and ``log_mass`` [B, N].
  """

  num_stack_symbols: int = 3
  normalize: bool = False
  reading: str = rns_stack.STATE
  bottom: str = rns_stack.FIXED
  window: int = 0
  truncation_length: int = 0
  table: str = DEFAULT_NS_TABLE

  def _reading_size(self) -> int:
    q, s = self.num_states, self.num_stack_symbols
    return q * s if self.reading == rns_stack.STATE else s

  def _no_step_internals(self, batch):
    q, s, dt = self.num_states, self.num_stack_symbols, self.dtype
    state = jnp.zeros((batch, 1, q * s), dt).at[:, 0, 0].set(1)
    return {'action_log_weights': {
                'push': jnp.zeros((batch, 0, q, s, q, s), dt),
                'repl': jnp.zeros((batch, 0, q, s, q, s), dt),
                'pop': jnp.zeros((batch, 0, q, s, q), dt)},
            'readings': jnp.zeros((batch, 1, self._reading_size()),
                                  dt).at[:, 0, 0].set(1),
            'state_readings': state,
            'log_mass': jnp.zeros((batch, 1), dt)}

  def _controller(self, params):
    """(step_fn, its params, actions_fn) for the stack's coupled loops."""
    q, s = self.num_states, self.num_stack_symbols
    step_fn = functools.partial(
        rns_controller_step, vocab_size=self.vocab_size, num_states=q,
        num_symbols=s, normalize=self.normalize,
        precision=self.matmul_precision, input_lookup=self.input_lookup)
    controller = params['controller']
    if self.input_lookup:
      controller = split_input_matrix(controller, self.vocab_size)
    step_params = {'controller': controller, 'action': params['action']}
    # Truncated BPTT's boundary as in the tag of the bottom
    # (rns-vrns-reference.md section 2.2): with the ICLR 2023 fix, every
    # update trains the action layer, a chunk's last one in the next chunk
    # from the detached h; with the frozen (ICLR 2022) bottom, the last
    # update of a chunk gets no gradient.
    actions_fn = None
    if self.bottom == rns_stack.FIXED:
      actions_fn = lambda p, carry: rns_stack.split_action_logits(
          affine(p['action'], carry[0], self.matmul_precision), q, s,
          self.normalize)
    return step_fn, step_params, actions_fn

  def _window_parts(self, params, batch, margin=False):
    del params
    if self.table == 'log':
      return limited_log_stack.coupled_parts(
          batch, self.num_states, self.num_stack_symbols, self.window,
          self.bottom, self.reading, self.dtype, self.matmul_precision)
    return limited_stack.coupled_parts(
        batch, self.num_states, self.num_stack_symbols, self.window,
        self.bottom, self.reading, self.dtype, self.matmul_precision, margin)

  def _run(self, params, inputs_BxT):
    batch = inputs_BxT.shape[0]
    q, s = self.num_states, self.num_stack_symbols
    zeros_BxH = jnp.zeros((batch, self.hidden_size), self.dtype)
    step_fn, step_params, actions_fn = self._controller(params)
    if self.window:
      h_BxTxH, la, log_mass = limited_stack.run_parts(
          step_fn, self._window_parts(params, batch), step_params,
          (zeros_BxH, zeros_BxH), inputs_BxT, self.truncation_length,
          actions_fn)
    elif self.table == 'log':
      h_BxTxH, la, log_mass = log_stack.run_coupled(
          step_fn, step_params, (zeros_BxH, zeros_BxH), inputs_BxT, q, s,
          self.bottom, self.reading, precision=self.matmul_precision)
    else:
      h_BxTxH, la, log_mass = rns_stack.run_coupled(
          step_fn, step_params, (zeros_BxH, zeros_BxH), inputs_BxT, q, s,
          self.bottom, self.reading, precision=self.matmul_precision,
          unroll=self.scan_unroll)
    push, repl, pop = self._stack_log_weights(params, h_BxTxH)
    return h_BxTxH, {
        'action_log_weights': {'push': push, 'repl': repl, 'pop': pop},
        'readings': rns_stack.readout(la, self.reading)[0],
        'state_readings': rns_stack.readout(la, rns_stack.STATE)[0],
        'log_mass': log_mass}

  def _stack_log_weights(self, params, h_BxTxH):
    return rns_stack.split_action_logits(
        affine(params['action'], h_BxTxH, self.matmul_precision),
        self.num_states, self.num_stack_symbols, self.normalize)

  def _margin_fn(self):
    if self.table != 'shares':
      raise ValueError(f"stack_margin applies to the 'shares' table, not "
                       f"{self.table!r} ('log' is exact)")
    if self.window:
      return functools.partial(limited_stack.share_margin,
                               window=self.window, bottom=self.bottom,
                               precision=self.matmul_precision)
    return functools.partial(rns_stack.share_margin, bottom=self.bottom,
                             precision=self.matmul_precision)


# ---------------------------------------------------------------------------
# Construction and scoring.
# ---------------------------------------------------------------------------


# Time-loop unroll factor chosen by scan_unroll = 0 for the LSTM and JM on
# GPUs. Measured on one H200 (train step, batch 10, n = 80, full float32;
# benchmarks/results/train_step_gpu_*.json): unroll 8 ran 0.54x (LSTM) and
# 0.53x (JM) the time of unroll 1, for 1.2 / 3.2 s more compile. Gref gained
# 0.95x for 4x the compile (2.8 -> 10.7 s) and the NS-RNN 0.86x / 0.91x
# (Q=S=2 / 3) for 3-4x (14 -> 53 s): with a compile per string length or
# bucket that is about even or a loss, so both stay at 1. On 2 CPU cores
# unroll 8 was slower (LSTM 1.53x, JM 1.33x, Gref 1.25x:
# train_step_cpu_unroll.json).
GPU_UNROLLED_MODELS = ('lstm', 'jm')
GPU_UNROLL = 8


def auto_scan_unroll(name: str, backend: str | None = None) -> int:
  """The time loop's unroll factor for ``scan_unroll = 0`` (automatic).

  ``GPU_UNROLL`` for the ``GPU_UNROLLED_MODELS`` (LSTM, JM) on a GPU
  backend, 1 for everything else (``backend`` defaults to JAX's default
  backend).
  """
  backend = jax.default_backend() if backend is None else backend
  if backend in ('gpu', 'cuda', 'rocm') and name in GPU_UNROLLED_MODELS:
    return GPU_UNROLL
  return 1


def _check_int(name: str, value, minimum: int, what: str) -> int:
  """`value` as an int ≥ `minimum` (bools refused); `what` names the range."""
  if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
      or value < minimum):
    raise ValueError(f'{name} must be {what}, got {value!r}')
  return int(value)


def _check_auto_or_positive_int(name: str, value) -> int:
  """`value` as an int: 0 (automatic) or a positive integer."""
  return _check_int(name, value, 0, '0 (automatic) or a positive integer')


def _check_positive_int(name: str, value) -> int:
  """`value` as a positive int."""
  return _check_int(name, value, 1, 'a positive integer')


def check_stack_variant_supported(name: str, stack_window, truncation_length,
                                  stack_bottom, prefix: str = '') -> None:
  """Refuses stack-variant settings that model ``name`` would ignore.

  'rns' and 'vrns' have the memory-limited stack; 'vrns' has only the ICLR
  2023 fixed bottom (rns-vrns-reference.md section 3.2). The other variant
  fields (normalisation, reading) belong to 'rns' and keep their
  documented meaning for it only. ``prefix`` goes before each field name
  in the message (e.g. 'config.').
  """
  if name not in ('rns', 'vrns') and (stack_window or truncation_length):
    raise ValueError(
        f'{prefix}stack_window is {stack_window!r} and {prefix}'
        f'truncation_length {truncation_length!r}: model {name!r} has no '
        "memory-limited stack (only 'rns' and 'vrns' have); set both to 0")
  if name == 'vrns' and stack_bottom != rns_stack.FIXED:
    raise ValueError(f'{prefix}stack_bottom is {stack_bottom!r}: model '
                     "'vrns' has only the ICLR 2023 'fixed' bottom")


def get(name: str, vocab_size: int, hidden_size: int = 20,
        num_states: int = 2, num_stack_symbols: int = 2,
        stack_embedding_size: int = 20, dtype=jnp.float32,
        matmul_precision: str = 'highest',
        stack_normalize: bool = False, stack_reading: str = 'state',
        stack_bottom: str = 'fixed', stack_window: int = 0,
        truncation_length: int = 0,
        stack_vector_size: int = 3, stack_bottom_vector: str = 'learned',
        broadcast_bottom_vector: bool = False,
        stack_table: str = DEFAULT_NS_TABLE,
        stack_batch_chunk: int = 0, scan_unroll: int = 0,
        jm_num_stacks: int = 1, jm_push_hidden_state: bool = False,
        input_lookup: bool = False,
        ns_action_init: str = 'uniform') -> nn.Module:
  """Builds one of the language models.

  Args:
    name: one of ``MODEL_NAMES`` ('lstm', 'jm', 'gref', 'ns', 'rns', 'vrns').
    vocab_size: V.
    hidden_size: LSTM hidden units H (20 in the paper).
    num_states: NS-RNN PDA states Q (ns only).
    num_stack_symbols: NS-RNN stack symbols S including bottom (ns only).
    stack_embedding_size: JM/Gref stack vector size M (jm, gref only).
    stack_normalize, stack_reading, stack_bottom, stack_window,
      truncation_length: the stack variant (rns only; see
      ``rns_stack.validate_stack_config``).
    dtype: parameter and computation dtype (float32 or float64; float64
      needs ``jax_enable_x64``).
    matmul_precision: precision of every matmul (``ns_stack.MATMUL_PRECISIONS``;
      'highest' = full float32 on GPUs / TPUs as on CPUs).
    stack_vector_size: VRNS stack-vector size m (vrns only).
    stack_bottom_vector: VRNS bottom vector: 'learned', 'one' or 'zero'.
    broadcast_bottom_vector: VRNS: the authors' broadcast bottom vector
      (``vrns_stack`` docstring) instead of the run-consistent one.
    stack_table: the stack's dynamic program: for ns one of ``NS_TABLES``
      ('shares': exact up to its flush limit; 'log': no flush, slower;
      'scaled': can flush in float32), for rns and vrns (with or without a
      window) one of ``RNS_TABLES``; other models take only the default.
    stack_batch_chunk: strings per run of the NS-RNN's stack, 0 = automatic
      (``stack_batch_chunk``; ns only).
    scan_unroll: ``lax.scan`` unroll factor of the time loop (same values;
      lstm, jm, gref, ns and rns without a window; 1 for the others), 0 =
      automatic (``auto_scan_unroll``).
    jm_num_stacks: JM stacks K of width ``stack_embedding_size``, each with
      its own actions (jm only; the ICLR 2023 paper's JM-3.3.3 is K = 3,
      M = 3).
    jm_push_hidden_state: JM pushes the controller's hidden state itself
      (jm only; needs ``jm_num_stacks * stack_embedding_size ==
      hidden_size``).
    input_lookup: the controller reads its input by row lookup instead of
      a one-hot product (``lstm_step_ids``; lstm, rns and vrns; same
      values, faster for large vocabularies).
    ns_action_init: the NS-RNN's action-layer initialisation, one of
      ``NS_ACTION_INITS`` (ns only): 'uniform' U[-0.1, 0.1] (the authors'
      code), 'xavier' (Xavier uniform, bias 0: the paper's section 5.5).

  Returns:
    A Linen module; ``apply({'params': p}, symbols_BxN)`` gives logits
    ``[B, N, V]`` and ``apply(..., method='trace')`` a dict of internals.

  Raises:
    ValueError: unknown name, non-positive sizes or an unusable dtype.
  """
  if name not in MODEL_NAMES:
    raise ValueError(
        f'unknown model {name!r}; valid models: {", ".join(MODEL_NAMES)}')
  check_stack_table(stack_table)
  stack_batch_chunk = _check_auto_or_positive_int('stack_batch_chunk',
                                                  stack_batch_chunk)
  vocab_size = _check_positive_int('vocab_size', vocab_size)
  hidden_size = _check_positive_int('hidden_size', hidden_size)
  num_states = _check_positive_int('num_states', num_states)
  num_stack_symbols = _check_positive_int('num_stack_symbols',
                                          num_stack_symbols)
  stack_embedding_size = _check_positive_int('stack_embedding_size',
                                             stack_embedding_size)
  try:
    np_dtype = np.dtype(dtype)
  except TypeError as e:
    raise ValueError(f'dtype must be a floating dtype, got {dtype!r}') from e
  if np_dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
    raise ValueError(f'dtype must be float32 or float64, got {np_dtype}')
  if np_dtype == np.float64 and not jax.config.jax_enable_x64:
    raise ValueError('dtype float64 needs jax_enable_x64 (e.g. '
                     '`with jax.enable_x64(True):` or JAX_ENABLE_X64=1)')
  scan_unroll = (_check_auto_or_positive_int('scan_unroll', scan_unroll)
                 or auto_scan_unroll(name))
  if scan_unroll > 1 and (name == 'vrns' or (name == 'rns' and stack_window)):
    raise ValueError(f'scan_unroll must be 1 for {name!r}'
                     f'{" with a window" if name == "rns" else ""} (its '
                     f'scans are not unrolled), got {scan_unroll}')
  check_stack_variant_supported(name, stack_window, truncation_length,
                                stack_bottom)
  if not isinstance(input_lookup, (bool, np.bool_)):
    raise ValueError(f'input_lookup must be True or False, got '
                     f'{input_lookup!r}')
  if ns_action_init not in NS_ACTION_INITS:
    raise ValueError(f'ns_action_init must be one of '
                     f'{", ".join(NS_ACTION_INITS)}, got {ns_action_init!r}')
  if ns_action_init != 'uniform' and name != 'ns':
    raise ValueError(f'ns_action_init applies to model \'ns\' only (got '
                     f'{name!r})')
  if input_lookup and name not in INPUT_LOOKUP_MODELS:
    raise ValueError(f'input_lookup applies to models '
                     f'{", ".join(INPUT_LOOKUP_MODELS)} (got {name!r})')
  common = dict(vocab_size=vocab_size, hidden_size=hidden_size,
                dtype=np_dtype.type,
                matmul_precision=ns_stack.check_precision(matmul_precision),
                input_lookup=bool(input_lookup))
  if name != 'vrns':
    common['scan_unroll'] = scan_unroll
  if not can_run_table(name, stack_table):
    if name in ('rns', 'vrns'):
      raise ValueError(f'stack_table {stack_table!r} does not apply to model '
                       f'{name}; use ' + ' or '.join(map(repr, RNS_TABLES)))
    raise ValueError(f'stack_table {stack_table!r} applies to models ns, '
                     f'rns and vrns only (model {name!r})')
  if name == 'lstm':
    return LSTMLM(**common)
  if name == 'jm':
    jm_num_stacks = _check_positive_int('jm_num_stacks', jm_num_stacks)
    if not isinstance(jm_push_hidden_state, (bool, np.bool_)):
      raise ValueError('jm_push_hidden_state must be True or False, got '
                       f'{jm_push_hidden_state!r}')
    if (jm_push_hidden_state
        and jm_num_stacks * stack_embedding_size != hidden_size):
      raise ValueError(
          'jm_push_hidden_state pushes the hidden state, so jm_num_stacks * '
          'stack_embedding_size must equal hidden_size (got '
          f'{jm_num_stacks} * {stack_embedding_size} != {hidden_size})')
    return JMLM(stack_embedding_size=stack_embedding_size,
                num_stacks=jm_num_stacks,
                push_hidden_state=bool(jm_push_hidden_state), **common)
  if name == 'gref':
    return GrefLM(stack_embedding_size=stack_embedding_size, **common)
  if name == 'rns':
    rns_stack.validate_stack_config(dict(
        stack_normalize=stack_normalize, stack_reading=stack_reading,
        stack_bottom=stack_bottom, stack_window=stack_window,
        truncation_length=truncation_length))
    return RNSLM(num_states=num_states, num_stack_symbols=num_stack_symbols,
                 normalize=bool(stack_normalize), reading=stack_reading,
                 bottom=stack_bottom, window=int(stack_window),
                 truncation_length=int(truncation_length),
                 table=stack_table, **common)
  if name == 'vrns':
    from nsrnn_jax import vrns_model  # pylint: disable=g-import-not-at-top
    rns_stack.validate_stack_config(dict(
        stack_window=stack_window, truncation_length=truncation_length))
    return vrns_model.make(
        num_states=num_states, num_stack_symbols=num_stack_symbols,
        stack_vector_size=stack_vector_size,
        stack_bottom_vector=stack_bottom_vector,
        broadcast_bottom_vector=broadcast_bottom_vector,
        stack_window=int(stack_window),
        truncation_length=int(truncation_length), stack_table=stack_table,
        **common)
  return NSLM(num_states=num_states, num_stack_symbols=num_stack_symbols,
              table=stack_table, batch_chunk=stack_batch_chunk,
              action_init=ns_action_init, **common)


def build(config, vocab_size: int | None = None) -> nn.Module:
  """Builds the model named by a flat config.

  Reads ``model``, ``hidden_size``, ``num_states``, ``num_stack_symbols``,
  ``stack_embedding_size``, ``matmul_precision``, ``stack_table`` and the
  stack-variant fields (missing fields take the paper's defaults; a config
  stored before ``stack_table`` existed gets the exact 'shares' table,
  which computes the same function).
  ``vocab_size`` defaults to ``config.vocab_size`` if present, else to the
  vocabulary of ``config.task`` from :mod:`nsrnn_jax.languages`; with
  ``config.predict_eos`` the model gets one more symbol, EOS = V.
  """
  def field(name, default):
    try:
      return config[name]
    except (KeyError, AttributeError, TypeError):
      return getattr(config, name, default)

  model = field('model', None)
  if model is None:
    raise ValueError('config has no field `model`; valid models: '
                     f'{", ".join(MODEL_NAMES)}')
  if vocab_size is None:
    vocab_size = field('vocab_size', None)
  if vocab_size is None:
    task = field('task', None)
    if task is None:
      raise ValueError('vocab_size not given and config has neither '
                       '`vocab_size` nor `task`')
    from nsrnn_jax import languages  # pylint: disable=g-import-not-at-top
    vocab_size = languages.get(task).vocab_size
  if field('predict_eos', False):
    # EOS is output V (and an input slot that is never set: the ICLR 2022
    # one-hot layout, rns-vrns-reference.md §1.3); train.eos_id.
    vocab_size += 1
  return get(model, vocab_size,
             hidden_size=field('hidden_size', 20),
             num_states=field('num_states', 2),
             num_stack_symbols=field('num_stack_symbols', 2),
             stack_embedding_size=field('stack_embedding_size', 20),
             dtype=field('dtype', jnp.float32),
             matmul_precision=field('matmul_precision', 'highest'),
             stack_normalize=field('stack_normalize', False),
             stack_reading=field('stack_reading', 'state'),
             stack_bottom=field('stack_bottom', 'fixed'),
             stack_window=field('stack_window', 0),
             truncation_length=field('truncation_length', 0),
             stack_vector_size=field('stack_vector_size', 3),
             stack_bottom_vector=field('stack_bottom_vector', 'learned'),
             broadcast_bottom_vector=field('broadcast_bottom_vector', False),
             stack_table=field('stack_table', DEFAULT_NS_TABLE),
             stack_batch_chunk=field('stack_batch_chunk', 0),
             scan_unroll=field('scan_unroll', 0),
             jm_num_stacks=field('jm_num_stacks', 1),
             jm_push_hidden_state=field('jm_push_hidden_state', False),
             input_lookup=field('input_lookup', False),
             ns_action_init=field('ns_action_init', 'uniform'))


def init_params(model: nn.Module, rng: jax.Array) -> dict[str, Any]:
  """Initial parameters of ``model`` without running a forward pass.

  Equal to ``model.init(rng, symbols_BxN)['params']`` for any symbols.
  """
  return model.init(rng, method='declare_params')['params']


def sequence_log_prob(logits_BxNxV: jax.Array, symbols_BxN: jax.Array,
                      mask_BxN: jax.Array | None = None) -> jax.Array:
  """Per-string log-likelihood ``sum_t mask[b, t] log p(w_t | w_<t)``.

  Args:
    logits_BxNxV: model output.
    symbols_BxN: the scored strings (same ids that were fed).
    mask_BxN: optional 0/1 weights (1 = real symbol, 0 = padding).

  Returns:
    ``[B]`` natural-log probabilities.
  """
  if np.ndim(logits_BxNxV) != 3 or np.ndim(symbols_BxN) != 2:
    raise ValueError(
        'expected logits [B, N, V] and symbols [B, N], got shapes '
        f'{np.shape(logits_BxNxV)} and {np.shape(symbols_BxN)}')
  if tuple(np.shape(logits_BxNxV)[:2]) != tuple(np.shape(symbols_BxN)):
    raise ValueError(
        f'logits shape {np.shape(logits_BxNxV)} does not match symbols shape '
        f'{np.shape(symbols_BxN)}')
  if mask_BxN is not None and tuple(np.shape(mask_BxN)) != tuple(
      np.shape(symbols_BxN)):
    raise ValueError(f'mask shape {np.shape(mask_BxN)} does not match '
                     f'symbols shape {np.shape(symbols_BxN)}')
  if np.shape(symbols_BxN)[1]:
    # Ids outside [0, V) (checked where concrete): take_along_axis would
    # read -1 as the last symbol, and >= V as NaN.
    symbols_BxN = _check_symbols(symbols_BxN, np.shape(logits_BxNxV)[2])
  if mask_BxN is not None and not isinstance(mask_BxN, jax.core.Tracer):
    mask = np.asarray(mask_BxN)
    if not np.isin(mask, (0, 1)).all():
      raise ValueError('mask must hold 0/1 weights (1 = real symbol)')
  log_p_BxNxV = jax.nn.log_softmax(logits_BxNxV, axis=-1)
  log_p_BxN = jnp.take_along_axis(
      log_p_BxNxV, jnp.asarray(symbols_BxN)[..., None], axis=-1)[..., 0]
  if mask_BxN is not None:
    # where, not multiply: a masked -inf must not turn into NaN.
    log_p_BxN = jnp.where(jnp.asarray(mask_BxN) > 0,
                          log_p_BxN * jnp.asarray(mask_BxN, log_p_BxN.dtype),
                          0.0)
  return jnp.sum(log_p_BxN, axis=-1)
