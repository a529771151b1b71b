"""Benchmark of the vector nondeterministic stack (nsrnn_jax.vrns_stack).

For B=10, (Q, S, m) in the paper's VRNS sizes (1-1-3, 2-1-3, 2-3-3) and
string lengths n (T = n - 1 updates), it measures in one process, with the
variants interleaved per configuration:

* `vrns`: forward time and forward+backward time of `vrns_stack.run` (the
  default: `rns_stack.run_coupled_vectors`'s share sweep, O(n²) memory
  custom VJP), median of a few jitted calls;
* `vrns_log_space`: the same stack on the log-space tables
  (`log_space=True`, the reference and the broadcast bottom's path);
* `vrns_m1`: the same with m = 1 (the cost of the scalar stack inside the
  VRNS; the RNS-RNN's state readings, `vrns_stack` with a constant vector);
* `ns`: `ns_stack.run` (the CoNLL 2020 NS stack, normalised actions,
  scaled-linear storage) at the same (Q, S), for scale;
* XLA's static buffer plan of the jitted gradient
  (`compiled.memory_analysis().temp_size_in_bytes`).

The loss is Σ c·ρ + 0.1·Σ log-mass with random unnormalised log-weights
(float32). Other work shares the CPU cores: compare ratios within one run.

Usage:
  python benchmarks/vrns_stack.py            # n in {20, 40, 80}
  python benchmarks/vrns_stack.py --quick    # n in {20, 40}, 2-3-3 only
Prints a table and writes benchmarks/results/vrns_stack.json
(vrns_stack_quick.json with --quick).

Before/after comparison of a change to the VRNS DP (`--compare`): the
current `vrns_stack.run` against `vrns_stack.py` as of a git revision
(`--before`, loaded from `git show`), the RNS stack (`rns_stack.run`, the
ICLR 2022/2023 scalar stack, same unnormalised inputs) and the NS stack, at
one size (default n = 80, B = 10, Q-S-m = 2-3-3), forward and
forward+backward, all calls interleaved in one process (median and min of
--reps calls):

  python benchmarks/vrns_stack.py --compare --before=271ee1f
writes benchmarks/results/vrns_stack_speed.json.
"""

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position

import machine  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import ns_stack  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import vrns_stack  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position


def _inputs(b, t, q, s, m, seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return (f(b, t, q, s, q, s), f(b, t, q, s, q, s), f(b, t, q, s, q),
          jax.nn.log_sigmoid(f(b, t, m)), jax.nn.log_sigmoid(f(m)))


def _vrns_fns(b, t, q, s, m, module=vrns_stack, log_space=False):
  args = _inputs(b, t, q, s, m)
  c = jnp.asarray(np.random.default_rng(1).normal(size=(b, t + 1, q, s, m)),
                  jnp.float32)
  run = module.run
  if log_space:
    run = lambda *a: module.run(*a, log_space=True)

  def loss(*a):
    rho, log_mass = run(*a)
    return jnp.sum(c * rho) + 0.1 * jnp.sum(log_mass)

  fwd = jax.jit(run)
  grad = jax.jit(jax.grad(loss, argnums=tuple(range(5))))
  return fwd, grad, args


def _ns_fns(b, t, q, s):
  push, repl, pop = _inputs(b, t, q, s, 1)[:3]
  # The NS stack expects normalised actions: log-softmax per (q, x) row.
  flat = jnp.concatenate([push.reshape(b, t, q * s, -1),
                          repl.reshape(b, t, q * s, -1),
                          pop.reshape(b, t, q * s, -1)], -1)
  flat = jax.nn.log_softmax(flat, -1)
  n = q * s
  args = (flat[..., :n].reshape(push.shape),
          flat[..., n:2 * n].reshape(repl.shape),
          flat[..., 2 * n:].reshape(pop.shape))
  c = jnp.asarray(np.random.default_rng(1).normal(size=(b, t + 1, s)),
                  jnp.float32)

  def loss(*a):
    readings, log_mass = ns_stack.run(*a)
    return jnp.sum(c * readings) + 0.1 * jnp.sum(log_mass)

  return (jax.jit(ns_stack.run), jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
          args)


def _rns_fns(b, t, q, s):
  push, repl, pop = _inputs(b, t, q, s, 1)[:3]
  c = jnp.asarray(np.random.default_rng(1).normal(size=(b, t + 1, q, s)),
                  jnp.float32)

  def loss(*a):
    log_alpha_hat, log_mass = rns_stack.run(*a)
    return jnp.sum(c * jnp.exp(log_alpha_hat)) + 0.1 * jnp.sum(log_mass)

  return (jax.jit(rns_stack.run), jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
          (push, repl, pop))


def compare(args):
  """Interleaved before/after timings of the VRNS DP plus RNS and NS."""
  b, n, (q, s, m) = args.batch, args.length, (2, 3, 3)
  t = n - 1
  variants = {"vrns": _vrns_fns(b, t, q, s, m)}
  if args.before:
    before = machine.module_at_revision(args.before, "vrns_stack")
    variants["vrns_before"] = _vrns_fns(b, t, q, s, m, before)
  variants["rns"] = _rns_fns(b, t, q, s)
  variants["ns"] = _ns_fns(b, t, q, s)
  calls = [(name, kind, fn, fargs) for name, (fwd, grad, fargs)
           in variants.items() for kind, fn in (("fwd", fwd), ("fwd_bwd",
                                                               grad))]
  compile_s = {}
  for name, kind, fn, fargs in calls:  # compile + warm up
    start = time.perf_counter()
    jax.block_until_ready(fn(*fargs))
    compile_s[f"{name}/{kind}"] = time.perf_counter() - start
  times = {f"{name}/{kind}": [] for name, kind, _, _ in calls}
  for _ in range(args.reps):  # interleaved: load changes hit every variant
    for name, kind, fn, fargs in calls:
      start = time.perf_counter()
      jax.block_until_ready(fn(*fargs))
      times[f"{name}/{kind}"].append(time.perf_counter() - start)
  rows = []
  print(f"B={b} n={n} Q-S-m={q}-{s}-{m}, {args.reps} interleaved calls")
  print(f"{'variant':>12} {'pass':>8} {'median ms':>10} {'min ms':>9} "
        f"{'first call s':>13}")
  for key, ts in times.items():
    name, kind = key.split("/")
    row = {"variant": name, "pass": kind, "median_ms": round(
        float(np.median(ts)) * 1e3, 1), "min_ms": round(min(ts) * 1e3, 1),
           "first_call_s": round(compile_s[key], 2)}
    rows.append(row)
    print(f"{name:>12} {kind:>8} {row['median_ms']:10.1f} "
          f"{row['min_ms']:9.1f} {row['first_call_s']:13.2f}")
  ratios = {}
  for kind in ("fwd", "fwd_bwd"):
    get = lambda v: float(np.median(times[f"{v}/{kind}"]))  # pylint: disable=cell-var-from-loop
    if "vrns_before" in variants:
      ratios[f"before_over_after_{kind}"] = round(get("vrns_before") /
                                                  get("vrns"), 2)
    ratios[f"vrns_over_rns_{kind}"] = round(get("vrns") / get("rns"), 2)
    ratios[f"vrns_over_ns_{kind}"] = round(get("vrns") / get("ns"), 2)
  print("ratios of medians:", ratios)
  load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
  info = machine.machine_info()
  out = {"device": machine.device_label(info), "machine": info,
         "platform": platform.node(),
         "jax": jax.__version__, "dtype": "float32", "batch": b, "n": n,
         "Q": q, "S": s, "m": m, "before": args.before, "reps": args.reps,
         "load_average_1min": load,
         "note": f"{args.note}; calls interleaved in one process, compare "
                 "ratios", "rows": rows, "ratios": ratios}
  path = args.out or os.path.join(_ROOT, "benchmarks", "results",
                                  "vrns_stack_speed.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(out, f, indent=2)
    f.write("\n")
  print(f"wrote {path}")


def build_parser() -> argparse.ArgumentParser:
  parser = cli.OneLineArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--batch", type=int, default=10)
  parser.add_argument("--reps", type=cli.positive_int, default=3)
  parser.add_argument("--compare", action="store_true",
                      help="before/after + RNS + NS at one size")
  parser.add_argument("--before", default=None,
                      help="git revision of the 'before' vrns_stack.py")
  parser.add_argument("--note", default="CPU shared with other jobs",
                      help="how the machine was used, saved in the JSON")
  parser.add_argument("--length", type=int, default=80,
                      help="string length n of --compare (T = n - 1)")
  parser.add_argument("--out", type=cli.output_file, default=None,
                      help="output JSON (default: benchmarks/results/"
                      "vrns_stack_speed.json with --compare, else "
                      "vrns_stack[_quick].json)")
  return parser


def main():
  parser = build_parser()
  args = parser.parse_args()
  if args.before and not args.compare:
    # The plain run has no before side: it would time without it.
    parser.error("--before needs --compare")
  if args.compare:
    compare(args)
    return
  sizes = [(2, 3, 3)] if args.quick else [(1, 1, 3), (2, 1, 3), (2, 3, 3)]
  lengths = (20, 40) if args.quick else (20, 40, 80)
  rows = []
  print(f"{'Q-S-m':>6} {'n':>4} {'variant':>8} {'fwd ms':>9} "
        f"{'fwd+bwd ms':>11} {'grad temp MiB':>14}")
  for q, s, m in sizes:
    for n in lengths:
      t = n - 1
      variants = [("vrns", _vrns_fns(args.batch, t, q, s, m)),
                  ("vrns_log_space", _vrns_fns(args.batch, t, q, s, m,
                                               log_space=True)),
                  ("vrns_m1", _vrns_fns(args.batch, t, q, s, 1)),
                  ("ns", _ns_fns(args.batch, t, q, s))]
      for name, (fwd, grad, fargs) in variants:
        fwd_ms = 1e3 * machine.median_seconds(fwd, *fargs, repeats=args.reps)
        grad_ms = 1e3 * machine.median_seconds(grad, *fargs,
                                                repeats=args.reps)
        temp = grad.lower(*fargs).compile().memory_analysis()
        temp_mib = temp.temp_size_in_bytes / 2**20
        row = {"Q": q, "S": s, "m": m if name.startswith("vrns_l") or
               name == "vrns" else (1 if name == "vrns_m1" else None),
               "n": n, "variant": name,
               "batch": args.batch, "fwd_ms": round(fwd_ms, 2),
               "fwd_bwd_ms": round(grad_ms, 2),
               "grad_temp_mib": round(temp_mib, 3)}
        rows.append(row)
        print(f"{q}-{s}-{m:<2} {n:>4} {name:>8} {fwd_ms:9.1f} {grad_ms:11.1f}"
              f" {temp_mib:14.2f}")
  info = machine.machine_info()
  out = {"device": machine.device_label(info), "machine": info,
         "platform": platform.node(), "jax": jax.__version__,
         "dtype": "float32",
         "note": f"{args.note}; compare ratios within a run", "rows": rows}
  name = "vrns_stack_quick.json" if args.quick else "vrns_stack.json"
  path = args.out or os.path.join(_ROOT, "benchmarks", "results", name)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(out, f, indent=2)
    f.write("\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
