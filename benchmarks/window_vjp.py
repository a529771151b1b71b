"""Benchmark: the windowed stack's hand-written gradient against autodiff.

`limited_stack.WINDOW_VJP` = "custom" (the default: each update's
hand-written VJP and, for a chunk of coupled steps, the reverse sweep that
rebuilds the window from the two slices each update overwrote) against
"autodiff" (JAX's transpose of the same forward, which keeps the whole
D × D window at every update), compiled once each and timed with the calls
interleaved in one process:

* `chunk`: the gradient of `limited_stack.run_coupled` (a tanh controller,
  H = 8, Q-S = 2-3) for B = 10 strings of n = 80 at windows D = 10 and 35,
  one chunk (no truncation); median wall time and XLA's temporary memory;
* `log chunk`: the same gradient through `limited_log_stack.run_coupled`
  (the window's log table, config.stack_table = "log"), whose "custom"
  reverse sweep re-differentiates each update with `jax.vjp`;
* `ptb`: the PTB RNS-RNN's corpus train step (configs/ptb_rns.py: V =
  10,000, H = 256, B = 32, T = D = 35, input by lookup), forward, backward
  and SGD update of one BPTT chunk.

With `--baseline_ref=REF`, instead: the `chunk` and `log chunk`
gradients' hand-written VJPs with their stack module (`limited_stack`,
`limited_log_stack`) as of git REF ("before") against the working tree's
("after"), interleaved in one process, at windows 10, 35 and 100 (the log
window at 10 and 35): a change to a window's gradient measured before and
after in one run (`window_vjp_before_after.json`).

Usage:
  python benchmarks/window_vjp.py [--reps=7] [--note=...] [--out=...]
      [--baseline_ref=REF]
Prints a table and writes benchmarks/results/window_vjp.json, or
window_vjp_huge_pages.json when run as corpus training runs, with huge pages
(GLIBC_TUNABLES=glibc.malloc.hugetlb=1, `cli.reexec_with_huge_pages`).
"""

import argparse
import os
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position

import corpus_step  # pylint: disable=g-import-not-at-top,wrong-import-position
import machine  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import limited_log_stack  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import limited_stack  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

MODES = ("custom", "autodiff")


def _chunk_gradient(window, batch=10, length=80, q=2, s=3, hidden=8,
                    stack=limited_stack):
  """(call of the compiled gradient, its memory analysis) of one coupled
  chunk at this window; `stack` is `limited_stack` or `limited_log_stack`."""
  rng = np.random.default_rng(0)
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  params = {"wr": f(q * s, hidden), "wx": f(hidden, hidden),
            "wa": 0.3 * f(hidden, q * s * (2 * q * s + q))}
  t = length - 1
  xs, w = f(batch, t, hidden), f(batch, t + 1, q, s)

  def step_fn(p, h, x, rho):
    h = jnp.tanh(x @ p["wx"] + rho @ p["wr"])
    return h, rns_stack.split_action_logits(h @ p["wa"], q, s, False), h

  def loss(p):
    outs, hat, lm = stack.run_coupled(
        step_fn, p, jnp.zeros((batch, hidden)), xs, q, s, window)
    return (jnp.sum(outs) + jnp.sum(w * jnp.exp(hat))
            + 0.01 * jnp.sum(lm))

  compiled = jax.jit(jax.grad(loss)).lower(params).compile()
  return (lambda: compiled(params)), compiled.memory_analysis()


def _ptb_step():
  _, fn, _, temp_mib = corpus_step._step("rns", 10000, 256, True)  # pylint: disable=protected-access
  return fn, temp_mib


def _interleaved(fns, reps):
  """{name: [seconds of each call]}: each compiled fn called once to warm
  up, then `reps` rounds of one call each, in turn."""
  for fn in fns.values():
    jax.block_until_ready(fn())
  times = {name: [] for name in fns}
  for _ in range(reps):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
  return times


def _timed(builders, reps):
  """{mode: (median s, temp MiB)} with the calls interleaved."""
  fns, temp = {}, {}
  for mode in MODES:
    limited_stack.WINDOW_VJP = mode      # read while tracing
    try:
      fns[mode], temp[mode] = builders()
    finally:
      limited_stack.WINDOW_VJP = "custom"
  times = _interleaved(fns, reps)
  return {m: (float(np.median(times[m])), temp[m]) for m in MODES}


BEFORE_AFTER = (("chunk", limited_stack, (10, 35, 100)),
                ("log chunk", limited_log_stack, (10, 35)))


def _before_after(ref, reps):
  """Rows of the chunk gradients (`BEFORE_AFTER`: the share window's and
  the log window's) with their stack module at `ref` and now."""
  rows = []
  for case, module, windows in BEFORE_AFTER:
    before = machine.module_at_revision(ref, module.__name__.split(".")[-1])
    rows += [_before_after_row(case, before, module, window, reps)
             for window in windows]
  return rows


def _before_after_row(case, before, after, window, reps):
  """One row of `_before_after`: `case` at `window`, timed interleaved."""
  fns, temp = {}, {}
  for name, stack in (("before", before), ("after", after)):
    fns[name], analysis = _chunk_gradient(window, stack=stack)
    temp[name] = round(analysis.temp_size_in_bytes / 2**20, 1)
  times = _interleaved(fns, reps)
  med = {name: float(np.median(t)) for name, t in times.items()}
  best = {name: min(t) for name, t in times.items()}
  return {"case": case, "window": window, "batch": 10, "length": 80,
          "label": f"{case} gradient, D = {window}",
          "before_ms": round(1e3 * med["before"], 2),
          "after_ms": round(1e3 * med["after"], 2),
          "speedup": round(med["before"] / med["after"], 2),
          "speedup_best": round(best["before"] / best["after"], 2),
          "before_temp_mib": temp["before"],
          "after_temp_mib": temp["after"]}


def build_parser() -> argparse.ArgumentParser:
  parser = cli.OneLineArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=cli.positive_int, default=7)
  parser.add_argument("--note", default="",
                      help="appended to the result's note (e.g. the load)")
  parser.add_argument("--baseline_ref", default=None,
                      help="time the chunk gradient with limited_stack as "
                      "of this git revision against the working tree "
                      "instead (window_vjp_before_after.json)")
  parser.add_argument("--out", type=cli.output_file, default=None,
                      help="output JSON (default: benchmarks/results/"
                      "window_vjp[_huge_pages].json)")
  return parser


def main():
  args = build_parser().parse_args()
  if args.baseline_ref:
    rows = _before_after(args.baseline_ref, args.reps)
    print(f"| case | before ({args.baseline_ref}) | after | speed-up "
          "(median / best) | temporary memory, before / after |")
    print("|---|---|---|---|---|")
    for r in rows:
      print(f"| {r['label']} | {r['before_ms']:.1f} ms | {r['after_ms']:.1f} "
            f"ms | {r['speedup']:.2f}x / {r['speedup_best']:.2f}x | "
            f"{r['before_temp_mib']} / {r['after_temp_mib']} MiB |")
    machine.save_rows(
        "window_vjp_before_after.json", rows,
        machine.with_note("median of interleaved calls in one process",
                          args.note),
        out=args.out, reps=args.reps, baseline_ref=args.baseline_ref)
    return
  rows = []

  def mib(analysis):
    return round(analysis.temp_size_in_bytes / 2**20, 1)

  for case, stack in (("chunk", limited_stack),
                      ("log chunk", limited_log_stack)):
    for window in (10, 35):
      res = _timed(lambda w=window, st=stack: (lambda f, m: (f, mib(m)))(
          *_chunk_gradient(w, stack=st)), args.reps)
      rows.append({"case": case, "label": f"{case} gradient, D = {window}",
                   "window": window, "batch": 10, "length": 80,
                   **{f"{m}_ms": round(1e3 * res[m][0], 2) for m in MODES},
                   **{f"{m}_temp_mib": res[m][1] for m in MODES}})
  res = _timed(_ptb_step, args.reps)
  rows.append({"case": "ptb", "label": "PTB RNS 2-3 train step, D = 35",
               "window": 35, "batch": 32, "length": 35,
               **{f"{m}_ms": round(1e3 * res[m][0], 2) for m in MODES},
               **{f"{m}_temp_mib": res[m][1] for m in MODES}})
  print("| case | hand-written | autodiff | speed-up | temp memory, "
        "hand-written / autodiff |")
  print("|---|---|---|---|---|")
  for r in rows:
    r["speedup"] = round(r["autodiff_ms"] / r["custom_ms"], 2)
    print(f"| {r['label']} | {r['custom_ms']:.1f} ms | "
          f"{r['autodiff_ms']:.1f} ms | {r['speedup']:.2f}x | "
          f"{r['custom_temp_mib']} / {r['autodiff_temp_mib']} MiB |")
  tunables = os.environ.get("GLIBC_TUNABLES", "")
  machine.save_rows(
      "window_vjp_huge_pages.json" if tunables else "window_vjp.json", rows,
      machine.with_note(
          "median of interleaved calls in one process"
          + (f"; huge pages (GLIBC_TUNABLES={tunables})" if tunables
             else "; no huge pages"), args.note),
      out=args.out, reps=args.reps, glibc_tunables=tunables)


if __name__ == "__main__":
  main()
