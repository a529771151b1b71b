"""Benchmark of the vector nondeterministic stack (nsrnn_jax.vrns_stack).

For B=10, (Q, S, m) in the paper's VRNS sizes (1-1-3, 2-1-3, 2-3-3) and
string lengths n (T = n - 1 updates), it measures in one process, with the
variants interleaved per configuration:

* `vrns`: forward time and forward+backward time of `vrns_stack.run` (custom
  VJP, O(n²·m) memory), median of a few jitted calls;
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

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position

from nsrnn_jax import ns_stack  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import vrns_stack  # pylint: disable=g-import-not-at-top,wrong-import-position


def _inputs(b, t, q, s, m, seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return (f(b, t, q, s, q, s), f(b, t, q, s, q, s), f(b, t, q, s, q),
          jax.nn.log_sigmoid(f(b, t, m)), jax.nn.log_sigmoid(f(m)))


def _vrns_fns(b, t, q, s, m):
  args = _inputs(b, t, q, s, m)
  c = jnp.asarray(np.random.default_rng(1).normal(size=(b, t + 1, q, s, m)),
                  jnp.float32)

  def loss(*a):
    rho, log_mass = vrns_stack.run(*a)
    return jnp.sum(c * rho) + 0.1 * jnp.sum(log_mass)

  fwd = jax.jit(vrns_stack.run)
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


def _time(fn, args, reps):
  jax.block_until_ready(fn(*args))  # compile + warm up
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e3


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--batch", type=int, default=10)
  parser.add_argument("--reps", type=int, default=3)
  args = parser.parse_args()
  sizes = [(2, 3, 3)] if args.quick else [(1, 1, 3), (2, 1, 3), (2, 3, 3)]
  lengths = (20, 40) if args.quick else (20, 40, 80)
  rows = []
  print(f"{'Q-S-m':>6} {'n':>4} {'variant':>8} {'fwd ms':>9} "
        f"{'fwd+bwd ms':>11} {'grad temp MiB':>14}")
  for q, s, m in sizes:
    for n in lengths:
      t = n - 1
      variants = [("vrns", _vrns_fns(args.batch, t, q, s, m)),
                  ("vrns_m1", _vrns_fns(args.batch, t, q, s, 1)),
                  ("ns", _ns_fns(args.batch, t, q, s))]
      for name, (fwd, grad, fargs) in variants:
        fwd_ms = _time(fwd, fargs, args.reps)
        grad_ms = _time(grad, fargs, args.reps)
        temp = grad.lower(*fargs).compile().memory_analysis()
        temp_mib = temp.temp_size_in_bytes / 2**20
        row = {"Q": q, "S": s, "m": m if name == "vrns" else (
            1 if name == "vrns_m1" else None), "n": n, "variant": name,
               "batch": args.batch, "fwd_ms": round(fwd_ms, 2),
               "fwd_bwd_ms": round(grad_ms, 2),
               "grad_temp_mib": round(temp_mib, 3)}
        rows.append(row)
        print(f"{q}-{s}-{m:<2} {n:>4} {name:>8} {fwd_ms:9.1f} {grad_ms:11.1f}"
              f" {temp_mib:14.2f}")
  out = {"device": jax.devices()[0].device_kind, "platform": platform.node(),
         "jax": jax.__version__, "dtype": "float32",
         "note": "CPU shared with other jobs; compare ratios within a run",
         "rows": rows}
  name = "vrns_stack_quick.json" if args.quick else "vrns_stack.json"
  path = os.path.join(_ROOT, "benchmarks", "results", name)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(out, f, indent=2)
    f.write("\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
