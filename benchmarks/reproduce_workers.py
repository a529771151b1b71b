"""Benchmark: how to spend a CPU's cores on the paper's protocol.

Times one short slice of `python -m nsrnn_jax.reproduce` (RUNS restarts of
one model at one learning rate, --set=max_epochs=E; data, training, test
table and record, as in a real run) three ways on the same machine, one
after another, each in fresh directories:

  sequential   one run after another, one CPU device (--workers=1)
  devices      one run after another, each batch split over --cores CPU
               devices (--cpu_devices=<cores>)
  workers      --cores runs at a time, each in its own process on one CPU
               device (--workers=<cores>), each pinned to its own core(s)
  workers_unpinned
               the same with --pin_workers=off: every worker may run on
               every core (what --workers did before pinning)

--modes picks some (speed-ups are against the first one given).
Warm-up runs (one on 1 device, one on --cores, as the modes need) fill a fresh persistent
compilation cache first and every mode then reads it, as successive runs of one model do in real use (the
cache is on by default). Prints a table (wall seconds, runs per hour, speed
against `sequential`) and saves benchmarks/results/reproduce_workers.json.
Other jobs on the cores skew it: run it on an otherwise idle machine.

  python benchmarks/reproduce_workers.py [--task=marked_reversal] \
      [--model=ns] [--runs=4] [--max_epochs=1] [--cores=2] \
      [--modes=sequential,devices,workers,workers_unpinned]
"""

import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import machine  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# Mode name -> its reproduce flags, given the number of cores.
MODES = {
    "sequential": lambda n: ["--workers=1", "--cpu_devices=1"],
    "devices": lambda n: ["--workers=1", f"--cpu_devices={n}"],
    "workers": lambda n: [f"--workers={n}", "--cpu_devices=1"],
    "workers_unpinned": lambda n: [f"--workers={n}", "--cpu_devices=1",
                                   "--pin_workers=off"],
}


def protocol_argv(args, workdir, results, restart_ids, extra=()):
  """The reproduce command line of the benchmark's slice."""
  return [sys.executable, "-m", "nsrnn_jax.reproduce", f"--task={args.task}",
          f"--models={args.model}", f"--learning_rates={args.learning_rate}",
          f"--restarts={max(restart_ids) + 1}",
          f"--restart_ids={','.join(str(r) for r in restart_ids)}",
          f"--set=max_epochs={args.max_epochs}", f"--workdir={workdir}",
          f"--results={results}", "--execution=sequential",
          f"--stack_sizes={args.stack_size}"] + list(extra)


def timed(argv, env):
  """Wall seconds of one reproduce invocation (which must succeed)."""
  start = time.perf_counter()
  proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True,
                        text=True, check=False)
  seconds = time.perf_counter() - start
  if proc.returncode != 0:
    cli.fail(f"{' '.join(argv[2:])} exited with {proc.returncode}: "
             + (proc.stderr.strip().splitlines() or ["no output"])[-1])
  return seconds


def main():
  parser = cli.OneLineArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--task", default="marked_reversal")
  parser.add_argument("--model", default="ns")
  parser.add_argument("--learning_rate", default="0.005")
  parser.add_argument("--stack_size", type=int, default=2,
                      help="m of JM/Gref (ignored by lstm/ns)")
  parser.add_argument("--runs", type=int, default=4,
                      help="restarts in the slice (each mode trains them all)")
  parser.add_argument("--max_epochs", type=int, default=1)
  parser.add_argument("--cores", type=int, default=os.cpu_count() or 2)
  parser.add_argument("--modes", default=",".join(MODES),
                      help="comma-separated, in the order to run them; "
                      "speed-ups are against the first")
  parser.add_argument("--out", type=cli.output_file,
                      default=os.path.join(RESULTS, "reproduce_workers.json"))
  args = parser.parse_args()
  if args.runs < 1 or args.max_epochs < 1 or args.cores < 2:
    cli.fail("--runs and --max_epochs must be >= 1, --cores >= 2")
  names = [m.strip() for m in args.modes.split(",") if m.strip()]
  if not names or any(m not in MODES for m in names):
    cli.fail(f"--modes must be some of {', '.join(MODES)}")
  modes = [(m, MODES[m](args.cores)) for m in names]

  info = machine.machine_info()
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.join(tmp, "xla"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env["PYTHONPATH"] = os.pathsep.join(
        [REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    # Warm-up: a restart outside the slice, on 1 and on --cores devices,
    # fills the compilation cache with every mode's programs.
    warm = 0.0
    needed = sorted({args.cores if f"--cpu_devices={args.cores}" in extra
                     else 1 for _, extra in modes})
    for devices in needed:
      warm += timed(protocol_argv(
          args, os.path.join(tmp, f"warm{devices}"),
          os.path.join(tmp, f"warm{devices}_results"), [args.runs],
          [f"--cpu_devices={devices}"]), env)
    print(f"warm-up runs (fill the compilation cache): {warm:.1f} s",
          flush=True)
    for name, extra in modes:
      seconds = timed(protocol_argv(args, os.path.join(tmp, name),
                                    os.path.join(tmp, name + "_results"),
                                    list(range(args.runs)), extra), env)
      rows.append({"mode": name, "flags": " ".join(extra),
                   "wall_s": seconds,
                   "runs_per_hour": 3600.0 * args.runs / seconds})
      print(f"{name}: {seconds:.1f} s", flush=True)
  base = rows[0]["wall_s"]
  for row in rows:
    row["speedup"] = base / row["wall_s"]

  print(f"\n{args.runs} runs of {args.model} on {args.task}, "
        f"{args.max_epochs} epoch(s) each, {machine.device_label(info)}")
  print(f"{'mode':<12} {'flags':<32} {'wall s':>8} {'runs/h':>8} "
        f"{'speed-up':>9}")
  for row in rows:
    print(f"{row['mode']:<12} {row['flags']:<32} {row['wall_s']:>8.1f} "
          f"{row['runs_per_hour']:>8.1f} {row['speedup']:>8.2f}x")
  result = {"benchmark": "reproduce_workers", "machine": info,
            "device": machine.device_label(info),
            "date": time.strftime("%Y-%m-%d"), "task": args.task,
            "model": args.model, "learning_rate": float(args.learning_rate),
            "runs": args.runs, "max_epochs": args.max_epochs,
            "cores": args.cores, "warmup_s": warm,
            "speedup_against": rows[0]["mode"], "rows": rows}
  machine.save_result(args.out, result)


if __name__ == "__main__":
  main()
