"""benchmarks/gpu_session.sh: its commands parse before a GPU runs them.

A GPU is lent for minutes at a time, so a renamed flag, an unknown model or a
malformed tile triple in the session script would waste the device's time.
Oracle: each benchmark's own argparse parser (`build_parser`) and its own
checks of model names and kernel tiles, applied to the commands as the script
would run them; shellcheck for the script's shell.
"""

import os
import re
import shlex
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_session.sh")


def _source():
  with open(SCRIPT) as f:
    return f.read()


def _joined_lines(text):
  """The script's lines with backslash continuations joined."""
  return text.replace("\\\n", " ").splitlines()


def _expand(text):
  """Shell variables as the script sets them ($u: the first of its loop)."""
  text = re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", text)
  for name, value in (("TS", "benchmarks/train_step.py"), ("OUT", "/out"),
                      ("u", "1")):
    text = re.sub(r"\$%s\b" % name, value, text)
  return text


def bench_commands(text):
  """(phase, argv) of every `bench NAME LIMIT [ENV=V ...] -- SCRIPT ARGS`."""
  commands, phase = [], None
  for line in _joined_lines(text):
    m = re.match(r"\s+(\w+)\)$", line)
    if m:
      phase = m.group(1)
    if re.match(r"\s*bench ", line) and " -- " in line:
      args = line.split(" -- ", 1)[1]
      args = args.split(";")[0]
      commands.append((phase, shlex.split(_expand(args))))
  return commands


def _phase_lists(text):
  """The phases the script accepts, runs by default, and has a branch for."""
  accepted = re.search(r'case "\$p" in ([\w|]+)\) ;;', text).group(1)
  default = re.search(r"phases=\(([\w ]+)\)", text).group(1)
  loop = text[text.index('for p in "${phases[@]}"; do\n  case'):]
  branches = re.findall(r"^    (\w+)\)$", loop, flags=re.M)
  return set(accepted.split("|")), default.split(), branches


def test_every_accepted_phase_runs_and_has_a_branch():
  accepted, default, branches = _phase_lists(_source())
  assert len(branches) == len(set(branches))
  assert set(branches) == accepted
  assert set(default) == accepted and len(default) == len(accepted)


def test_the_command_reader_finds_each_benchmark_phase():
  commands = bench_commands(_source())
  phases = {phase for phase, _ in commands}
  _, _, branches = _phase_lists(_source())
  # Every phase but the suite runs at least one benchmark script.
  assert phases == set(branches) - {"tests"}
  scripts = {argv[0] for _, argv in commands}
  assert scripts == {"benchmarks/train_step.py", "benchmarks/scale.py",
                     "benchmarks/profile_step.py",
                     "benchmarks/corpus_step.py", "benchmarks/vrns_stack.py",
                     "benchmarks/window_vjp.py"}


def test_the_reader_catches_a_bad_flag(load_benchmark):
  # The oracle can fail: a flag the benchmark lacks is an argparse error.
  parser = load_benchmark("train_step").build_parser()
  with pytest.raises(SystemExit):
    parser.parse_args(["--models=ns22", "--no_such_flag"])


@pytest.mark.parametrize("phase,argv", bench_commands(_source()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_each_benchmark_command_parses(phase, argv, load_benchmark):
  name = os.path.splitext(os.path.basename(argv[0]))[0]
  module = load_benchmark(name)
  args = module.build_parser().parse_args(argv[1:])
  assert args.out and args.out.startswith("/out/"), phase
  if hasattr(args, "models"):
    # The script's own model names (corpus_step: the PTB configs), else
    # train_step's settings, which the other benchmarks share.
    settings = getattr(module, "CONFIGS", None) or load_benchmark(
        "train_step").SETTINGS
    models = [m for m in args.models.split(",") if m]
    assert models and set(models) <= set(settings), (phase, models)
  if getattr(args, "kernel_tiles", ""):
    assert args.pallas_kernels, phase
    tiles = load_benchmark("train_step").parse_kernel_tiles(args.kernel_tiles)
    assert len(tiles) == len(args.kernel_tiles.split(","))


def test_outputs_have_distinct_names():
  # Each benchmark's JSON comes back under its own name (a loop's `$u` is
  # part of its name, and one line of text there).
  names = [argv[argv.index("--out") + 1]
           for _, argv in bench_commands(_source())]
  assert len(names) == len(set(names)), names


def test_shellcheck_clean(shellcheck):
  result = subprocess.run(
      [shellcheck, SCRIPT, os.path.join(REPO, "benchmarks", "gpu_wheels.sh")],
      capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode == 0, result.stdout
