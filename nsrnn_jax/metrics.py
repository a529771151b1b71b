"""Metric writers (JSON lines + TensorBoard) and cross-entropy helpers.

Only process 0 writes files; other processes only log. The cross-entropy
difference of section 5.3 of the paper is

  diff = [sum_w -ln p_model(w) - sum_w -ln p_sample(w)] / sum_w |w|

in nats per symbol, where the lower bound of a string is

  -ln p_sample(w) = -ln G(w) + ln G(|w|) + ln N_L

(N_L = number of valid lengths of the interval the set was drawn from).
"""

import csv
import json
import math
import os
from typing import Any, Mapping, Sequence

from absl import logging
import numpy as np


def lower_bound_neg_log_prob(log_prob_B, length_log_prob, num_lengths):
  """Returns -ln p_sample(w) for each string (float64 [B]).

  Args:
    log_prob_B: ln G(w) of each string.
    length_log_prob: ln G(|w|), scalar or [B].
    num_lengths: N_L, or 0/None to omit the ln N_L term.
  """
  log_num_lengths = math.log(num_lengths) if num_lengths else 0.0
  return (-np.asarray(log_prob_B, np.float64)
          + np.asarray(length_log_prob, np.float64) + log_num_lengths)


def ce_difference(model_nll_sum, bound_nll_sum, num_symbols):
  """Cross-entropy difference in nats/symbol (model minus lower bound)."""
  if num_symbols <= 0:
    raise ValueError(f"num_symbols must be positive (got {num_symbols})")
  return (float(model_nll_sum) - float(bound_nll_sum)) / float(num_symbols)


def perplexity(nll_sum, num_symbols):
  """exp(total negative log-likelihood / number of symbols)."""
  if num_symbols <= 0:
    raise ValueError(f"num_symbols must be positive (got {num_symbols})")
  try:
    return math.exp(float(nll_sum) / float(num_symbols))
  except OverflowError:  # A diverged model: report inf, not a crash.
    return math.inf


def percent(fraction: float) -> str:
  """A fraction as a percentage that is "100%" or "0%" only when exact.

  For counts such as the strings a stack margin proves exact, where
  "100%" must not hide one string: the fewest decimals (up to 3) that keep
  a part away from 0 and 100 ("99.9%", "0.04%").
  """
  fraction = float(fraction)
  if fraction >= 1 or fraction <= 0:
    return f"{fraction:.0%}"
  for digits in range(4):
    text = f"{100 * fraction:.{digits}f}"
    if 0 < float(text) < 100:
      return f"{text}%"
  return ">99.999%" if fraction > 0.5 else "<0.001%"


def check_finite(value, what: str):
  """Raises FloatingPointError if `value` is NaN or infinite."""
  if not math.isfinite(float(value)):
    raise FloatingPointError(
        f"non-finite {what}: {value} (try a smaller learning rate or check "
        "the model for log-zero NaNs)")


def check_valid_perplexity(perplexity: float, cross_entropy: float,
                           unit: str, where: str, advice: str,
                           checkpoint: str) -> None:
  """Raises FloatingPointError if a validation perplexity is past float32's
  range (the type the best-so-far is kept in).

  Such a model (over 88 nats per `unit`) has diverged, and it never beats
  the best, which starts at inf: without this the run would go on to
  "finish" and report its initial parameters as the best. `where` names
  the epoch (and run); `advice` what to try, `checkpoint` what is kept.
  """
  if not np.isfinite(np.float32(perplexity)):
    raise FloatingPointError(
        f"non-finite validation perplexity ({perplexity}; cross-entropy "
        f"{cross_entropy:.6g} nats per {unit}) in {where}: training diverged"
        f" ({advice}); {checkpoint}")


class MetricWriter:
  """Writes scalars to `workdir/metrics.jsonl` and TensorBoard events.

  Disabled writers (processes other than 0) write nothing. Opening a workdir
  keeps the records of epochs <= `resume_epoch` (the restored checkpoint's
  epoch; 0 for a fresh run) and drops the rest, and rewrites the TensorBoard
  events from the kept records, so a resumed run has one record per epoch
  and one TensorBoard history.
  """

  def __init__(self, workdir: str, enabled: bool = True,
               tensorboard: bool = True, resume_epoch: int = 0):
    self._enabled = enabled
    self._jsonl = None
    self._tb = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    kept = []
    if os.path.exists(path):
      # A line cut by a kill is dropped: its epoch is trained again.
      kept = [r for r in read_jsonl(path, skip_bad_lines=True)
              if isinstance(r.get("epoch", 0), int)
              and r.get("epoch", 0) <= resume_epoch]
    with open(path + ".tmp", "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(path + ".tmp", path)
    self._jsonl = open(path, "a")
    if tensorboard:
      try:
        import tensorboardX  # pylint: disable=g-import-not-at-top
      except ImportError:  # TensorBoard output is optional.
        logging.warning("tensorboardX not installed: no TensorBoard events")
        return
      for name in os.listdir(workdir):
        if name.startswith("events.out.tfevents"):
          os.remove(os.path.join(workdir, name))  # Rebuilt from metrics.jsonl.
      self._tb = tensorboardX.SummaryWriter(logdir=workdir)
      for record in kept:
        self._write_tb(record)

  def _write_tb(self, record: Mapping[str, Any]) -> None:
    for key, value in record.items():
      if key != "epoch" and isinstance(value, (int, float)):
        self._tb.add_scalar(key, value, int(record["epoch"]))

  def write_scalars(self, step: int, scalars: Mapping[str, Any],
                    jsonl: bool = True):
    """Writes one JSON line {"epoch": step, **scalars} and TB scalars.

    Args:
      step: the epoch (x axis).
      scalars: name -> value.
      jsonl: also append to metrics.jsonl (False for end-of-run summaries,
        which go to results.json, so the file stays one line per epoch).
    """
    record = {"epoch": int(step)}
    record.update({k: _to_python(v) for k, v in scalars.items()})
    if not self._enabled:
      return
    if jsonl:
      self._jsonl.write(json.dumps(record) + "\n")
      self._jsonl.flush()
    if self._tb is not None:
      self._write_tb(record)

  def close(self):
    """Flushes and closes all outputs."""
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _to_python(value):
  """Converts numpy/JAX scalars to JSON-serialisable Python values."""
  if isinstance(value, (str, bool, int, float)) or value is None:
    return value
  arr = np.asarray(value)
  if arr.ndim == 0:
    return arr.item()
  return arr.tolist()


def last_complete_epoch(workdir: str) -> int:
  """The last epoch E such that metrics.jsonl holds epochs 1..E (0: none).

  A line cut by a kill does not count (its epoch is trained again). Resuming
  restores no checkpoint newer than E (`loop`), so the log never gets a
  hole when a run directory mixes an older log with newer checkpoints.
  """
  path = os.path.join(workdir, "metrics.jsonl")
  try:
    records = read_jsonl(path, skip_bad_lines=True)
  except OSError:
    return 0
  epochs = {r["epoch"] for r in records if isinstance(r.get("epoch"), int)}
  last = 0
  while last + 1 in epochs:
    last += 1
  return last


def read_jsonl(path: str, skip_bad_lines: bool = False) -> list[dict]:
  """Reads a JSON-lines file into a list of dicts.

  Args:
    path: the file.
    skip_bad_lines: drop lines that are not a JSON object (e.g. the last line
      of a run killed while writing it) with a warning, instead of raising.

  Raises:
    ValueError: the file is not UTF-8 text, or a line is not a JSON object
      (unless `skip_bad_lines`).
  """
  records, bad = [], []
  with open(path, encoding="utf-8") as f:
    try:
      lines = list(f)
    except UnicodeDecodeError as e:
      raise ValueError(f"{path} is not a JSON-lines log (not UTF-8 "
                       "text)") from e
    for number, line in enumerate(lines, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        record = None
      if isinstance(record, dict):
        records.append(record)
      elif skip_bad_lines:
        bad.append(number)
      else:
        raise ValueError(f"{path}: line {number} is not a JSON object: "
                         f"{line.strip()[:60]!r}")
  if bad:
    logging.warning("%s: skipped %d line(s) that are not JSON objects "
                    "(lines %s; a run killed while writing)", path, len(bad),
                    ", ".join(map(str, bad[:5])))
  return records


def write_test_table(workdir: str, table: Mapping[str, Sequence[Any]],
                     enabled: bool = True) -> str:
  """Saves the per-length test table as JSON and CSV; returns printable text.

  Args:
    workdir: output directory (test_by_length.json / .csv).
    table: column name -> list of values, all the same length; must contain
      "lengths".
    enabled: write files (process 0) or only format.
  """
  columns = list(table)
  rows = list(zip(*(table[c] for c in columns)))
  if enabled:
    with open(os.path.join(workdir, "test_by_length.json"), "w") as f:
      json.dump({c: [_to_python(v) for v in table[c]] for c in columns}, f,
                indent=1)
    with open(os.path.join(workdir, "test_by_length.csv"), "w",
              newline="") as f:
      writer = csv.writer(f)
      writer.writerow(columns)
      writer.writerows(rows)
  return format_table(columns, rows)


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """Formats rows as a fixed-width text table."""
  def fmt(v):
    if isinstance(v, float):
      return f"{v:.4f}"
    return str(v)
  cells = [[fmt(v) for v in row] for row in rows]
  widths = [max([len(c)] + [len(r[i]) for r in cells])
            for i, c in enumerate(columns)]
  lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
  lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
  return "\n".join(lines)
