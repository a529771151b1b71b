"""Runs many command lines of this package fast: `python tests/cli_forks.py`
reads a JSON list of argvs (each ``["-m", module, *args]``) on stdin and
prints a JSON list of [exit status, stderr], one per argv, in order.

Each command runs in a child forked from this process after the imports
every command pays for (JAX, Flax, Optax, Orbax, `nsrnn_jax.train`: ~2 s
of CPU a process), then as ``python -m module args``: `runpy` runs the
module as ``__main__`` with that sys.argv, so its flags, parsing, checks
and exit are the command's own. The fork is safe because this process
never starts a JAX backend (no device is touched before the fork). A
command that restarts itself (`cli.reexec_with_huge_pages`) execs a real
``python -m module args`` (sys.orig_argv is set to it).

Used by main_test's bad-input walk: 32 commands in ~9 s of CPU rather
than ~60 s as separate processes.
"""

import importlib
import json
import os
import runpy
import sys
import tempfile
import warnings

# What every command imports; none of it starts a JAX backend.
PRELOADED = ("jax", "flax", "optax", "orbax.checkpoint", "nsrnn_jax.train")


def _child(argv, err_fd):
  """Runs `python ARGV` in this (forked) process; never returns."""
  code = 1
  try:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.dup2(err_fd, 2)
    module, args = argv[1], list(argv[2:])
    sys.argv = [module] + args
    sys.orig_argv = [sys.executable, "-m", module] + args
    # The module may already be imported here (e.g. nsrnn_jax.data, by
    # train); running it as __main__ anyway is what `python -m` does.
    warnings.filterwarnings("ignore", category=RuntimeWarning,
                            module="runpy")
    try:
      runpy.run_module(module, run_name="__main__", alter_sys=True)
      code = 0
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # pylint: disable=broad-except
      import traceback  # pylint: disable=g-import-not-at-top
      traceback.print_exc()
  finally:
    try:
      sys.stdout.flush()
      sys.stderr.flush()
    finally:
      os._exit(code)  # pylint: disable=protected-access


def main():
  for name in PRELOADED:
    importlib.import_module(name)
  results = []
  for argv in json.load(sys.stdin):
    if argv[:1] != ["-m"] or len(argv) < 2:
      raise ValueError(f"not a -m command line: {argv!r}")
    with tempfile.TemporaryFile() as err:
      pid = os.fork()
      if pid == 0:
        _child(argv, err.fileno())
      _, status = os.waitpid(pid, 0)
      err.seek(0)
      results.append([os.waitstatus_to_exitcode(status),
                      err.read().decode(errors="replace")])
  print(json.dumps(results))


if __name__ == "__main__":
  main()
