"""Tests of nsrnn_jax.metrics: CE-difference helpers and writers."""

import csv
import json
import math
import os

import numpy as np
import pytest

from nsrnn_jax import metrics


def test_lower_bound_includes_log_num_lengths():
  log_prob = np.array([-3.0, -4.0])
  got = metrics.lower_bound_neg_log_prob(log_prob, -1.0, 20)
  np.testing.assert_allclose(got, [3.0 - 1.0 + math.log(20),
                                   4.0 - 1.0 + math.log(20)])
  np.testing.assert_allclose(
      metrics.lower_bound_neg_log_prob(log_prob, -1.0, None), [2.0, 3.0])


def test_ce_difference_is_log_perplexity_difference():
  nll, bound, n = 123.4, 100.0, 60
  diff = metrics.ce_difference(nll, bound, n)
  np.testing.assert_allclose(
      diff, math.log(metrics.perplexity(nll, n))
      - math.log(metrics.perplexity(bound, n)), rtol=1e-12)
  np.testing.assert_allclose(diff, 23.4 / 60)
  with pytest.raises(ValueError, match="num_symbols"):
    metrics.ce_difference(1.0, 1.0, 0)


def test_perplexity_overflow_is_inf_and_check_finite_raises():
  assert metrics.perplexity(1e6, 1) == math.inf
  metrics.check_finite(3.0, "loss")
  for bad in (math.nan, math.inf):
    with pytest.raises(FloatingPointError, match="non-finite loss"):
      metrics.check_finite(bad, "loss")


def test_writer_jsonl_appends_and_tensorboard(tmp_path):
  with metrics.MetricWriter(str(tmp_path)) as w:
    w.write_scalars(1, {"valid_ce_diff": np.float32(0.5), "lr": 0.01})
  with metrics.MetricWriter(str(tmp_path)) as w:  # resumed run appends
    w.write_scalars(2, {"valid_ce_diff": 0.25})
  records = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert records == [{"epoch": 1, "valid_ce_diff": 0.5, "lr": 0.01},
                     {"epoch": 2, "valid_ce_diff": 0.25}]
  events = [f for f in os.listdir(tmp_path) if f.startswith("events.out")]
  assert events
  # The event files hold the scalar tag (TFRecord with the tag as bytes).
  blob = b"".join(open(tmp_path / f, "rb").read() for f in events)
  assert b"valid_ce_diff" in blob


def test_disabled_writer_writes_nothing(tmp_path):
  with metrics.MetricWriter(str(tmp_path / "w"), enabled=False) as w:
    w.write_scalars(1, {"x": 1.0})
  assert not os.path.exists(tmp_path / "w")
  text = metrics.write_test_table(str(tmp_path), {"lengths": [3]},
                                  enabled=False)
  assert "lengths" in text and not os.listdir(tmp_path)


def test_test_table_json_and_csv(tmp_path):
  table = {"lengths": [41, 43], "ce_diff": [0.01, -0.02],
           "num_strings": [100, 100]}
  text = metrics.write_test_table(str(tmp_path), table)
  assert json.load(open(tmp_path / "test_by_length.json")) == table
  rows = list(csv.reader(open(tmp_path / "test_by_length.csv")))
  assert rows == [["lengths", "ce_diff", "num_strings"],
                  ["41", "0.01", "100"], ["43", "-0.02", "100"]]
  lines = text.splitlines()
  assert len(lines) == 3 and "-0.0200" in lines[2]
