"""The test suite's result as a results record, from pytest's JUnit XML.

`benchmarks/gpu_session.sh` runs the suite with `--junitxml` and calls this,
so the record behind docs/benchmarks.md's "Test suite on a GPU" lines
(`results/gpu_suite_<gpu>.json`, rendered by `report.py`) comes back from
the device machine ready to commit instead of being copied from a log by
hand. Counts, failed and skipped tests, the device, the packages and the
code's revision are filled in; what only a person can say (the cause of
failures, the commits that fix them) is left for them to write. Each
record also says where the suite's time went (per test module, and the
slowest tests): `--out cpu_suite.json` from a CPU run of the README's test
command is the record behind README's and docs/benchmarks.md's suite time.

  python benchmarks/suite_record.py REPORT.xml [MORE.xml ...] \
      --out gpu_suite_h100.json [--command "python -m pytest ..."] \
      [--environment "..."]

Several reports are the parts of one suite, in order: a run stopped at a
time limit, then a run of the tests it did not finish (NSRNN_TEST_DONE in
tests/conftest.py; gpu_session.sh's TESTS_DONE).
"""

import importlib.metadata
import json
import os
import sys
import time
import xml.etree.ElementTree as ElementTree

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position
import machine
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin",
            "flax", "optax", "orbax-checkpoint", "ml_collections", "pytest",
            "pytest-xdist")
TO_WRITE = "to be written by whoever reads the failures"


def _node_id(case, root):
  """pytest's node id of a JUnit testcase: classname "tests.x_test" (or
  "tests.x_test.TestClass") and name "test_y[param]" -> "tests/x_test.py::
  [TestClass::]test_y[param]" (the module path checked against `root`)."""
  parts = case.get("classname", "").split(".")
  for cut in range(len(parts), 0, -1):
    path = "/".join(parts[:cut]) + ".py"
    if os.path.exists(os.path.join(root, path)):
      return "::".join([path] + parts[cut:] + [case.get("name", "")])
  return "::".join(parts + [case.get("name", "")])


def _outcomes(xml_path, root):
  """({node id: (outcome, skip message, seconds)}, wall seconds) of one
  report (a test's seconds: its setup, call and teardown)."""
  tree = ElementTree.parse(xml_path)
  suites = ([tree.getroot()] if tree.getroot().tag == "testsuite"
            else list(tree.getroot().iter("testsuite")))
  outcomes = {}
  for case in (c for s in suites for c in s.iter("testcase")):
    if not case.get("name"):
      continue  # an interrupted run's placeholder for the test it stopped in
    skipped = case.find("skipped")
    if case.find("failure") is not None:
      outcome = "failed"
    elif case.find("error") is not None:
      outcome = "errors"
    elif skipped is not None and skipped.get("type") == "pytest.xfail":
      outcome = "xfailed"
    elif skipped is not None:
      outcome = "skipped"
    else:
      outcome = "passed"
    outcomes[_node_id(case, root)] = (
        outcome, skipped.get("message", "") if skipped is not None else "",
        float(case.get("time", 0)))
  return outcomes, sum(float(s.get("time", 0)) for s in suites)


def finished_tests(xml_path, root="."):
  """The node ids of the tests a JUnit report says finished (any outcome):
  what a run that completes an interrupted suite leaves out (tests/conftest.py,
  NSRNN_TEST_DONE)."""
  return set(_outcomes(xml_path, root)[0])


def _as_list(xml_paths):
  """One report path, or the parts of one suite, as a list of paths."""
  return ([xml_paths] if isinstance(xml_paths, (str, os.PathLike))
          else list(xml_paths))


# How many of the slowest tests a record names (where the suite's time goes,
# for whoever shortens it next).
SLOWEST = 15


def parse(xml_paths, root="."):
  """{passed, failed, errors, skipped, xfailed, wall_s, failed_tests,
  skipped_tests, test_s, modules, slowest_tests} of pytest JUnit XML
  reports: one path, or the parts of one suite in order (an interrupted
  run's report, then the report of the run that finished it; a test in two
  parts counts once, as the later says).

  test_s is the tests' own seconds summed (over all workers: about the
  workers times wall_s), modules {path: {"tests", "seconds"}} the same per
  test module, slowest first, and slowest_tests the SLOWEST slowest
  [node id, seconds].
  """
  outcomes, wall = {}, 0.0
  for path in _as_list(xml_paths):
    part, part_wall = _outcomes(path, root)
    outcomes.update(part)
    wall += part_wall
  out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "xfailed": 0,
         "wall_s": wall, "failed_tests": [], "skipped_tests": []}
  modules = {}
  for node, (outcome, message, seconds) in outcomes.items():
    module = modules.setdefault(node.split("::")[0],
                                {"tests": 0, "seconds": 0.0})
    module["tests"] += 1
    module["seconds"] += seconds
    out[outcome] += 1
    if outcome in ("failed", "errors"):
      out["failed_tests"].append(node)
    elif outcome == "skipped":
      out["skipped_tests"].append(f"{node} ({message})")
  times = sorted(((n, o[2]) for n, o in outcomes.items()),
                 key=lambda item: -item[1])
  out["test_s"] = round(sum(t for _, t in times), 2)
  out["modules"] = {
      path: {"tests": m["tests"], "seconds": round(m["seconds"], 2)}
      for path, m in sorted(modules.items(), key=lambda i: -i[1]["seconds"])}
  out["slowest_tests"] = [[n, round(t, 2)] for n, t in times[:SLOWEST]]
  return out


# Exit statuses of an interrupted suite: pytest's own (2, e.g. the SIGINT
# that `timeout -s INT` sends), `timeout`'s when the limit struck (124), and
# a kill (137).
INTERRUPTED_EXIT_CODES = (2, 124, 137)


def record(xml_paths, root, command, environment, exit_code=None,
           commit=None):
  """The results record: `parse` plus the machine, packages and code.

  xml_paths: one report, or the parts of one suite in order (`parse`).
  commit: the revision the suite ran; by default that of the checkout at
    `root` where it is one (a fresh clone's, not this checkout's), else of
    this checkout.
  exit_code: the suite's exit status (of its last part), if known; an
    interrupted suite (time limit) is marked `"interrupted": true` -- its
    counts are of the tests that finished, not of the suite.
  """
  info = machine.machine_info()
  versions = {}
  for name in PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  xml_paths = _as_list(xml_paths)
  result = parse(xml_paths, root)
  d = {"note": "the test suite's result, written by benchmarks/"
               "suite_record.py from pytest's JUnit XML report",
       "device": machine.device_label(info), "date": time.strftime("%Y-%m-%d"),
       "commit": (commit or machine.source_revision(root)
                  or info.get("source_revision")),
       "python": sys.version.split()[0], "packages": versions,
       "command": command, "environment": environment, **result}
  if len(xml_paths) > 1:
    d["parts"] = len(xml_paths)
  if exit_code is not None:
    d.update(exit_code=int(exit_code),
             interrupted=int(exit_code) in INTERRUPTED_EXIT_CODES)
  if result["failed"] or result["errors"]:
    # fixes_rerun: null until the fixes have run on a GPU, then what that
    # rerun showed (written by hand, like the cause).
    d.update(cause_of_failures=TO_WRITE, fixed_in=[], fixes_rerun=None)
  return d


def main():
  parser = cli.OneLineArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("report", nargs="+",
                      help="pytest --junitxml output; or the parts of one "
                      "suite in order: an interrupted run's report, then "
                      "that of the run that finished it (NSRNN_TEST_DONE)")
  parser.add_argument("--out", type=cli.output_file, required=True)
  parser.add_argument("--root", default=".",
                      help="the directory pytest ran in (for test paths)")
  parser.add_argument("--command", default="")
  parser.add_argument("--environment", default="")
  parser.add_argument("--commit", default=None,
                      help="the revision the suite ran (default: that of "
                      "the checkout at --root, else of this one)")
  parser.add_argument("--exit_code", type=int, default=None,
                      help="the suite's exit status, of its last part (2, "
                      "124, 137: interrupted, so the counts are partial)")
  args = parser.parse_args()
  try:
    d = record(args.report, args.root, args.command, args.environment,
               args.exit_code, args.commit)
  except (OSError, ElementTree.ParseError) as e:
    parser.error(f"cannot read {' '.join(args.report)}: {e}")
  with open(args.out, "w") as f:
    json.dump(d, f, indent=1)
  print(("INTERRUPTED (the counts are of the tests that finished): "
         if d.get("interrupted") else "")
        + f"{d['passed']} passed, {d['failed']} failed, {d['errors']} errors, "
        f"{d['skipped']} skipped, {d['xfailed']} xfailed in "
        f"{d['wall_s']:.0f} s on {d['device']}"
        + (f" in {d['parts']} parts" if d.get("parts") else "")
        + f"; saved {args.out}")


if __name__ == "__main__":
  main()
