"""Tests of nsrnn_jax.train and the loop it runs: loss, schedule, steps,
end-to-end, resume, workdir safety.

The data and (mostly) the model are small stand-ins so the tests do not depend
on other modules' speed: marked-reversal strings with their exact
probabilities, and a tiny causal LSTM language model.
"""

import json
import math
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from nsrnn_jax import checkpointing
from nsrnn_jax import data
from nsrnn_jax import train
from nsrnn_jax import workdir_lock


# ---------------------------------------------------------------------------
# Stand-ins.
# ---------------------------------------------------------------------------


class TinyLM(nn.Module):
  """Causal LM: LSTM over one-hot w_1..w_{n-1}, logits from h_0 = 0 .. h_{n-1}."""
  vocab_size: int = 3
  hidden_size: int = 8

  @nn.compact
  def __call__(self, symbols_BxN):
    x_BxNxV = jax.nn.one_hot(symbols_BxN, self.vocab_size)
    # Shift right so that position t only sees symbols before t.
    x_BxNxV = jnp.pad(x_BxNxV[:, :-1], ((0, 0), (1, 0), (0, 0)))
    h_BxNxH = nn.RNN(nn.OptimizedLSTMCell(self.hidden_size))(x_BxNxV)
    return nn.Dense(self.vocab_size)(h_BxNxH)


class NaNLM(TinyLM):
  """TinyLM whose logits are NaN: the loss is not finite."""

  def __call__(self, symbols_BxN):
    return super().__call__(symbols_BxN) * jnp.nan


class FarOffLM(TinyLM):
  """TinyLM that puts e^-10000 on every symbol but "0": a finite training
  loss (~5,000 nats a symbol) whose perplexity is past float range."""

  def __call__(self, symbols_BxN):
    logits = super().__call__(symbols_BxN)
    return logits.at[..., 0].add(1e4)


# One instance per stand-in, shared by all tests, so that the module-level
# jit caches of train.py are reused across tests.
TINY = TinyLM()


def marked_reversal_batch(rng, length, num):
  """Strings u # reverse(u) with exact ln G(w), ln G(length) (mean length 60)."""
  k = (length - 1) // 2
  half_BxK = rng.integers(0, 2, size=(num, k))
  symbols = np.concatenate(
      [half_BxK, np.full((num, 1), 2), half_BxK[:, ::-1]], axis=1)
  f = 60.0 / 61.0
  length_log_prob = k * math.log(f) + math.log(1.0 - f)
  log_prob = np.full(num, length_log_prob - k * math.log(2.0))
  return data.Batch(symbols.astype(np.int32), log_prob, length_log_prob)


def tiny_splits(seed=0, lengths=(5, 7), num_train=12, num_valid=3,
                batch_size=4, test_lengths=(5, 7, 9)):
  rng = np.random.default_rng(seed)
  pick = lambda: int(rng.choice(lengths))
  train_b = [marked_reversal_batch(rng, pick(), batch_size)
             for _ in range(num_train)]
  valid_b = [marked_reversal_batch(rng, pick(), batch_size)
             for _ in range(num_valid)]
  test_rng = np.random.default_rng(1000 + seed)
  test_b = [marked_reversal_batch(test_rng, n, 6) for n in test_lengths]
  split = lambda b, n: data.Split(b, len(n), min(n), max(n))
  return data.Splits("marked_reversal", ("0", "1", "#"), seed, 1000 + seed,
                     False, split(train_b, lengths), split(valid_b, lengths),
                     split(test_b, test_lengths))


def tiny_config(**overrides):
  config = default.get_config()
  config.batch_size = 4
  config.train_min_length, config.train_max_length = 5, 7
  config.test_min_length, config.test_max_length = 5, 9
  config.max_epochs = 3
  config.learning_rate = 0.02
  config.progress_bar = False
  config.length_buckets = (8, 12)
  for k, v in overrides.items():
    config[k] = v
  return config


def restore_arrays(workdir, model, config):
  state = train.create_train_state(config, jax.random.key(0), model)
  manager = checkpointing.make_manager(os.path.join(workdir, "checkpoints"))
  step, arrays, host = checkpointing.restore_latest(manager, state.arrays())
  checkpointing.close(manager)
  return step, arrays, host


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
  """One uninterrupted 4-epoch run on `tiny_splits()`: (result, workdir).

  The resume tests compare their interrupted-and-resumed runs against it;
  they only read its workdir.
  """
  workdir = str(tmp_path_factory.mktemp("reference") / "full")
  result = train.train_and_evaluate(tiny_config(max_epochs=4), workdir,
                                    splits=tiny_splits(), model=TINY)
  return result, workdir


# ---------------------------------------------------------------------------
# Loss.
# ---------------------------------------------------------------------------


def test_loss_is_sum_over_positions_mean_over_batch():
  rng = np.random.default_rng(0)
  logits_BxNxV = rng.normal(size=(3, 5, 4)).astype(np.float32)
  symbols_BxN = rng.integers(0, 4, size=(3, 5)).astype(np.int32)
  apply_fn = lambda variables, s: jnp.asarray(logits_BxNxV)
  batch = train.make_batch(symbols_BxN)
  loss = train.loss_fn({}, apply_fn, batch)
  # NumPy oracle: log-softmax by hand.
  log_z = np.log(np.sum(np.exp(logits_BxNxV.astype(np.float64)), axis=-1))
  picked = np.take_along_axis(logits_BxNxV.astype(np.float64),
                              symbols_BxN[..., None], axis=-1)[..., 0]
  expected = np.sum(log_z - picked) / 3.0
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5)


def test_masked_padding_gives_the_same_loss_and_gradient():
  model = TinyLM()
  symbols = np.random.default_rng(1).integers(0, 3, (4, 7)).astype(np.int32)
  params = model.init(jax.random.key(0), symbols)["params"]
  grad_fn = jax.jit(jax.value_and_grad(train.loss_fn), static_argnums=1)
  loss, grads = grad_fn(params, model.apply, train.make_batch(symbols))
  loss_p, grads_p = grad_fn(params, model.apply,
                            train.make_batch(symbols, padded_to=12))
  np.testing.assert_allclose(float(loss_p), float(loss), rtol=1e-6)
  for g, gp in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_p)):
    np.testing.assert_allclose(gp, g, rtol=1e-5, atol=1e-7)


def test_make_batch_with_eos():
  symbols = np.asarray([[0, 1, 2], [2, 2, 0]], np.int32)
  got = train.make_batch(symbols, padded_to=5, eos=3)
  np.testing.assert_array_equal(got["symbols"], [[0, 1, 2, 3, 0, 0],
                                                 [2, 2, 0, 3, 0, 0]])
  np.testing.assert_array_equal(got["mask"], [[1, 1, 1, 1, 0, 0]] * 2)
  # The default (CoNLL 2020) path is unchanged.
  plain = train.make_batch(symbols, padded_to=5)
  np.testing.assert_array_equal(plain["symbols"], [[0, 1, 2, 0, 0],
                                                   [2, 2, 0, 0, 0]])
  np.testing.assert_array_equal(plain["mask"], [[1, 1, 1, 0, 0]] * 2)


def test_eos_loss_adds_the_eos_term_at_position_n():
  # Fixed logits [B, N + 1, V + 1]: the loss is the hand-computed CE of the
  # n symbols plus -log p(EOS) at position n.
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(2, 5, 4))
  symbols = rng.integers(0, 3, size=(2, 4)).astype(np.int32)
  apply_fn = lambda variables, s: jnp.asarray(logits, jnp.float32)
  loss = train.loss_fn({}, apply_fn, train.make_batch(symbols, eos=3))
  log_p = logits - np.log(np.sum(np.exp(logits), -1, keepdims=True))
  targets = np.concatenate([symbols, np.full((2, 1), 3)], axis=1)
  expected = -np.sum(np.take_along_axis(log_p, targets[..., None], -1)) / 2
  np.testing.assert_allclose(float(loss), expected, rtol=1e-6)


@pytest.mark.parametrize("name", ["lstm", "jm", "gref", "ns", "rns", "vrns"])
def test_predict_eos_for_every_model(name):
  # models.build gives V + 1 outputs; eval_step's nll is the CE of w_1..w_n
  # and EOS, each predicted from the symbols before it only (the oracle
  # feeds a different symbol after w_n: no logit may change).
  from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
  config = default.get_config()
  config.task, config.model, config.hidden_size = "marked_reversal", name, 4
  assert models.build(config).vocab_size == 3
  config.predict_eos = True
  model = models.build(config)
  assert model.vocab_size == 4 and train.eos_id(config, model) == 3
  symbols = np.asarray([[0, 1, 2, 1, 0], [1, 1, 2, 1, 1]], np.int32)
  params = models.init_params(model, jax.random.key(1))
  sums = train.eval_step(params, train.make_batch(symbols, eos=3),
                         apply_fn=model.apply)
  other = np.concatenate([symbols, np.zeros((2, 1), np.int32)], axis=1)
  logits = np.asarray(model.apply({"params": params}, other), np.float64)
  log_p = logits - np.log(np.sum(np.exp(logits), -1, keepdims=True))
  targets = np.concatenate([symbols, np.full((2, 1), 3)], axis=1)
  want = -np.sum(np.take_along_axis(log_p, targets[..., None], -1)[..., 0],
                 axis=1)
  np.testing.assert_allclose(sums["nll"], want, rtol=1e-5)
  np.testing.assert_array_equal(sums["num_tokens"], [6, 6])


def test_predict_eos_must_be_a_bool():
  # E.g. a config.json edited by hand (ConfigDict itself keeps the type).
  import ml_collections  # pylint: disable=g-import-not-at-top
  config = ml_collections.ConfigDict({**tiny_config().to_dict(),
                                      "predict_eos": 1})
  with pytest.raises(ValueError, match="predict_eos") as e:
    train.validate_config(config)
  assert "\n" not in str(e.value)


def test_lengths_whose_exact_length_table_takes_hours_are_refused():
  """The length table sums one term per (binary rule, length, split point):
  R·n(n−1)/2 from scratch; marked reversal has R = 4 binary rules."""
  from nsrnn_jax import languages  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import pcfg  # pylint: disable=g-import-not-at-top
  fresh = pcfg.CompiledPCFG(languages.get("marked_reversal").compiled.grammar)
  assert len(fresh.bin_prob) == 4
  limit = languages.MAX_LENGTH_TABLE_WORK
  # 316,228 · 316,227 = 99,999,831,756 <= 2·limit/4 = 10^11 < 316,229 ·
  # 316,228 = 100,000,464,212.
  assert fresh.length_table_work(316_228) == 2 * 99_999_831_756 <= limit
  assert fresh.length_table_work(316_229) == 2 * 100_000_464_212 > limit
  fresh.log_length_table(50)  # computed lengths cost nothing again
  assert fresh.length_table_work(50) == 0
  assert fresh.length_table_work(60) == 4 * (60 * 59 - 50 * 49) // 2
  config = tiny_config()
  config.task, config.test_max_length = "marked_reversal", 400_000
  with pytest.raises(ValueError, match=r"config.test_max_length is 400,000: "
                     r"the exact length table of marked_reversal up to it "
                     r"sums ~3.2e\+11 terms .* lengths up to 316,228 are "
                     r"supported") as e:
    train.validate_config(config)
  assert "\n" not in str(e.value)


def test_stack_batch_chunk_must_be_a_non_negative_int():
  for bad in (-1, 2.5, True):
    config = tiny_config()
    config.model, config.stack_batch_chunk = "ns", 0
    # Assigned after creation: ConfigDict keeps the field's type otherwise.
    config = config.to_dict()
    config["stack_batch_chunk"] = bad
    import ml_collections  # pylint: disable=g-import-not-at-top
    with pytest.raises(ValueError, match="stack_batch_chunk") as e:
      train.validate_config(ml_collections.ConfigDict(config))
    assert "\n" not in str(e.value)


def test_state_too_large_for_memory_is_refused_before_allocating(
    monkeypatch):
  """The training state is five copies of the parameters (parameters, best
  parameters, Adam's two moments, a gradient) of 4 bytes, plus a few
  scalars: refused one byte below 20 bytes per parameter, accepted with
  room for the scalars; per CPU device, and per model of a vmapped grid."""
  from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import parallel  # pylint: disable=g-import-not-at-top
  config = tiny_config()
  model = models.build(config)
  num_params = sum(x.size for x in jax.tree.leaves(
      models.init_params(model, jax.random.key(0))))
  mesh = parallel.make_mesh()
  devices = len(jax.local_devices())
  for num_models in (1, 3):
    need = 20 * num_params * num_models * devices
    monkeypatch.setattr(parallel, "device_memory_bytes",
                        lambda device=None, m=need: m - 1)
    with pytest.raises(ValueError, match=f"the model has {num_params:,} "
                       "parameters") as e:
      train.check_state_fits_memory(config, model, num_models, mesh)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(parallel, "device_memory_bytes",
                        lambda device=None, m=need: m + 4096 * num_models)
    train.check_state_fits_memory(config, model, num_models, mesh)
  # A runtime that does not say how much memory it has: no check.
  monkeypatch.setattr(parallel, "device_memory_bytes", lambda device=None: None)
  train.check_state_fits_memory(config, model, 1, mesh)


def test_padded_length_buckets():
  config = tiny_config(compile_strategy="bucket")
  assert [train.padded_length(n, config) for n in (2, 8, 9, 12)] == [
      8, 8, 12, 12]
  with pytest.raises(ValueError, match="length_buckets"):
    train.padded_length(13, config)
  assert train.padded_length(13, tiny_config()) == 13


# ---------------------------------------------------------------------------
# Epoch-end schedule (PyTorch ReduceLROnPlateau + early stopping).
# ---------------------------------------------------------------------------


def _run_schedule(metrics, **overrides):
  config = tiny_config(learning_rate=1.0, max_epochs=200, **overrides)
  state = train.create_train_state(config, jax.random.key(0), TINY)
  end = jax.jit(train.end_of_epoch)
  lrs, stopped = [], []
  for m in metrics:
    state = end(state, m)
    lrs.append(float(train.learning_rate(state)))
    stopped.append(bool(state.stopped))
  return state, lrs, stopped


def test_plateau_decays_on_sixth_bad_epoch_and_stops_on_eleventh():
  # Epoch 1 sets the best; epochs 2.. are all worse.
  state, lrs, stopped = _run_schedule([5.0] + [8.0] * 13)
  # Bad epochs 1..5 (epochs 2-6) keep the LR; the 6th (epoch 7) decays it.
  np.testing.assert_allclose(lrs[:6], [1.0] * 6)
  np.testing.assert_allclose(lrs[6:12], [0.9] * 6, rtol=1e-6)
  # Early stopping: 11th bad epoch is epoch 12.
  assert stopped.index(True) == 11
  assert int(state.epoch) == 12 and int(state.best_epoch) == 1
  # A stopped state no longer changes (epochs 13, 14 ignored).
  assert lrs[12:] == [lrs[11]] * 2
  np.testing.assert_allclose(float(state.best_metric), 5.0)


def test_relative_threshold_vs_strict_early_stopping():
  # Tiny improvements (< 1e-4 relative) reset early stopping but not the
  # plateau counter, as in PyTorch.
  metrics = [5.0, 4.9999, 4.9998, 4.9997, 4.9996, 4.99958, 4.99956, 4.99954]
  state, lrs, stopped = _run_schedule(metrics)
  np.testing.assert_allclose(lrs[:6], [1.0] * 6)
  np.testing.assert_allclose(lrs[6], 0.9, rtol=1e-6)  # 6th plateau-bad epoch
  assert int(state.bad_epochs) == 0 and int(state.best_epoch) == 8
  assert not any(stopped)


def _reference_schedule(metrics, patience=5, factor=0.9, threshold=1e-4,
                        stop_patience=10):
  """Plain-Python transcription of torch ReduceLROnPlateau + the authors'
  early stopping loop; returns (lrs, stop_epoch or None, best_epoch)."""
  lr, best, bad = 1.0, math.inf, 0
  es_best, es_bad, best_epoch = math.inf, 0, 0
  lrs = []
  for epoch, m in enumerate(metrics, start=1):
    if m < es_best:
      es_best, es_bad, best_epoch = m, 0, epoch
    else:
      es_bad += 1
    if m < best * (1 - threshold):
      best, bad = m, 0
    else:
      bad += 1
    if bad > patience:
      lr, bad = lr * factor, 0
    lrs.append(lr)
    if es_bad > stop_patience:
      return lrs, epoch, best_epoch
  return lrs, None, best_epoch


def test_schedule_matches_reference_on_random_sequences():
  rng = np.random.default_rng(3)
  for _ in range(3):
    # A slowly improving, noisy metric produces decays and a late stop.
    metrics = list(3.0 + 0.5 * np.exp(-np.arange(60) / 8.0)
                   + 0.02 * rng.random(60))
    metrics = [float(np.float32(m)) for m in metrics]
    ref_lrs, ref_stop, ref_best = _reference_schedule(metrics)
    state, lrs, stopped = _run_schedule(metrics)
    n = len(ref_lrs)
    np.testing.assert_allclose(lrs[:n], ref_lrs, rtol=1e-5)
    got_stop = stopped.index(True) + 1 if any(stopped) else None
    assert got_stop == ref_stop
    assert int(state.best_epoch) == ref_best


def test_max_epochs_stops():
  config = tiny_config(max_epochs=2)
  state = train.create_train_state(config, jax.random.key(0), TINY)
  state = train.end_of_epoch(state, 3.0)
  assert not bool(state.stopped)
  state = train.end_of_epoch(state, 2.0)
  assert bool(state.stopped)


def test_end_of_epoch_vmaps_over_models():
  config = tiny_config(learning_rate=1.0, max_epochs=200)
  model = TINY  # one model: states must share their static fields
  states = [train.create_train_state(config, jax.random.key(k), model)
            for k in range(2)]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
  seqs = [[5.0] + [8.0] * 11, [5.0 - 0.1 * i for i in range(12)]]
  end = jax.jit(jax.vmap(train.end_of_epoch))
  for t in range(12):
    stacked = end(stacked, jnp.asarray([seqs[0][t], seqs[1][t]]))
  assert stacked.stopped.tolist() == [True, False]
  np.testing.assert_allclose(stacked.opt_state.hyperparams["learning_rate"],
                             [0.9, 1.0], rtol=1e-6)


def test_stopped_state_train_step_is_a_no_op():
  config = tiny_config()
  model = TINY
  state = train.create_train_state(config, jax.random.key(0), model)
  state = state.replace(stopped=jnp.asarray(True))
  batch = train.make_batch(tiny_splits().train[0].symbols)
  new_state, m = jax.jit(train.train_step)(state, batch)
  assert np.isfinite(float(m["loss"]))
  # The loss reported is still the batch's at the (unchanged) parameters:
  # NumPy log-softmax of the model's logits, summed over positions, mean
  # over the strings.
  logits = np.asarray(TINY.apply({"params": state.params}, batch["symbols"]),
                      np.float64)
  log_z = np.log(np.sum(np.exp(logits), -1))
  picked = np.take_along_axis(logits, batch["symbols"][..., None], -1)[..., 0]
  want = np.sum((log_z - picked) * batch["mask"]) / len(logits)
  np.testing.assert_allclose(float(m["loss"]), want, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(state.arrays()),
                  jax.tree.leaves(new_state.arrays())):
    np.testing.assert_array_equal(a, b)


def _numpy_adam(params, grad_fn, batches, lr, clip_norm, b1=0.9, b2=0.999,
                eps=1e-8):
  """Hand-written clip-by-global-norm + Adam in float64 (clip_norm=None: off)."""
  p = [np.asarray(x, np.float64) for x in params]
  m = [np.zeros_like(x) for x in p]
  v = [np.zeros_like(x) for x in p]
  for t, batch in enumerate(batches, start=1):
    g = [np.asarray(x, np.float64) for x in grad_fn(p, batch)]
    norm = math.sqrt(sum(float(np.sum(x ** 2)) for x in g))
    if clip_norm is not None and norm > clip_norm:
      g = [x * clip_norm / norm for x in g]
    m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
    v = [b2 * vi + (1 - b2) * gi ** 2 for vi, gi in zip(v, g)]
    p = [pi - lr * (mi / (1 - b1 ** t)) / (np.sqrt(vi / (1 - b2 ** t)) + eps)
         for pi, mi, vi in zip(p, m, v)]
  return p


def test_train_step_matches_hand_written_clipped_adam():
  # After the first step Adam's update depends on the ratio of successive
  # gradients, so clipping (active at every step here: the gradient norm is
  # well above 0.5) changes the parameters; a missing clip fails the test.
  config = tiny_config(learning_rate=0.05, clip_norm=0.5)
  state = train.create_train_state(config, jax.random.key(0), TINY)
  splits = tiny_splits()
  batches = [train.make_batch(splits.train[i].symbols) for i in (0, 1, 2, 3)]
  treedef = jax.tree.structure(state.params)
  grad = jax.jit(jax.grad(train.loss_fn), static_argnums=1)

  def grad_fn(leaves, batch):
    params = jax.tree.unflatten(treedef, [jnp.asarray(x, jnp.float32)
                                          for x in leaves])
    return jax.tree.leaves(grad(params, TINY.apply, batch))

  step = jax.jit(train.train_step)
  norms = []
  for batch in batches:
    state, m = step(state, batch)
    norms.append(float(m["grad_norm"]))
  assert min(norms) > 1.0  # the clip is active at every step
  start = jax.tree.leaves(train.create_train_state(
      config, jax.random.key(0), TINY).params)
  clipped = _numpy_adam(start, grad_fn, batches, 0.05, 0.5)
  unclipped = _numpy_adam(start, grad_fn, batches, 0.05, None)
  got = [np.asarray(x, np.float64) for x in jax.tree.leaves(state.params)]
  gap = max(float(np.max(np.abs(c - u))) for c, u in zip(clipped, unclipped))
  err = max(float(np.max(np.abs(g - c))) for g, c in zip(got, clipped))
  assert err < 1e-4 < gap, (err, gap)


# ---------------------------------------------------------------------------
# End to end.
# ---------------------------------------------------------------------------


def test_train_and_evaluate_end_to_end(tmp_path):
  config = tiny_config(max_epochs=4)
  splits = tiny_splits()
  results = train.train_and_evaluate(config, str(tmp_path), splits=splits,
                                     model=TINY)
  assert results["finished"] and results["epochs"] == 4
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  per_epoch = [r for r in records if "train_loss" in r]
  assert per_epoch == records  # one line per epoch, no summary lines
  assert [r["epoch"] for r in per_epoch] == [1, 2, 3, 4]
  # The loss falls.
  assert per_epoch[-1]["train_loss"] < per_epoch[0]["train_loss"] - 0.5
  assert per_epoch[-1]["valid_ce_diff"] < per_epoch[0]["valid_ce_diff"]
  # The CE difference agrees with the perplexities it is made of.
  for r in per_epoch:
    np.testing.assert_allclose(
        r["valid_ce_diff"], math.log(r["valid_perplexity"])
        - math.log(r["valid_lower_bound_perplexity"]), rtol=1e-9, atol=1e-12)
  # The validation lower bound includes ln N_L: recompute it by hand.
  bound = sum(float(np.sum(-b.log_prob + b.length_log_prob + math.log(2)))
              for b in splits.valid)
  tokens = sum(b.symbols.size for b in splits.valid)
  np.testing.assert_allclose(per_epoch[0]["valid_lower_bound_perplexity"],
                             math.exp(bound / tokens), rtol=1e-12)
  table = json.load(open(tmp_path / "test_by_length.json"))
  assert table["lengths"] == [5, 7, 9]
  # Per-length test bound includes ln N_L,test (3 lengths) by default.
  b5 = splits.test[0]
  expected = math.exp(float(np.mean(-b5.log_prob + b5.length_log_prob
                                    + math.log(3))) / 5)
  np.testing.assert_allclose(table["lower_bound_perplexity"][0], expected,
                             rtol=1e-12)
  csv_lines = open(tmp_path / "test_by_length.csv").read().splitlines()
  assert csv_lines[0].startswith("lengths,ce_diff") and len(csv_lines) == 4
  saved = json.load(open(tmp_path / "results.json"))
  assert saved["best_epoch"] == results["best_epoch"]
  assert json.load(open(tmp_path / "config.json"))["alphabet"] == [
      "0", "1", "#"]
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path))


def test_train_and_evaluate_with_eos(tmp_path):
  # The ICLR 2022/2023 protocol: EOS predicted, bounds over |w| + 1 symbols,
  # per-length test bound without ln N_L.
  config = tiny_config(max_epochs=1, predict_eos=True,
                       test_bound_includes_num_lengths=False)
  splits = tiny_splits()
  train.train_and_evaluate(config, str(tmp_path), splits=splits,
                           model=TinyLM(vocab_size=4))
  record = json.loads(open(tmp_path / "metrics.jsonl").readline())
  bound = sum(float(np.sum(-b.log_prob + b.length_log_prob + math.log(2)))
              for b in splits.valid)
  tokens = sum(b.symbols.size + len(b) for b in splits.valid)
  np.testing.assert_allclose(record["valid_lower_bound_perplexity"],
                             math.exp(bound / tokens), rtol=1e-12)
  table = json.load(open(tmp_path / "test_by_length.json"))
  for length, ppl, b in zip(table["lengths"],
                            table["lower_bound_perplexity"], splits.test):
    assert b.length == length
    np.testing.assert_allclose(
        ppl, math.exp(float(np.mean(-b.log_prob + b.length_log_prob))
                      / (length + 1)), rtol=1e-12)


def test_test_bound_flag_shifts_by_log_num_lengths(tmp_path):
  config = tiny_config(max_epochs=1)
  splits = tiny_splits()
  train.train_and_evaluate(config, str(tmp_path / "a"), splits=splits,
                           model=TINY)
  config.test_bound_includes_num_lengths = False
  train.train_and_evaluate(config, str(tmp_path / "b"), splits=splits,
                           model=TINY)
  a = json.load(open(tmp_path / "a" / "test_by_length.json"))
  b = json.load(open(tmp_path / "b" / "test_by_length.json"))
  shift = np.asarray(b["ce_diff"]) - np.asarray(a["ce_diff"])
  np.testing.assert_allclose(shift, math.log(3) / np.asarray(a["lengths"]),
                             rtol=1e-9)


def test_resume_after_interrupt_is_exact(tmp_path, reference_run):
  splits = tiny_splits()
  full, full_dir = reference_run
  part = train.train_and_evaluate(
      tiny_config(max_epochs=4, stop_after_epochs=2), str(tmp_path / "part"),
      splits=splits, model=TINY)
  assert not part["finished"] and part["epochs"] == 2
  resumed = train.train_and_evaluate(tiny_config(max_epochs=4),
                                     str(tmp_path / "part"), splits=splits,
                                     model=TINY)
  assert resumed == full
  config = tiny_config()
  _, a, host_a = restore_arrays(full_dir, TINY, config)
  _, b, host_b = restore_arrays(str(tmp_path / "part"), TINY, config)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert host_a == host_b


def test_corrupt_latest_checkpoint_falls_back(tmp_path, caplog, reference_run):
  splits = tiny_splits()
  workdir = str(tmp_path / "run")
  full, _ = reference_run
  train.train_and_evaluate(tiny_config(max_epochs=4, stop_after_epochs=3),
                           workdir, splits=splits, model=TINY)
  ckpt = os.path.join(workdir, "checkpoints")
  assert sorted(os.listdir(ckpt)) == ["2", "3"]
  # Corrupt every data file of the latest checkpoint.
  for root, _, files in os.walk(os.path.join(ckpt, "3", "state")):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"garbage")
  # And leave a partial (never finalised) save behind, as a crash would.
  os.makedirs(os.path.join(ckpt, "4.orbax-checkpoint-tmp-123", "state"))
  with caplog.at_level("WARNING"):
    resumed = train.train_and_evaluate(tiny_config(max_epochs=4), workdir,
                                       splits=splits, model=TINY)
  assert any("Unreadable" in r.getMessage() for r in caplog.records)
  assert resumed == full
  # Moved aside, not deleted.
  aside = os.path.join(workdir, checkpointing.UNREADABLE_DIR)
  assert os.listdir(aside) == ["3"]
  assert os.listdir(os.path.join(aside, "3", "state"))


def _snapshot(directory):
  """Every file under `directory` with its bytes."""
  out = {}
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, directory)] = f.read()
  return out


def test_config_change_is_an_error_and_touches_nothing(tmp_path):
  workdir = str(tmp_path)
  train.train_and_evaluate(tiny_config(max_epochs=2), workdir,
                           splits=tiny_splits(), model=TINY)
  before = _snapshot(workdir)
  with pytest.raises(ValueError, match=r"different config: clip_norm \(stored "
                     r"5.0, requested 1.0\); hidden_size \(stored 20, "
                     r"requested 21\)\. Use a new --workdir"):
    train.train_and_evaluate(tiny_config(max_epochs=2, hidden_size=21,
                                         clip_norm=1.0), workdir,
                             splits=tiny_splits(), model=TINY)
  assert _snapshot(workdir) == before
  # Fields that do not change the run may differ.
  again = train.train_and_evaluate(
      tiny_config(max_epochs=2, progress_bar=True, checkpoints_to_keep=3),
      workdir, splits=tiny_splits(), model=TINY)
  assert again["finished"] and again["epochs"] == 2


def test_a_run_that_never_started_may_be_reconfigured(tmp_path):
  # A first invocation that failed before its first epoch (out of memory,
  # say) left only config.json: the corrected config replaces it.
  workdir = str(tmp_path)
  checkpointing.write_config(workdir, train.config_to_json(
      tiny_config(max_epochs=2, hidden_size=21)))
  done = train.train_and_evaluate(tiny_config(max_epochs=2), workdir,
                                  splits=tiny_splits(), model=TINY)
  assert done["finished"]
  assert checkpointing.read_config(workdir)["hidden_size"] == 20


def test_no_readable_checkpoint_is_an_error_not_a_restart(tmp_path):
  workdir = str(tmp_path)
  train.train_and_evaluate(tiny_config(max_epochs=2), workdir,
                           splits=tiny_splits(), model=TINY)
  ckpt = os.path.join(workdir, "checkpoints")
  for root, _, files in os.walk(ckpt):
    for name in files:
      if root.endswith("state") or "ocdbt" in root:
        with open(os.path.join(root, name), "wb") as f:
          f.write(b"garbage")
  before = _snapshot(workdir)
  with pytest.raises(ValueError, match="no readable checkpoint"):
    train.train_and_evaluate(tiny_config(max_epochs=2), workdir,
                             splits=tiny_splits(), model=TINY)
  assert _snapshot(workdir) == before


def test_resume_truncates_metrics_and_keeps_one_tensorboard_history(
    tmp_path, reference_run):
  splits = tiny_splits()
  full, full_dir = reference_run
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(tiny_config(max_epochs=4), workdir, splits=splits,
                           model=TINY)
  # A kill after epoch 4's record but before its checkpoint was finalised.
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.rmtree(os.path.join(workdir, "checkpoints", "4"))
  os.remove(os.path.join(workdir, "results.json"))
  resumed = train.train_and_evaluate(tiny_config(max_epochs=4), workdir,
                                     splits=splits, model=TINY)
  assert resumed == full
  records = [json.loads(l) for l in open(os.path.join(workdir,
                                                      "metrics.jsonl"))]
  want = [json.loads(l)
          for l in open(os.path.join(full_dir, "metrics.jsonl"))]
  assert [r["epoch"] for r in records] == [1, 2, 3, 4]
  for r, w in zip(records, want):
    assert r["train_loss"] == w["train_loss"]
  events = [f for f in os.listdir(workdir) if f.startswith("events.out")]
  assert len(events) == 1
  # A fresh run in a directory with a stale metrics file starts it anew.
  stale = str(tmp_path / "stale")
  os.makedirs(stale)
  with open(os.path.join(stale, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"epoch": 7, "train_loss": 1.0}) + "\n")
  train.train_and_evaluate(tiny_config(max_epochs=1), stale, splits=splits,
                           model=TINY)
  assert [json.loads(l)["epoch"] for l in open(
      os.path.join(stale, "metrics.jsonl"))] == [1]


def test_kill_right_after_a_checkpoint_keeps_every_epoch_record(
    tmp_path, monkeypatch, reference_run):
  splits = tiny_splits()
  full, _ = reference_run
  workdir = str(tmp_path / "run")
  real_save = checkpointing.save

  def save_then_die(manager, step, state, host):
    real_save(manager, step, state, host)
    if step == 3:
      raise KeyboardInterrupt("killed right after checkpoint 3")

  monkeypatch.setattr(checkpointing, "save", save_then_die)
  with pytest.raises(KeyboardInterrupt):
    train.train_and_evaluate(tiny_config(max_epochs=4), workdir,
                             splits=splits, model=TINY)
  monkeypatch.setattr(checkpointing, "save", real_save)
  resumed = train.train_and_evaluate(tiny_config(max_epochs=4), workdir,
                                     splits=splits, model=TINY)
  assert resumed == full
  # Epoch 3's record was written before its checkpoint, so the resumed log
  # holds every epoch once.
  records = [json.loads(l) for l in open(os.path.join(workdir,
                                                      "metrics.jsonl"))]
  assert [r["epoch"] for r in records] == [1, 2, 3, 4]


def test_a_log_older_than_the_checkpoints_resumes_where_the_log_ends(
    tmp_path, reference_run):
  # A run directory put together from copies of different times: its
  # metrics.jsonl ends at epoch 2, its newest checkpoint is epoch 3.
  # Resuming from 3 would leave epoch 3 out of the log for good.
  splits = tiny_splits()
  full, full_dir = reference_run
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(tiny_config(max_epochs=4, stop_after_epochs=3),
                           workdir, splits=splits, model=TINY)
  log = os.path.join(workdir, "metrics.jsonl")
  records = [json.loads(l) for l in open(log)]
  with open(log, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records if r["epoch"] <= 2)
  resumed = train.train_and_evaluate(tiny_config(max_epochs=4), workdir,
                                     splits=splits, model=TINY)
  assert resumed == full
  got = [json.loads(l) for l in open(log)]
  want = [json.loads(l)
          for l in open(os.path.join(full_dir, "metrics.jsonl"))]
  assert [r["epoch"] for r in got] == [1, 2, 3, 4]
  assert [r["train_loss"] for r in got] == [r["train_loss"] for r in want]
  # The skipped checkpoint is set aside, not deleted.
  assert os.listdir(os.path.join(workdir, checkpointing.AHEAD_DIR)) == ["3"]
  # A log older than every kept checkpoint (3, 4): an error, nothing changed.
  with open(log, "w") as f:
    f.write(json.dumps(got[0]) + "\n")
  os.remove(os.path.join(workdir, "results.json"))
  _assert_refused_untouched(workdir, splits, r"\(epochs 3, 4\) are newer "
                            r"than the run's metrics.jsonl, which holds "
                            r"epoch 1, ")


def _assert_refused_untouched(workdir, splits, match):
  """Resuming `workdir` (4 tiny epochs) is a ValueError matching `match`
  and changes no file."""
  before = _snapshot(workdir)
  with pytest.raises(ValueError, match=match):
    train.train_and_evaluate(tiny_config(max_epochs=4), workdir,
                             splits=splits, model=TINY)
  assert _snapshot(workdir) == before


def test_a_log_without_its_checkpoints_is_an_error_not_a_restart(tmp_path):
  # checkpoints/ deleted (or emptied) after 2 checkpointed epochs: starting
  # again would silently overwrite the log of the epochs run so far.
  splits = tiny_splits()
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(tiny_config(max_epochs=4, stop_after_epochs=2),
                           workdir, splits=splits, model=TINY)
  shutil.rmtree(os.path.join(workdir, "checkpoints"))
  _assert_refused_untouched(workdir, splits, r"metrics.jsonl holds epochs "
                            r"1-2 but there is no checkpoint in .*nothing "
                            r"was changed")
  # With a checkpoint every 2 epochs, a log of 1 epoch has none to lose.
  workdir = str(tmp_path / "one")
  train.train_and_evaluate(
      tiny_config(max_epochs=4, stop_after_epochs=1,
                  checkpoint_every_epochs=2), workdir, splits=splits,
      model=TINY)
  assert train.train_and_evaluate(
      tiny_config(max_epochs=4, checkpoint_every_epochs=2), workdir,
      splits=splits, model=TINY)["finished"]


def test_should_stop_saves_and_resumes_exactly(tmp_path):
  splits = tiny_splits()
  config = tiny_config(max_epochs=4, checkpoint_every_epochs=3)
  full = train.train_and_evaluate(config, str(tmp_path / "full"),
                                  splits=splits, model=TINY)
  workdir = str(tmp_path / "run")
  part = train.train_and_evaluate(config, workdir, splits=splits, model=TINY,
                                  should_stop=lambda: True)
  assert not part["finished"] and part["epochs"] == 1
  # Epoch 1 is not a checkpoint epoch, but stopping saved it.
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["1"]
  assert not os.path.exists(os.path.join(workdir, "results.json"))
  assert train.train_and_evaluate(config, workdir, splits=splits,
                                  model=TINY) == full


def test_non_finite_loss_raises(tmp_path):
  config = tiny_config(max_epochs=2)
  with pytest.raises(FloatingPointError,
                     match=r"non-finite training loss .* in epoch 1, step 1 "
                     f"of run {tmp_path}"):
    train.train_and_evaluate(config, str(tmp_path),
                             splits=tiny_splits(lengths=(5,)),
                             model=NaNLM())


def test_a_validation_perplexity_past_float_range_raises(tmp_path):
  # Such a model never beats the initial best (inf): without the check the
  # run went on to "finish" and reported its initial parameters.
  config = tiny_config(max_epochs=2)
  with pytest.raises(FloatingPointError,
                     match=r"non-finite validation perplexity \(inf; "
                     r"cross-entropy [0-9.e+]+ nats per symbol\) in epoch 1 "
                     f"of run {tmp_path}: training diverged"):
    train.train_and_evaluate(config, str(tmp_path),
                             splits=tiny_splits(lengths=(5,)),
                             model=FarOffLM())
  assert not os.path.exists(os.path.join(tmp_path, "results.json"))


def test_bucket_strategy_trains_like_per_length(tmp_path):
  splits = tiny_splits()
  a = train.train_and_evaluate(tiny_config(max_epochs=1), str(tmp_path / "a"),
                               splits=splits, model=TINY)
  b = train.train_and_evaluate(
      tiny_config(max_epochs=1, compile_strategy="bucket"),
      str(tmp_path / "b"), splits=splits, model=TINY)
  for key in ("best_valid_perplexity", "test_ce_diff"):
    np.testing.assert_allclose(a[key], b[key], rtol=1e-4)


_TWO_DEVICE_SCRIPT = r"""
import json, sys
import jax
sys.path.insert(0, {repo!r})
from nsrnn_jax import parallel
parallel.use_cpu_devices(2)  # what main.py's --cpu_devices=2 does
from tests import train_test as t
from nsrnn_jax import models, train
assert jax.device_count() == 2
model = models.get("lstm", vocab_size=3, hidden_size=6)
r = train.train_and_evaluate(t.tiny_config(max_epochs=1), sys.argv[1],
                             splits=t.tiny_splits(lengths=(5,)), model=model)
print("RESULT" + json.dumps(r))
"""


def test_first_line_names_the_runtime_and_the_ns_stack_table(
    tmp_path, capsys):
  # The line reports the config's field (not the default here); the tiny
  # stand-in model keeps the run cheap.
  table = "scaled"
  train.train_and_evaluate(
      tiny_config(model="ns", max_epochs=1, run_test=False,
                  stack_table=table),
      str(tmp_path / "run"), splits=tiny_splits(lengths=(5,)), model=TINY)
  first = capsys.readouterr().err.splitlines()[0]
  assert first.startswith(f"runtime: backend {jax.default_backend()}")
  assert first.endswith(f"; matmul precision highest; NS stack table {table}")


def test_two_devices_match_one_device(tmp_path):
  """Batch sharded over a 2-device mesh: same results as one device."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
      [sys.executable, "-c", _TWO_DEVICE_SCRIPT.format(repo=repo),
       str(tmp_path / "two")], cwd=repo, env=env, capture_output=True,
      text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  two = json.loads(proc.stdout.split("RESULT")[-1])
  model = models.get("lstm", vocab_size=3, hidden_size=6)
  one = train.train_and_evaluate(tiny_config(max_epochs=1),
                                 str(tmp_path / "one"),
                                 splits=tiny_splits(lengths=(5,)), model=model)
  assert one.keys() == two.keys()
  for key, value in one.items():
    np.testing.assert_allclose(two[key], value, rtol=1e-4, err_msg=key)


def test_a_second_process_cannot_train_in_a_busy_workdir(tmp_path):
  # Another live process holds the run directory: training refuses with one
  # line and writes no checkpoint; the holder's lock stays.
  import socket  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  holder = subprocess.Popen([sys.executable, "-c",
                             "import time; time.sleep(120)"])
  try:
    lock = os.path.join(workdir, workdir_lock.LOCK_FILE)
    with open(lock, "w") as f:
      json.dump({"pid": holder.pid, "host": socket.gethostname()}, f)
    config = tiny_config(model="lstm", max_epochs=1)
    with pytest.raises(ValueError, match="in use by process") as info:
      train.train_and_evaluate(config, workdir, splits=tiny_splits())
    assert "\n" not in str(info.value)
    with open(lock) as f:
      assert json.load(f)["pid"] == holder.pid
    assert not os.path.exists(os.path.join(workdir, "checkpoints"))
  finally:
    holder.kill()
    holder.wait()
  # Once the holder is gone, the same call trains (its lock is stale).
  results = train.train_and_evaluate(config, workdir, splits=tiny_splits())
  assert results["finished"] and not os.path.exists(lock)
