"""The float32-accuracy tests under XLA's default CPU codegen.

The session compiles with XLA's previous CPU fusion emitters, which compile
faster (conftest.py). Float32 accuracy is where two code generators could
part (their exp, log and reduction orders), and the library runs on XLA's
default: so every test with "float32" in its id (`conftest.is_float32_test`)
runs here, in a subprocess on the default codegen, and the session that
runs this test leaves them out of its own run (conftest).
"""

import os
import subprocess
import sys

import jax
import pytest

import conftest

_TESTS = os.path.dirname(os.path.abspath(__file__))


def test_float32_tests_pass_under_xla_default_codegen():
  flags = os.environ.get("XLA_FLAGS", "")
  if conftest.TEST_CODEGEN_FLAG not in flags.split():
    # NSRNN_TEST_DEFAULT_CODEGEN=1, or a GPU/TPU session (conftest).
    pytest.skip("this session already compiles with XLA's default codegen")
  env = dict(os.environ, XLA_FLAGS=" ".join(
      f for f in flags.split() if f != conftest.TEST_CODEGEN_FLAG))
  env[conftest.DEFAULT_CODEGEN_ENV] = "1"
  # And with XLA's full optimisations, as the library compiles.
  env.pop(conftest.FAST_COMPILE_ENV, None)
  env[conftest.FLOAT32_ONLY_ENV] = "1"
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       "-p", "no:xdist", _TESTS],
      cwd=os.path.dirname(_TESTS), env=env, capture_output=True, text=True,
      timeout=900, check=False)
  summary = proc.stdout.strip().splitlines()[-1] if proc.stdout else ""
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  # The selection is not empty: a renamed test would drop out silently.
  passed = int(summary.split(" passed")[0].split()[-1])
  assert passed >= 30, summary


def test_a_flag_this_jaxlib_does_not_know_is_left_out(monkeypatch):
  # XLA aborts a process whose XLA_FLAGS holds a flag it does not know: a
  # jaxlib that drops the emitter flag must get XLA's default, not a dead
  # session. The probe is what decides.
  monkeypatch.setattr(conftest, "TEST_CODEGEN_FLAG",
                      "--xla_cpu_no_such_flag_for_nsrnn=false")
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
  monkeypatch.delenv(conftest.DEFAULT_CODEGEN_ENV, raising=False)
  # (Unset: the session's own probe set it, and this one must probe.)
  monkeypatch.delenv(conftest.CODEGEN_PROBED_ENV, raising=False)
  conftest._use_test_codegen()  # pylint: disable=protected-access
  assert os.environ["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false"
  monkeypatch.setattr(conftest, "TEST_CODEGEN_FLAG",
                      "--xla_cpu_use_fusion_emitters=true")
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
  monkeypatch.delenv(conftest.CODEGEN_PROBED_ENV, raising=False)
  conftest._use_test_codegen()  # pylint: disable=protected-access
  assert os.environ["XLA_FLAGS"] == ("--xla_cpu_enable_fast_math=false "
                                     "--xla_cpu_use_fusion_emitters=true")


def _no_probe(xla_flags):
  raise AssertionError(f"a second probe (XLA_FLAGS={xla_flags!r})")


def test_fast_compile_does_not_need_the_codegen_flag(monkeypatch):
  # A jaxlib without the previous emitters' flag still compiles the CPU
  # session without XLA's most expensive optimisations (the probe says the
  # backend is the CPU); NSRNN_TEST_DEFAULT_CODEGEN=1 never does, and a
  # value already in the environment (a worker's, the user's) is followed.
  if jax.default_backend() != "cpu":
    pytest.skip("the probe would find another backend")
  monkeypatch.setattr(conftest, "TEST_CODEGEN_FLAG",
                      "--xla_cpu_no_such_flag_for_nsrnn=false")
  monkeypatch.setattr(conftest, "_probed_backend", None)
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.delenv(conftest.DEFAULT_CODEGEN_ENV, raising=False)
  monkeypatch.delenv(conftest.FAST_COMPILE_ENV, raising=False)
  monkeypatch.delenv(conftest.CODEGEN_PROBED_ENV, raising=False)
  codegen = conftest._use_test_codegen()  # pylint: disable=protected-access
  assert not codegen
  assert conftest._probed_backend is None  # pylint: disable=protected-access
  # A worker inherits the refusal and does not probe again.
  assert os.environ[conftest.CODEGEN_PROBED_ENV] == "1"
  with monkeypatch.context() as m:
    m.setattr(conftest, "_probe_backend", _no_probe)
    assert not conftest._use_test_codegen()  # pylint: disable=protected-access
  assert conftest._compiles_fast(codegen)  # pylint: disable=protected-access
  assert conftest._probed_backend == "cpu"  # pylint: disable=protected-access
  # No second probe: the backend is known now (a GPU session's codegen
  # probe answers "gpu", and that session compiles as the library does).
  monkeypatch.setattr(conftest, "_probed_backend", "gpu")
  assert not conftest._compiles_fast(False)  # pylint: disable=protected-access
  monkeypatch.setenv(conftest.FAST_COMPILE_ENV, "true")
  assert conftest._compiles_fast(False)  # pylint: disable=protected-access
  monkeypatch.setenv(conftest.FAST_COMPILE_ENV, "false")
  assert not conftest._compiles_fast(True)  # pylint: disable=protected-access
  monkeypatch.setenv(conftest.FAST_COMPILE_ENV, "true")
  monkeypatch.setenv(conftest.DEFAULT_CODEGEN_ENV, "1")
  assert not conftest._compiles_fast(True)  # pylint: disable=protected-access


def _collected(monkeypatch, nodeids, flags, float32_only=False):
  """The ids conftest keeps of `nodeids` under these XLA_FLAGS."""
  monkeypatch.setenv("XLA_FLAGS", flags)
  monkeypatch.delenv(conftest.DONE_ENV, raising=False)
  if float32_only:
    monkeypatch.setenv(conftest.FLOAT32_ONLY_ENV, "1")
  else:
    monkeypatch.delenv(conftest.FLOAT32_ONLY_ENV, raising=False)
  return conftest.kept_by_collection(nodeids)


def test_float32_tests_run_once_on_the_default_codegen(monkeypatch):
  rerun = ("tests/default_codegen_test.py::"
           "test_float32_tests_pass_under_xla_default_codegen")
  f32 = ["tests/a_test.py::test_fixture_float32",
         "tests/b_test.py::test_x[float32-4]"]
  other = ["tests/a_test.py::test_fixture_float64",
           "tests/float32_named_module_test.py::test_y"]
  ids = [rerun] + f32 + other
  flag = conftest.TEST_CODEGEN_FLAG
  # The session on the test codegen that runs the rerun: float32 tests out.
  assert _collected(monkeypatch, ids, flag) == [rerun] + other
  # Without the rerun in the session (e.g. -k float32, or one module), or on
  # XLA's default codegen, they run here.
  assert _collected(monkeypatch, f32 + other, flag) == f32 + other
  assert _collected(monkeypatch, ids, "") == ids
  # The rerun's subprocess: the float32 tests only.
  assert _collected(monkeypatch, ids, "", float32_only=True) == f32


def test_the_session_compiles_without_most_optimizations():
  # On the CPU the session, its workers and subprocesses compile without
  # XLA's most expensive optimisations.
  if (jax.default_backend() != "cpu"
      or os.environ.get(conftest.DEFAULT_CODEGEN_ENV) == "1"):
    pytest.skip("this session compiles as the library does")
  assert conftest.FAST_COMPILE_ENV in os.environ
  if not conftest.fast_compile_asked():
    pytest.skip(f"the user set {conftest.FAST_COMPILE_ENV} false")
  assert jax.config.values[conftest.FAST_COMPILE_FLAG]
  out = subprocess.run(
      [sys.executable, "-c", "import jax; "
       f"print(jax.config.values['{conftest.FAST_COMPILE_FLAG}'])"],
      env=os.environ, capture_output=True, text=True, timeout=300,
      check=True).stdout
  assert out.split() == ["True"]


@pytest.mark.optimized
def test_an_optimized_test_compiles_as_the_library():
  assert not jax.config.values[conftest.FAST_COMPILE_FLAG]
