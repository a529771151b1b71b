"""The PTB protocol's random search: N runs per model, the best one reported.

rns-vrns-reference.md §4.4: each model gets 10 runs, each with a learning
rate drawn log-uniformly from [1, 100] and a gradient-clipping threshold
from [0.0112, 1.12]; the run with the best validation perplexity is kept
and its test perplexity reported.

  python -m nsrnn_jax.corpus_search --config=configs/ptb_rns.py \\
      --config.corpus_dir=data/ptb --workdir=runs/ptb_rns --runs=10

Run k trains in `<workdir>/run_<k>` (`train.train_and_evaluate`, task
"corpus") with its draws and param_seed = config.param_seed + k. The draws
are a function of (--seed, k) only, so rerunning the command skips finished
runs, resumes an interrupted one from its last checkpoint, and a later call
with more --runs keeps the first runs' draws. `<workdir>/summary.json`
holds every finished run (learning rate, clip threshold, epochs, best
validation and test perplexity) and the selected one; the table is printed.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Optional, Sequence

import numpy as np

from nsrnn_jax import checkpointing

# rns-vrns-reference.md §4.4.
LEARNING_RATE_RANGE = (1.0, 100.0)
CLIP_RANGE = (0.0112, 1.12)
NUM_RUNS = 10
SUMMARY_FILE = "summary.json"


def draws(run_index: int, seed: int = 0,
          learning_rate_range=LEARNING_RATE_RANGE,
          clip_range=CLIP_RANGE) -> tuple[float, float]:
  """(learning rate, clip threshold) of run k, log-uniform in the ranges."""
  rng = np.random.default_rng([seed, run_index])
  lr, clip = (math.exp(rng.uniform(math.log(lo), math.log(hi)))
              for lo, hi in (learning_rate_range, clip_range))
  return float(lr), float(clip)


def run_config(config, run_index: int, seed: int = 0,
               learning_rate_range=LEARNING_RATE_RANGE,
               clip_range=CLIP_RANGE):
  """Run k's config: the base config with its draws and seed."""
  lr, clip = draws(run_index, seed, learning_rate_range, clip_range)
  out = config.copy_and_resolve_references()
  out.learning_rate = lr
  out.clip_norm = clip
  out.param_seed = int(config.param_seed) + run_index
  return out


def _check_range(name: str, value: Sequence[float]) -> tuple[float, float]:
  try:
    lo, hi = (float(v) for v in value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be two numbers LOW,HIGH (got "
                     f"{value!r})") from None
  if not 0 < lo <= hi < float("inf"):
    raise ValueError(f"{name} must satisfy 0 < LOW <= HIGH (got {lo}, {hi})")
  return lo, hi


def search(config, workdir: str, num_runs: int = NUM_RUNS, seed: int = 0,
           learning_rate_range=LEARNING_RATE_RANGE, clip_range=CLIP_RANGE,
           train_fn=None) -> dict[str, Any]:
  """Trains runs 0..num_runs−1 (resuming) and selects the best.

  Args:
    config: a corpus config (task "corpus"); its learning_rate, clip_norm
      and param_seed are replaced per run.
    workdir: holds run_<k>/ and summary.json.
    num_runs: N >= 1.
    seed: the draws' seed.
    learning_rate_range, clip_range: (low, high) of the log-uniform draws.
    train_fn: `train.train_and_evaluate` (tests may wrap it).

  Returns:
    The summary (also written to summary.json): "runs" (one row per
    finished run), "best" (the row with the lowest best validation
    perplexity, ties to the lower index) and "finished" (all N done).
  """
  from nsrnn_jax import train  # pylint: disable=g-import-not-at-top
  if isinstance(num_runs, bool) or not isinstance(num_runs, int) \
      or num_runs < 1:
    raise ValueError(f"--runs must be an integer >= 1 (got {num_runs!r})")
  learning_rate_range = _check_range("--learning_rate_range",
                                     learning_rate_range)
  clip_range = _check_range("--clip_range", clip_range)
  if config.get("task") != "corpus":
    raise ValueError(f"corpus_search runs task 'corpus' configs (got task "
                     f"{config.get('task')!r}); use later_protocol or "
                     "reproduce for the formal languages")
  train.validate_config(config)
  checkpointing.check_writable(workdir)
  train_fn = train.train_and_evaluate if train_fn is None else train_fn
  rows = []
  for k in range(num_runs):
    run_dir = os.path.join(workdir, f"run_{k}")
    cfg = run_config(config, k, seed, learning_rate_range, clip_range)
    result = _finished(run_dir)
    if result is None:
      print(f"run {k + 1}/{num_runs}: learning rate {cfg.learning_rate:.4g}, "
            f"clip {cfg.clip_norm:.4g}", file=sys.stderr, flush=True)
      result = train_fn(cfg, run_dir)
      if not result.get("finished"):
        break  # stop_after_epochs: the rest waits for the next call.
    rows.append({"run": k, "learning_rate": cfg.learning_rate,
                 "clip_norm": cfg.clip_norm, "param_seed": cfg.param_seed,
                 "epochs": result["epochs"],
                 "best_epoch": result["best_epoch"],
                 "best_valid_perplexity": result["best_valid_perplexity"],
                 "test_perplexity": result["test_perplexity"]})
  summary = {"num_runs": num_runs, "seed": seed,
             "learning_rate_range": list(learning_rate_range),
             "clip_range": list(clip_range), "runs": rows,
             "finished": len(rows) == num_runs,
             "best": min(rows, key=lambda r: (r["best_valid_perplexity"],
                                              r["run"])) if rows else None}
  os.makedirs(workdir, exist_ok=True)
  checkpointing.write_json(workdir, SUMMARY_FILE, summary)
  return summary


def _finished(run_dir: str) -> Optional[dict]:
  """A finished run's results.json, else None."""
  path = os.path.join(run_dir, "results.json")
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    result = json.load(f)
  return result if result.get("finished") else None


def render(summary: dict) -> str:
  """The summary as a Markdown table plus the selected run."""
  lines = ["| run | learning rate | clip | epochs | best valid ppl | test ppl |",
           "|---|---|---|---|---|---|"]
  best = summary["best"]["run"] if summary["best"] else None
  for r in summary["runs"]:
    mark = " (best)" if r["run"] == best else ""
    lines.append(f"| {r['run']}{mark} | {r['learning_rate']:.4g} | "
                 f"{r['clip_norm']:.4g} | {r['epochs']} | "
                 f"{r['best_valid_perplexity']:.3f} | "
                 f"{r['test_perplexity']:.3f} |")
  if summary["best"] is not None:
    lines.append("")
    lines.append(f"selected: run {best}, test perplexity "
                 f"{summary['best']['test_perplexity']:.3f} ({len(summary['runs'])}"
                 f" of {summary['num_runs']} runs finished)")
  return "\n".join(lines)


# Fields `run_config` draws for every run: set on the command line they
# would be ignored.
_SEARCH_SETS = {
    "learning_rate": "the search draws it for every run; use "
                     "--learning_rate_range=LOW,HIGH",
    "clip_norm": "the search draws it for every run; use --clip_range=LOW,HIGH",
}


def main(argv) -> None:
  """CLI (module docstring)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  del argv  # absl's leftovers; the overrides are in sys.argv.
  cli.refuse_config_overrides(sys.argv[1:], _SEARCH_SETS)
  f = flags.FLAGS
  summary = search(f.config, f.workdir, f.runs, f.seed,
                   f.learning_rate_range, f.clip_range)
  print(render(summary))


if __name__ == "__main__":
  import jax  # pylint: disable=g-import-not-at-top
  from absl import flags as _flags  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  cli.reexec_with_huge_pages()
  cli.define_config_file(
      "config", "Corpus configuration (configs/ptb_*.py).", lock_config=True)
  _flags.DEFINE_string("workdir", None, "Directory of the runs.")
  _flags.DEFINE_integer("runs", NUM_RUNS, "Runs (random draws).")
  _flags.DEFINE_integer("seed", 0, "Seed of the draws.")
  _flags.DEFINE_list("learning_rate_range",
                     [str(v) for v in LEARNING_RATE_RANGE],
                     "LOW,HIGH of the log-uniform learning rate.")
  _flags.DEFINE_list("clip_range", [str(v) for v in CLIP_RANGE],
                     "LOW,HIGH of the log-uniform clipping threshold.")
  _flags.mark_flags_as_required(["config", "workdir"])
  jax.config.config_with_absl()
  cli.run(main)
