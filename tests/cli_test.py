"""Tests of nsrnn_jax.cli's shared command-line settings."""

import argparse
import os
import re
import subprocess
import sys

import jax
import pytest

from nsrnn_jax import cli
from nsrnn_jax import paper_figures
from nsrnn_jax import plots

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
  # A directory it cannot write: an error (JAX would warn and run uncached).
  (tmp_path / "a_file").write_text("")
  for bad in ("/proc/nsrnn_cc", str(tmp_path / "a_file")):
    with pytest.raises(ValueError, match=f"^--compilation_cache '{bad}' is "
                       "not a writable directory"):
      cli.use_compilation_cache(bad)
  assert jax.config.values["jax_compilation_cache_dir"] == path
  # A cache named by the environment (e.g. the test session's) wins.
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
  assert cli.use_compilation_cache(str(tmp_path / "other")) == str(
      tmp_path / "env")
  assert jax.config.values["jax_compilation_cache_dir"] == path



def _restarted_env(extra_env):
  """GLIBC_TUNABLES as a restarted `python -c` program sees it, and how
  many times the program's first line ran (1 without a restart)."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  env = {k: v for k, v in os.environ.items()
         if k not in ("GLIBC_TUNABLES", cli.HUGE_PAGES_ENV)}
  env.update(extra_env)
  code = ("import sys; print('start', flush=True); "
          "from nsrnn_jax import cli; cli.reexec_with_huge_pages(); "
          "import os; print(os.environ.get('GLIBC_TUNABLES'))")
  out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                       capture_output=True, text=True).stdout.split()
  return out[-1], out.count("start")


def test_commands_restart_once_with_huge_pages_where_it_helps(monkeypatch):
  monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  monkeypatch.delenv(cli.HUGE_PAGES_ENV, raising=False)
  if cli.huge_pages_argv() is None:
    pytest.skip("not Linux with glibc >= 2.35 and transparent huge pages")
  # Restarted once, with the tunable; a process that has it (or any
  # GLIBC_TUNABLES, or NSRNN_JAX_HUGE_PAGES=0) goes on as it is.
  assert _restarted_env({}) == (cli.HUGE_PAGES_TUNABLE, 2)
  assert _restarted_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == (
      "glibc.malloc.arena_max=2", 1)
  assert _restarted_env({cli.HUGE_PAGES_ENV: "0"}) == ("None", 1)
  monkeypatch.setenv("GLIBC_TUNABLES", cli.HUGE_PAGES_TUNABLE)
  assert cli.huge_pages_argv() is None


def test_no_restart_off_linux(monkeypatch):
  monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  monkeypatch.setattr(cli.sys, "platform", "darwin")
  assert cli.huge_pages_argv() is None
  monkeypatch.setattr(cli.sys, "platform", "linux")
  monkeypatch.setattr(cli.platform, "libc_ver", lambda: ("glibc", "2.31"))
  assert cli.huge_pages_argv() is None


@pytest.mark.parametrize("main,argv,message", [
    (paper_figures.main, [], "--tex"),
    (paper_figures.main, ["--tex=x", "--bogus"], "--bogus"),
    (plots.main, [], "--workdirs"),
    (plots.main, ["--workdirs=a", "--out=b", "--group_by=x"], "--group_by"),
])
def test_argparse_commands_fail_in_one_line_with_exit_2(main, argv, message,
                                                        capsys):
  # OneLineArgumentParser: no usage block, one "error: ..." line.
  with pytest.raises(SystemExit) as exit_info:
    main(argv)
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and err.count("\n") == 1
  assert err.startswith("error: ") and message in err


def test_sigusr1_prints_the_stacks_and_the_command_goes_on():
  code = ("import os, signal\n"
          "from nsrnn_jax import cli\n"
          "def main():\n"
          "  os.kill(os.getpid(), signal.SIGUSR1)\n"
          "  print('went on')\n"
          "  return 3\n"
          "cli.run_argparse_command(main)\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 3, proc.stderr[-1000:]
  assert proc.stdout == "went on\n"
  assert "Thread MainThread (most recent call last):" in proc.stderr
  assert 'File "<string>", line 4, in main' in proc.stderr


@pytest.mark.parametrize("raise_it,first", [
    # XLA's allocation failure, and NumPy's (a huge batch sampled on the
    # host): one line each; any other runtime error keeps its traceback.
    ("raise RuntimeError('RESOURCE_EXHAUSTED: Out of memory allocating "
     "16 TB\\nmore')", "error: out of memory (RESOURCE_EXHAUSTED: Out of "
     "memory allocating 16 TB); use a smaller model"),
    ("import numpy as np; np.zeros((10**13, 10**3))",
     "error: out of memory (Unable to allocate"),
    ("raise RuntimeError('a bug')", "Traceback"),
])
def test_out_of_memory_is_one_line_with_exit_2(raise_it, first):
  code = ("from nsrnn_jax import cli\n"
          "def main(argv):\n"
          f"  {raise_it}\n"
          "cli.run(main)\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, timeout=120)
  lines = proc.stderr.strip().splitlines()
  if first == "Traceback":
    assert proc.returncode == 1 and lines[0].startswith(first), proc.stderr
    return
  assert proc.returncode == 2 and lines == [lines[0]], proc.stderr[-1000:]
  assert lines[0].startswith(first), lines[0]


def test_every_command_module_installs_the_sigusr1_handler():
  # `python -m nsrnn_jax.<module>`: each command starts through cli.run
  # (absl) or cli.run_argparse_command, which install the handler; a
  # command starting otherwise would die of `kill -USR1` (README).
  package = os.path.dirname(cli.__file__)
  commands = []
  for name in sorted(os.listdir(package)):
    if not name.endswith(".py"):
      continue
    with open(os.path.join(package, name)) as f:
      source = f.read()
    if 'if __name__ == "__main__":' not in source:
      continue
    commands.append(name)
    block = source.split('if __name__ == "__main__":', 1)[1]
    assert re.search(r"\bcli\.(run|run_argparse_command)\(_?main\)", block), name
  assert {"main.py", "reproduce.py", "later_protocol.py", "plots.py",
          "paper_figures.py"} <= set(commands)


def test_comma_list_refuses_empty_bad_and_repeated_items():
  assert cli.comma_list(" a, b ", "--x") == ["a", "b"]
  assert cli.comma_list("0.01,0.001", "--lr", float) == [0.01, 0.001]
  for value, message in [("", "--x is empty"), ("  ", "--x is empty"),
                         ("a,,b", "--x has an empty item: 'a,,b'"),
                         ("a,", "--x has an empty item: 'a,'"),
                         ("a,b,a", "--x repeats a")]:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
      cli.comma_list(value, "--x")
  with pytest.raises(ValueError, match=r"^--lr repeats 0.01$"):
    cli.comma_list("0.01,1e-2", "--lr", float)  # equal after the cast
  with pytest.raises(ValueError, match=r"^--n: 'x' is not a\(n\) int$"):
    cli.comma_list("1,x", "--n", int)


@pytest.mark.parametrize("argv,message", [
    (["--workdirs=a,", "--out=o"], "--workdirs has an empty item"),
    (["--workdirs=a", "--out=o", "--formats="], "--formats is empty"),
    (["--workdirs=a", "--out=o", "--formats=png,png"], "--formats repeats png"),
])
def test_plots_lists_are_checked(argv, message, capsys, tmp_path,
                                 monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SystemExit) as exit_info:
    plots.main(argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: ") and message in err
  assert not os.listdir(tmp_path)


def test_benchmark_scripts_fail_in_one_line_with_exit_2():
  # Their flags through OneLineArgumentParser and their own checks through
  # fail: no usage block, no exit status 1 (the rule for every command).
  root = os.path.join(os.path.dirname(cli.__file__), "..", "benchmarks")
  for name in sorted(os.listdir(root)):
    if name.endswith(".py"):
      with open(os.path.join(root, name)) as f:
        source = f.read()
      assert "argparse.ArgumentParser(" not in source, name
      assert not re.search(r"sys\.exit\(f?\"error", source), name
  for argv, message in [(["--runs=0"], "--runs and --max_epochs must be"),
                        (["--bogus"], "unrecognized arguments: --bogus")]:
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "reproduce_workers.py"), *argv],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-500:]
    assert proc.stderr.count("\n") == 1 and message in proc.stderr


def test_count_and_list_flag_types():
  assert cli.positive_int("3") == 3
  for bad in ("0", "-2", "x", "1.5"):
    with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
      cli.positive_int(bad)
  assert cli.int_list("1,8,") == [1, 8] and cli.int_list("") == []
  for bad in ("x", "1,-2", "2.5"):
    with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
      cli.int_list(bad)
