"""What every command line of the package shares (main, grid, evaluate, data).

* Bad input is one line on stderr, "error: ...", and exit status 2, never a
  traceback: flags that do not parse (an unknown or ill-typed --config.<field>,
  a config file that does not exist or fails to load), the ValueError,
  OSError and FloatingPointError raised by the library (their messages name
  the field, file or run) and running out of memory (XLA's
  RESOURCE_EXHAUSTED). `--verbosity=1` or more shows the traceback.
* Library logging (Orbax, absl, JAX) is at WARNING unless --verbosity asks
  for more; the commands print their own concise status lines.
* Compiled programs persist across runs (`use_compilation_cache`): a run
  compiles one train step per string length, minutes for the NS-RNN, and
  every later run, restart or resume of the same model reuses them.
* A config file loads from any working directory: the directory above the
  config's folder (the repository root for configs/*.py) is put on sys.path,
  so that `from configs import default` inside it works.
* On Linux, corpus training (`main` with task "corpus", `corpus_search`)
  restarts itself once at start-up with glibc's malloc asking for
  transparent huge pages (`reexec_with_huge_pages`): XLA:CPU's large
  temporary buffers are then faulted in 2 MiB pages, not 4 KiB ones
  (benchmarks/huge_pages.py).
"""

import argparse
import os
import platform
import re
import signal
import sys
import tempfile
import threading
import traceback
from typing import Any, Callable, NoReturn, Optional, Sequence

from absl import app
from absl import flags
from absl import logging


# Where compiled programs persist by default (per user; `--compilation_cache`).
DEFAULT_COMPILATION_CACHE = os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
    "nsrnn_jax", "xla")
# Programs that compile faster than this are not worth a file.
_CACHE_MIN_COMPILE_SECONDS = 1.0


def use_compilation_cache(path: str) -> Optional[str]:
  """Turns on JAX's persistent compilation cache at `path` ('' = off).

  The cache is keyed by the whole program, its compile options, the backend
  and the jax/jaxlib versions, so a hit is the same executable: values do not
  change. Measured: an NS-RNN (Q = S = 3) train step at one length compiles
  in 5.0 s and loads from the cache in 1.2 s; a paper run compiles ~41
  lengths. A cache named by JAX_COMPILATION_CACHE_DIR (e.g. the test
  session's) takes precedence. Must run before the first compilation.

  Returns:
    The directory in use, or None.
  """
  import jax  # pylint: disable=g-import-not-at-top
  env = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if env:
    return env
  if not path:
    return None
  path = os.path.expanduser(path)
  try:
    # JAX would only warn and run without it, every time.
    os.makedirs(path, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as e:
    raise ValueError(f"--compilation_cache {path!r} is not a writable "
                     f"directory ({e.strerror}); give another, or '' for no "
                     "cache") from None
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    _CACHE_MIN_COMPILE_SECONDS)
  return path


# glibc's tunable for malloc to madvise(MADV_HUGEPAGE) what it maps.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
# Set to 0 to keep the commands from restarting with it.
HUGE_PAGES_ENV = "NSRNN_JAX_HUGE_PAGES"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_argv() -> Optional[list[str]]:
  """The command line to restart this process with, or None to go on.

  A restart is worth it only where it changes something: Linux with glibc
  ≥ 2.35 (the tunable), transparent huge pages not "never", and neither
  GLIBC_TUNABLES (a choice already made, also the restarted process's own)
  nor NSRNN_JAX_HUGE_PAGES=0 in the environment.
  """
  if (sys.platform != "linux" or "GLIBC_TUNABLES" in os.environ
      or os.environ.get(HUGE_PAGES_ENV, "1") == "0"):
    return None
  libc, version = platform.libc_ver()
  try:
    if libc != "glibc" or tuple(map(int, version.split(".")[:2])) < (2, 35):
      return None
    with open(_THP_MODE) as f:
      if "[never]" in f.read():
        return None
  except (OSError, ValueError):
    return None
  return list(getattr(sys, "orig_argv", None) or [sys.executable] + sys.argv)


def reexec_with_huge_pages() -> None:
  """Restarts the command (same PID, arguments and streams) with
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 where `huge_pages_argv` says so.

  The dynamic loader reads the tunable at process start, so it cannot be
  turned on from inside. XLA:CPU allocates a step's temporaries (for the
  windowed stacks, every update's table kept for the backward: hundreds
  of MiB) anew at every call, and the kernel then faults them in page by
  page. With huge pages the PTB train steps ran 1.4-1.8x faster, while
  the paper's NS-RNN steps (a few MiB of temporaries) gained nothing and
  varied more (benchmarks/huge_pages.py): so only corpus training asks.
  Call it from a command's entry point before any work, never from
  library code (it replaces the process).
  """
  argv = huge_pages_argv()
  if argv is not None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv,
              dict(os.environ, GLIBC_TUNABLES=HUGE_PAGES_TUNABLE))


def fail(error, quiet_after: bool = False) -> NoReturn:
  """Prints `error` as one line on stderr and exits with status 2.

  `quiet_after`: then send file descriptor 2 to /dev/null, so that native
  code logging while the process winds down cannot add lines (the commands'
  own processes only, `run`; never inside a test process).
  """
  text = str(error)
  if "Error whilst parsing config file" in text and "Traceback" in text:
    # ml_collections embeds the traceback of an exception raised by the
    # config file's get_config (e.g. a bad `file.py:arg`); keep its message.
    last = [l for l in text.splitlines() if l.strip()][-1].strip()
    text = "cannot load --config: " + last.split(": ", 1)[-1]
    if "get_config() takes 0 positional arguments" in last:
      # `configs/quick.py:x` for a config without parameters: say so, not
      # Python's complaint about get_config's signature.
      text = ("cannot load --config: this config file takes no "
              "parameter; drop the ':...' after its path")
  message = " ".join(text.split()) or type(error).__name__
  if "Failed loading config file" in message and "[Errno" in message:
    # ml_collections wraps the OSError of a missing config file in prose.
    message = "cannot load --config: " + message[message.index("[Errno"):]
  print(f"error: {message}", file=sys.stderr, flush=True)
  if quiet_after:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
  sys.exit(2)


def positive_int(text):
  """argparse type of a count (--reps, --steps, ...): an int >= 1, or the
  flag's one-line error (a count of 0 would time nothing and save NaN)."""
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"want an integer >= 1, got {text!r}")
  return value


def int_list(text):
  """argparse type of a comma-separated list of integers >= 0 ("" = [])."""
  items = [t for t in text.split(",") if t]
  if not all(t.isdigit() for t in items):
    raise argparse.ArgumentTypeError(
        f"want comma-separated integers >= 0, got {text!r}")
  return [int(t) for t in items]


def output_file(text):
  """argparse type of a file a command writes (--out): not empty (an empty
  --out would fall back to the default path, over a committed result) and
  not a directory (found only when the run, minutes long, is done)."""
  if not text.strip():
    raise argparse.ArgumentTypeError("want a file path, got ''")
  if os.path.isdir(text):
    raise argparse.ArgumentTypeError(f"{text!r} is a directory; want a file"
                                     " path")
  return text


class OneLineArgumentParser(argparse.ArgumentParser):
  """argparse for the package's argparse commands: a flag that does not parse
  is one line, not argparse's usage block.

  With `error_type` unset (paper_figures, plots) the line goes to stderr and
  the process exits 2 (`fail`); with it set (reproduce, later_protocol, whose
  `main` returns its exit code) the message is raised as that exception for
  the command's own one-line handler.
  """

  def __init__(self, *args, error_type: Optional[type] = None, **kwargs):
    super().__init__(*args, **kwargs)
    self._error_type = error_type

  def error(self, message):
    if self._error_type is not None:
      raise self._error_type(message)
    fail(f"{message} (--help lists the flags)")


def _config_values(argv: Sequence[str]) -> list[str]:
  """The values of --config (`--config=v` or `--config v`): "path[:arg]"."""
  values = []
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      values.append(arg.split("=", 1)[1])
    elif arg == "--config" and i + 1 < len(argv):
      values.append(argv[i + 1])
  return values


def _config_roots(argv: Sequence[str]) -> list[str]:
  return [os.path.dirname(os.path.dirname(os.path.abspath(v.split(":")[0])))
          for v in _config_values(argv)]


def similar_fields(field: str, fields) -> list[str]:
  """Up to 3 config fields a misspelt `field` may mean: those holding all
  of its words (test_strings_per_length for test_per_length), then the
  closest spellings (difflib)."""
  import difflib  # pylint: disable=g-import-not-at-top
  fields = sorted(fields)
  words = set(field.split("_"))
  guesses = [f for f in fields if words <= set(f.split("_"))]
  guesses += difflib.get_close_matches(field, fields, n=3, cutoff=0.6)
  return list(dict.fromkeys(guesses))[:3]


def _config_fields(argv: Sequence[str]) -> Optional[list[str]]:
  """The top-level fields of the --config file in `argv` (None if it does
  not load): for naming what a misspelt --config.<field> may mean."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  for value in _config_values(argv)[:1]:
    path, _, config_arg = value.partition(":")
    try:
      spec = importlib.util.spec_from_file_location("_nsrnn_config", path)
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
      config = (module.get_config(config_arg) if config_arg
                else module.get_config())
      return list(config.keys())
    except Exception:  # pylint: disable=broad-except
      return None      # ml_collections' own message stands.
  return None


def _innermost(error: BaseException) -> str:
  """The innermost message of an ml_collections error (args nest)."""
  message = error
  while isinstance(message, BaseException) and message.args:
    message = message.args[0]
  return str(message)


def refuse_config_overrides(argv: Sequence[str],
                            reasons: dict[str, str]) -> None:
  """Refuses `--config.<field>` for the fields a command sets itself.

  `reasons` maps each such field to why and what to set instead; given on
  the command line it would be silently overwritten.

  Raises:
    ValueError: "--config.<field>: <reason>" for the first one in `argv`.
  """
  for arg in argv:
    name = arg.split("=", 1)[0]
    if name.startswith("--config.") and name[len("--config."):] in reasons:
      raise ValueError(f"{name}: {reasons[name[len('--config.'):]]}")


# The config-file flags `define_config_file` defined: `parse_flags` checks
# that each loaded file gave a ConfigDict.
_config_flag_names = []


def define_config_file(name: str, help_text: str, lock_config: bool):
  """`config_flags.DEFINE_config_file(name, None, ...)`, whose errors are
  one line: it reads the command line's --flagfile files when defined
  (before `run` parses anything), and an unreadable one was a traceback."""
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  _config_flag_names.append(name)
  try:
    return config_flags.DEFINE_config_file(name, None, help_text,
                                           lock_config=lock_config)
  except flags.Error as e:
    fail(str(e).removeprefix("ERROR:: "))


def parse_flags(argv: Sequence[str]) -> list[str]:
  """absl flags parser whose errors are one line (exit 2)."""
  for root in _config_roots(argv):
    if root not in sys.path:
      sys.path.append(root)
  try:
    rest = flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:
    message = _innermost(e)
    # A config file without get_config, or whose get_config returned no
    # ConfigDict (seen here when an override is applied to it).
    if "has no attribute 'get_config'" in message:
      fail("cannot load --config: the file defines no get_config()")
    if message.startswith("Attribute <class"):
      kind = message.split("'")[1] if "'" in message else "another type"
      fail(f"cannot load --config: its get_config() returned type {kind}, not"
           " an ml_collections.ConfigDict")
    # ml_collections raises these for --config.<name> with an unknown name;
    # its own guess is one close spelling, so name ours where we can.
    name = re.match(r"'([^']+)'", message)
    fields = _config_fields(argv) if name else None
    if fields is not None:
      guesses = similar_fields(name.group(1), fields)
      message = f"'{name.group(1)}'" + (
          f"; did you mean {' or '.join(guesses)}?" if guesses else "")
    fail(f"unknown config field {message} (fields: configs/default.py)")
  except (flags.Error, ImportError, OSError, TypeError, ValueError,
          SyntaxError) as e:
    fail(e)
  import ml_collections  # pylint: disable=g-import-not-at-top
  for name in _config_flag_names:
    value = flags.FLAGS[name].value if name in flags.FLAGS else None
    # (ml_collections's stand-in for a file it could not load raises its
    # own error, one line at first use: `run`.)
    if value is not None and type(value).__name__ != "_ErrorConfig" and (
        not isinstance(value, (ml_collections.ConfigDict,
                               ml_collections.FrozenConfigDict))):
      fail(f"cannot load --{name}: its get_config() returned type "
           f"{type(value).__name__}, not an ml_collections.ConfigDict")
  return rest


def comma_list(value: str, what: str, cast: Callable[[str], Any] = str
               ) -> list:
  """The items of a comma-separated flag value, each `cast`.

  Raises:
    ValueError (one line, naming the flag `what`): an empty value, an empty
      item ("a,,b", "a,"), an item `cast` refuses, or an item given twice
      (after `cast`: "0.01,1e-2" repeats 0.01), which a command would
      otherwise count twice or run once.
  """
  items = [v.strip() for v in value.split(",")]
  if items == [""]:
    raise ValueError(f"{what} is empty")
  if "" in items:
    raise ValueError(f"{what} has an empty item: {value!r}")
  out = []
  for item in items:
    try:
      out.append(cast(item))
    except ValueError:
      kind = getattr(cast, "__name__", "value")
      raise ValueError(f"{what}: {item!r} is not a(n) {kind}") from None
  repeated = [v for i, v in enumerate(out) if v in out[:i]]
  if repeated:
    raise ValueError(f"{what} repeats {', '.join(map(str, repeated))}")
  return out


# Exit status of a command stopped by an interrupt (Ctrl-C, SIGINT): 128 + 2.
INTERRUPTED = 130


def interrupted(what: str) -> NoReturn:
  """One line on stderr for an interrupt (no traceback); exit 130."""
  print(f"interrupted: {what}", file=sys.stderr)
  sys.exit(INTERRUPTED)


def _print_stacks(signum, frame) -> None:
  """SIGUSR1's handler: every thread's Python stack on stderr."""
  del signum, frame
  names = {t.ident: t.name for t in threading.enumerate()}
  parts = []
  for ident, top in sys._current_frames().items():  # pylint: disable=protected-access
    parts.append(f"Thread {names.get(ident, ident)} (most recent call "
                 "last):\n" + "".join(traceback.format_stack(top)))
  sys.stderr.write("\n".join(parts) + "\n")
  sys.stderr.flush()


def print_stacks_on_sigusr1() -> None:
  """From now on SIGUSR1 prints every thread's Python stack to stderr and
  the process goes on (`kill -USR1 PID`: where a command that seems stuck
  is); without this, SIGUSR1 kills it.

  A Python handler, so the stacks come when the main thread next runs
  Python code (at once in a training loop; a main thread blocked in native
  code prints when it returns: `py-spy dump --pid PID` sees it there).
  faulthandler's dump, which does not wait, read the other threads' frames
  while Orbax's checkpoint threads came and went and crashed the process
  (SIGSEGV; seen in a full test-suite run).
  """
  if (hasattr(signal, "SIGUSR1")
      and threading.current_thread() is threading.main_thread()):
    signal.signal(signal.SIGUSR1, _print_stacks)


def run_argparse_command(main: Callable[[], int]) -> NoReturn:
  """`sys.exit(main())` for the commands that parse their own flags
  (reproduce, later_protocol, plots, paper_figures), with SIGUSR1 as in
  `run`."""
  print_stacks_on_sigusr1()
  sys.exit(main())


def run(main: Callable[[Sequence[str]], None]) -> None:
  """app.run(main) with the conventions of the module docstring.

  SIGUSR1 prints every thread's Python stack (`print_stacks_on_sigusr1`).
  """
  print_stacks_on_sigusr1()

  def wrapped(argv):
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
      fail(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
      main(argv)
    except (ValueError, OSError, FloatingPointError) as e:
      if flags.FLAGS.verbosity >= 1:
        raise
      fail(e)
    except Exception as e:  # pylint: disable=broad-except
      # Out of device/host memory (e.g. a huge hidden_size or length):
      # a one-line error saying so; any other runtime error is a bug and
      # keeps its traceback.
      # A host array too large to allocate (e.g. a huge batch_size when the
      # data are sampled) is NumPy's MemoryError: the same one line.
      out_of_memory = (isinstance(e, MemoryError)
                       or "RESOURCE_EXHAUSTED" in str(e))
      if not out_of_memory or flags.FLAGS.verbosity >= 1:
        raise
      first = (str(e).strip().splitlines() or [type(e).__name__])[0]
      # XLA may log more about the failed allocation while the process
      # winds down (seen: a buffer check at teardown, 1 run in ~10 under
      # load): after the one line, the process's stderr goes quiet.
      fail(f"out of memory ({first}); use a smaller model, batch or string "
           "length, or a device with more memory", quiet_after=True)
    except KeyboardInterrupt:
      if flags.FLAGS.verbosity >= 1:
        raise
      interrupted("the workdir keeps its last checkpoint (one per epoch); "
                  "rerun the same command to resume")

  try:
    app.run(wrapped, flags_parser=parse_flags)
  except SystemExit as e:
    # absl ends --help / --helpfull with status 1; asking for help is no
    # error (argparse, and the reproduce command, exit 0).
    if e.code == 1 and any(a in ("-h", "--help", "--helpshort", "--helpfull")
                           for a in sys.argv[1:]):
      sys.exit(0)
    raise
