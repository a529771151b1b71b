"""Benchmark: train steps of concurrent processes, pinned to cores or not.

What `reproduce --workers=N` does to a CPU: N processes train at once. Here
each of --cores processes compiles one train step (batch 10, n = 80, the
models of benchmarks/train_step.py), then, once all have compiled, all time
that step back to back over the same wall-clock window; the table gives the steps each process ran
and their sum. Two modes, alternated over --rounds:

  free     every process may run on every core (each XLA thread pool sized
           for all of them)
  pinned   process k on the k-th usable core only (`parallel.pin_to_cores`, what
           `reproduce --workers` does by default)

  python benchmarks/concurrent_steps.py [--models=ns22,jm] [--cores=2] \
      [--window=30] [--rounds=1] [--modes=free,pinned] [--batch_chunk=0,5]

--batch_chunk runs the NS models once per value of config.stack_batch_chunk
(0: automatic, `models.stack_batch_chunk`, sized for one process's use of
the caches), to see what chunk suits N processes sharing them, as
`reproduce --workers=N` runs them.

Prints a table and saves benchmarks/results/concurrent_steps.json. Other
jobs on the cores skew it: run it on an otherwise idle machine.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
# Seconds from the last process's "compiled" to the window's start.
START_DELAY_S = 0.5


def child(model, go_path, window, cores, out, batch_chunk=0):
  """One process: pin (if asked), compile, say so, wait for the window's
  start (written to `go_path` once every process has compiled), time."""
  sys.path[:0] = [REPO, HERE]
  from nsrnn_jax import parallel  # pylint: disable=g-import-not-at-top
  if cores:
    parallel.pin_to_cores(parallel.parse_cores(cores))
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import train_step as ts  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import models, train  # pylint: disable=g-import-not-at-top
  config = ts._config(model, "highest")  # pylint: disable=protected-access
  config.stack_batch_chunk = batch_chunk
  module = models.build(config, vocab_size=3)
  state = train.create_train_state(config, jax.random.key(0), module)
  batch = train.make_batch(ts._symbols(80))  # pylint: disable=protected-access
  step = jax.jit(train.train_step)
  jax.block_until_ready(step(state, batch)[1]["loss"])
  with open(out + ".ready", "w") as f:
    f.write("compiled")
  while not os.path.exists(go_path):
    time.sleep(0.01)
  with open(go_path) as f:
    start_at = float(f.read())
  while time.time() < start_at:
    time.sleep(0.001)
  times = []
  while time.time() < start_at + window:
    t = time.perf_counter()
    jax.block_until_ready(step(state, batch)[1]["loss"])
    times.append(time.perf_counter() - t)
  with open(out, "w") as f:
    json.dump({"steps": len(times), "median_s": float(np.median(times)),
               "best_s": min(times), "cores": parallel.usable_cores()}, f)


def run_mode(model, mode, usable, cores, window, tmp, batch_chunk=0,
             tag=""):
  """Runs `cores` processes at once (pinned: the k-th on `usable[k]`);
  their results in process order."""
  go_path = os.path.join(tmp, f"{model}-{mode}{tag}.go")
  procs, outs = [], []
  for k in range(cores):
    out = os.path.join(tmp, f"{model}-{mode}{tag}-{k}.json")
    argv = [sys.executable, __file__, "--child", model, go_path,
            str(window), str(usable[k]) if mode == "pinned" else "", out,
            str(batch_chunk)]
    procs.append(subprocess.Popen(argv, cwd=REPO))
    outs.append(out)
  # The window opens once every process has compiled (compiling on the
  # cores would skew the first steps of the others).
  while not all(os.path.exists(o + ".ready") for o in outs):
    if any(p.poll() not in (None, 0) for p in procs):
      break
    time.sleep(0.05)
  with open(go_path + ".tmp", "w") as f:
    f.write(repr(time.time() + START_DELAY_S))
  os.replace(go_path + ".tmp", go_path)
  for p in procs:
    if p.wait() != 0:
      cli.fail(f"a {mode} {model} process exited with {p.returncode}")
  results = []
  for out in outs:
    with open(out) as f:
      results.append(json.load(f))
  return results


def main():
  if len(sys.argv) > 1 and sys.argv[1] == "--child":
    model, go_path, window, cores, out, chunk = sys.argv[2:8]
    child(model, go_path, float(window), cores, out, int(chunk))
    return
  parser = cli.OneLineArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", default="ns22,jm")
  parser.add_argument("--cores", type=int, default=os.cpu_count() or 2)
  parser.add_argument("--window", type=float, default=30.0)
  parser.add_argument("--rounds", type=int, default=1)
  parser.add_argument("--modes", default="free,pinned",
                      help="comma-separated: free, pinned")
  parser.add_argument("--batch_chunk", default="0",
                      help="comma-separated config.stack_batch_chunk values "
                      "for the NS models (0: automatic)")
  parser.add_argument("--out", type=cli.output_file,
                      default=os.path.join(RESULTS, "concurrent_steps.json"))
  args = parser.parse_args()
  if args.cores < 2 or args.window <= 0 or args.rounds < 1:
    cli.fail("--cores must be >= 2, --window > 0, --rounds >= 1")
  modes = tuple(args.modes.split(","))
  if not modes or set(modes) - {"free", "pinned"}:
    cli.fail(f"--modes must name free and/or pinned, got {args.modes!r}")
  chunks = args.batch_chunk.split(",")
  if not all(c.isdigit() for c in chunks):
    cli.fail("--batch_chunk must be comma-separated integers >= 0, got "
             f"{args.batch_chunk!r}")
  chunks = [int(c) for c in chunks]
  sys.path[:0] = [REPO, HERE]
  import machine  # pylint: disable=g-import-not-at-top
  import train_step  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import parallel  # pylint: disable=g-import-not-at-top
  unknown = [m for m in args.models.split(",")
             if m not in train_step.SETTINGS]
  if unknown:
    parser.error(f"--models: unknown {', '.join(unknown)}; choose from "
                 f"{', '.join(train_step.SETTINGS)}")
  usable = parallel.usable_cores()
  if usable is None:
    cli.fail("this OS cannot pin a process to cores")
  if len(usable) < args.cores:
    cli.fail(f"--cores={args.cores} but this process may use "
             f"{len(usable)} core(s)")
  info = machine.machine_info()
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for model in args.models.split(","):
      for r in range(args.rounds):
        # Alternate which variant goes first, so drift favours none.
        variants = [(m, c) for c in (chunks if model.startswith("ns")
                                     else [0]) for m in modes]
        for mode, chunk in (variants if r % 2 == 0 else variants[::-1]):
          procs = run_mode(model, mode, usable, args.cores, args.window,
                           tmp, chunk, tag=f"-c{chunk}-r{r}")
          rows.append({"model": model, "mode": mode, "round": r,
                       "batch_chunk": chunk,
                       "steps": [p["steps"] for p in procs],
                       "total_steps": sum(p["steps"] for p in procs),
                       "median_ms": [1e3 * p["median_s"] for p in procs],
                       "cores": [p["cores"] for p in procs]})
          print(f"{model} {mode} chunk {chunk or 'auto'} round {r}: "
                f"{rows[-1]['steps']} steps", flush=True)
  summary = {}
  for model in args.models.split(","):
    for chunk in sorted({r["batch_chunk"] for r in rows
                         if r["model"] == model}):
      tot = {m: sum(r["total_steps"] for r in rows
                    if r["model"] == model and r["mode"] == m
                    and r["batch_chunk"] == chunk) for m in modes}
      key = model if chunk == 0 else f"{model} chunk {chunk}"
      summary[key] = {f"{m}_steps": tot[m] for m in modes}
      if len(modes) == 2:
        summary[key]["pinned_over_free"] = tot["pinned"] / tot["free"]
  print(f"\n{args.cores} processes at once, {args.window:g} s window, "
        f"{machine.device_label(info)}")
  print(f"{'model':<16} " + " ".join(f"{m + ' steps':>12}" for m in modes)
        + ("  ratio" if len(modes) == 2 else ""))
  for key, s in summary.items():
    print(f"{key:<16} " + " ".join(f"{s[m + '_steps']:>12}" for m in modes)
          + (f"  {s['pinned_over_free']:>4.2f}x" if len(modes) == 2 else ""))
  result = {"benchmark": "concurrent_steps", "machine": info,
            "device": machine.device_label(info),
            "date": time.strftime("%Y-%m-%d"), "processes": args.cores,
            "window_s": args.window, "batch": 10, "length": 80,
            "rows": rows, "summary": summary}
  machine.save_result(args.out, result)


if __name__ == "__main__":
  main()
