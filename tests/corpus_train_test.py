"""Tests for nsrnn_jax.corpus_train (the stream training loop).

Also the re-evaluation and scoring API of a corpus run (evaluate.py).

Oracles: the model's whole-row forward (`__call__` on each row of the
stream, no chunks, no carry) for the evaluated perplexity; optax-free
arithmetic (p − lr · g, with g from `jax.grad` of the chunk's mean NLL) for
an SGD step; an uninterrupted run for a resumed one; a single-process run
for a two-process (jax.distributed) one.
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import quick_corpus
from nsrnn_jax import corpus
from nsrnn_jax import corpus_train
from nsrnn_jax import evaluate
from nsrnn_jax import models
from nsrnn_jax import parallel
from nsrnn_jax import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("corpus"))
  corpus.write_synthetic(d, "marked_reversal", (60, 12, 12), 3, 9, seed=5)
  return d


def _config(directory, **overrides):
  config = quick_corpus.get_config()
  config.corpus_dir = directory
  config.model = "lstm"
  config.stack_window = 0  # quick_corpus.py's RNS-RNN has a window
  config.hidden_size = 8
  config.batch_size = 4
  config.bptt_length = 7
  config.max_epochs = 3
  config.progress_bar = False
  for k, v in overrides.items():
    config[k] = v
  return config


def test_evaluated_perplexity_is_the_whole_rows_forward(corpus_dir):
  config = _config(corpus_dir, eval_batch_size=2)
  data = corpus.load(corpus_dir)
  model = models.build(config, vocab_size=len(data.vocab))
  state = corpus_train.create_train_state(config, model, jax.random.key(3))
  mesh = parallel.make_mesh()
  split = corpus_train.SplitStream(data.streams["valid"], 2, 7, mesh)
  programs = corpus_train.Programs(model, mesh, state.params, 4, 2)
  got = corpus_train.evaluate(state.params, programs, split)
  rows = split.rows
  nll = 0.0
  for r in range(2):
    n = int(rows.mask[r].sum())
    tokens = np.concatenate([rows.inputs[r, :n], rows.targets[r, n - 1:n]])
    logits = model.apply({"params": state.params}, tokens[None])[0, 1:]
    row_nll = float(jnp.sum(optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.asarray(tokens[1:]))))
    np.testing.assert_allclose(got["row_nlls"][r], row_nll, rtol=1e-5)
    nll += row_nll
  assert got["num_targets"] == len(data.streams["valid"]) - 1
  np.testing.assert_allclose(got["cross_entropy"], nll / got["num_targets"],
                             rtol=1e-5)
  np.testing.assert_allclose(got["perplexity"],
                             np.exp(nll / got["num_targets"]), rtol=1e-5)


# The VRNS-RNN's stream margins: models_stream_test (the same path).
@pytest.mark.parametrize("model, opts", [
    ("rns", dict(stack_window=3)),
    ("rns", dict(stack_window=2, stack_bottom="frozen"))])
def test_evaluated_stack_margin_is_each_whole_row_s(corpus_dir, model, opts):
  """Each row's margin is `stack_margin` of the row's real tokens at once
  (the last row is padded); perplexity is that of the evaluation without
  margins."""
  config = _config(corpus_dir, model=model, eval_batch_size=3,
                   valid_stack_margin=True, **opts)
  data = corpus.load(corpus_dir)
  model = models.build(config, vocab_size=len(data.vocab))
  state = corpus_train.create_train_state(config, model, jax.random.key(3))
  params = jax.tree.map(lambda p: p * 4, state.params)  # the stack in use
  mesh = parallel.make_mesh()
  split = corpus_train.SplitStream(data.streams["valid"], 3, 7, mesh)
  programs = corpus_train.Programs(model, mesh, params, 4, 3)
  got = corpus_train.evaluate(params, programs, split, stack_margin=True)
  plain = corpus_train.evaluate(params, programs, split)
  assert got["cross_entropy"] == pytest.approx(plain["cross_entropy"],
                                               rel=1e-6)
  rows = split.rows
  assert rows.mask[-1].sum() < rows.mask[0].sum()  # a padded row
  margins = []
  frozen = opts.get("stack_bottom") == "frozen"
  for r in range(3):
    n = int(rows.mask[r].sum())
    # Frozen bottom: the update after the last real input is made too.
    tokens = np.concatenate([rows.inputs[r, :n], rows.targets[r, n - 1:n]])
    margins.append(float(model.apply({"params": params},
                                     tokens[None, :n + 1 if frozen else n],
                                     method="stack_margin")[0]))
  np.testing.assert_allclose(got["stack_margins"], margins, rtol=1e-5)
  assert got["stack_margin"] == min(got["stack_margins"])
  assert got["stack_exact_fraction"] == 1.0  # all above ~-40 nats here
  assert got["stack_margin"] < -1.0
  # The rows a margin does not prove are evaluated again in float64: here
  # rows 0 and 2 marked unproven, row 0's −ln p 0.25 off and proven row 1's
  # 1.0 off: only the first is checked, and found.
  config.vocab_size = len(data.vocab)  # as a run's config.json has it
  loaded = evaluate.Loaded(model, params, config)
  marked = dict(got, stack_margins=np.array([-100.0, 0.0, -100.0]))
  clean = evaluate._unproven_rows(loaded, split, marked, "valid")  # pylint: disable=protected-access
  assert clean == {"valid_stack_unproven_rows": 2,
                   "valid_stack_unproven_max_error": pytest.approx(0, abs=1e-3)}
  marked["row_nlls"] = got["row_nlls"] + np.array([0.25, 1.0, 0.0])
  off = evaluate._unproven_rows(loaded, split, marked, "valid")  # pylint: disable=protected-access
  assert off["valid_stack_unproven_max_error"] == pytest.approx(0.25,
                                                                abs=1e-3)


def test_a_run_records_the_stack_margin(corpus_dir, tmp_path, capsys):
  config = _config(corpus_dir, model="rns", stack_window=3, max_epochs=1,
                   valid_stack_margin=True)
  results = train.train_and_evaluate(config, str(tmp_path / "run"))
  (record,) = [json.loads(l) for l in open(tmp_path / "run" /
                                           "metrics.jsonl")]
  # One epoch: the best parameters are the epoch's.
  assert results["best_valid_stack_margin"] == record["valid_stack_margin"]
  assert (results["best_valid_stack_exact_fraction"]
          == record["valid_stack_exact_fraction"] == 1.0)
  assert -40 < results["test_stack_margin"] < 0
  assert results["test_stack_exact_fraction"] == 1.0
  assert (f"margin {record['valid_stack_margin']:.1f} (100% exact)"
          in capsys.readouterr().err)
  stored = json.load(open(tmp_path / "run" / "results.json"))
  assert stored["test_stack_margin"] == results["test_stack_margin"]
  # Re-evaluation gives the same margins.
  again = evaluate.reevaluate(str(tmp_path / "run"), out=str(tmp_path / "ev"),
                              stack_margin=True)["summary"]
  for key in ("stack_margin", "stack_exact_fraction"):
    assert again[f"test_{key}"] == pytest.approx(results[f"test_{key}"],
                                                 rel=1e-6)
    assert again[f"valid_{key}"] == pytest.approx(
        results[f"best_valid_{key}"], rel=1e-6)
  assert again["test_stack_unproven_rows"] == 0  # all proven: none checked
  assert again["test_stack_unproven_max_error"] == 0.0


def test_sgd_step_is_minus_lr_times_the_mean_token_gradient(corpus_dir):
  config = _config(corpus_dir, learning_rate=0.5, clip_norm=1e6,
                   init_scale=0.3)
  data = corpus.load(corpus_dir)
  model = models.build(config, vocab_size=len(data.vocab))
  state = corpus_train.create_train_state(config, model, jax.random.key(0))
  leaves = jax.tree.leaves(state.params)
  # init_scale: every parameter uniform in [−0.3, 0.3], spread out.
  assert all(float(jnp.max(jnp.abs(x))) <= 0.3 for x in leaves)
  assert max(float(jnp.max(jnp.abs(x))) for x in leaves) > 0.25
  rows = corpus.make_rows(data.streams["train"], 4)
  batch = rows.chunk(0, 7)
  carry = model.apply({"params": state.params}, 4,
                      method="initial_stream_state")

  def mean_nll(p):
    logits, _ = model.apply({"params": p}, batch["inputs"], carry,
                            method="stream")
    ce = optax.softmax_cross_entropy_with_integer_labels(logits,
                                                         batch["targets"])
    return jnp.sum(ce * batch["mask"]) / jnp.sum(batch["mask"])

  grads = jax.jit(jax.grad(mean_nll))(state.params)
  new_state, _, nll, count = jax.jit(corpus_train.train_chunk)(state, batch,
                                                               carry)
  assert int(count) == 28
  np.testing.assert_allclose(float(nll) / 28, mean_nll(state.params),
                             rtol=1e-6)
  for new, old, g in zip(jax.tree.leaves(new_state.params), leaves,
                         jax.tree.leaves(grads)):
    np.testing.assert_allclose(new, old - 0.5 * g, rtol=1e-5, atol=1e-7)


def test_training_learns_and_a_resumed_run_matches(corpus_dir, tmp_path):
  config = _config(corpus_dir)
  whole = train.train_and_evaluate(config, str(tmp_path / "whole"))
  assert whole["finished"] and whole["epochs"] == 3
  log = [json.loads(l) for l in open(tmp_path / "whole" / "metrics.jsonl")]
  assert [r["epoch"] for r in log] == [1, 2, 3]
  assert log[-1]["valid_perplexity"] < log[0]["valid_perplexity"]
  assert all(r["train_tokens_per_second"] > 0 for r in log)
  # A true-distribution bound below every model.
  assert all(r["valid_ce_diff"] > 0 for r in log)
  assert whole["test_ce_diff"] > 0
  stored = json.load(open(tmp_path / "whole" / "config.json"))
  assert stored["vocabulary"] == list(corpus.load(corpus_dir).vocab.tokens)
  assert stored["vocab_size"] == len(stored["vocabulary"])

  # Re-evaluation from the workdir gives the run's own numbers.
  again = evaluate.reevaluate(str(tmp_path / "whole"),
                              out=str(tmp_path / "eval"))["summary"]
  assert again["test_perplexity"] == pytest.approx(whole["test_perplexity"],
                                                   rel=1e-6)
  # A sentence's score is the stream NLL of "<eos> sentence <eos>" read
  # in chunks with the carried state (corpus_train.evaluate).
  loaded = evaluate.load_model(str(tmp_path / "whole"))
  words = "0 1 1 # 1 1 0"
  (got,) = evaluate.score(loaded, [words])
  vocab = corpus.Vocabulary(tuple(stored["vocabulary"]))
  ids = [vocab.id(t) for t in ["<eos>"] + words.split() + ["<eos>"]]
  mesh = parallel.make_mesh()
  programs = corpus_train.Programs(loaded.model, mesh, loaded.params, 1, 1)
  stream = corpus_train.SplitStream(np.asarray(ids, np.int32), 1, 3, mesh)
  want = corpus_train.evaluate(loaded.params, programs, stream)
  assert got == pytest.approx(-want["cross_entropy"] * (len(ids) - 1),
                              rel=1e-5)
  with pytest.raises(ValueError, match="unknown token 'x' in sentence 0"):
    evaluate.score(loaded, ["0 x"])

  # Resuming on other files is refused; on a moved copy it is not.
  other = str(tmp_path / "other_corpus")
  corpus.write_synthetic(other, "marked_reversal", (60, 12, 12), 3, 9, seed=6)
  with pytest.raises(ValueError, match=r"corpus_digest \(stored"):
    train.train_and_evaluate(_config(other), str(tmp_path / "whole"))
  moved = str(tmp_path / "moved_corpus")
  shutil.copytree(corpus_dir, moved)
  assert train.train_and_evaluate(_config(moved), str(tmp_path / "whole"))[
      "test_perplexity"] == whole["test_perplexity"]
  # Re-evaluated on the moved copy; other files are refused.
  assert evaluate.reevaluate(
      str(tmp_path / "whole"), out=str(tmp_path / "eval2"),
      corpus_dir=moved)["summary"]["test_perplexity"] == pytest.approx(
          whole["test_perplexity"], rel=1e-6)
  with pytest.raises(ValueError, match="SHA-256 differs"):
    evaluate.reevaluate(str(tmp_path / "whole"), out=str(tmp_path / "eval3"),
                        corpus_dir=other)

  # Stopped after 2 epochs, its newest checkpoint damaged: the resume
  # falls back to epoch 1 (moved aside, never deleted), retrains epoch 2
  # and ends where the uninterrupted run did.
  part = tmp_path / "part"
  first = train.train_and_evaluate(_config(corpus_dir, stop_after_epochs=2),
                                   str(part))
  assert not first["finished"] and first["epochs"] == 2
  for root, _, files in os.walk(part / "checkpoints" / "2" / "state"):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"\x00corrupt")
  resumed = train.train_and_evaluate(config, str(part))
  assert os.listdir(part / "checkpoints_unreadable") == ["2"]
  log = [json.loads(l) for l in open(part / "metrics.jsonl")]
  assert [r["epoch"] for r in log] == [1, 2, 3]
  # Checkpoints gone but the log kept: refused, nothing changed.
  shutil.rmtree(part / "checkpoints")
  with pytest.raises(ValueError, match="no checkpoint; nothing was changed"):
    train.train_and_evaluate(config, str(part))
  for key in ("best_epoch", "steps", "test_perplexity",
              "best_valid_perplexity"):
    assert resumed[key] == pytest.approx(whole[key], rel=1e-6), key


@pytest.mark.parametrize("overrides, message", [
    (dict(model="ns", stack_window=0), "must carry a fixed-size state"),
    (dict(model="rns", stack_window=0), "without a window"),
    (dict(model="rns", stack_window=3, truncation_length=3),
     "cut by bptt_length"),
    (dict(corpus_dir="/nonexistent/corpus"), "is not a directory"),
    # A directory without the split files: refused before the run starts.
    (dict(corpus_dir="EMPTY"), "config.corpus_dir is unusable: corpus "
     "directory .* has no train file"),
    (dict(bptt_length=0), "bptt_length must be an integer >= 1"),
    (dict(optimizer="rmsprop"), "expected one of adam, sgd"),
    (dict(init_scale=-1.0), "init_scale must be 0"),
])
def test_bad_config_is_a_one_line_error(corpus_dir, tmp_path, overrides,
                                        message):
  if overrides.get("corpus_dir") == "EMPTY":
    (tmp_path / "empty").mkdir()
    overrides = dict(overrides, corpus_dir=str(tmp_path / "empty"))
  with pytest.raises(ValueError, match=message) as e:
    train.train_and_evaluate(_config(corpus_dir, **overrides),
                             str(tmp_path / "run"))
  assert "\n" not in str(e.value)
  assert not os.path.exists(tmp_path / "run")


def test_a_diverged_run_raises_instead_of_reporting_its_start(corpus_dir,
                                                               tmp_path):
  # lr 1e4 without clipping: ~9,000 nats a token, a finite training loss
  # whose perplexity never beats the initial best (inf).
  with pytest.raises(FloatingPointError,
                     match=r"non-finite validation perplexity \(inf; "
                     r"cross-entropy [0-9.e+]+ nats per token\) in epoch 1:"
                     " training diverged"):
    train.train_and_evaluate(
        _config(corpus_dir, learning_rate=1e4, clip_norm=1e30,
                max_epochs=2), str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run" / "results.json")


def _free_port():
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


def test_two_processes_give_the_one_process_result(corpus_dir, tmp_path):
  # Two jax.distributed processes (one CPU device each): each builds its
  # half of the rows of every chunk; only process 0 writes the metrics.
  args = [sys.executable, "-m", "nsrnn_jax.main",
          f"--config={REPO}/configs/quick_corpus.py",
          f"--config.corpus_dir={corpus_dir}", "--config.model=lstm",
          "--config.stack_window=0",
          "--config.hidden_size=8", "--config.batch_size=4",
          "--config.bptt_length=7", "--config.max_epochs=2",
          "--config.progress_bar=False"]
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("NSRNN_", "XLA_FLAGS"))}
  env.update(JAX_PLATFORMS="cpu")
  single = tmp_path / "single"
  proc = subprocess.run(args + [f"--workdir={single}"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  pair = tmp_path / "pair"
  port = _free_port()
  procs = [subprocess.Popen(
      args + [f"--workdir={pair}", "--distributed"], cwd=REPO,
      env={**env, "NSRNN_COORDINATOR_ADDRESS": f"localhost:{port}",
           "NSRNN_NUM_PROCESSES": "2", "NSRNN_PROCESS_ID": str(i)},
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  try:
    errs = [p.communicate(timeout=300)[1] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, err in zip(procs, errs):
    assert p.returncode == 0, err[-2000:]
  assert "process 0/2, 2 device(s)" in errs[0] and "epoch" not in errs[1]
  want = json.load(open(single / "results.json"))
  got = json.load(open(pair / "results.json"))
  for key in ("test_perplexity", "best_valid_perplexity"):
    assert got[key] == pytest.approx(want[key], rel=1e-4)
  assert len(open(pair / "metrics.jsonl").readlines()) == 2
