"""Shared fixtures. No test module changes a global JAX flag at import time.

* `x64`: float64 inside one test (`jax.enable_x64` context).
* `fast_compile`: XLA's most expensive optimisations off for one module
  (compilation dominates the tiny models of the training tests); the flag
  is restored when the module's tests are done. Use it with
  `pytestmark = pytest.mark.usefixtures("fast_compile")`.

The repository root is on sys.path through setup.cfg (`pythonpath = .`), so
`from configs import default` works under bare `pytest` and
`python -m pytest` alike.
"""

import jax
import pytest

_FAST_COMPILE_FLAG = "jax_disable_most_optimizations"


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


@pytest.fixture(scope="module")
def fast_compile():
  old = jax.config.values[_FAST_COMPILE_FLAG]
  jax.config.update(_FAST_COMPILE_FLAG, True)
  yield
  jax.config.update(_FAST_COMPILE_FLAG, old)
