"""Benchmark: one corpus train step (a BPTT chunk) at PTB size.

`corpus_train.train_chunk` (forward, backward and the SGD update of one
chunk of B rows × T tokens, the carried state in and out) for the PTB
configs' models (configs/ptb_*.py: V = 10,000 words, H = 256, B = 32,
T = 35, D = 35), each with the controller's input as a one-hot product
(the default) and by row lookup (`input_lookup`), compiled once and timed
with the calls interleaved in one process, float32; also the compiled
step's temporary memory (XLA's memory analysis). For the VRNS, a third
variant runs the window in the log-space representation
(`limited_vrns.initial_state(..., log_space=True)`, the stack before the
share representation), input by lookup, to give the shares' speed-up; for
the RNS and the VRNS, "sliced" reads the input by lookup with the input
matrix sliced inside the time loop, as before `models.split_input_matrix`. The words are random
ids; the step's cost does not depend on them.

Usage:
  python benchmarks/corpus_step.py                 # lstm, rns 2-3, vrns 1-5-20
  python benchmarks/corpus_step.py --quick         # V = 1,000, H = 64, lstm + rns
Prints a table and writes benchmarks/results/corpus_step.json
(corpus_step_quick.json with --quick; --out elsewhere, e.g. on a GPU:
benchmarks/gpu_session.sh corpus).
"""

import argparse
import contextlib
import inspect
import os
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

import machine  # pylint: disable=g-import-not-at-top,wrong-import-position
from configs import ptb_lstm, ptb_rns, ptb_vrns  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import corpus_train  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import limited_vrns  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import models  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

CONFIGS = {"lstm": ptb_lstm, "rns": ptb_rns, "vrns": ptb_vrns}


@contextlib.contextmanager
def _tracing_as_before(log_space, sliced):
  """While tracing: the VRNS window in log space (`log_space=True`), and/or
  the input matrix sliced in the loop (`split_input_matrix` a no-op)."""
  originals = (limited_vrns.coupled_parts, models.split_input_matrix)
  if log_space:
    signature = inspect.signature(originals[0])

    def in_log_space(*args, **kwargs):
      # log_space=True however the model passes it (by position or name).
      bound = signature.bind(*args, **kwargs)
      bound.arguments["log_space"] = True
      return originals[0](*bound.args, **bound.kwargs)

    limited_vrns.coupled_parts = in_log_space
  if sliced:
    models.split_input_matrix = lambda params, vocab_size: params
  try:
    yield
  finally:
    limited_vrns.coupled_parts, models.split_input_matrix = originals


def _step(name, vocab, hidden, lookup, log_space=False, sliced=False,
          baseline=None):
  config = CONFIGS[name].get_config()
  config.hidden_size = hidden
  config.input_lookup = lookup
  model = models.build(config, vocab_size=vocab)
  state = corpus_train.create_train_state(config, model, jax.random.key(0))
  b, t = int(config.batch_size), int(config.bptt_length)
  rng = np.random.default_rng(0)
  batch = {"inputs": rng.integers(0, vocab, (b, t)).astype(np.int32),
           "targets": rng.integers(0, vocab, (b, t)).astype(np.int32),
           "mask": np.ones((b, t), np.float32)}
  with _tracing_as_before(log_space, sliced), \
      machine.window_stacks_at(baseline):
    carry = model.apply({"params": state.params}, b,
                        method="initial_stream_state")
    compiled = jax.jit(corpus_train.train_chunk).lower(
        state, batch, carry).compile()
  memory = compiled.memory_analysis()
  label = {"lstm": "LSTM",
           "rns": f"RNS {config.num_states}-{config.num_stack_symbols}",
           "vrns": f"VRNS {config.num_states}-{config.num_stack_symbols}-"
                   f"{config.stack_vector_size}"}[name]
  if name != "lstm":
    label += f", D = {config.stack_window}"
  temp_mib = (None if memory is None
              else round(memory.temp_size_in_bytes / 2 ** 20, 1))
  return label, (lambda: compiled(state, batch, carry)), config, temp_mib


def build_parser() -> argparse.ArgumentParser:
  parser = cli.OneLineArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--reps", type=cli.positive_int, default=5)
  parser.add_argument("--models", default="lstm,rns,vrns",
                      help=f"comma-separated subset of {','.join(CONFIGS)}")
  parser.add_argument("--note", default="",
                      help="appended to the result's note (e.g. the load)")
  parser.add_argument("--baseline", default="",
                      help="also time the stack models' step with the "
                      "window stacks as of this git revision")
  parser.add_argument("--out", type=cli.output_file, default=None,
                      help="output JSON (default: benchmarks/results/"
                      "corpus_step[_quick].json)")
  return parser


def main():
  args = build_parser().parse_args()
  unknown = set(args.models.split(",")) - set(CONFIGS)
  if unknown:
    cli.fail(f"unknown --models {sorted(unknown)}; expected a subset "
             f"of {','.join(CONFIGS)}")
  vocab, hidden = (1000, 64) if args.quick else (10000, 256)
  names = ["lstm", "rns"] if args.quick else args.models.split(",")
  rows = []
  for name in names:
    fns = {}
    variants = ([False, True] + (["sliced"] if name != "lstm" else [])
                + (["log_space"] if name == "vrns" else [])
                + (["baseline"] if name != "lstm" and args.baseline
                   else []))
    for variant in variants:
      label, fn, config, temp_mib = _step(
          name, vocab, hidden, bool(variant), variant == "log_space",
          variant == "sliced",
          args.baseline if variant == "baseline" else None)
      start = time.perf_counter()
      jax.block_until_ready(fn())
      fns[variant] = (fn, time.perf_counter() - start, temp_mib)
    times = {v: [] for v in variants}
    for _ in range(args.reps):
      for variant in variants:  # interleaved
        start = time.perf_counter()
        jax.block_until_ready(fns[variant][0]())
        times[variant].append(time.perf_counter() - start)
    med = {k: float(np.median(v)) for k, v in times.items()}
    row = {"model": name, "label": label, "vocab": vocab, "hidden": hidden,
           "batch": int(config.batch_size), "bptt": int(config.bptt_length),
           "one_hot_ms": round(1e3 * med[False], 2),
           "lookup_ms": round(1e3 * med[True], 2),
           "speedup": round(med[False] / med[True], 2),
           "first_call_s": {"one_hot": round(fns[False][1], 2),
                            "lookup": round(fns[True][1], 2)},
           # XLA's temporary buffers of the compiled step (activations,
           # residuals of the backward), beside the state it reads.
           "temp_mib": {"one_hot": fns[False][2], "lookup": fns[True][2]}}
    if "sliced" in fns:
      row["sliced_ms"] = round(1e3 * med["sliced"], 2)
      row["split_speedup"] = round(med["sliced"] / med[True], 2)
      row["first_call_s"]["sliced"] = round(fns["sliced"][1], 2)
      row["temp_mib"]["sliced"] = fns["sliced"][2]
    if "log_space" in fns:
      row["log_space_ms"] = round(1e3 * med["log_space"], 2)
      row["shares_speedup"] = round(med["log_space"] / med[True], 2)
      row["first_call_s"]["log_space"] = round(fns["log_space"][1], 2)
      row["temp_mib"]["log_space"] = fns["log_space"][2]
    if "baseline" in fns:
      row["baseline"] = args.baseline
      row["baseline_ms"] = round(1e3 * med["baseline"], 2)
      row["baseline_speedup"] = round(med["baseline"] / med[True], 2)
      row["first_call_s"]["baseline"] = round(fns["baseline"][1], 2)
      row["temp_mib"]["baseline"] = fns["baseline"][2]
    rows.append(row)
    print(f"{label:>24}  one-hot {row['one_hot_ms']:9.1f} ms  lookup "
          f"{row['lookup_ms']:9.1f} ms  {row['speedup']:.2f}x", flush=True)
    if "sliced" in fns:
      print(f"{'':>24}  input matrix sliced in the loop "
            f"{row['sliced_ms']:9.1f} ms: split {row['split_speedup']:.2f}x "
            "faster", flush=True)
    if "log_space" in fns:
      print(f"{'':>24}  log-space window {row['log_space_ms']:9.1f} ms: "
            f"shares {row['shares_speedup']:.2f}x faster", flush=True)
    if "baseline" in row:
      print(f"{'':>24}  window stacks at {args.baseline} "
            f"{row['baseline_ms']:9.1f} ms: now {row['baseline_speedup']:.2f}x"
            " faster", flush=True)
  machine.save_rows(
      "corpus_step_quick.json" if args.quick else "corpus_step.json", rows,
      machine.with_note("train step of one chunk, median of interleaved "
                        "calls in one process", args.note),
      out=args.out, reps=args.reps)


if __name__ == "__main__":
  main()
