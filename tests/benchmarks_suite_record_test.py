"""benchmarks/suite_record.py counts a real pytest JUnit report correctly.

Oracle: a small suite whose outcomes are known by construction (2 passed, 1
failed, 1 error, 1 skipped, 1 xfailed), run by pytest in a subprocess.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SUITE = textwrap.dedent("""
    import pytest

    @pytest.fixture
    def broken():
      raise RuntimeError("fixture fails")

    @pytest.mark.parametrize("x", [1, 2])
    def test_passes(x):
      assert x > 0

    def test_fails():
      assert 1 == 2

    def test_errors(broken):
      pass

    def test_skipped():
      pytest.skip("not here")

    @pytest.mark.xfail(reason="known")
    def test_xfails():
      assert False

    class TestGroup:
      def test_in_class_fails(self):
        assert False
""")


@pytest.fixture(scope="module")
def suite_record(load_benchmark):
  return load_benchmark("suite_record")


def _run_suite(tmp_path):
  pkg = tmp_path / "sub"
  pkg.mkdir()
  (pkg / "sample_test.py").write_text(_SUITE)
  xml = tmp_path / "report.xml"
  subprocess.run([sys.executable, "-m", "pytest", "-q", "-p",
                  "no:cacheprovider", "-p", "no:xdist",
                  f"--junitxml={xml}", "sub/sample_test.py"],
                 cwd=tmp_path, capture_output=True, check=False)
  return xml


def _record_cli(*args):
  """`python benchmarks/suite_record.py ARGS`, its output captured."""
  return subprocess.run(
      [sys.executable, os.path.join(REPO, "benchmarks", "suite_record.py"),
       *args], capture_output=True, text=True, check=False)


def test_counts_of_a_real_report(suite_record, tmp_path):
  got = suite_record.parse(str(_run_suite(tmp_path)), str(tmp_path))
  assert {k: got[k] for k in ("passed", "failed", "errors", "skipped",
                              "xfailed")} == {
                                  "passed": 2, "failed": 2, "errors": 1,
                                  "skipped": 1, "xfailed": 1}
  assert sorted(got["failed_tests"]) == [
      "sub/sample_test.py::TestGroup::test_in_class_fails",
      "sub/sample_test.py::test_errors",
      "sub/sample_test.py::test_fails"]
  assert got["skipped_tests"] == [
      "sub/sample_test.py::test_skipped (not here)"]
  assert got["wall_s"] > 0


def test_cli_writes_a_record_report_py_can_render(suite_record, load_benchmark,
                                                  tmp_path):
  xml = _run_suite(tmp_path)
  out = tmp_path / "gpu_suite_x.json"
  run = _record_cli(str(xml), "--out", str(out), "--root", str(tmp_path),
                    "--command", "pytest sub", "--environment", "defaults")
  assert run.returncode == 0, run.stderr
  assert "2 passed, 2 failed, 1 errors" in run.stdout
  d = json.loads(out.read_text())
  assert d["command"] == "pytest sub" and d["failed"] == 2
  # What a person must write is marked so, never invented.
  assert d["cause_of_failures"] == suite_record.TO_WRITE
  assert d["fixed_in"] == [] and d["fixes_rerun"] is None
  assert d["packages"]["pytest"]
  # report.py renders it (the README line for GPU suites).
  report = load_benchmark("report")
  report.RESULTS = str(tmp_path)
  line = report.gpu_suite_line()
  assert len(line) == 1 and "2 passed, 2 failed" in line[0]
  assert "not fixed yet" in line[0]


def test_unreadable_report_is_a_clear_error(tmp_path):
  bad = tmp_path / "bad.xml"
  bad.write_text("<testsuite><testcase")
  run = _record_cli(str(bad), "--out", str(tmp_path / "x.json"))
  assert run.returncode == 2
  assert "cannot read" in run.stderr and "Traceback" not in run.stderr


def test_suite_stopped_at_its_time_limit_gives_a_partial_record(
    suite_record, load_benchmark, tmp_path):
  # gpu_session.sh stops the suite at its limit with SIGINT (`timeout -s
  # INT`): pytest still writes the report of the tests that finished, and
  # the record says it is partial.
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "slow_test.py").write_text(textwrap.dedent("""
      import time

      def test_a():
        pass

      def test_b():
        pass

      def test_slow():
        time.sleep(60)
  """))
  xml = tmp_path / "report.xml"
  run = subprocess.run(
      ["timeout", "-s", "INT", "-k", "20", "8", sys.executable, "-m",
       "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
       f"--junitxml={xml}", "sub/slow_test.py"],
      cwd=tmp_path, capture_output=True, text=True, check=False)
  assert run.returncode == 124, run.stdout + run.stderr
  got = suite_record.parse(str(xml), str(tmp_path))
  assert (got["passed"], got["failed"], got["errors"]) == (2, 0, 0)
  out = tmp_path / "gpu_suite_x.json"
  run = _record_cli(str(xml), "--out", str(out), "--root", str(tmp_path),
                    "--exit_code", "124")
  assert run.returncode == 0, run.stderr
  assert run.stdout.startswith("INTERRUPTED")
  d = json.loads(out.read_text())
  assert d["interrupted"] and d["exit_code"] == 124 and d["passed"] == 2
  report = load_benchmark("report")
  report.RESULTS = str(tmp_path)
  assert "interrupted at its time limit" in report.gpu_suite_line()[0]
  # A finished suite is not marked.
  assert not suite_record.record(str(xml), str(tmp_path), "", "",
                                 exit_code=1)["interrupted"]


def test_record_says_where_the_suite_s_time_went(suite_record, load_benchmark,
                                                 tmp_path):
  # Oracle: sleeps of known length. The record sums each module's tests
  # and names the slowest; report.py renders it (cpu_suite.json).
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "a_test.py").write_text(textwrap.dedent("""
      import time

      def test_sleeps():
        time.sleep(1.0)

      def test_quick():
        pass
  """))
  (tmp_path / "sub" / "b_test.py").write_text(textwrap.dedent("""
      import time

      def test_naps():
        time.sleep(0.3)
  """))
  xml = tmp_path / "report.xml"
  subprocess.run([sys.executable, "-m", "pytest", "-q", "-p",
                  "no:cacheprovider", "-p", "no:xdist", f"--junitxml={xml}",
                  "sub"], cwd=tmp_path, capture_output=True, check=False)
  got = suite_record.parse(str(xml), str(tmp_path))
  assert list(got["modules"]) == ["sub/a_test.py", "sub/b_test.py"]
  a, b = got["modules"].values()
  assert a["tests"] == 2 and 1.0 <= a["seconds"] < 3.0
  assert b["tests"] == 1 and 0.3 <= b["seconds"] < 1.0
  assert [n for n, _ in got["slowest_tests"]] == [
      "sub/a_test.py::test_sleeps", "sub/b_test.py::test_naps",
      "sub/a_test.py::test_quick"]
  assert got["test_s"] == pytest.approx(a["seconds"] + b["seconds"],
                                        abs=0.02)
  assert got["test_s"] <= got["wall_s"] + 0.01   # one worker
  out = tmp_path / "cpu_suite.json"
  run = _record_cli(str(xml), "--out", str(out), "--root", str(tmp_path),
                    "--command", "pytest sub")
  assert run.returncode == 0, run.stderr
  report = load_benchmark("report")
  report.RESULTS = str(tmp_path)
  line = report.cpu_suite_line(modules=1, tests=1)
  assert len(line) == 1 and "3 passed, 0 failed" in line[0]
  sleeps = got["slowest_tests"][0][1]
  assert (f"most in `a_test.py` {a['seconds']:.0f} s (2 tests); the slowest "
          f"tests: `test_sleeps` {sleeps:.0f} s.") in line[0]
  assert report.suite_block().startswith(line[0].split("; the slowest")[0])


def _run_part(tmp_path, name, keyword):
  xml = tmp_path / name
  subprocess.run([sys.executable, "-m", "pytest", "-q", "-p",
                  "no:cacheprovider", "-p", "no:xdist", "-k", keyword,
                  f"--junitxml={xml}", "sub/sample_test.py"],
                 cwd=tmp_path, capture_output=True, check=False)
  return str(xml)


def test_a_suite_in_two_parts_counts_as_the_whole(suite_record, tmp_path):
  # A run cut at a time limit, then a run of the rest (gpu_session.sh's
  # TESTS_DONE): the two reports give the whole suite's record.
  whole = suite_record.parse(str(_run_suite(tmp_path)), str(tmp_path))
  first = _run_part(tmp_path, "first.xml", "passes")
  rest = _run_part(tmp_path, "rest.xml", "not passes")
  assert suite_record.finished_tests(first, str(tmp_path)) == {
      "sub/sample_test.py::test_passes[1]",
      "sub/sample_test.py::test_passes[2]"}
  merged = suite_record.parse([first, rest], str(tmp_path))
  for key in ("passed", "failed", "errors", "skipped", "xfailed"):
    assert merged[key] == whole[key], key
  assert sorted(merged["failed_tests"]) == sorted(whole["failed_tests"])
  # A test in both parts counts once.
  assert suite_record.parse([first, first], str(tmp_path))["passed"] == 2
  out = tmp_path / "gpu_suite_x.json"
  run = _record_cli(first, rest, "--out", str(out), "--root", str(tmp_path),
                    "--exit_code", "1")
  assert run.returncode == 0, run.stderr
  assert "2 passed, 2 failed, 1 errors" in run.stdout
  assert "in 2 parts" in run.stdout
  d = json.loads(out.read_text())
  assert d["parts"] == 2 and not d["interrupted"]


def test_the_session_leaves_out_what_an_earlier_report_finished(
    tmp_path, monkeypatch):
  # tests/conftest.py with NSRNN_TEST_DONE: the finished tests (any outcome)
  # are left out; the one the interrupted run stopped in (no name in its
  # report) and those it never reached run.
  import conftest  # pylint: disable=g-import-not-at-top
  (tmp_path / "first.xml").write_text(textwrap.dedent("""\
      <testsuites><testsuite name="pytest" time="3.0">
      <testcase classname="tests.main_test" name="test_a" time="1"/>
      <testcase classname="tests.main_test" name="test_b[x-1]" time="1">
        <failure message="boom"/></testcase>
      <testcase classname="" name="" time="0"/>
      </testsuite></testsuites>
      """))
  monkeypatch.setenv(conftest.DONE_ENV, str(tmp_path / "first.xml"))
  monkeypatch.delenv(conftest.FLOAT32_ONLY_ENV, raising=False)
  monkeypatch.setenv("XLA_FLAGS", "")
  ids = ["tests/main_test.py::test_a", "tests/main_test.py::test_b[x-1]",
         "tests/main_test.py::test_b[x-2]", "tests/main_test.py::test_c"]
  assert conftest.kept_by_collection(ids) == ids[2:]


def test_commit_is_that_of_the_checkout_the_suite_ran_in(suite_record,
                                                         tmp_path):
  # The README's test command runs in a fresh clone, and the record is
  # written from there with --root: its commit is the clone's HEAD (which
  # may be behind this checkout's), and --commit says it outright.
  xml = _run_suite(tmp_path)
  git = ["git", "-C", str(tmp_path), "-c", "user.name=t",
         "-c", "user.email=t@t"]
  subprocess.run(git + ["init", "-q"], check=True)
  subprocess.run(git + ["add", "sub"], check=True)
  subprocess.run(git + ["commit", "-q", "-m", "x"], check=True)
  head = subprocess.run(git + ["rev-parse", "--short", "HEAD"],
                        capture_output=True, text=True,
                        check=True).stdout.strip()
  assert suite_record.record(str(xml), str(tmp_path), "", "")[
      "commit"] == head
  out = tmp_path / "s.json"
  run = _record_cli(str(xml), "--out", str(out), "--root", str(tmp_path),
                    "--commit", "abc1234")
  assert run.returncode == 0, run.stderr
  assert json.loads(out.read_text())["commit"] == "abc1234"
