"""Benchmark: one full training step (forward, loss, backward, clip, Adam).

Batch 10, length 80 (marked reversal, V = 3) for the NS-RNN (Q = S = 2 and
Q = S = 3), JM and Gref (m = 20) and the LSTM, through
`train.train_step` (jitted) that training vmaps. Prints a table and saves
benchmarks/results/train_step.json.

With --compile_study it also measures what the compile strategy costs: the
compile time of the train step and the step time at several lengths, and
from these the time of the first epoch and of 100 epochs under
"per_length" (one executable per length, no padding) and "bucket" (pad to
config.length_buckets). Timings are noisy on shared cores: compare ratios
within one run.

  python benchmarks/train_step.py [--models=ns22,ns33,jm,gref,lstm]
      [--length=80] [--repeats=5] [--compile_study --study_model=ns22,jm]
"""

import argparse
import json
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import default  # pylint: disable=g-import-not-at-top
from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
from nsrnn_jax import train  # pylint: disable=g-import-not-at-top

_STEP = jax.jit(train.train_step)

# Issue 4 targets (seconds per step on 2 CPU cores) and the authors' PyTorch
# times on the same kind of CPU (reference figures from the issue).
SETTINGS = {
    "ns22": dict(model="ns", num_states=2, num_stack_symbols=2,
                 target=0.060, pytorch=8.1),
    "ns33": dict(model="ns", num_states=3, num_stack_symbols=3,
                 target=0.250, pytorch=86.0),
    "jm": dict(model="jm", stack_embedding_size=20, target=0.005,
               pytorch=0.062),
    "gref": dict(model="gref", stack_embedding_size=20, target=0.005,
                 pytorch=0.340),
    "lstm": dict(model="lstm", target=0.002, pytorch=0.002),
}


def _config(name):
  config = default.get_config()
  for k, v in SETTINGS[name].items():
    if k not in ("target", "pytorch"):
      config[k] = v
  return config


def _state_and_batch(name, length, batch_size=10, seed=0):
  config = _config(name)
  model = models.build(config, vocab_size=3)
  state = train.create_train_state(config, jax.random.key(seed), model)
  rng = np.random.default_rng(seed)
  symbols = rng.integers(0, 3, size=(batch_size, length)).astype(np.int32)
  return state, symbols


def time_step(state, batch, repeats):
  """(compile seconds, median step seconds, all step seconds)."""
  start = time.perf_counter()
  state, m = _STEP(state, batch)
  jax.block_until_ready(m["loss"])
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    state, m = _STEP(state, batch)
    jax.block_until_ready((state.params, m["loss"]))
    times.append(time.perf_counter() - start)
  return compile_s, statistics.median(times), times


def bench_models(names, length, repeats):
  rows = []
  for name in names:
    state, symbols = _state_and_batch(name, length)
    compile_s, step_s, times = time_step(state, train.make_batch(symbols),
                                         repeats)
    s = SETTINGS[name]
    rows.append({"model": name, "length": length, "batch": 10,
                 "compile_s": compile_s, "step_s": step_s,
                 "min_step_s": min(times), "target_s": s["target"],
                 "pytorch_s": s["pytorch"],
                 "meets_target": min(times) <= s["target"]})
    print(f"{name:6s} compile {compile_s:7.2f} s   step median "
          f"{step_s * 1e3:9.2f} ms  min {min(times) * 1e3:9.2f} ms   target "
          f"{s['target'] * 1e3:7.1f} ms   PyTorch {s['pytorch'] * 1e3:8.0f} ms",
          flush=True)
  return rows


def compile_study(name, lengths, buckets, repeats, epochs=100,
                  steps_per_epoch=1000):
  """Measures compile/step time per length; totals for both strategies."""
  measured = {}
  state, _ = _state_and_batch(name, 4)
  needed = sorted(set(lengths) | {b for b in buckets
                                  if b >= min(lengths)
                                  and b <= max(buckets)})
  for n in needed:
    rng = np.random.default_rng(n)
    symbols = rng.integers(0, 3, size=(10, n)).astype(np.int32)
    compile_s, step_s, _ = time_step(state, train.make_batch(symbols),
                                     repeats)
    measured[n] = (compile_s, step_s)
    print(f"  length {n:3d}: compile {compile_s:6.2f} s, step "
          f"{step_s * 1e3:8.2f} ms", flush=True)
  # Interpolate the step time over all training lengths from the measured
  # ones (it is smooth in n); compile time is taken as the mean.
  xs = np.array(sorted(measured))
  step_at = lambda n: float(np.interp(n, xs, [measured[x][1] for x in xs]))
  compile_mean = float(np.mean([measured[x][0] for x in xs]))
  train_lengths = list(range(41, 80, 2))  # marked reversal: 20 odd lengths
  bucket_of = lambda n: min(b for b in buckets if b >= n)
  per_epoch_pl = steps_per_epoch * np.mean([step_at(n) for n in train_lengths])
  per_epoch_bk = steps_per_epoch * np.mean(
      [step_at(bucket_of(n)) for n in train_lengths])
  used_buckets = sorted({bucket_of(n) for n in train_lengths})
  result = {
      "model": name, "measured": {str(k): v for k, v in measured.items()},
      "compile_mean_s": compile_mean,
      "per_length": {"compiles": len(train_lengths),
                     "compile_total_s": compile_mean * len(train_lengths),
                     "epoch_steps_s": per_epoch_pl},
      "bucket": {"buckets": used_buckets, "compiles": len(used_buckets),
                 "compile_total_s": compile_mean * len(used_buckets),
                 "epoch_steps_s": per_epoch_bk},
  }
  for key in ("per_length", "bucket"):
    r = result[key]
    r["first_epoch_s"] = r["compile_total_s"] + r["epoch_steps_s"]
    r[f"{epochs}_epochs_s"] = r["compile_total_s"] + epochs * r["epoch_steps_s"]
  print(f"compile strategy ({name}, 20 lengths 41..79, {steps_per_epoch} "
        f"steps/epoch):")
  for key in ("per_length", "bucket"):
    r = result[key]
    print(f"  {key:10s}: {r['compiles']:2d} compiles = "
          f"{r['compile_total_s']:7.1f} s, steps/epoch {r['epoch_steps_s']:7.1f}"
          f" s, first epoch {r['first_epoch_s']:7.1f} s, {epochs} epochs "
          f"{r[f'{epochs}_epochs_s']:8.1f} s")
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="ns22,ns33,jm,gref,lstm")
  parser.add_argument("--length", type=int, default=80)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--compile_study", action="store_true")
  parser.add_argument("--study_model", default="ns22,jm",
                      help="comma-separated models for --compile_study")
  parser.add_argument("--study_lengths", default="41,61,79")
  parser.add_argument("--buckets", default="50,60,70,80")
  parser.add_argument("--out", default=os.path.join(
      os.path.dirname(os.path.abspath(__file__)), "results",
      "train_step.json"))
  args = parser.parse_args()
  out = {"device": str(jax.devices()[0]), "cpu_count": os.cpu_count(),
         "jax": jax.__version__}
  names = [n for n in args.models.split(",") if n]
  if names:
    out["steps"] = bench_models(names, args.length, args.repeats)
  if args.compile_study:
    out["compile_study"] = [compile_study(
        name, [int(x) for x in args.study_lengths.split(",")],
        [int(x) for x in args.buckets.split(",")], args.repeats)
                            for name in args.study_model.split(",")]
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  print(f"saved {args.out}")


if __name__ == "__main__":
  main()
