"""Tests for nsrnn_jax.corpus_search (the PTB protocol's random search).

Oracles: the log-uniform distribution's own moments (mean and standard
deviation of ln x: the interval's midpoint and width / √12) for the draws;
a stand-in trainer that records what it was asked and writes the
results.json a real run writes, for resuming and selection; one real
search of two tiny runs.
"""

import json
import math
import os

import numpy as np
import pytest

from configs import quick_corpus
from nsrnn_jax import corpus
from nsrnn_jax import corpus_search


def test_draws_are_log_uniform_and_a_function_of_seed_and_index():
  n = 4000
  lr, clip = np.log(np.asarray([corpus_search.draws(k, seed=7)
                                for k in range(n)])).T
  for x, (lo, hi) in ((lr, corpus_search.LEARNING_RATE_RANGE),
                      (clip, corpus_search.CLIP_RANGE)):
    a, b = math.log(lo), math.log(hi)
    assert a <= x.min() and x.max() <= b
    sd = (b - a) / math.sqrt(12)
    assert abs(x.mean() - (a + b) / 2) < 5 * sd / math.sqrt(n)
    assert abs(x.std() - sd) < 0.05 * sd
  assert corpus_search.draws(3, seed=7) == corpus_search.draws(3, seed=7)
  assert corpus_search.draws(3, seed=7) != corpus_search.draws(3, seed=8)
  assert corpus_search.draws(3, seed=7) != corpus_search.draws(4, seed=7)


def _config(corpus_dir):
  config = quick_corpus.get_config()
  config.corpus_dir = corpus_dir
  config.model = "lstm"
  config.stack_window = 0  # quick_corpus.py's RNS-RNN has a window
  config.hidden_size = 6
  config.batch_size = 4
  config.bptt_length = 7
  config.max_epochs = 1
  config.progress_bar = False
  return config


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("corpus"))
  corpus.write_synthetic(d, "dyck", (30, 8, 8), 4, 8, seed=2)
  return d


class _FakeTrainer:
  """Writes results.json as a run does; valid perplexity = |ln lr − 2|."""

  def __init__(self, finish=True):
    self.calls = []
    self.finish = finish

  def __call__(self, config, workdir):
    self.calls.append((workdir, config.learning_rate, config.clip_norm,
                       config.param_seed))
    ppl = 1 + abs(math.log(config.learning_rate) - 2)
    result = {"finished": self.finish, "epochs": 1, "best_epoch": 1,
              "best_valid_perplexity": ppl, "test_perplexity": ppl + 0.5}
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "results.json"), "w") as f:
      json.dump(result, f)
    return result


def test_search_selects_resumes_and_grows(corpus_dir, tmp_path):
  config = _config(corpus_dir)
  fake = _FakeTrainer()
  summary = corpus_search.search(config, str(tmp_path), 3, seed=1,
                                 train_fn=fake)
  assert [c[0] for c in fake.calls] == [str(tmp_path / f"run_{k}")
                                        for k in range(3)]
  for k, (_, lr, clip, seed) in enumerate(fake.calls):
    assert (lr, clip) == corpus_search.draws(k, seed=1)
    assert seed == config.param_seed + k
  best = min(range(3), key=lambda k: abs(math.log(fake.calls[k][1]) - 2))
  assert summary["finished"] and summary["best"]["run"] == best
  assert summary["best"]["test_perplexity"] == pytest.approx(
      summary["best"]["best_valid_perplexity"] + 0.5)
  with open(tmp_path / corpus_search.SUMMARY_FILE) as f:
    assert json.load(f) == summary
  assert "| " + str(best) + " (best) |" in corpus_search.render(summary)
  # Rerun with two more runs: the three finished ones are not retrained
  # and keep their draws.
  fake.calls.clear()
  grown = corpus_search.search(config, str(tmp_path), 5, seed=1,
                               train_fn=fake)
  assert [c[0][-5:] for c in fake.calls] == ["run_3", "run_4"]
  assert grown["runs"][:3] == summary["runs"]


def test_an_unfinished_run_stops_the_search_until_the_next_call(corpus_dir,
                                                                 tmp_path):
  summary = corpus_search.search(_config(corpus_dir), str(tmp_path), 3,
                                 train_fn=_FakeTrainer(finish=False))
  assert not summary["finished"] and summary["runs"] == []
  assert summary["best"] is None


def test_a_real_search_of_two_tiny_runs(corpus_dir, tmp_path):
  summary = corpus_search.search(_config(corpus_dir), str(tmp_path), 2,
                                 learning_rate_range=(0.5, 2.0))
  assert summary["finished"] and len(summary["runs"]) == 2
  for r in summary["runs"]:
    with open(tmp_path / f"run_{r['run']}" / "results.json") as f:
      result = json.load(f)
    assert result["test_perplexity"] == r["test_perplexity"]
    with open(tmp_path / f"run_{r['run']}" / "config.json") as f:
      assert json.load(f)["learning_rate"] == r["learning_rate"]
  assert summary["best"]["best_valid_perplexity"] == min(
      r["best_valid_perplexity"] for r in summary["runs"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_runs=0), "--runs must be an integer >= 1"),
    (dict(learning_rate_range=(2.0, 1.0)), "--learning_rate_range must"),
    (dict(clip_range=("a", 1)), "--clip_range must be two numbers"),
])
def test_bad_arguments_are_one_line_errors(corpus_dir, tmp_path, kwargs,
                                           message):
  with pytest.raises(ValueError, match=message):
    corpus_search.search(_config(corpus_dir), str(tmp_path), **kwargs)


def test_formal_language_configs_are_refused(tmp_path):
  from configs import quick  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="runs task 'corpus' configs"):
    corpus_search.search(quick.get_config(), str(tmp_path), 2)
