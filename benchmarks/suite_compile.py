"""Benchmark: how much of the test suite's time is JAX compiling.

Runs pytest with this file as a plugin in every process (the xdist workers
too): JAX's compile events (`jax.monitoring`: tracing to a jaxpr, lowering
to MLIR, XLA's compilation) are summed per test, and the table gives the
whole run's share of each, per test module and for the tests that compile
longest. The suite's time is mostly compiling many small, distinct
programs (tests/conftest.py already compiles them the cheaper way), so this
is the figure to watch before and after a change meant to cut it. Tests
that start their own Python processes (the CLI, the float32 rerun) count
only their own time: their children are not instrumented.

  python benchmarks/suite_compile.py [--out suite_compile.json] [--top 20] \
      -- -n 2 tests

The arguments after `--` go to pytest (default: tests).
"""

import collections
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# jax.monitoring's duration events of a compilation, by the stage they time.
EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
}
STAGES = tuple(EVENTS.values())
# Set for the pytest run: the folder where each process writes its sums.
OUT_DIR_ENV = "NSRNN_SUITE_COMPILE_DIR"

# --------------------------------------------------------------------------
# The plugin (imported by pytest in each process as `-p suite_compile`).

_current = {"test": None, "start": 0.0}
_per_test = collections.defaultdict(
    lambda: dict({s: 0.0 for s in STAGES}, compiles=0, wall_s=0.0))


def _on_duration(event, duration, **kwargs):
  """Adds one compile stage's duration to the test that is running."""
  del kwargs
  stage = EVENTS.get(event)
  if stage is None or _current["test"] is None:
    return
  sums = _per_test[_current["test"]]
  sums[stage] += float(duration)
  if stage == "compile_s":
    sums["compiles"] += 1


def pytest_configure(config):
  """Listens to JAX's compile events in a run started by `main`."""
  del config
  if os.environ.get(OUT_DIR_ENV):
    import jax  # pylint: disable=g-import-not-at-top
    jax.monitoring.register_event_duration_secs_listener(_on_duration)


def pytest_runtest_protocol(item, nextitem):
  """Marks `item` as the test whose compile events these are."""
  del nextitem
  _current.update(test=item.nodeid, start=time.perf_counter())


def pytest_runtest_logfinish(nodeid, location):
  """Closes the test's wall time; later events belong to no test."""
  del location
  if _current["test"] == nodeid:
    _per_test[nodeid]["wall_s"] = time.perf_counter() - _current["start"]
  _current["test"] = None


def pytest_unconfigure(config):
  """Writes this process's per-test sums for `main` to gather."""
  del config
  out_dir = os.environ.get(OUT_DIR_ENV)
  if out_dir and _per_test:
    with open(os.path.join(out_dir, f"{os.getpid()}.json"), "w") as f:
      json.dump(dict(_per_test), f)


# --------------------------------------------------------------------------
# The benchmark.


def summarize(per_test: dict, wall_s: float, top: int) -> dict:
  """The run's record from every process's per-test sums."""
  totals = dict({s: 0.0 for s in STAGES}, compiles=0, test_s=0.0)
  modules = collections.defaultdict(
      lambda: dict({s: 0.0 for s in STAGES}, tests=0, test_s=0.0))
  for nodeid, sums in per_test.items():
    module = modules[nodeid.split("::", 1)[0]]
    module["tests"] += 1
    module["test_s"] += sums["wall_s"]
    totals["test_s"] += sums["wall_s"]
    totals["compiles"] += sums["compiles"]
    for s in STAGES:
      module[s] += sums[s]
      totals[s] += sums[s]
  compiling = lambda d: sum(d[s] for s in STAGES)
  slowest = sorted(per_test.items(), key=lambda kv: -compiling(kv[1]))[:top]
  return {
      "note": "JAX's compile stages (jax.monitoring events) summed over the "
              "tests of one pytest run, written by benchmarks/"
              "suite_compile.py; test_s = the tests' own wall time (setup, "
              "call, teardown) summed over the processes",
      "wall_s": wall_s, **totals,
      "compiling_share": compiling(totals) / totals["test_s"]
                         if totals["test_s"] else 0.0,
      "modules": dict(sorted(modules.items(),
                             key=lambda kv: -compiling(kv[1]))),
      "most_compiling_tests": [dict(test=k, **v) for k, v in slowest],
  }


def table(record: dict) -> str:
  """Markdown: the run's totals, then per module and per test."""
  def row(name, d, tests=""):
    total = sum(d[s] for s in STAGES)
    share = total / d["test_s"] if d["test_s"] else 0.0
    return (f"| {name} | {tests} | {d['test_s']:.1f} s | {d['trace_s']:.1f} "
            f"s | {d['lower_s']:.1f} s | {d['compile_s']:.1f} s | "
            f"{share:.0%} |")
  lines = ["| tests | count | test time | tracing | lowering | XLA compile "
           "| compiling share |", "|---|---|---|---|---|---|---|",
           row("all", record, str(sum(m["tests"] for m in
                                      record["modules"].values())))]
  for name, d in record["modules"].items():
    lines.append(row(f"`{name}`", d, str(d["tests"])))
  lines += ["", "| test | compiles | test time | compiling |",
            "|---|---|---|---|"]
  for d in record["most_compiling_tests"]:
    total = sum(d[s] for s in STAGES)
    lines.append(f"| `{d['test']}` | {d['compiles']} | {d['wall_s']:.1f} s "
                 f"| {total:.1f} s |")
  return "\n".join(lines)


def main(argv=None):
  """Runs pytest with the plugin, prints the tables, saves the JSON."""
  argv = sys.argv[1:] if argv is None else argv
  pytest_args = ["tests"]
  if "--" in argv:
    cut = argv.index("--")
    argv, pytest_args = argv[:cut], argv[cut + 1:] or pytest_args
  sys.path.insert(0, REPO)
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  parser = cli.OneLineArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", type=cli.output_file,
                      default=os.path.join(HERE, "results",
                                           "suite_compile.json"))
  parser.add_argument("--top", type=cli.positive_int, default=20)
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as out_dir:
    env = dict(os.environ, **{OUT_DIR_ENV: out_dir})
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (HERE, env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "suite_compile",
         *pytest_args], cwd=REPO, env=env, check=False)
    wall_s = time.perf_counter() - start
    per_test = {}
    for path in glob.glob(os.path.join(out_dir, "*.json")):
      with open(path) as f:
        per_test.update(json.load(f))
  if not per_test:
    cli.fail(f"pytest ran no test (exit code {proc.returncode})")
  record = summarize(per_test, wall_s, args.top)
  import machine  # pylint: disable=g-import-not-at-top
  record.update(command="python -m pytest " + " ".join(pytest_args),
                exit_code=proc.returncode, date=time.strftime("%Y-%m-%d"),
                machine=machine.machine_info())
  print(table(record))
  with open(args.out, "w") as f:
    json.dump(record, f, indent=1)
  print(f"saved {args.out}")
  return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
  sys.exit(main())
