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

With --windows D1,D2,... --baseline REV it instead times `limited_stack`
against nsrnn_jax/limited_stack.py as of git revision REV, loaded into the
same process: eval and train as above at n = 500 for each window D,
interleaved calls on the same inputs, min of 5 (a before/after of a change;
writes limited_vs_baseline.json).

With --vs-ns it instead times the unlimited RNS DP against ns_stack
(B = 10, Q = S = 2 and 3, n ∈ {80, 250}, float32, normalised actions, the
RNS DP in its CoNLL 2020 variant so both compute the same readings):
forward and forward+backward (gradient of Σ c·τ), interleaved calls in one
process on the same inputs, min and median per function; --baseline REV
also loads nsrnn_jax/rns_stack.py as of git revision REV into the same
process (before/after of a change).

Other work shares the CPU cores: compare the per-symbol figures within one
run. Usage:

  python benchmarks/rns_stack.py           # the table above
  python benchmarks/rns_stack.py --quick   # n ∈ {100, 500}
  python benchmarks/rns_stack.py --vs-ns --baseline 66dc6cd
  python benchmarks/rns_stack.py --windows 10,20,50,100 --baseline 4d575bb

Prints a table and writes benchmarks/results/rns_stack.json
(rns_stack_quick.json with --quick, rns_vs_ns.json with --vs-ns,
limited_vs_baseline.json with --windows).
"""

import json
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
from nsrnn_jax import limited_stack  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import ns_stack  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

B, Q, S, D, H, V, CHUNK = 4, 2, 3, 20, 20, 3, 35


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


def _params(rng):
  return {k: jnp.asarray(0.3 * rng.normal(size=sh), jnp.float32)
          for k, sh in (("wx", (V, H)), ("wr", (Q * S, H)), ("wh", (H, H)),
                        ("wa", (H, Q * S * (2 * Q * S + Q))),
                        ("wo", (H, V)))}


def _limited_fns(mod, window, xs):
  """(jitted eval of actions, jitted gradient of params) for one module."""
  fwd = jax.jit(lambda a, b, c: mod.run(a, b, c, window)[:2])

  def loss(p):
    outs, hat, _ = mod.run_coupled(
        _step_fn, p, jnp.zeros((B, H)), xs, Q, S, window,
        truncation_length=CHUNK)
    return jnp.sum(outs ** 2) + jnp.sum(rns_stack.readout(hat)[0][..., 1])

  return fwd, jax.jit(jax.grad(loss))


def _measure(n, rng):
  row = {"n": n}
  acts = _actions(rng, n)
  params = _params(rng)
  xs = jnp.asarray(rng.integers(0, V, size=(B, n)))
  fwd, grad = _limited_fns(limited_stack, D, xs)
  row["eval_us_per_symbol"] = 1e6 * machine.median_seconds(fwd, *acts) / n
  row["eval_temp_bytes_per_symbol"] = _temp_bytes(fwd, *acts) / n
  row["train_us_per_symbol"] = 1e6 * machine.median_seconds(grad, params) / n
  row["train_temp_bytes_per_symbol"] = _temp_bytes(grad, params) / n
  if n <= 250:
    unl = jax.jit(lambda a, b, c: rns_stack.run(a, b, c))
    row["unlimited_eval_us_per_symbol"] = (
        1e6 * machine.median_seconds(unl, *acts) / n)
    row["unlimited_eval_temp_bytes_per_symbol"] = _temp_bytes(unl,
                                                              *acts) / n
  return row


# ---------------------------------------------------------------------------
# --vs-ns: the unlimited RNS DP against ns_stack (and a baseline revision).
# ---------------------------------------------------------------------------

VS_B = 10


def _versus_fns(n, q, s, baseline):
  """name -> (forward fn, forward+backward fn) on the same normalised inputs.

  Normalised actions, so ns_stack is exact too; the RNS DP runs its CoNLL
  variant (frozen bottom, symbol reading), which equals ns_stack.
  """
  rng = np.random.default_rng(n + 10 * q + 100 * s)
  logits = jnp.asarray(rng.normal(size=(VS_B, n, q * s * (2 * q * s + q))),
                       jnp.float32)
  acts = rns_stack.split_action_logits(logits, q, s, True)
  c = jnp.asarray(rng.normal(size=(VS_B, n + 1, s)), jnp.float32)

  def ns_read(push, repl, pop):
    return ns_stack.run(push, repl, pop)[0]

  def rns_read(mod):
    return lambda push, repl, pop: mod.readout(
        mod.run(push, repl, pop, bottom="frozen")[0], "symbol")[0]

  readers = {"ns_stack": ns_read, "rns": rns_read(rns_stack)}
  if baseline is not None:
    readers["rns_baseline"] = rns_read(baseline)
  fns = {}
  for name, read in readers.items():
    fwd = jax.jit(read)
    loss = lambda p, r, o, read=read: jnp.sum(c * read(p, r, o))
    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    fns[name] = (fwd, fwd_bwd)
  return fns, acts


def versus_ns(args):
  """Interleaved timings (one process, same inputs); writes JSON."""
  baseline = (machine.module_at_revision(args.baseline, "rns_stack")
              if args.baseline else None)
  pairs = [tuple(int(v) for v in p.split("x")) for p in args.sizes.split(",")]
  sizes = [(n, q, s) for q, s in pairs for n in args.lengths]
  out = args.out or os.path.join(_ROOT, "benchmarks", "results",
                                 "rns_vs_ns.json")
  rows = []
  print(f"B={VS_B} float32 normalised actions on "
        f"{jax.devices()[0].platform}; ms per symbol, min (and median) "
        f"of {args.repeats} interleaved calls")
  for n, q, s in sizes:
    fns, acts = _versus_fns(n, q, s, baseline)
    for fwd, fwd_bwd in fns.values():   # compile + warm up
      jax.block_until_ready(fwd(*acts))
      jax.block_until_ready(fwd_bwd(*acts))
    times = {(k, m): [] for k in fns for m in ("fwd", "fwd_bwd")}
    for _ in range(args.repeats):
      for name, pair in fns.items():
        for mode, fn in zip(("fwd", "fwd_bwd"), pair):
          t0 = time.perf_counter()
          jax.block_until_ready(fn(*acts))
          times[(name, mode)].append(time.perf_counter() - t0)
    row = {"n": n, "Q": q, "S": s, "B": VS_B}
    for (name, mode), ts in times.items():
      # Min over interleaved calls: the least disturbed by other work on
      # the shared cores (the medians are kept too).
      row[f"{name}_{mode}_ms_per_symbol"] = 1e3 * float(np.min(ts)) / n
      row[f"{name}_{mode}_median_ms_per_symbol"] = (
          1e3 * float(np.median(ts)) / n)
    for mode in ("fwd", "fwd_bwd"):
      ns_ms = row[f"ns_stack_{mode}_ms_per_symbol"]
      row[f"rns_over_ns_{mode}"] = row[f"rns_{mode}_ms_per_symbol"] / ns_ms
      if baseline is not None:
        row[f"baseline_over_rns_{mode}"] = (
            row[f"rns_baseline_{mode}_ms_per_symbol"]
            / row[f"rns_{mode}_ms_per_symbol"])
    rows.append(row)
    print(json.dumps(row), flush=True)
    with open(out, "w") as f:
      json.dump({"config": {"B": VS_B, "dtype": "float32",
                            "baseline_revision": args.baseline,
                            "repeats": args.repeats,
                            "loadavg_at_end": os.getloadavg(),
                            "device": str(jax.devices()[0])},
                 "rows": rows}, f, indent=1)
  print(f"wrote {out}")


def limited_vs_baseline(args, n=500, repeats=5):
  """limited_stack now vs at --baseline, per window D; writes JSON."""
  baseline = machine.module_at_revision(args.baseline, "limited_stack")
  windows = [int(w) for w in args.windows.split(",")]
  out = args.out or os.path.join(_ROOT, "benchmarks", "results",
                                 "limited_vs_baseline.json")
  rng = np.random.default_rng(0)
  rows = []
  print(f"B={B} Q={Q} S={S} n={n} chunk={CHUNK} float32 on "
        f"{jax.devices()[0].platform}; us per symbol, min of {repeats} "
        f"interleaved calls; baseline = limited_stack.py at {args.baseline}")
  print(f"{'D':>4} {'eval base':>10} {'eval now':>9} {'ratio':>6} "
        f"{'train base':>11} {'train now':>10} {'ratio':>6}")
  for window in windows:
    acts = _actions(rng, n)
    params = _params(rng)
    xs = jnp.asarray(rng.integers(0, V, size=(B, n)))
    fns = {"baseline": _limited_fns(baseline, window, xs),
           "now": _limited_fns(limited_stack, window, xs)}
    args_of = {"eval": acts, "train": [params]}
    times = {(k, m): [] for k in fns for m in args_of}
    for k, (fwd, grad) in fns.items():     # compile + warm up
      jax.block_until_ready(fwd(*acts))
      jax.block_until_ready(grad(params))
    for _ in range(repeats):
      for k, pair in fns.items():
        for m, fn in zip(args_of, pair):
          t0 = time.perf_counter()
          jax.block_until_ready(fn(*args_of[m]))
          times[(k, m)].append(time.perf_counter() - t0)
    row = {"D": window, "n": n}
    for (k, m), ts in times.items():
      row[f"{k}_{m}_us_per_symbol"] = 1e6 * float(np.min(ts)) / n
    for m in args_of:
      row[f"{m}_speedup"] = (row[f"baseline_{m}_us_per_symbol"]
                             / row[f"now_{m}_us_per_symbol"])
    rows.append(row)
    print(f"{window:>4} {row['baseline_eval_us_per_symbol']:>10.1f} "
          f"{row['now_eval_us_per_symbol']:>9.1f} {row['eval_speedup']:>5.2f}x"
          f" {row['baseline_train_us_per_symbol']:>11.1f} "
          f"{row['now_train_us_per_symbol']:>10.1f} "
          f"{row['train_speedup']:>5.2f}x", flush=True)
  with open(out, "w") as f:
    json.dump({"config": {"B": B, "Q": Q, "S": S, "n": n, "H": H,
                          "truncation_length": CHUNK, "dtype": "float32",
                          "baseline_revision": args.baseline,
                          "repeats": repeats,
                          "device": str(jax.devices()[0])},
               "rows": rows}, f, indent=1)
  print(f"wrote {out}")


def main():
  parser = cli.OneLineArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="n in {100, 500} only")
  parser.add_argument("--out", type=cli.output_file, default=None,
                      help="JSON path")
  parser.add_argument("--vs-ns", action="store_true",
                      help="unlimited RNS DP vs ns_stack (B=10, Q=S=2 and "
                      "Q=S=3), forward and forward+backward")
  parser.add_argument("--baseline", default=None,
                      help="with --vs-ns: also time rns_stack.py as of this "
                      "git revision, in the same process; with --windows: "
                      "limited_stack.py")
  parser.add_argument("--lengths", type=int, nargs="+", default=[80, 250],
                      help="with --vs-ns: string lengths n")
  parser.add_argument("--sizes", default="2x2,3x3",
                      help="with --vs-ns: comma-separated QxS pairs")
  parser.add_argument("--repeats", type=cli.positive_int, default=5,
                      help="with --vs-ns: timed calls per function")
  parser.add_argument("--windows", default=None,
                      help="with --baseline: limited_stack at these windows "
                      "D (comma-separated) against the baseline revision")
  args = parser.parse_args()
  if args.baseline and not (args.windows or args.vs_ns):
    # The plain run has no baseline: it would time without it and write
    # rns_stack.json.
    parser.error("--baseline needs --vs-ns or --windows")
  if args.windows:
    if not args.baseline:
      parser.error("--windows needs --baseline REV")
    limited_vs_baseline(args)
    return
  if args.vs_ns:
    versus_ns(args)
    return
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
