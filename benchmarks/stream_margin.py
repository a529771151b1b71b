"""Benchmark: what a corpus run's stack margin costs its evaluation.

With `config.valid_stack_margin` a corpus run evaluates each chunk with
`corpus_train.eval_chunk_margin` (`model.stream_with_margin`: the window's
updates with their product margins, forward only) instead of
`corpus_train.eval_chunk`. For the PTB configs' stack models
(configs/ptb_rns.py, ptb_vrns.py: V = 10,000 words, H = 256, B = 32 rows,
T = 35 tokens, window D = 35, input by lookup) it times both on one chunk
of random ids, interleaved in one process (the median of --reps calls after
a warm-up), float32, and prints their ratio and the chunk's smallest margin.
With --baseline REV it also times `eval_chunk_margin` with the window
stacks (limited_stack, limited_vrns) as of git revision REV (a before/after
in one run). Other work shares the CPU cores: compare the ratios of one
run. Usage:

  python benchmarks/stream_margin.py            # rns 2-3, vrns 1-5-20
  python benchmarks/stream_margin.py --quick    # V = 1,000, H = 64
  python benchmarks/stream_margin.py --baseline 2c66e1e

Prints a table and writes benchmarks/results/stream_margin.json
(stream_margin_quick.json with --quick).
"""

import argparse
import functools
import os
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

import machine  # pylint: disable=g-import-not-at-top,wrong-import-position
from configs import ptb_rns, ptb_vrns  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import corpus_train  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import models  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top,wrong-import-position

CONFIGS = {"rns": ptb_rns, "vrns": ptb_vrns}


def row(name: str, vocab: int, hidden: int, reps: int,
        overrides=None, baseline=None) -> dict:
  """Timings of one model: eval_chunk and eval_chunk_margin, interleaved
  (`overrides`: config fields to change, e.g. for a small test;
  `baseline`: a git revision whose window stacks' margin is timed too)."""
  config = CONFIGS[name].get_config()
  config.hidden_size = hidden
  config.update(overrides or {})
  model = models.build(config, vocab_size=vocab)
  params = corpus_train.create_train_state(config, model,
                                           jax.random.key(0)).params
  b, t = int(config.batch_size), int(config.bptt_length)
  rng = np.random.default_rng(0)
  batch = {"inputs": rng.integers(0, vocab, (b, t)).astype(np.int32),
           "targets": rng.integers(0, vocab, (b, t)).astype(np.int32),
           "mask": np.ones((b, t), np.float32)}
  carry = model.apply({"params": params}, b, method="initial_stream_state")
  fns = {key: jax.jit(functools.partial(fn, apply_fn=model.apply))
         for key, fn in (("eval", corpus_train.eval_chunk),
                         ("margin", corpus_train.eval_chunk_margin))}
  outs = {key: jax.block_until_ready(fn(params, batch, carry))  # compile
          for key, fn in fns.items()}
  carries = {key: carry for key in fns}
  if baseline:
    fns["before"] = jax.jit(functools.partial(corpus_train.eval_chunk_margin,
                                              apply_fn=model.apply))
    with machine.window_stacks_at(baseline):   # traced (compiled) here, kept
      # The revision's own state types (NamedTuples of its modules).
      carries["before"] = model.apply({"params": params}, b,
                                      method="initial_stream_state")
      outs["before"] = jax.block_until_ready(
          fns["before"](params, batch, carries["before"]))
  times = {key: [] for key in fns}
  for _ in range(reps):
    for key, fn in fns.items():  # interleaved
      start = time.perf_counter()
      jax.block_until_ready(fn(params, batch, carries[key]))
      times[key].append(time.perf_counter() - start)
  med = {key: float(np.median(v)) for key, v in times.items()}
  label = f"{name.upper()} {config.num_states}-{config.num_stack_symbols}"
  if name == "vrns":
    label += f"-{config.stack_vector_size}"
  out = {"model": name, "label": f"{label}, D = {config.stack_window}",
          "vocab": vocab, "hidden": hidden, "batch": b, "bptt": t,
          "eval_ms": round(1e3 * med["eval"], 2),
          "margin_ms": round(1e3 * med["margin"], 2),
          "margin_over_eval": round(med["margin"] / med["eval"], 2),
          # The margin evaluation's cross-entropy sum is the plain one's.
          "same_nll": bool(np.allclose(np.asarray(outs["eval"][1]),
                                       np.asarray(outs["margin"][1]),
                                       rtol=1e-5)),
          "min_margin": float(np.min(np.asarray(outs["margin"][3])))}
  if baseline:
    out.update(
        baseline=baseline, before_ms=round(1e3 * med["before"], 2),
        before_over_eval=round(med["before"] / med["eval"], 2),
        speedup=round(med["before"] / med["margin"], 2),
        # The change must keep the values: the baseline's margins.
        same_margins=bool(np.array_equal(np.asarray(outs["margin"][3]),
                                         np.asarray(outs["before"][3]))))
  return out


def build_parser() -> argparse.ArgumentParser:
  parser = cli.OneLineArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--reps", type=cli.positive_int, default=5)
  parser.add_argument("--baseline", default="",
                      help="also time the margin with the window stacks "
                           "as of this git revision")
  parser.add_argument("--note", default="",
                      help="appended to the result's note (e.g. the load)")
  return parser


def main():
  args = build_parser().parse_args()
  vocab, hidden = (1000, 64) if args.quick else (10000, 256)
  before = (f" margin at {args.baseline} | before / after | same margins |"
            if args.baseline else "")
  print("| model | eval_chunk | eval_chunk_margin | ratio | smallest margin |"
        + before)
  print("|---|---|---|---|---|" + "---|" * (3 if args.baseline else 0))
  rows = []
  for name in CONFIGS:
    r = row(name, vocab, hidden, args.reps, baseline=args.baseline or None)
    rows.append(r)
    extra = (f" {r['before_ms']:.1f} ms | {r['speedup']:.2f} | "
             f"{r['same_margins']} |" if args.baseline else "")
    print(f"| {r['label']} | {r['eval_ms']:.1f} ms | {r['margin_ms']:.1f} ms "
          f"| {r['margin_over_eval']:.2f} | {r['min_margin']:.1f} |" + extra,
          flush=True)
  machine.save_rows(
      "stream_margin_quick.json" if args.quick else "stream_margin.json",
      rows, machine.with_note("one evaluation chunk, median of interleaved "
                              "calls in one process", args.note),
      reps=args.reps, margin_kind=rns_stack.MARGIN_KIND)


if __name__ == "__main__":
  main()
