"""Benchmark: build each task's full paper dataset with exact lower bounds.

For every task: sample train (1,000 x 10), valid (100 x 10) and test (100 per
valid length in [40, 100]) and compute ln G(w) for every validation and test
string (the lower bounds). Prints a table of seconds per phase (wall clock;
"cpu s" is the CPU time of make_splits summed over its threads; "score s" and
"sample s" re-time scoring and sampling alone) and saves
benchmarks/results/data.json. The issue's target is hardest_cfl under 60 s
on 2 CPU cores. Other jobs may share the cores, so also compare the ratio of
phases within one run.

  python benchmarks/data.py [--tasks=hardest_cfl,dyck] [--scale=1.0]
"""

import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nsrnn_jax import data  # pylint: disable=g-import-not-at-top
from nsrnn_jax import languages  # pylint: disable=g-import-not-at-top
from nsrnn_jax import parallel  # pylint: disable=g-import-not-at-top
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position


def run_task(task: str, scale: float) -> dict:
  """Times sampling and scoring for one task; returns a result row."""
  t0 = time.perf_counter()
  lang = languages.get(task)
  lang.valid_lengths(1, 100)
  t_setup = time.perf_counter() - t0
  t0, c0 = time.perf_counter(), time.process_time()
  splits = data.make_splits(task, seed=1,
                            train_batches=int(1000 * scale),
                            valid_batches=int(100 * scale),
                            test_per_length=max(1, int(100 * scale)))
  t_total = time.perf_counter() - t0
  c_total = time.process_time() - c0
  # Re-time the scoring alone on the same strings (valid + test).
  t0 = time.perf_counter()
  for split in (splits.valid, splits.test):
    for batch in split:
      lang.log_prob_batch(batch.symbols)
  t_score = time.perf_counter() - t0
  # Re-time the sampling alone (same protocol, fresh generators).
  t0 = time.perf_counter()
  rng = np.random.default_rng(1)
  for split in (splits.train, splits.valid):
    for batch in split:
      lang.sample_batch(batch.length, len(batch), rng)
  rng = np.random.default_rng(0)
  for batch in splits.test:
    lang.sample_batch(batch.length, len(batch), rng)
  t_sample = time.perf_counter() - t0
  bounds = np.concatenate(splits.valid.lower_bounds()
                          + splits.test.lower_bounds())
  return {
      "task": task,
      "setup_s": t_setup,
      "make_splits_s": t_total,
      "make_splits_cpu_s": c_total,
      "scoring_s": t_score,
      "sampling_s": t_sample,
      "num_train": splits.train.num_strings,
      "num_valid": splits.valid.num_strings,
      "num_test": splits.test.num_strings,
      "all_bounds_finite": bool(np.isfinite(bounds).all()),
      "valid_lower_bound_ce": splits.valid.lower_bound_cross_entropy(),
      "test_lower_bound_ce": splits.test.lower_bound_cross_entropy(),
  }


def main() -> None:
  parser = cli.OneLineArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tasks", default=",".join(languages.TASKS))
  parser.add_argument("--scale", type=float, default=1.0,
                      help="fraction of the paper's dataset sizes")
  args = parser.parse_args()
  rows = [run_task(t, args.scale) for t in args.tasks.split(",")]
  header = (f"{'task':<18} {'total s':>8} {'cpu s':>7} {'score s':>8} "
            f"{'sample s':>9} "
            f"{'#train':>7} {'#valid':>7} {'#test':>6} {'valid LB':>9}")
  print(header)
  print("-" * len(header))
  for r in rows:
    print(f"{r['task']:<18} {r['make_splits_s']:8.2f} "
          f"{r['make_splits_cpu_s']:7.2f} {r['scoring_s']:8.2f} "
          f"{r['sampling_s']:9.2f} {r['num_train']:7d} {r['num_valid']:7d} "
          f"{r['num_test']:6d} {r['valid_lower_bound_ce']:9.4f}")
  out_dir = os.path.join(os.path.dirname(__file__), "results")
  os.makedirs(out_dir, exist_ok=True)
  out = {"scale": args.scale, "cpu_count": os.cpu_count(),
         "machine": platform.platform(), "cpu_model": parallel.host_cpu_model(),
         "device": f"cpu: {parallel.host_cpu_model()} ({os.cpu_count()} cores)",
         "load_average_1_5_15": list(os.getloadavg()), "rows": rows}
  with open(os.path.join(out_dir, "data.json"), "w") as f:
    json.dump(out, f, indent=2)
  print(f"saved {os.path.join(out_dir, 'data.json')}")


if __name__ == "__main__":
  main()
