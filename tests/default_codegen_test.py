"""The float32-accuracy tests under XLA's default CPU codegen.

The session compiles with XLA's previous CPU fusion emitters, which compile
faster (conftest.py). Float32 accuracy is where two code generators could
part (their exp, log and reduction orders), and the library runs on XLA's
default: so every test with "float32" in its id runs once more here, in a
subprocess on the default codegen.
"""

import os
import subprocess
import sys

import pytest

import conftest

_TESTS = os.path.dirname(os.path.abspath(__file__))


def test_float32_tests_pass_under_xla_default_codegen():
  flags = os.environ.get("XLA_FLAGS", "")
  if conftest.TEST_CODEGEN_FLAG not in flags.split():
    pytest.skip("this session already compiles with XLA's default codegen")
  env = dict(os.environ, XLA_FLAGS=" ".join(
      f for f in flags.split() if f != conftest.TEST_CODEGEN_FLAG))
  env[conftest.DEFAULT_CODEGEN_ENV] = "1"
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       "-p", "no:xdist", "-k", "float32 and not default_codegen", _TESTS],
      cwd=os.path.dirname(_TESTS), env=env, capture_output=True, text=True,
      timeout=900, check=False)
  summary = proc.stdout.strip().splitlines()[-1] if proc.stdout else ""
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  # The selection is not empty: a renamed test would drop out silently.
  passed = int(summary.split(" passed")[0].split()[-1])
  assert passed >= 30, summary
