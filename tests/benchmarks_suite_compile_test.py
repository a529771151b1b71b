"""benchmarks/suite_compile.py: JAX's compile time, test by test."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "suite_compile.py")

_TESTS = '''
import jax
import jax.numpy as jnp
import numpy as np


def test_compiles():
  f = jax.jit(lambda x: jnp.tanh(x) @ x.T)
  assert np.isfinite(np.asarray(f(np.ones((3, 3), np.float32)))).all()


def test_numpy_only():
  assert np.arange(4).sum() == 6
'''


def test_summary_sums_per_module_and_ranks_by_compile_time(load_benchmark):
  suite_compile = load_benchmark("suite_compile")
  zero = {s: 0.0 for s in suite_compile.STAGES}
  per_test = {
      "a_test.py::x": dict(zero, trace_s=1.0, lower_s=2.0, compile_s=3.0,
                           compiles=4, wall_s=10.0),
      "a_test.py::y": dict(zero, compile_s=0.5, compiles=1, wall_s=1.0),
      "b_test.py::z": dict(zero, compiles=0, wall_s=9.0),
  }
  record = suite_compile.summarize(per_test, wall_s=12.0, top=2)
  assert (record["trace_s"], record["lower_s"], record["compile_s"]) == (
      1.0, 2.0, 3.5)
  assert record["compiles"] == 5 and record["test_s"] == 20.0
  assert record["compiling_share"] == pytest.approx(6.5 / 20.0)
  assert list(record["modules"]) == ["a_test.py", "b_test.py"]
  assert record["modules"]["a_test.py"]["tests"] == 2
  assert record["modules"]["a_test.py"]["test_s"] == 11.0
  assert [t["test"] for t in record["most_compiling_tests"]] == [
      "a_test.py::x", "a_test.py::y"]
  assert "| all | 3 | 20.0 s | 1.0 s | 2.0 s | 3.5 s | 32% |" in (
      suite_compile.table(record))


def test_compiles_count_in_the_test_that_made_them_on_xdist_workers(
    tmp_path):
  (tmp_path / "tiny_test.py").write_text(_TESTS)
  out = tmp_path / "out.json"
  proc = subprocess.run(
      [sys.executable, SCRIPT, f"--out={out}", "--",
       str(tmp_path / "tiny_test.py"), "-n", "2", "-p", "no:cacheprovider"],
      cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  record = json.loads(out.read_text())
  tests = {t["test"].split("::")[-1]: t
           for t in record["most_compiling_tests"]}
  jitted, plain = tests["test_compiles"], tests["test_numpy_only"]
  assert jitted["compiles"] >= 1 and 0 < jitted["compile_s"] < jitted["wall_s"]
  assert plain["compiles"] == 0 and plain["compile_s"] == 0.0
  assert record["exit_code"] == 0 and record["compiles"] == jitted["compiles"]
  assert record["date"] and "source_revision" in record["machine"]


def test_a_run_with_no_test_is_one_line_and_exit_2(tmp_path):
  (tmp_path / "empty_test.py").write_text("X = 1\n")
  proc = subprocess.run(
      [sys.executable, SCRIPT, f"--out={tmp_path / 'out.json'}", "--",
       str(tmp_path / "empty_test.py"), "-p", "no:cacheprovider"],
      cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
  assert "pytest ran no test" in lines[0]
  assert not (tmp_path / "out.json").exists()


def test_a_bad_flag_is_one_line_and_exit_2_before_pytest_runs(
    load_benchmark, capsys, monkeypatch):
  suite_compile = load_benchmark("suite_compile")
  monkeypatch.setattr(suite_compile.subprocess, "run",
                      lambda *a, **k: pytest.fail("pytest ran"))
  with pytest.raises(SystemExit) as exit_info:
    suite_compile.main(["--top=0", "--", "tests"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "--top: want an integer >= 1" in err, err
