"""Tests of nsrnn_jax.metrics: CE-difference helpers and writers."""

import csv
import json
import math
import os
import struct

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


def _tensorboard_scalars(directory):
  """{(tag, step): value} of every event file, and the number of files."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  out, files = {}, 0
  for name in os.listdir(directory):
    if not name.startswith("events.out"):
      continue
    files += 1
    blob = open(os.path.join(directory, name), "rb").read()
    pos = 0
    while pos < len(blob):  # TFRecords: u64 length, u32 crc, data, u32 crc.
      (length,) = struct.unpack("<Q", blob[pos:pos + 8])
      event = event_pb2.Event.FromString(blob[pos + 12:pos + 12 + length])
      pos += 16 + length
      for value in event.summary.value:
        out[(value.tag, event.step)] = value.simple_value
  return out, files


def test_writer_resume_truncates_and_keeps_one_history(tmp_path):
  with metrics.MetricWriter(str(tmp_path)) as w:
    for epoch in (1, 2, 3):
      w.write_scalars(epoch, {"valid_ce_diff": np.float32(0.5 / epoch)})
  # Resumed from the checkpoint of epoch 2: epoch 3 is trained again.
  with metrics.MetricWriter(str(tmp_path), resume_epoch=2) as w:
    w.write_scalars(3, {"valid_ce_diff": 0.125})
  records = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert records == [{"epoch": 1, "valid_ce_diff": 0.5},
                     {"epoch": 2, "valid_ce_diff": 0.25},
                     {"epoch": 3, "valid_ce_diff": 0.125}]
  scalars, files = _tensorboard_scalars(str(tmp_path))
  assert files == 1
  assert scalars == {("valid_ce_diff", 1): 0.5, ("valid_ce_diff", 2): 0.25,
                     ("valid_ce_diff", 3): 0.125}
  # A fresh run (resume_epoch 0) starts the files anew.
  with metrics.MetricWriter(str(tmp_path)) as w:
    w.write_scalars(1, {"x": 1.0})
  assert metrics.read_jsonl(str(tmp_path / "metrics.jsonl")) == [
      {"epoch": 1, "x": 1.0}]
  assert _tensorboard_scalars(str(tmp_path)) == ({("x", 1): 1.0}, 1)


def test_writer_resume_drops_a_line_cut_by_a_kill(tmp_path):
  path = tmp_path / "metrics.jsonl"
  # Killed while writing epoch 3's line: the resume from epoch 2's checkpoint
  # must neither fail on it nor keep it.
  path.write_text('{"epoch": 1, "x": 1.0}\n{"epoch": 2, "x": 2.0}\n'
                  '{"epoch": 3, "x"')
  with pytest.raises(ValueError, match="line 3 is not a JSON object"):
    metrics.read_jsonl(str(path))
  assert metrics.read_jsonl(str(path), skip_bad_lines=True) == [
      {"epoch": 1, "x": 1.0}, {"epoch": 2, "x": 2.0}]
  with metrics.MetricWriter(str(tmp_path), resume_epoch=2,
                            tensorboard=False) as w:
    w.write_scalars(3, {"x": 3.0})
  assert metrics.read_jsonl(str(path)) == [
      {"epoch": 1, "x": 1.0}, {"epoch": 2, "x": 2.0}, {"epoch": 3, "x": 3.0}]


def test_a_log_that_is_not_text_or_has_bad_epochs(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_bytes(b'{"epoch": 1}\n\xff\xfe garbage\n')
  for skip in (False, True):
    with pytest.raises(ValueError, match=f"{path} is not a JSON-lines log "
                       r"\(not UTF-8 text\)"):
      metrics.read_jsonl(str(path), skip_bad_lines=skip)
  # An epoch that is no integer is dropped on resume, not compared.
  path.write_text('{"epoch": 1, "x": 1.0}\n{"epoch": null}\n'
                  '{"epoch": "2"}\n{"step": 0}\n')
  with metrics.MetricWriter(str(tmp_path), resume_epoch=1,
                            tensorboard=False):
    pass
  assert metrics.read_jsonl(str(path)) == [{"epoch": 1, "x": 1.0},
                                           {"step": 0}]


def test_last_complete_epoch_is_the_end_of_the_first_gap(tmp_path):
  assert metrics.last_complete_epoch(str(tmp_path / "missing")) == 0
  path = tmp_path / "metrics.jsonl"
  lines = [{"epoch": 1, "x": 0.5}, {"epoch": 2}, {"note": "no epoch"},
           {"epoch": "3"}, {"epoch": 4}, {"epoch": 2}]
  path.write_text("".join(json.dumps(r) + "\n" for r in lines))
  assert metrics.last_complete_epoch(str(tmp_path)) == 2  # "3" is no epoch
  with open(path, "a") as f:
    f.write(json.dumps({"epoch": 3}) + "\n" + '{"epoch": 5, "x": 0.')
  # 5's line was cut by a kill: it does not count.
  assert metrics.last_complete_epoch(str(tmp_path)) == 4
  path.write_text(json.dumps({"epoch": 2}) + "\n")
  assert metrics.last_complete_epoch(str(tmp_path)) == 0


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


@pytest.mark.parametrize("fraction, text", [
    (1.0, "100%"), (0.0, "0%"), (0.5, "50%"), (0.999, "99.9%"),
    (0.9996, "99.96%"), (0.0004, "0.04%"), (1 - 1e-7, ">99.999%"),
    (1e-7, "<0.001%"), (np.float32(0.25), "25%")])
def test_percent_is_whole_only_when_exact(fraction, text):
  assert metrics.percent(fraction) == text
