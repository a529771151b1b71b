"""Benchmark: train steps with and without transparent huge pages (CPU).

XLA:CPU allocates a compiled step's temporary buffers at every call; the
kernel then faults the fresh pages in one by one (4 KiB each). glibc's
tunable GLIBC_TUNABLES=glibc.malloc.hugetlb=1 makes malloc madvise its
mappings for transparent huge pages (2 MiB), and corpus training restarts
itself with it (`cli.reexec_with_huge_pages`). The tunable is
read when a process starts, so each measurement is a child process: for
every workload the children with and without it alternate, `--pairs`
times, in one run on one machine; each child compiles the step, warms it
up and times `--steps` calls (median), counting the minor page faults per
step (getrusage).

Workloads: the PTB corpus train steps of configs/ptb_{lstm,rns,vrns}.py
(V = 10,000, H = 256, B = 32, T = 35, D = 35, input by lookup; the windowed
stacks keep every update's window for the backward: hundreds of MiB of
temporaries) and the paper's NS-RNN train step (B = 10, n = 80, Q = S = 2
and 3; a custom VJP with O(n²) memory).

Usage:
  python benchmarks/huge_pages.py [--workloads=vrns,rns,lstm,ns22,ns33]
      [--pairs=2] [--steps=8]
Prints a table and writes benchmarks/results/huge_pages.json.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import machine  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

WORKLOADS = {
    "vrns": "PTB VRNS 1-5-20, D = 35",
    "rns": "PTB RNS 2-3, D = 35",
    "lstm": "PTB LSTM",
    "ns22": "NS-RNN Q=S=2, n = 80",
    "ns33": "NS-RNN Q=S=3, n = 80",
}
TUNABLE = "glibc.malloc.hugetlb=1"


def _step_fn(workload):
  """A no-argument function that runs one train step and blocks."""
  import jax  # pylint: disable=g-import-not-at-top
  if workload in ("vrns", "rns", "lstm"):
    import corpus_step  # pylint: disable=g-import-not-at-top
    _, fn, _, _ = corpus_step._step(workload, 10000, 256, True)  # pylint: disable=protected-access
    return lambda: jax.block_until_ready(fn())
  import train_step  # pylint: disable=g-import-not-at-top
  v = train_step.Variant(workload, "current", 80, "highest")
  return lambda: jax.block_until_ready(v.step(v.state, v.batch)[1]["loss"])


def child(workload, steps):
  """Times `steps` calls of one workload; prints one JSON line."""
  fn = _step_fn(workload)
  for _ in range(2):
    fn()
  times, faults = [], []
  for _ in range(steps):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
  print(json.dumps({"median_s": float(np.median(times)),
                    "min_s": float(np.min(times)),
                    "faults_per_step": float(np.median(faults)),
                    "tunable": os.environ.get("GLIBC_TUNABLES", "")}))


def _run_child(workload, steps, huge):
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  if huge:
    env["GLIBC_TUNABLES"] = TUNABLE
  out = subprocess.run(
      [sys.executable, os.path.abspath(__file__), f"--child={workload}",
       f"--steps={steps}"], env=env, check=True, capture_output=True,
      text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def main():
  parser = cli.OneLineArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workloads", default=",".join(WORKLOADS))
  parser.add_argument("--pairs", type=int, default=2)
  parser.add_argument("--steps", type=cli.positive_int, default=8)
  parser.add_argument("--child", default="", help=argparse.SUPPRESS)
  parser.add_argument("--note", default="",
                      help="appended to the result's note (e.g. the load)")
  args = parser.parse_args()
  if args.child:
    child(args.child, args.steps)
    return
  names = args.workloads.split(",")
  unknown = set(names) - set(WORKLOADS)
  if unknown:
    cli.fail(f"unknown --workloads {sorted(unknown)}; expected a "
             f"subset of {','.join(WORKLOADS)}")
  rows = []
  for name in names:
    runs = {False: [], True: []}
    for _ in range(args.pairs):
      for huge in (False, True):  # alternating children
        runs[huge].append(_run_child(name, args.steps, huge))
    med = {h: float(np.median([r["median_s"] for r in rs]))
           for h, rs in runs.items()}
    row = {"workload": name, "label": WORKLOADS[name],
           "plain_ms": round(1e3 * med[False], 2),
           "huge_pages_ms": round(1e3 * med[True], 2),
           "speedup": round(med[False] / med[True], 2),
           "plain_faults_per_step": float(np.median(
               [r["faults_per_step"] for r in runs[False]])),
           "huge_pages_faults_per_step": float(np.median(
               [r["faults_per_step"] for r in runs[True]])),
           "children": {"plain": runs[False], "huge_pages": runs[True]}}
    rows.append(row)
    print(f"{row['label']:>26}  plain {row['plain_ms']:9.1f} ms  huge pages "
          f"{row['huge_pages_ms']:9.1f} ms  {row['speedup']:.2f}x  faults "
          f"{row['plain_faults_per_step']:.0f} -> "
          f"{row['huge_pages_faults_per_step']:.0f} per step", flush=True)
  with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
    thp = f.read().strip()
  machine.save_rows(
      "huge_pages.json", rows,
      machine.with_note("each figure the median over child processes of "
                        "the median step; children with and without the "
                        "tunable alternate", args.note),
      pairs=args.pairs, steps=args.steps, thp_enabled=thp)


if __name__ == "__main__":
  main()
