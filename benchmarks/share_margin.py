"""Benchmark: what the share stack's product margin costs beside its forward.

`rns_stack.share_margin` (and `limited_stack.share_margin` for a window)
proves a share sweep flush-free per batch element by running the sweep
again with a few column-sized reductions per update (a window: also one
over its D × D ring). For B = 10, n = 80,
float32, unnormalised N(0, 3²) log-weights, Q = S = 2 and Q = S = 3 it
times, interleaved in one process, the median of 5 calls after a warm-up:

* `run`: the sweep's forward (`rns_stack.run`; `limited_stack.run` with
  --window D), jitted;
* `margin`: `share_margin` on the same inputs;

and prints their ratio. With --baseline REV it also times `share_margin`
as of git revision REV (`margin_before`, interleaved with the others: a
before/after of a change to the margin in one run). Other work shares the
CPU cores: compare the ratios of one run. Usage:

  python benchmarks/share_margin.py [--window D] [--baseline REV] [--note "..."]

Prints a table and writes benchmarks/results/share_margin.json
(share_margin_window.json with --window).
"""

import functools
import os
import sys

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position

import machine  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import limited_stack  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top,wrong-import-position

B, N = 10, 80
SIZES = (2, 3)
REPEATS = 5


def functions(window, baseline=None):
  """{run, margin[, margin_before]} jitted on push, repl, pop, for the
  window D or none (`baseline`: a git revision whose margin is timed too)."""
  name = "limited_stack" if window else "rns_stack"
  mods = {"margin": limited_stack if window else rns_stack}
  if baseline:
    mods["margin_before"] = machine.module_at_revision(baseline, name)
  run = (functools.partial(limited_stack.run, window=window) if window
         else rns_stack.run)
  fns = {"run": jax.jit(lambda *a: run(*a)[:2])}
  for key, mod in mods.items():
    fns[key] = jax.jit(functools.partial(mod.share_margin, window=window)
                       if window else mod.share_margin)
  return fns


def row(q, window, rng, baseline=None):
  """Timings of one (Q = S = q) row."""
  shapes = [(B, N, q, q, q, q)] * 2 + [(B, N, q, q, q)]
  acts = [jnp.asarray(3 * rng.normal(size=sh), jnp.float32) for sh in shapes]
  fns = functions(window, baseline)
  for fn in fns.values():                            # compilation
    jax.block_until_ready(fn(*acts))
  times = {name: [] for name in fns}
  for _ in range(REPEATS):
    for name, fn in fns.items():
      times[name].append(machine.median_seconds(fn, *acts, repeats=1,
                                                warmup=False))
  out = {"Q": q, "S": q, "B": B, "n": N, "window": window}
  for name in fns:
    out[f"{name}_s"] = float(np.median(times[name]))
  out["margin_over_run"] = out["margin_s"] / out["run_s"]
  margins = np.asarray(fns["margin"](*acts))
  out["min_margin"] = float(np.min(margins))
  if baseline:
    out["baseline"] = baseline
    out["margin_before_over_run"] = out["margin_before_s"] / out["run_s"]
    out["speedup"] = out["margin_before_s"] / out["margin_s"]
    # The change must keep the values: same margins as the baseline's.
    out["same_margins"] = bool(np.array_equal(
        margins, np.asarray(fns["margin_before"](*acts))))
  return out


def main():
  parser = cli.OneLineArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--note", default="")
  parser.add_argument("--window", type=int, default=0,
                      help="time limited_stack's with this window D")
  parser.add_argument("--baseline", default="",
                      help="also time share_margin as of this git revision")
  args = parser.parse_args()
  if args.window < 0:
    cli.fail(f"--window must be >= 0, got {args.window}")
  rng = np.random.default_rng(0)
  before = (f" margin at {args.baseline} | before / after | same margins |"
            if args.baseline else "")
  print("| Q = S | run | margin | margin / run | smallest margin |" + before)
  print("|---|---|---|---|---|" + "---|" * (3 if args.baseline else 0))
  rows = []
  for q in SIZES:
    r = row(q, args.window, rng, args.baseline or None)
    rows.append(r)
    extra = (f" {1e3 * r['margin_before_s']:.1f} ms | {r['speedup']:.2f} | "
             f"{r['same_margins']} |" if args.baseline else "")
    print(f"| {q} | {1e3 * r['run_s']:.1f} ms | {1e3 * r['margin_s']:.1f} "
          f"ms | {r['margin_over_run']:.2f} | {r['min_margin']:.1f} |" + extra,
          flush=True)
  machine.save_rows(
      "share_margin_window.json" if args.window else "share_margin.json",
      rows, args.note, margin_kind=rns_stack.MARGIN_KIND)


if __name__ == "__main__":
  main()
