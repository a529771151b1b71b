"""Benchmark: the exact log-space stack (log_stack) against the share table.

What the exactness of ``config.stack_table = "log"`` costs. For B = 10,
n = 80, float32, Q = S = 2 and Q = S = 3 it times in one process, on the same
inputs (unnormalised N(0, 3²) log-weights), interleaved calls:

* `fwd`: `rns_stack.run` / `log_stack.run` (jitted, readings and log Σα);
* `fwd+bwd`: the gradient of Σ readings[..., 1] (each table's custom VJP);

the median of 3 calls after a warm-up, XLA's temporary buffers of the
gradient, and the largest reading difference between the two tables (they
compute the same function; log_stack has no flush). --baseline REV also
times log_stack.py as of that revision ("log_before": a before/after in
one run). --window D times the memory-limited stacks instead
(`limited_stack.run` / `limited_log_stack.run` with window D; writes
log_stack_window.json).

With --workdir RUN it instead checks a trained NS / RNS run: its best
parameters on both tables, float32, on strings of its task sampled at
lengths 20, 40, 80 and 120 (`--strings` per length) and on uniformly random
strings of the same lengths (off the language, where the weights are least
tame): the largest difference in ln p(w) and in the stack readings, and
the smallest entry of the exact log-share table (how far inside the share
table's flush the model's runs stay), and the share sweep's product margin
(`model.stack_margin`): its smallest value and the fraction of strings it
proves exact (margin above `rns_stack.exact_margin`, ~−40.2 nats); and
each table's float32 ln p(w) against the same parameters in float64 on
the share table (proven exact there by its float64 margin, ~−350 nats):
which of the two float32 tables is nearer the exact value.

Other work shares the CPU cores: compare the ratios of one run. Usage:

  python benchmarks/log_stack.py [--note "how the machine was loaded"]
  python benchmarks/log_stack.py --window 35
  python benchmarks/log_stack.py --workdir /path/to/run [--out NAME.json]

Prints a table and writes benchmarks/results/log_stack.json
(log_stack_trained.json, or --out, with --workdir).
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
from nsrnn_jax import limited_log_stack  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import limited_stack  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import log_stack  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top,wrong-import-position

B, N = 10, 80
SIZES = (2, 3)
# name -> run(push, repl, pop) -> (log α̂, log Σα, ...).
TABLES = {"shares": rns_stack.run, "log": log_stack.run}


def window_tables(window):
  """The memory-limited stacks' runs with window D."""
  return {"shares": functools.partial(limited_stack.run, window=window),
          "log": functools.partial(limited_log_stack.run, window=window)}


def _functions(run):
  fwd = jax.jit(lambda *a: run(*a)[:2])
  grad = jax.jit(jax.grad(
      lambda *a: jnp.sum(rns_stack.readout(run(*a)[0])[0][..., 1]),
      argnums=(0, 1, 2)))
  return fwd, grad


def _row(q, rng, tables):
  shapes = [(B, N, q, q, q, q)] * 2 + [(B, N, q, q, q)]
  acts = [jnp.asarray(3 * rng.normal(size=sh), jnp.float32) for sh in shapes]
  fns = {name: _functions(run) for name, run in tables.items()}
  row = {"Q": q, "S": q, "B": B, "n": N}
  times = {name: {"fwd": [], "fwd_bwd": []} for name in tables}
  for name, (fwd, grad) in fns.items():          # warm-up (compilation)
    jax.block_until_ready(fwd(*acts))
    jax.block_until_ready(grad(*acts))
  for _ in range(3):
    for name, (fwd, grad) in fns.items():
      times[name]["fwd"].append(machine.median_seconds(fwd, *acts, repeats=1,
                                                       warmup=False))
      times[name]["fwd_bwd"].append(machine.median_seconds(
          grad, *acts, repeats=1, warmup=False))
  for name, (fwd, grad) in fns.items():
    row[f"{name}_fwd_s"] = float(np.median(times[name]["fwd"]))
    row[f"{name}_fwd_bwd_s"] = float(np.median(times[name]["fwd_bwd"]))
    row[f"{name}_grad_temp_mib"] = grad.lower(*acts).compile(
    ).memory_analysis().temp_size_in_bytes / 2**20
  read = {name: np.asarray(rns_stack.readout(fns[name][0](*acts)[0])[0])
          for name in tables}
  row["max_reading_difference"] = float(np.abs(read["log"]
                                               - read["shares"]).max())
  row["slowdown_fwd"] = row["log_fwd_s"] / row["shares_fwd_s"]
  row["slowdown_fwd_bwd"] = row["log_fwd_bwd_s"] / row["shares_fwd_bwd_s"]
  if "log_before" in tables:
    row["speedup_fwd"] = row["log_before_fwd_s"] / row["log_fwd_s"]
    row["speedup_fwd_bwd"] = row["log_before_fwd_bwd_s"] / row["log_fwd_bwd_s"]
  return row


TRAINED_LENGTHS = (20, 40, 80, 120)


TIMED_LENGTH = 80


# The share table's flush margin, float32: a share below e^-43 times
# another below it is a product below the smallest normal number, which the
# shares table would flush; below e^-87 a share itself is flushed.
SHARE_MARGINS = (-43.0, -87.0)


def _trace_actions(trace_out, model):
  """((push, repl, pop) log-weights, bottom) of a trace of `model`."""
  if "action_log_weights" in trace_out:         # RNS: unnormalised weights
    w = trace_out["action_log_weights"]
    return (w["push"], w["repl"], w["pop"]), model.bottom
  a = trace_out["actions"]                      # NS: probabilities
  return tuple(jnp.log(a[k]) for k in ("push", "repl", "pop")), (
      log_stack.FROZEN)


def _log_shares(trace_out, model):
  """The exact log-share table's finite entries for a trace of `model`
  (log_stack's sweep on the trace's action log-weights): how far below
  the best runs the smallest shares of a trained model's runs fall."""
  acts, bottom = _trace_actions(trace_out, model)
  tables, _ = jax.jit(lambda *z: log_stack._sweep(  # pylint: disable=protected-access
      *z, bottom, "highest"))(*acts)
  table = np.asarray(tables[0])
  return table[np.isfinite(table)]


def _trained_timing(shares_trace, log_model, params, language, count, rng):
  """Forward (trace) seconds on the trained model at n = TIMED_LENGTH, each
  table timed in turn (median of 3 after a warm-up): "shares", "log" and
  "log_logsumexp" (log_stack.POP_CONTRACTION = "logsumexp": every update
  on the materialised terms). "log" near "log_logsumexp" would mean the
  matmul path's fallback runs on most updates of a trained model."""
  x = jnp.asarray(np.stack([language.sample(TIMED_LENGTH, rng)
                            for _ in range(count)]), jnp.int32)
  fns = {"shares": shares_trace}
  default = log_stack.POP_CONTRACTION
  try:
    for name, mode in (("log", "matmul"), ("log_logsumexp", "logsumexp")):
      log_stack.POP_CONTRACTION = mode
      fn = jax.jit(lambda p, x: log_model.apply({"params": p}, x,
                                                method="trace"))
      jax.block_until_ready(fn(params, x))   # traced under `mode`
      fns[name] = fn
  finally:
    log_stack.POP_CONTRACTION = default
  out = {}
  for name, fn in fns.items():
    out[name] = machine.median_seconds(fn, params, x, repeats=3)
  return out


def _trained(workdir, per_length, note, out_name, factor_revision=None):
  """Both tables on a trained run's best parameters (float32); with
  `factor_revision`, also the factor margin (`rns_stack.share_margin` as of
  that revision) beside the product margin."""
  from nsrnn_jax import evaluate  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import languages  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
  try:
    shares = evaluate.load_model(workdir)
  except (OSError, ValueError) as e:   # no run there, or not a readable one
    cli.fail(f"--workdir: {e}")
  config = shares.config
  if config.model not in ("ns", "rns") or config.get("stack_window", 0):
    cli.fail(f"{workdir} is a {config.model!r} run; "
             "--workdir takes an NS or RNS run without a window")
  print("| n | strings | largest ln p difference | largest reading "
        "difference | smallest log share | smallest margin | proven "
        "exact | shares error | log error |")
  print("|---|---|---|---|---|---|---|---|---|")
  exact = dict(config.to_dict(), stack_table="log")
  log_model = models.build(exact, vocab_size=config.get("vocab_size"))
  language = languages.get(config.task)
  rng = np.random.default_rng(0)
  trace = {name: jax.jit(lambda p, x, m=m: m.apply({"params": p}, x,
                                                   method="trace"))
           for name, m in (("shares", shares.model), ("log", log_model))}
  margin_fn = jax.jit(lambda p, x: shares.model.apply(
      {"params": p}, x, method="stack_margin"))
  factor_margin = (machine.module_at_revision(
      factor_revision, "rns_stack").share_margin if factor_revision else None)
  proven = rns_stack.exact_margin(np.float32)
  with jax.enable_x64(True):
    model64 = models.build(dict(config.to_dict(), dtype="float64"),
                           vocab_size=config.get("vocab_size"))
    params64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a), jnp.float64),
                            shares.params)
    logits64 = jax.jit(lambda p, x: model64.apply({"params": p}, x))
    margin64 = jax.jit(lambda p, x: model64.apply({"params": p}, x,
                                                  method="stack_margin"))
  rows = []
  for n in TRAINED_LENGTHS:
    for kind in ("language", "random"):
      if kind == "language":
        x = np.stack([language.sample(n, rng) for _ in range(per_length)])
      else:
        x = rng.integers(0, language.vocab_size, size=(per_length, n))
      x = jnp.asarray(x, jnp.int32)
      out = {k: f(shares.params, x) for k, f in trace.items()}
      lp = {k: np.asarray(models.sequence_log_prob(o["logits"], x),
                          np.float64) for k, o in out.items()}
      rows.append({"n": n, "strings": kind, "count": per_length,
                   "max_log_prob_difference": float(
                       np.abs(lp["log"] - lp["shares"]).max()),
                   "mean_log_prob": float(lp["log"].mean()),
                   "max_reading_difference": float(np.abs(
                       np.asarray(out["log"]["readings"])
                       - np.asarray(out["shares"]["readings"])).max())})
      exact = _log_shares(out["log"], log_model)
      margins = np.asarray(margin_fn(shares.params, x), np.float64)
      rows[-1].update(min_log_share=float(exact.min()), **{
          f"fraction_of_shares_below_{-m:g}_nats": float((exact < m).mean())
          for m in SHARE_MARGINS})
      rows[-1].update(min_stack_margin=float(margins.min()),
                      fraction_proven_exact=float((margins > proven).mean()))
      if factor_margin is not None:     # the certificate it replaced
        acts, bottom = _trace_actions(out["shares"], shares.model)
        factor = np.asarray(factor_margin(*acts, bottom=bottom), np.float64)
        rows[-1].update(min_factor_margin=float(factor.min()),
                        fraction_proven_factor=float((factor > proven).mean()))
      with jax.enable_x64(True):
        x64 = jnp.asarray(x, jnp.int32)
        lp64 = np.asarray(models.sequence_log_prob(
            logits64(params64, x64), x64), np.float64)
        m64 = np.asarray(margin64(params64, x64))
      if not np.all(m64 > rns_stack.exact_margin(np.float64)):
        cli.fail("the float64 reference is not proven exact "
                 f"(margin {m64.min():.1f})")
      rows[-1].update(**{
          f"max_log_prob_error_{k}": float(np.abs(lp[k] - lp64).max())
          for k in ("shares", "log")})
      # On the strings the float32 margin proves flush-free: what is left
      # is float32 rounding (amplified by the recurrence).
      ok = margins > proven
      rows[-1]["max_log_prob_error_shares_proven"] = (
          float(np.abs(lp["shares"] - lp64)[ok].max()) if ok.any() else None)
      r = rows[-1]
      print(f"| {n} | {kind} | {r['max_log_prob_difference']:.1e} | "
            f"{r['max_reading_difference']:.1e} | {r['min_log_share']:.1f} "
            f"| {r['min_stack_margin']:.1f} | "
            f"{r['fraction_proven_exact']:.0%} | "
            f"{r['max_log_prob_error_shares']:.1e} | "
            f"{r['max_log_prob_error_log']:.1e} |"
            + (f" factor margin {r['min_factor_margin']:.1f} "
               f"({r['fraction_proven_factor']:.0%}) |"
               if "min_factor_margin" in r else ""), flush=True)
  timing = _trained_timing(trace["shares"], log_model, shares.params,
                           language, per_length, rng)
  print(f"n = {TIMED_LENGTH}, {per_length} strings of the language, forward: "
        + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in timing.items()))
  machine.save_rows(out_name, rows, note, workdir=os.path.abspath(workdir),
                    margin_kind=rns_stack.MARGIN_KIND, task=config.task,
                    model=config.model, timed_length=TIMED_LENGTH,
                    forward_s=timing)


def main():
  parser = cli.OneLineArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--note", default="")
  parser.add_argument("--workdir", default=None)
  parser.add_argument("--strings", type=cli.positive_int, default=20)
  parser.add_argument("--out", type=cli.output_file,
                      default="log_stack_trained.json")
  parser.add_argument("--baseline", default=None,
                      help="also time nsrnn_jax/log_stack.py as of this git "
                      "revision ('log_before'; a before/after in one run)")
  parser.add_argument("--factor_baseline", default="4ee2779",
                      help="with --workdir: also the factor margin, "
                      "rns_stack.share_margin as of this revision (the last "
                      "with it); '' for none")
  parser.add_argument("--window", type=int, default=0,
                      help="time the memory-limited stacks with this window "
                      "D instead (writes log_stack_window.json)")
  args = parser.parse_args()
  if args.workdir:
    _trained(args.workdir, args.strings, args.note, args.out,
             args.factor_baseline or None)
    return
  rng = np.random.default_rng(0)
  tables = window_tables(args.window) if args.window else dict(TABLES)
  if args.baseline:
    if args.window:
      cli.fail("--baseline times the unlimited log_stack; "
               "leave out --window")
    tables["log_before"] = machine.module_at_revision(args.baseline,
                                                      "log_stack").run
  rows = [_row(q, rng, tables) for q in SIZES]
  print("| Q=S | table | fwd | fwd+bwd | gradient temp | log / shares "
        "(fwd, fwd+bwd) |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    for name in tables:
      ratio = (f"{r['slowdown_fwd']:.0f}x, {r['slowdown_fwd_bwd']:.0f}x"
               if name == "log" else "")
      print(f"| {r['Q']} | {name} | {1e3 * r[name + '_fwd_s']:.1f} ms | "
            f"{1e3 * r[name + '_fwd_bwd_s']:.1f} ms | "
            f"{r[name + '_grad_temp_mib']:.1f} MiB | {ratio} |")
  machine.save_rows(
      "log_stack_window.json" if args.window else "log_stack.json", rows,
      args.note, baseline=args.baseline, window=args.window)


if __name__ == "__main__":
  main()
