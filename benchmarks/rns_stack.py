"""Benchmark of the memory-limited stack (nsrnn_jax.limited_stack) vs length.

The claim checked: at a fixed window D the cost per symbol is flat in the
string length n (linear total), for incremental evaluation and for chunked
training (truncated BPTT), while the unlimited stack (nsrnn_jax.rns_stack)
grows with n.

For B = 4, Q = 2, S = 3, D = 20 (float32, unnormalised actions) and
n ∈ {100, 250, 500, 1000, 2000} it measures in one process:

* `eval`: forward time per symbol of `limited_stack.run` (median of 3
  jitted calls after a warm-up) and XLA's static buffer plan
  (`compiled.memory_analysis().temp_size_in_bytes`) per symbol;
* `train`: the same for the gradient of a small tanh controller + limited
  stack through `limited_stack.run_coupled` with truncation_length 35
  (a scan over chunks, gradients stopped at chunk boundaries);
* `unlimited`: `rns_stack.run` forward at n ∈ {100, 250} for contrast.

Other work shares the CPU cores: compare the per-symbol figures within one
run. Usage:

  python benchmarks/rns_stack.py           # the table above
  python benchmarks/rns_stack.py --quick   # n ∈ {100, 500}

Prints a table and writes benchmarks/results/rns_stack.json
(rns_stack_quick.json with --quick).
"""

import argparse
import json
import os
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position

from nsrnn_jax import limited_stack  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top,wrong-import-position

B, Q, S, D, H, V, CHUNK = 4, 2, 3, 20, 20, 3, 35


def _median_time(fn, *args, repeats=3):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _temp_bytes(fn, *args):
  return int(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes)


def _actions(rng, n):
  shapes = [(B, n, Q, S, Q, S)] * 2 + [(B, n, Q, S, Q)]
  return [jnp.asarray(3 * rng.normal(size=sh), jnp.float32) for sh in shapes]


def _step_fn(p, h, x, rho):
  h = jnp.tanh(jax.nn.one_hot(x, V, dtype=rho.dtype) @ p["wx"]
               + rho @ p["wr"] + h @ p["wh"])
  return h, rns_stack.split_action_logits(h @ p["wa"], Q, S, False), h @ p[
      "wo"]


def _measure(n, rng):
  row = {"n": n}
  acts = _actions(rng, n)
  fwd = jax.jit(lambda a, b, c: limited_stack.run(a, b, c, D)[:2])
  row["eval_us_per_symbol"] = 1e6 * _median_time(fwd, *acts) / n
  row["eval_temp_bytes_per_symbol"] = _temp_bytes(fwd, *acts) / n
  params = {k: jnp.asarray(0.3 * rng.normal(size=sh), jnp.float32)
            for k, sh in (("wx", (V, H)), ("wr", (Q * S, H)), ("wh", (H, H)),
                          ("wa", (H, Q * S * (2 * Q * S + Q))),
                          ("wo", (H, V)))}
  xs = jnp.asarray(rng.integers(0, V, size=(B, n)))

  def loss(p):
    outs, hat, lm = limited_stack.run_coupled(
        _step_fn, p, jnp.zeros((B, H)), xs, Q, S, D,
        truncation_length=CHUNK)
    return jnp.sum(outs ** 2) + jnp.sum(rns_stack.readout(hat)[0][..., 1])

  grad = jax.jit(jax.grad(loss))
  row["train_us_per_symbol"] = 1e6 * _median_time(grad, params) / n
  row["train_temp_bytes_per_symbol"] = _temp_bytes(grad, params) / n
  if n <= 250:
    unl = jax.jit(lambda a, b, c: rns_stack.run(a, b, c))
    row["unlimited_eval_us_per_symbol"] = 1e6 * _median_time(unl, *acts) / n
    row["unlimited_eval_temp_bytes_per_symbol"] = _temp_bytes(unl,
                                                              *acts) / n
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="n in {100, 500} only")
  parser.add_argument("--out", default=None, help="JSON path")
  args = parser.parse_args()
  lengths = (100, 500) if args.quick else (100, 250, 500, 1000, 2000)
  out = args.out or os.path.join(
      _ROOT, "benchmarks", "results",
      "rns_stack_quick.json" if args.quick else "rns_stack.json")
  rng = np.random.default_rng(0)
  rows = []
  print(f"B={B} Q={Q} S={S} D={D} chunk={CHUNK} float32 on "
        f"{jax.devices()[0].platform}")
  print(f"{'n':>6} {'eval us/sym':>12} {'eval B/sym':>11} "
        f"{'train us/sym':>13} {'train B/sym':>12} {'unlim us/sym':>13}")
  for n in lengths:
    row = _measure(n, rng)
    rows.append(row)
    print(f"{n:>6} {row['eval_us_per_symbol']:>12.1f} "
          f"{row['eval_temp_bytes_per_symbol']:>11.0f} "
          f"{row['train_us_per_symbol']:>13.1f} "
          f"{row['train_temp_bytes_per_symbol']:>12.0f} "
          f"{row.get('unlimited_eval_us_per_symbol', float('nan')):>13.1f}",
          flush=True)
  with open(out, "w") as f:
    json.dump({"config": {"B": B, "Q": Q, "S": S, "D": D, "H": H,
                          "truncation_length": CHUNK, "dtype": "float32",
                          "device": str(jax.devices()[0])},
               "rows": rows}, f, indent=1)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
