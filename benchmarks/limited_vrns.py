"""Benchmark: the memory-limited vector stack against the unlimited one.

For B = 10 and Q-S-m = 2-3-3 (the ICLR 2023 paper's largest VRNS), it times
forward and forward+backward passes of `limited_vrns.run` (window D, plain
autodiff of its scan; the default share representation and, as
"log space", `log_space=True`) at string lengths n (T = n − 1 updates) and of
`vrns_stack.run` (unlimited, O(n²) custom VJP on the share sweep; its
log-space tables, O(n²·m), at the shorter lengths), all
in one process with the calls interleaved per length, and reports the time
per update: constant in n for the window (linear time), growing with n
without it. Random unnormalised log-weights, float32; the loss is
Σ c·ρ + 0.1·Σ log-mass. Other work shares the CPU cores: compare ratios
within one run.

Usage:
  python benchmarks/limited_vrns.py           # D in {10, 35}, n up to 320
  python benchmarks/limited_vrns.py --quick   # D = 10, n in {20, 40}
Prints a table and writes benchmarks/results/limited_vrns.json
(limited_vrns_quick.json with --quick).
"""

import os
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position

import machine  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import limited_vrns  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import vrns_stack  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

Q, S, M = 2, 3, 3


def _inputs(b, t, seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return (f(b, t, Q, S, Q, S), f(b, t, Q, S, Q, S), f(b, t, Q, S, Q),
          jax.nn.log_sigmoid(f(b, t, M)),
          jax.nn.log_sigmoid(f(b, M)))


def _fns(run, b, t):
  args = _inputs(b, t)
  c = jnp.asarray(np.random.default_rng(1).normal(size=(b, t + 1, Q, S, M)),
                  jnp.float32)

  def loss(*a):
    rho, log_mass = run(*a)[:2]
    return jnp.sum(c * rho) + 0.1 * jnp.sum(log_mass)

  fwd = jax.jit(lambda *a: run(*a)[:2])
  grad = jax.jit(jax.grad(loss, argnums=tuple(range(5))))
  return {"fwd": fwd, "fwd_bwd": grad}, args


def _time(fn, args, reps):
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  first = time.perf_counter() - start
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times)), float(np.min(times)), first


def main():
  parser = cli.OneLineArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--batch", type=int, default=10)
  parser.add_argument("--reps", type=cli.positive_int, default=3)
  parser.add_argument("--note", default="",
                      help="appended to the result's note (e.g. the load)")
  args = parser.parse_args()
  if args.quick:
    windows, lengths, log_space_upto = (10,), (20, 40), 40
  else:
    windows, lengths, log_space_upto = (10, 35), (40, 80, 160, 320), 80
  rows = []
  for n in lengths:
    variants = [(f"limited D={d}{', log space' if ls else ''}",
                 lambda *a, d=d, ls=ls: limited_vrns.run(
                     *a[:4], a[4], d, log_space=ls))
                for d in windows for ls in (False, True)]
    variants.append(("unlimited", vrns_stack.run))
    if n <= log_space_upto:
      variants.append(("unlimited, log space",
                       lambda *a: vrns_stack.run(*a, log_space=True)))
    fns = {name: _fns(run, args.batch, n - 1) for name, run in variants}
    for pass_ in ("fwd", "fwd_bwd"):
      for name, (passes, inputs) in fns.items():
        median, best, first = _time(passes[pass_], inputs, args.reps)
        rows.append({"variant": name, "n": n, "pass": pass_,
                     "median_ms": round(1e3 * median, 2),
                     "min_ms": round(1e3 * best, 2),
                     "per_update_ms": round(1e3 * median / (n - 1), 3),
                     "first_call_s": round(first, 2)})
        print(f"{name:>14}  n={n:<4} {pass_:<8} median {1e3 * median:9.1f} ms"
              f"  per update {1e3 * median / (n - 1):7.3f} ms", flush=True)
  print()
  print("| variant | n | pass | median | per update |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['variant']} | {r['n']} | {r['pass']} | {r['median_ms']} ms "
          f"| {r['per_update_ms']} ms |")
  machine.save_rows(
      "limited_vrns_quick.json" if args.quick else "limited_vrns.json", rows,
      machine.with_note("calls interleaved per length in one process; "
                        "compare ratios within this run", args.note),
      batch=args.batch, Q=Q, S=S, m=M, reps=args.reps)


if __name__ == "__main__":
  main()
