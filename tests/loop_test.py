"""Tests of nsrnn_jax.loop beyond train_test's end-to-end runs: the test
uses the best epoch's parameters, compilation happens once per shape, and a
non-finite loss stops every run at once with the run named."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from nsrnn_jax import data
from nsrnn_jax import grid
from nsrnn_jax import loop
from nsrnn_jax import parallel
from nsrnn_jax import train
from train_test import NaNLM, TinyLM, TINY, restore_arrays, tiny_config, tiny_splits  # pylint: disable=g-multiple-import


def test_best_epoch_parameters_are_tested_when_the_last_epoch_is_worse(
    tmp_path):
  # With this (too large) learning rate epoch 4 is the best and epoch 5 is
  # clearly worse (validation perplexity 2.03 vs 2.51).
  config = tiny_config(max_epochs=5, learning_rate=0.6)
  splits = tiny_splits()
  results = train.train_and_evaluate(config, str(tmp_path), splits=splits,
                                     model=TINY)
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert results["best_epoch"] == 4 and results["epochs"] == 5
  best, last = records[3], records[4]
  assert last["valid_perplexity"] > 1.1 * best["valid_perplexity"]
  assert results["best_valid_perplexity"] == pytest.approx(
      best["valid_perplexity"], rel=1e-6)
  # The saved test table is that of the best parameters, not the last.
  _, arrays, _ = restore_arrays(str(tmp_path), TINY, config)
  tables = {}
  for key in ("params", "best_params"):
    params_K = jax.tree.map(lambda x: np.asarray(x)[None], arrays[key])
    (results_k,) = loop.evaluate_split(
        params_K, TINY.apply, [splits.test], config,
        [splits.test.num_lengths], parallel.make_mesh())
    tables[key] = loop.test_outputs(results_k, config)[0]["ce_diff"]
  saved = json.load(open(tmp_path / "test_by_length.json"))["ce_diff"]
  np.testing.assert_allclose(saved, tables["best_params"], rtol=1e-9)
  assert np.max(np.abs(np.asarray(saved) - tables["params"])) > 1e-3


def test_stack_margins_are_each_unpadded_string_s(tmp_path, capsys,
                                                  monkeypatch):
  """With valid_stack_margin, each epoch's valid_stack_margin (from the
  loop's batches padded to a bucket, the margin masked to each string) is
  the smallest margin of the validation strings each run alone with that
  epoch's parameters, and the fraction proven exact is theirs; the epoch
  line shows both; results.json and the test table hold the best
  parameters' on the validation and test strings (per length), and how far
  the test strings the margin does not prove are from float64."""
  from nsrnn_jax import evaluate  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top
  # Every test string counts as unproven for the float64 check (this tiny
  # model's margins prove them all), which then scores them on the float64
  # 'log' table.
  monkeypatch.setattr(evaluate, "exact_margin", lambda loaded: np.inf)
  model = models.get("ns", 3, hidden_size=3, num_states=2,
                     num_stack_symbols=2)
  config = tiny_config(max_epochs=1, valid_stack_margin=True,
                       learning_rate=0.5)
  assert config.compile_strategy == "per_length"    # scores: 5, 7 and 9
  splits = tiny_splits(num_train=4)
  margin_programs = loop.jitted_margins(parallel.make_mesh())
  before = margin_programs._cache_size()  # pylint: disable=protected-access
  train.train_and_evaluate(config, str(tmp_path), splits=splits, model=model)
  # Margins go to length buckets (8, 12) whatever the compile strategy:
  # one program per bucket and batch size, validation's (4 strings) at 8
  # and the test's (6) at 8 and 12, where the scores compile one per
  # length (5: 5 and 7, then 5, 7 and 9).
  assert margin_programs._cache_size() - before == 3  # pylint: disable=protected-access
  (record,) = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert record["best_epoch"] == 1      # so best_params are epoch 1's too
  _, arrays, _ = restore_arrays(str(tmp_path), model, config)
  margin_fn = jax.jit(lambda p, x: model.apply({"params": p}, x,
                                               method="stack_margin"))
  margins = lambda split: [np.asarray(margin_fn(arrays["best_params"],
                                                b.symbols))
                           for b in split]
  valid = np.concatenate(margins(splits.valid))
  assert {b.symbols.shape[1] for b in splits.valid} == {5, 7}
  exact = rns_stack.exact_margin()
  for got in (record, json.load(open(tmp_path / "results.json"))):
    prefix = "valid_" if got is record else "best_valid_"
    assert got[prefix + "stack_margin"] == pytest.approx(np.min(valid),
                                                         rel=1e-5)
    assert got[prefix + "stack_exact_fraction"] == np.mean(valid > exact)
  assert (f"margin {np.min(valid):.1f} "
          f"({record['valid_stack_exact_fraction']:.0%} exact)"
          in capsys.readouterr().err)
  test = margins(splits.test)
  table = json.load(open(tmp_path / "test_by_length.json"))
  assert table["lengths"] == [5, 7, 9]
  np.testing.assert_allclose(table["stack_margin"],
                             [np.min(m) for m in test], rtol=1e-5)
  assert table["stack_exact_fraction"] == [np.mean(m > exact) for m in test]
  results = json.load(open(tmp_path / "results.json"))
  assert results["test_stack_margin_kind"] == "product"
  assert results["test_stack_margin"] == pytest.approx(
      np.min(np.concatenate(test)), rel=1e-5)
  # The test batches unpadded, in float32 and (a model built from scratch)
  # in float64: the largest difference in ln p is the recorded one.
  lp = lambda m, p, x: np.asarray(jax.jit(
      lambda p, x: models.sequence_log_prob(m.apply({"params": p}, x), x))(
          p, x), np.float64)
  lp32 = np.concatenate([lp(model, arrays["best_params"], b.symbols)
                         for b in splits.test])
  with jax.enable_x64(True):
    model64 = models.get("ns", 3, hidden_size=3, num_states=2,
                         num_stack_symbols=2, dtype="float64")
    params64 = jax.tree.map(lambda a: np.asarray(a, np.float64),
                            arrays["best_params"])
    lp64 = np.concatenate([lp(model64, params64, np.asarray(b.symbols))
                           for b in splits.test])
  assert results["test_stack_unproven_strings"] == len(lp32) == 18
  error = np.max(np.abs(lp32 - lp64))
  assert 0 < results["test_stack_unproven_max_error"] < 1e-5
  assert results["test_stack_unproven_max_error"] == pytest.approx(
      error, abs=1e-6)  # one float32 ulp of ln p ~ -5 is 4.8e-7


@pytest.mark.parametrize("strategy,compiles", [("per_length", 2),
                                               ("bucket", 1)])
def test_train_step_compiles_once_per_length_or_bucket(tmp_path, strategy,
                                                       compiles, monkeypatch):
  # A model of its own, so that its cache entries are new to this test.
  model = TinyLM(hidden_size=3 if strategy == "bucket" else 5)
  # No test phase until the end: it drops every compiled program first.
  config = tiny_config(max_epochs=3, compile_strategy=strategy,
                       run_test=False)
  splits = tiny_splits(lengths=(5, 7))  # buckets (8, 12): both in 8
  steps = loop.jitted_steps(parallel.make_mesh())
  train_before = steps.train._cache_size()  # pylint: disable=protected-access
  end_before = steps.end_of_epoch._cache_size()  # pylint: disable=protected-access
  train.train_and_evaluate(config, str(tmp_path / "a"), splits=splits,
                           model=model)
  assert steps.train._cache_size() - train_before == compiles  # pylint: disable=protected-access
  assert steps.end_of_epoch._cache_size() - end_before == 1  # pylint: disable=protected-access
  # Resuming compiles nothing new either.
  train.train_and_evaluate(tiny_config(max_epochs=3, stop_after_epochs=1,
                                       compile_strategy=strategy,
                                       run_test=False),
                           str(tmp_path / "b"), splits=splits, model=model)
  train.train_and_evaluate(config, str(tmp_path / "b"), splits=splits,
                           model=model)
  assert steps.train._cache_size() - train_before == compiles  # pylint: disable=protected-access
  # A process past a share of its memory-mapping limit (on the CPU each
  # compiled program holds some; Linux allows 65,530) drops its compiled
  # programs before a run's test phase.
  config.run_test = True
  monkeypatch.setattr(loop, "MAPPINGS_FRACTION", 0.0)
  train.train_and_evaluate(config, str(tmp_path / "c"), splits=splits,
                           model=model)
  if loop.many_memory_mappings():    # Linux: /proc tells.
    assert steps.train._cache_size() == 0  # pylint: disable=protected-access


def test_non_finite_loss_in_a_grid_fails_fast_naming_the_run(tmp_path):
  config = tiny_config(max_epochs=2)
  config.grid_learning_rates = (0.01, 0.02)
  config.num_restarts = 1
  splits = [tiny_splits()] * 2
  with pytest.raises(FloatingPointError, match=r"in epoch 1, step 1 of run "
                     r"lr_0.01/restart_0"):
    grid.run_grid(config, str(tmp_path), splits=splits, model=NaNLM())


def test_unusable_splits_are_one_line_errors_before_any_write(tmp_path):
  splits = tiny_splits()
  no_test = dataclasses.replace(splits, test=data.Split([], 0, 5, 9))
  with pytest.raises(ValueError, match="config.run_test is set but run .* "
                     "has no test strings"):
    train.train_and_evaluate(tiny_config(), str(tmp_path / "run"),
                             splits=no_test, model=TINY)
  no_train = dataclasses.replace(splits, train=data.Split([], 0, 5, 7))
  with pytest.raises(ValueError, match="has no train batches"):
    train.train_and_evaluate(tiny_config(), str(tmp_path / "run"),
                             splits=no_train, model=TINY)
  assert not os.path.exists(tmp_path / "run")


# ---------------------------------------------------------------------------
# EOS (config.predict_eos): bounds over |w| + 1 symbols.
# ---------------------------------------------------------------------------


def _ideal_eos_model(lengths, vocab):
  """Brute force: next-symbol log-probabilities (EOS = `vocab`) of the
  sampling distribution p(w) = p(w | l) / N_L with p(w | l) uniform over
  all strings of length l over `vocab` symbols (so a string of one length
  can be the prefix of a longer one and EOS carries information).

  Returns:
    (apply_fn, strings by length): apply_fn(variables, symbols [B, N]) gives
    logits [B, N, V + 1] at each position from the prefix before it.
  """
  import itertools  # pylint: disable=g-import-not-at-top
  prob = {w: float(vocab) ** -n / len(lengths) for n in lengths
          for w in itertools.product(range(vocab), repeat=n)}
  assert abs(sum(prob.values()) - 1) < 1e-12
  base, longest = vocab + 2, max(lengths) + 1
  table = np.full((base ** longest, vocab + 1), -1e4, np.float32)
  prefixes = {w[:t] for w in prob for t in range(len(w) + 1)}
  for pre in prefixes:
    mass = sum(p for w, p in prob.items() if w[:len(pre)] == pre)
    nxt = [sum(p for w, p in prob.items()
               if len(w) > len(pre) and w[:len(pre) + 1] == pre + (x,))
           for x in range(vocab)] + [prob.get(pre, 0.0)]
    code = sum((s + 1) * base ** i for i, s in enumerate(pre))
    table[code] = np.log(np.maximum(np.asarray(nxt) / mass, 1e-300)).clip(-1e4)
  table = jax.numpy.asarray(table)

  def apply_fn(variables, symbols_BxN):
    del variables
    n = symbols_BxN.shape[1]
    digits = (symbols_BxN + 1) * base ** jax.numpy.arange(n)
    code = jax.numpy.cumsum(digits, axis=1) - digits   # prefix before t
    return table[jax.numpy.minimum(code, table.shape[0] - 1)]

  strings = {n: np.asarray([w for w in prob if len(w) == n], np.int32)
             for n in lengths}
  return apply_fn, strings


def test_eos_bound_is_the_cross_entropy_of_the_true_distribution():
  # With EOS, -ln p(w|l) + ln N_L is exactly the CE (over |w| + 1 symbols)
  # of the model that predicts the true next symbol or EOS: the brute-force
  # ideal model scores CE difference 0 through the loop's evaluation.
  lengths, vocab = (2, 3), 2
  apply_fn, strings = _ideal_eos_model(lengths, vocab)
  batches = []
  for n in lengths:
    length_log_prob = -0.5 * n
    log_prob = np.full(len(strings[n]), length_log_prob - n * np.log(2.0))
    batches.append(data.Batch(strings[n], log_prob, length_log_prob))
  split = data.Split(batches, len(lengths), min(lengths), max(lengths))
  config = tiny_config()
  params_K = {"unused": np.zeros((1, 1), np.float32)}
  mesh = parallel.make_mesh()
  with_eos = loop.summarize(loop.evaluate_split(
      params_K, apply_fn, [split], config, [len(lengths)], mesh, eos=vocab)[0])
  bound = sum(float(np.sum(-b.log_prob + b.length_log_prob + np.log(2)))
              for b in batches)
  tokens = sum(b.symbols.size + len(b) for b in batches)   # |w| + 1 each
  np.testing.assert_allclose(with_eos["lower_bound_perplexity"],
                             np.exp(bound / tokens), rtol=1e-12)
  np.testing.assert_allclose(with_eos["ce_diff"], 0.0, atol=2e-6)
  # Without EOS (the CoNLL 2020 path) the same model is not charged for
  # ending a string (ln 2 per length-2 string here), the bound still counts
  # ln N_L, and the denominators are |w|.
  without = loop.summarize(loop.evaluate_split(
      params_K, apply_fn, [split], config, [len(lengths)], mesh)[0])
  plain_tokens = sum(b.symbols.size for b in batches)
  np.testing.assert_allclose(without["lower_bound_perplexity"],
                             np.exp(bound / plain_tokens), rtol=1e-12)
  np.testing.assert_allclose(without["ce_diff"],
                             -len(strings[2]) * np.log(2) / plain_tokens,
                             atol=2e-6)


_TWO_DEVICE_EVAL_SCRIPT = r"""
import sys
sys.path.insert(0, {repo!r})
from nsrnn_jax import parallel
parallel.use_cpu_devices(2)
import jax
import numpy as np
from nsrnn_jax import data, loop, models, train
from tests import train_test as t

# The stack runs on chunks of 2 strings (config.stack_batch_chunk, on by
# default on CPU): under GSPMD, slicing a chunk out of the sharded batch
# inside the scan is what gathered the symbols.
model = models.get("ns", vocab_size=3, hidden_size=6, num_states=3,
                   num_stack_symbols=3, stack_batch_chunk=2)
config = t.tiny_config(model="ns")
params_K = jax.tree.map(lambda x: np.asarray(x)[None], train.create_train_state(
    config, jax.random.key(0), model=model).params)
rng = np.random.default_rng(0)
# 3 strings: the batch is padded to 4 rows, 2 per device.
split = data.Split([t.marked_reversal_batch(rng, 7, 4),
                    t.marked_reversal_batch(rng, 9, 3)], 2, 7, 9)

def scores(mesh):
  on_mesh = jax.device_put(params_K, parallel.model_sharding(mesh))
  return loop.evaluate_split(on_mesh, model.apply, [split], config, [None],
                             mesh)[0]

two, one = parallel.make_mesh(), parallel.make_mesh(num_data=1)
assert two.devices.size == 2 and one.devices.size == 1
for a, b in zip(scores(two), scores(one)):
  assert a["num_strings"] == b["num_strings"] and a["length"] == b["length"]
  for key in ("model_nll", "num_tokens", "num_correct"):
    np.testing.assert_allclose(a[key], b[key], rtol=1e-5)
batch = parallel.put_model_batch(jax.tree.map(
    lambda x: x[None], train.make_batch(split[0].symbols)), two)
text = loop.jitted_eval(two).lower(
    jax.device_put(params_K, parallel.model_sharding(two)), batch,
    apply_fn=model.apply).compile().as_text()
for op in ("all-gather", "all-reduce", "collective-permute", "all-to-all"):
  assert op not in text, op
print("OK")
"""


def test_two_device_evaluation_matches_one_device_without_collectives():
  """Scoring is per string: on 2 CPU devices the evaluation program holds
  no collective (XLA:CPU's in-process all-gather, which GSPMD put in the NS
  scan, deadlocked with a split's programs in flight) and equals 1 device.
  """
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
      [sys.executable, "-c", _TWO_DEVICE_EVAL_SCRIPT.format(repo=repo)],
      cwd=repo, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip().endswith("OK")


def test_epoch_lines_show_the_stack_margin_where_measured():
  record = {"train_loss": 1.0, "valid_perplexity": 2.0, "learning_rate": 0.01,
            "valid_ce_diff": 0.05}
  margin = dict(record, valid_stack_margin=-41.25,
                valid_stack_exact_fraction=0.875)
  one = loop._epoch_line(np.array([3]), {3: margin}, 10, 1, 2.0)  # pylint: disable=protected-access
  assert "ppl 2.0000  margin -41.2 (88% exact)  lr" in one
  # One string of 1,000 not proven is not "100%".
  almost = loop._epoch_line(np.array([3]), {3: dict(  # pylint: disable=protected-access
      margin, valid_stack_exact_fraction=0.999)}, 10, 1, 2.0)
  assert "(99.9% exact)" in almost
  several = loop._epoch_line(  # pylint: disable=protected-access
      np.array([3, 3]), {0: margin, 1: dict(margin, valid_stack_margin=-5.0)},
      10, 2, 2.0)
  assert several.endswith("median 0.0500  margin min -41.2  2.0s"), several
  plain = loop._epoch_line(np.array([3, 3]), {0: record, 1: record}, 10, 2,  # pylint: disable=protected-access
                           2.0)
  assert "margin" not in plain and "margin" not in loop._epoch_line(  # pylint: disable=protected-access
      np.array([3]), {3: record}, 10, 1, 2.0)


def test_program_guard_drops_programs_before_a_new_shape_past_the_limit(
    monkeypatch):
  reads, drops = [], []
  over = {"now": False}
  monkeypatch.setattr(loop, "many_memory_mappings",
                      lambda f: reads.append(f) or over["now"])
  monkeypatch.setattr(loop, "drop_compiled_programs",
                      lambda: drops.append(len(reads)))
  guard = loop.ProgramGuard(0.5)
  guard.before(5)            # the first program: nothing to drop
  guard.before(7)
  guard.before(5)            # already held: no read
  assert reads == [0.5] and drops == [] and guard.seen == {5, 7}
  over["now"] = True
  guard.before(5)            # held: still no read, no drop
  guard.before(9)            # new, past the limit: drop all, then hold 9
  assert reads == [0.5, 0.5] and drops == [2] and guard.seen == {9}
  assert guard.drops == 1


def test_program_guard_warns_once_when_dropped_programs_keep_coming_back(
    monkeypatch, caplog):
  # A run whose programs do not fit drops and reloads them over and over
  # (epochs several times slower): the second drop of a program that was
  # dropped before says so, once, naming the limit and the remedies.
  monkeypatch.setattr(loop, "many_memory_mappings", lambda f: True)
  monkeypatch.setattr(loop, "drop_compiled_programs", lambda: None)
  monkeypatch.setattr(loop, "max_map_count", lambda: 65530)
  guard = loop.ProgramGuard()
  with caplog.at_level("WARNING"):
    guard.before(5)
    guard.before(7)          # drops 5
    guard.before(9)          # drops 7: new programs only, no warning
    assert guard.drops == 2 and not caplog.records
    guard.before(5)          # drops 9; 5 is back
    guard.before(7)          # drops 5 a second time: warns
    guard.before(9)
    guard.before(5)
  assert guard.drops == 6
  warnings = [r.getMessage() for r in caplog.records]
  assert len(warnings) == 1, warnings
  assert "vm.max_map_count = 65530" in warnings[0]
  assert "sysctl -w vm.max_map_count=262144" in warnings[0]
  assert "compile_strategy='bucket'" in warnings[0]


def test_program_guard_drops_a_finished_phase_past_its_lower_share(
    monkeypatch):
  # Programs that are done with go at MAPPINGS_FRACTION; live ones only at
  # the guard's own, higher share.
  reads, drops = [], []
  held = {"share": 0.5}
  monkeypatch.setattr(loop, "many_memory_mappings",
                      lambda f: reads.append(f) or held["share"] > f)
  monkeypatch.setattr(loop, "drop_compiled_programs",
                      lambda: drops.append(1))
  guard = loop.ProgramGuard()
  guard.before(5)
  guard.before(7)            # half the limit: under the live share
  assert not drops
  guard.phase_done()         # over the finished phase's
  assert drops == [1] and not guard.seen
  held["share"] = 0.2
  guard.before(9)            # the first since the drop: no read
  guard.phase_done()         # under both shares
  assert drops == [1] and guard.seen == {9}
  assert reads == [loop.LIVE_MAPPINGS_FRACTION, loop.MAPPINGS_FRACTION,
                   loop.MAPPINGS_FRACTION]
  assert loop.MAPPINGS_FRACTION < loop.LIVE_MAPPINGS_FRACTION


def test_the_test_phase_drops_programs_before_its_new_lengths(
    tmp_path, monkeypatch):
  # The epochs' guard also watches the final evaluations: a process past
  # its live-mapping share only once training is over (the pre-test drop
  # at MAPPINGS_FRACTION not taken) drops its programs before the test's
  # new lengths, and the test's figures are those of a run that keeps them.
  config = tiny_config(max_epochs=1)
  splits = tiny_splits(lengths=(5, 7), test_lengths=(5, 7, 9))
  train.train_and_evaluate(config, str(tmp_path / "kept"), splits=splits,
                           model=TinyLM(hidden_size=4))
  phase = {"testing": False}
  drops = []
  drop = loop.drop_compiled_programs
  monkeypatch.setattr(loop, "drop_compiled_programs",
                      lambda: drops.append(phase["testing"]) or drop())
  test_num_lengths = loop.test_num_lengths
  monkeypatch.setattr(loop, "test_num_lengths", lambda *a: phase.update(
      testing=True) or test_num_lengths(*a))
  # Past the guard's share whenever the test phase has begun (its lengths
  # are counted after the guard's `phase_done`, which so finds no excess).
  monkeypatch.setattr(loop, "many_memory_mappings",
                      lambda f=None: f is not None and phase["testing"])
  train.train_and_evaluate(config, str(tmp_path / "dropped"), splits=splits,
                           model=TinyLM(hidden_size=4))
  # Once: before length 9, the one length training and validation never ran.
  assert drops == [True]

  def tested(name):
    with open(tmp_path / name / "results.json") as f:
      r = json.load(f)
    return {k: v for k, v in r.items() if k.startswith("test_")}
  assert tested("kept") and tested("dropped") == tested("kept")


def test_a_run_that_drops_its_programs_mid_epoch_trains_the_same(
    tmp_path, monkeypatch):
  # Past the mapping limit a run drops its compiled programs before a new
  # batch shape (train or validation) and they come back when next needed:
  # the same losses, epoch by epoch, as a run that keeps them.
  config = tiny_config(max_epochs=2, run_test=False)
  splits = tiny_splits(lengths=(5, 7))
  train.train_and_evaluate(config, str(tmp_path / "kept"), splits=splits,
                           model=TinyLM(hidden_size=4))
  drops = []
  drop = loop.drop_compiled_programs
  monkeypatch.setattr(loop, "drop_compiled_programs",
                      lambda: drops.append(1) or drop())
  monkeypatch.setattr(loop, "many_memory_mappings", lambda f=None: True)
  train.train_and_evaluate(config, str(tmp_path / "dropped"), splits=splits,
                           model=TinyLM(hidden_size=4))
  assert len(drops) >= 3     # train lengths, validation lengths, each epoch

  def losses(name):
    with open(tmp_path / name / "metrics.jsonl") as f:
      rows = [json.loads(line) for line in f]
    return [(r.get("train_loss"), r.get("valid_ce_diff")) for r in rows
            if "train_loss" in r]
  assert losses("kept") and losses("dropped") == losses("kept")
