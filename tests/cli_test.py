"""Tests of nsrnn_jax.cli's shared command-line settings."""

import jax
import pytest

from nsrnn_jax import cli

_KEYS = ("jax_compilation_cache_dir",
         "jax_persistent_cache_min_compile_time_secs")


@pytest.fixture
def restore_cache_config():
  saved = {k: jax.config.values[k] for k in _KEYS}
  yield
  for k, v in saved.items():
    jax.config.update(k, v)


def test_compilation_cache_is_set_off_or_left_to_the_environment(
    tmp_path, monkeypatch, restore_cache_config):
  del restore_cache_config
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  before = jax.config.values["jax_compilation_cache_dir"]
  assert cli.use_compilation_cache("") is None        # off: nothing changes
  assert jax.config.values["jax_compilation_cache_dir"] == before
  path = str(tmp_path / "xla")
  assert cli.use_compilation_cache(path) == path
  assert jax.config.values["jax_compilation_cache_dir"] == path
  assert jax.config.values["jax_persistent_cache_min_compile_time_secs"] == 1
  # A cache named by the environment (e.g. the test session's) wins.
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
  assert cli.use_compilation_cache(str(tmp_path / "other")) == str(
      tmp_path / "env")
  assert jax.config.values["jax_compilation_cache_dir"] == path

