"""Tests of nsrnn_jax.evaluate: loading, scoring, re-evaluation, errors."""

import itertools
import json
import math
import os
import shutil
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from configs import default
from nsrnn_jax import data
from nsrnn_jax import evaluate
from nsrnn_jax import loop
from nsrnn_jax import models
from nsrnn_jax import parallel
from nsrnn_jax import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batch(rng, length, num):
  k = (length - 1) // 2
  half = rng.integers(0, 2, size=(num, k))
  symbols = np.concatenate([half, np.full((num, 1), 2), half[:, ::-1]], 1)
  llp = k * math.log(60 / 61) + math.log(1 / 61)
  return data.Batch(symbols.astype(np.int32),
                         np.full(num, llp - k * math.log(2)), llp)


def _splits():
  rng = np.random.default_rng(0)
  return data.Splits(
      "marked_reversal", ("0", "1", "#"), 0, 0, False,
      train=data.Split([_batch(rng, 5, 4) for _ in range(6)], 1, 5, 5),
      valid=data.Split([_batch(rng, 5, 4) for _ in range(2)], 1, 5, 5),
      test=data.Split([_batch(rng, n, 5) for n in (5, 7)], 2, 5, 7))


def _config():
  c = default.get_config()
  c.model, c.hidden_size = "lstm", 6
  c.batch_size, c.max_epochs, c.learning_rate = 4, 2, 0.02
  c.train_min_length, c.train_max_length = 5, 5
  c.test_min_length, c.test_max_length = 5, 7
  c.progress_bar = False
  return c


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("run"))
  config = _config()
  model = models.build(config, vocab_size=3)
  train.train_and_evaluate(config, path, splits=_splits(), model=model)
  return path


@pytest.fixture(scope="module")
def loaded(workdir):
  return evaluate.load_model(workdir)


def test_scores_of_all_strings_of_a_length_sum_to_one(loaded):
  # No EOS: the model's probabilities of all length-4 strings sum to 1.
  strings = ["".join(p) for p in itertools.product("01#", repeat=4)]
  scores = evaluate.score(loaded, strings)
  np.testing.assert_allclose(np.sum(np.exp(scores)), 1.0, rtol=1e-5)
  assert np.all(scores < 0)


def test_score_matches_model_log_softmax(loaded):
  symbols = np.array([[0, 1, 2, 1, 0]], np.int32)
  logits = np.asarray(loaded.model.apply({"params": loaded.params}, symbols),
                      np.float64)[0]
  log_p = logits - np.log(np.sum(np.exp(logits), -1, keepdims=True))
  expected = sum(log_p[t, s] for t, s in enumerate(symbols[0]))
  got = evaluate.score(loaded, ["01#10", ["0", "1"], list("01#10"),
                                "0 1 # 1 0"])
  np.testing.assert_allclose(got[[0, 2, 3]], [expected] * 3, rtol=1e-5)
  assert got.shape == (4,)
  # ["0", "1"] is the string 01: its log-probability from the model's
  # logits on that string alone.
  logits01 = np.asarray(loaded.model.apply({"params": loaded.params},
                                           symbols[:, :2]), np.float64)[0]
  log_p01 = logits01 - np.log(np.sum(np.exp(logits01), -1, keepdims=True))
  np.testing.assert_allclose(got[1], log_p01[0, 0] + log_p01[1, 1],
                             rtol=1e-5)


def test_best_params_are_restored(workdir, loaded):
  results = json.load(open(os.path.join(workdir, "results.json")))
  splits = _splits()
  params_K = jax.tree.map(lambda x: np.asarray(x)[None], loaded.params)
  (sums,) = loop.evaluate_split(params_K, loaded.model.apply, [splits.valid],
                                loaded.config, [1], parallel.make_mesh())
  np.testing.assert_allclose(loop.summarize(sums)["perplexity"],
                             results["best_valid_perplexity"], rtol=1e-5)


def test_unknown_symbol_is_a_clear_error(loaded):
  with pytest.raises(ValueError, match=r"symbols \['x'\] are not in the "
                     r"alphabet \(string 1\) \('0', '1', '#'\)"):
    evaluate.score(loaded, ["01#10", "0x"])
  with pytest.raises(ValueError, match=r"symbols \[\['0'\]\] are not in"):
    evaluate.score(loaded, [["0", ["0"]]])
  with pytest.raises(ValueError, match="string 0 is empty"):
    evaluate.score(loaded, [""])
  for bad in (None, 7):
    with pytest.raises(ValueError, match=f"string 1 is {bad!r}; expected a "
                       "string of symbols or a list of symbols"):
      evaluate.score(loaded, ["01#10", bad])


def _snapshot(directory):
  out = {}
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      out[path] = open(path, "rb").read()
  return out


def test_reevaluate_reproduces_test_table(workdir, tmp_path):
  saved = json.load(open(os.path.join(workdir, "test_by_length.json")))
  before = _snapshot(workdir)
  out = str(tmp_path / "out")
  result = evaluate.reevaluate(workdir, splits=_splits(), out=out)
  assert result["table"]["lengths"] == saved["lengths"] == [5, 7]
  np.testing.assert_allclose(result["table"]["ce_diff"], saved["ce_diff"],
                             rtol=1e-9)
  assert json.load(open(os.path.join(out, "test_by_length.json"))) == (
      result["table"])
  # With --out elsewhere the workdir is not written at all.
  assert _snapshot(workdir) == before
  # An unusable output is an error before any work.
  (tmp_path / "file").write_text("")
  with pytest.raises(ValueError, match="output directory .* is a file"):
    evaluate.reevaluate(workdir, splits=_splits(), out=str(tmp_path / "file"))


def test_reevaluation_past_the_mapping_limit_drops_programs_between_lengths(
    workdir, tmp_path, monkeypatch):
  # Many test lengths are many programs: past its mapping share the
  # re-evaluation drops them before each new length, with the same table.
  saved = json.load(open(os.path.join(workdir, "test_by_length.json")))
  drops = []
  drop = loop.drop_compiled_programs
  monkeypatch.setattr(loop, "drop_compiled_programs",
                      lambda: drops.append(1) or drop())
  monkeypatch.setattr(loop, "many_memory_mappings", lambda f=None: True)
  result = evaluate.reevaluate(workdir, splits=_splits(),
                               out=str(tmp_path / "out"))
  assert len(drops) == 1     # before the second of its two lengths
  np.testing.assert_allclose(result["table"]["ce_diff"], saved["ce_diff"],
                             rtol=1e-9)


def test_missing_or_broken_workdir_errors(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    evaluate.load_model(str(tmp_path / "nope"))
  (tmp_path / "file").write_text("")
  with pytest.raises(ValueError, match="is a file, not a directory"):
    evaluate.load_model(str(tmp_path / "file"))
  with pytest.raises(ValueError, match="no config.json"):
    evaluate.load_model(str(tmp_path))
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match="unreadable"):
    evaluate.load_model(str(tmp_path))


def test_cli_missing_workdir_one_line_error(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "nsrnn_jax.evaluate",
       f"--workdir={tmp_path}/missing"], cwd=REPO, capture_output=True,
      text=True, timeout=120)
  assert proc.returncode == 2
  assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_score_takes_a_path_like_workdir_and_refuses_other_things(workdir,
                                                                   loaded):
  import pathlib  # pylint: disable=g-import-not-at-top
  np.testing.assert_array_equal(
      evaluate.score(pathlib.Path(workdir), ["01#10"]),
      evaluate.score(loaded, ["01#10"]))
  for bad in (None, (1, 2)):
    with pytest.raises(TypeError, match="score takes a workdir path"):
      evaluate.score(bad, ["01#10"])


def test_a_config_edited_after_training_is_named_in_one_line(workdir,
                                                            tmp_path):
  # The checkpoints are readable but hold other shapes than config.json now
  # describes: said so (not "no readable checkpoint"), without the ~1,200
  # lines Orbax's abandoned reads printed at exit, and nothing is moved.
  copy = str(tmp_path / "run")
  shutil.copytree(workdir, copy)
  path = os.path.join(copy, "config.json")
  with open(path) as f:
    config = json.load(f)
  config["hidden_size"] += 1
  with open(path, "w") as f:
    json.dump(config, f)
  before = sorted(os.listdir(os.path.join(copy, "checkpoints")))
  proc = subprocess.run(
      [sys.executable, "-m", "nsrnn_jax.evaluate", f"--workdir={copy}",
       f"--out={tmp_path / 'table'}"], capture_output=True, text=True,
      timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr[-3000:]
  assert "hold a model of other shapes" in lines[0]
  assert "was config.json edited after training?" in lines[0]
  assert sorted(os.listdir(os.path.join(copy, "checkpoints"))) == before


def test_a_run_re_evaluates_on_the_exact_log_table(tmp_path):
  # A tiny NS run re-evaluated on log_stack: the same test table (the
  # tables compute the same function), written where --out says.
  path = str(tmp_path / "ns")
  config = _config()
  config.model, config.max_epochs = "ns", 1
  train.train_and_evaluate(config, path, splits=_splits(),
                           model=models.build(config, vocab_size=3))
  saved = json.load(open(os.path.join(path, "test_by_length.json")))
  result = evaluate.reevaluate(path, splits=_splits(),
                               out=str(tmp_path / "out"), stack_table="log")
  assert evaluate.load_model(path, stack_table="log").model.table == "log"
  # The same without reading the workdir again: same parameters, same scores.
  on_log = evaluate.on_table(evaluate.load_model(path), "log")
  assert on_log.model.table == "log" and on_log.config.stack_table == "log"
  np.testing.assert_allclose(
      evaluate.score(on_log, ["01#10", "110#011"]),
      evaluate.score(evaluate.load_model(path, stack_table="log"),
                     ["01#10", "110#011"]), rtol=1e-6)
  np.testing.assert_allclose(result["table"]["ce_diff"], saved["ce_diff"],
                             rtol=1e-5, atol=1e-6)
  # The share table's margin on the test strings: every one proven exact
  # (a small model on short strings), the summary's and each length's
  # minimum that of stack_margins on the same strings, fed as text.
  checked = evaluate.reevaluate(path, splits=_splits(),
                                out=str(tmp_path / "out2"), stack_margin=True)
  summary = checked["summary"]
  strings = ["".join("01#"[i] for i in row)
             for b in _splits().test.batches for row in b.symbols]
  margins = evaluate.stack_margins(path, strings)
  assert summary["test_stack_margin"] == pytest.approx(margins.min(), rel=1e-6)
  assert evaluate.exact_margin(path) < margins.min() < 0
  assert summary["test_stack_exact_fraction"] == 1.0
  assert summary["test_stack_unproven_strings"] == 0
  assert summary["test_stack_unproven_max_error"] == 0.0
  by_length = {}
  for text, m in zip(strings, margins):
    by_length[len(text)] = min(m, by_length.get(len(text), np.inf))
  assert checked["table"]["lengths"] == sorted(by_length)
  np.testing.assert_allclose(checked["table"]["stack_margin"],
                             [by_length[n] for n in sorted(by_length)],
                             rtol=1e-6)
  with pytest.raises(ValueError, match="'shares' table, not 'log'"):
    evaluate.reevaluate(path, splits=_splits(), out=str(tmp_path / "out3"),
                        stack_table="log", stack_margin=True)
  with pytest.raises(ValueError, match="'shares' table, not 'log'"):
    evaluate.stack_margins(evaluate.load_model(path, stack_table="log"),
                           strings)
  # score(exact=True): float64 scores of the same parameters, on the share
  # table where its float64 margin proves it exact (here all), else on the
  # float64 log table (an action layer 700 times sharper: margins -420 to
  # -500).
  loaded = evaluate.load_model(path)
  sharp = evaluate.Loaded(loaded.model, dict(loaded.params, action={
      k: v * 700.0 for k, v in loaded.params["action"].items()}),
                          loaded.config)
  with jax.enable_x64(True):
    def float64(run, table):
      config = ml_collections.ConfigDict(dict(run.config.to_dict(),
                                              dtype="float64",
                                              stack_table=table))
      return evaluate.Loaded(
          models.build(config, vocab_size=3),
          jax.tree.map(lambda a: np.asarray(a, np.float64), run.params),
          config)
    assert np.all(evaluate.stack_margins(float64(loaded, "shares"), strings)
                  > evaluate.exact_margin(float64(loaded, "shares")))
    assert np.all(evaluate.stack_margins(float64(sharp, "shares"), strings)
                  < evaluate.exact_margin(float64(sharp, "shares")))
    want = evaluate.score(float64(loaded, "shares"), strings)
    want_sharp = evaluate.score(float64(sharp, "log"), strings)
  got = evaluate.score(loaded, strings, exact=True)
  np.testing.assert_allclose(got, want, rtol=1e-12)
  assert np.abs(got - evaluate.score(loaded, strings)).max() > 0
  # Float64 to the last step: a cross-entropy in float32 (as it once was)
  # left every score a float32 number.
  assert np.any(got != got.astype(np.float32).astype(np.float64))
  np.testing.assert_allclose(evaluate.score(sharp, strings, exact=True),
                             want_sharp, rtol=1e-12)
  # As `unproven_errors` scores: each string padded to its length bucket
  # (config.length_buckets) in batches of config.batch_size rows, empty rows
  # filling the last; the float64 margins, masked to each string, still
  # send the sharp run to the log table.
  batches = evaluate._batches(loaded, strings, bucketed=True)[1]  # pylint: disable=protected-access
  assert {b["symbols"].shape for _, b in batches} == {
      (loaded.config.batch_size, loaded.config.length_buckets[0])}
  assert sorted(k for ks, _ in batches for k in ks if k >= 0) == list(
      range(len(strings)))
  for run, want_run in ((loaded, want), (sharp, want_sharp)):
    np.testing.assert_allclose(
        evaluate._float64_scores(run, strings, bucketed=True),  # pylint: disable=protected-access
        want_run, rtol=1e-12)
  # The strings whose float32 margin does not prove them exact are scored
  # again in float64: their count and the largest difference (an action
  # layer 60 times sharper: margins ~ -36 at length 5, proven, and ~ -43 at
  # length 7, not).
  medium = evaluate.Loaded(loaded.model, dict(loaded.params, action={
      k: v * 60.0 for k, v in loaded.params["action"].items()}), loaded.config)
  split = _splits().test
  results = loop.evaluate_split(
      evaluate._stacked(medium.params), medium.model.apply, [split],  # pylint: disable=protected-access
      medium.config, [None], parallel.make_mesh(), None, stack_margin=True)[0]
  unproven = [w for w, m in zip(strings,
                                evaluate.stack_margins(medium, strings))
              if m <= evaluate.exact_margin(medium)]
  assert 0 < len(unproven) < len(strings)
  errors = evaluate.unproven_errors(medium, split, results)
  assert errors["test_stack_unproven_strings"] == len(unproven)
  assert errors["test_stack_unproven_max_error"] < 1e-5  # nothing lost here
  # The run's ln p of one unproven string 0.25 off, and of a proven one 1.0
  # off: only the first is checked, and found.
  for r in results:
    bad = np.flatnonzero(r["stack_margins"] <= evaluate.exact_margin(medium))
    good = np.flatnonzero(r["stack_margins"] > evaluate.exact_margin(medium))
    r["string_nlls"] = r["string_nlls"].copy()
    r["string_nlls"][bad[:1]] += 0.25
    r["string_nlls"][good[:1]] += 1.0
  errors = evaluate.unproven_errors(medium, split, results)
  assert errors["test_stack_unproven_max_error"] == pytest.approx(0.25,
                                                                  abs=1e-5)


def test_stack_margins_of_a_run_without_a_share_stack_is_a_clear_error(
    workdir, tmp_path):
  with pytest.raises(ValueError, match="not to LSTMLM"):
    evaluate.stack_margins(workdir, ["01#10"])
  with pytest.raises(ValueError, match="not to LSTMLM"):
    evaluate.reevaluate(workdir, splits=_splits(), out=str(tmp_path),
                        stack_margin=True)
  with pytest.raises(TypeError, match="stack_margins takes a workdir path"):
    evaluate.stack_margins(None, ["01#10"])
  proc = subprocess.run(
      [sys.executable, "-m", "nsrnn_jax.evaluate", f"--workdir={workdir}",
       f"--out={tmp_path / 'cli'}", "--stack_margin"], capture_output=True,
      text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [
      "error: stack_margins applies to the share table of ns, rns and "
      "vrns, not to LSTMLM"]


def test_a_table_the_run_cannot_use_is_a_clear_error(workdir):
  with pytest.raises(ValueError, match="stack_table 'log' applies to models "
                     "ns, rns and vrns only"):
    evaluate.load_model(workdir, stack_table="log")
  with pytest.raises(ValueError, match="stack_table 'log' applies to models "
                     "ns, rns and vrns only"):
    evaluate.on_table(evaluate.load_model(workdir), "log")


@pytest.mark.parametrize("field,value,message", [
    ("compile_strategy", "bogus", "config.compile_strategy"),
    ("test_strings_per_length", 0,
     "config.test_strings_per_length must be >= 1 (got 0)"),
    ("stack_vector_size", 0, "config.stack_vector_size is 0 but applies to "
     "model 'vrns' only")])
def test_a_damaged_stored_config_is_named_before_anything_runs(
    workdir, tmp_path, field, value, message):
  # A config.json edited by hand: its field, not a batch size it implies
  # (test_strings_per_length is the test's batch) or silence.
  copy = str(tmp_path / "run")
  shutil.copytree(workdir, copy)
  path = os.path.join(copy, "config.json")
  with open(path) as f:
    config = json.load(f)
  config[field] = value
  with open(path, "w") as f:
    json.dump(config, f)
  with pytest.raises(ValueError) as info:
    evaluate.load_model(copy)
  assert str(info.value).startswith(f"{path}: ") and message in str(
      info.value) and "\n" not in str(info.value)
