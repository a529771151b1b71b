"""The command lines' bad-input contract, walked end to end (issue 10).

Every bad input below gives exactly one line on stderr starting "error:",
exit status 2, no traceback, and leaves the filesystem as it was. Also: a
config file loads from any working directory.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = os.path.join(REPO, "configs", "quick.py")


def _snapshot(root):
  out = {}
  for base, dirs, files in os.walk(root):
    for name in dirs + files:
      path = os.path.join(base, name)
      out[path] = None if os.path.isdir(path) else open(path, "rb").read()
  return out


def _cases(tmp):
  """(name, argv, expected message fragment)."""
  a_file = os.path.join(tmp, "a_file")
  trained = os.path.join(tmp, "trained")  # a config.json and a metric
  new = os.path.join(tmp, "new")
  main = ["-m", "nsrnn_jax.main", f"--config={QUICK}"]
  cases = [
      ("missing config file", ["-m", "nsrnn_jax.main",
                               f"--config={REPO}/configs/nope.py",
                               f"--workdir={new}"],
       "cannot load --config: [Errno 2] No such file"),
      ("parameter for a config without any", [
          "-m", "nsrnn_jax.main", f"--config={QUICK}:ns", f"--workdir={new}"],
       "this config file takes no parameter; drop the ':...'"),
      ("config file without get_config", [
          "-m", "nsrnn_jax.main", f"--config={tmp}/bad_configs/no_get.py",
          f"--workdir={new}"],
       "cannot load --config: the file defines no get_config()"),
      ("config file whose get_config returns no ConfigDict", [
          "-m", "nsrnn_jax.main", f"--config={tmp}/bad_configs/five.py",
          f"--workdir={new}"],
       "cannot load --config: its get_config() returned type int, not an "
       "ml_collections.ConfigDict"),
      ("the same, with an override", [
          "-m", "nsrnn_jax.main", f"--config={tmp}/bad_configs/five.py",
          "--config.max_epochs=2", f"--workdir={new}"],
       "cannot load --config: its get_config() returned type int"),
      ("ill-typed override", main + ["--config.hidden_size=1.5",
                                     f"--workdir={new}"],
       "--config.hidden_size=1.5"),
      ("unknown field", main + ["--config.hiden_size=2", f"--workdir={new}"],
       "unknown config field"),
      ("bad value", main + ["--config.max_epochs=0", f"--workdir={new}"],
       "config.max_epochs must be >= 1"),
      ("training interval without strings",
       main + ["--config.train_min_length=2", "--config.train_max_length=2",
               f"--workdir={new}"],
       "[2, 2], which holds no string of marked_reversal"),
      ("test interval without strings",
       main + ["--config.test_min_length=4", "--config.test_max_length=4",
               f"--workdir={new}"],
       "[4, 4], which holds no string of marked_reversal"),
      ("workdir is a file", main + [f"--workdir={a_file}"],
       "is a file, not a directory"),
      ("unreadable flagfile", main + [f"--workdir={new}",
                                      f"--flagfile={tmp}/no_flags"],
       "Unable to open flagfile"),
      ("unreadable grid flagfile",
       ["-m", "nsrnn_jax.grid", f"--config={QUICK}", f"--workdir={new}",
        f"--flagfile={tmp}/no_flags"], "Unable to open flagfile"),
      ("length buckets not integers",
       main + ["--config.length_buckets=(13.5,31.0)", f"--workdir={new}"],
       "config.length_buckets must be integer lengths"),
      # An empty path is the working directory: the run would write there.
      ("empty workdir", main + ["--workdir="], "workdir is an empty path"),
      ("empty grid workdir", ["-m", "nsrnn_jax.grid", f"--config={QUICK}",
                              "--workdir="], "workdir is an empty path"),
      ("empty data --out", ["-m", "nsrnn_jax.data", "--task=dyck", "--out="],
       "--out is an empty path"),
      ("workdir below a file", main + [f"--workdir={a_file}/run"],
       "cannot be created"),
      ("unwritable workdir", main + ["--workdir=/proc/nsrnn_run"],
       "is not writable"),
      ("changed config on a workdir", main + ["--config.hidden_size=21",
                                              f"--workdir={trained}"],
       "hidden_size (stored 20, requested 21)"),
      ("no CPU devices", main + ["--cpu_devices=0", f"--workdir={new}"],
       "cpu_devices must be a positive integer, got 0"),
      ("corpus directory missing",
       ["-m", "nsrnn_jax.main", f"--config={REPO}/configs/quick_corpus.py",
        f"--config.corpus_dir={tmp}/no_corpus", f"--workdir={new}"],
       "config.corpus_dir"),
      ("corpus of an unknown language",
       ["-m", "nsrnn_jax.corpus", "--task=nope", f"--out={new}"],
       "nope"),
      ("corpus search given the learning rate it draws",
       ["-m", "nsrnn_jax.corpus_search", f"--config={QUICK}",
        f"--workdir={new}", "--config.learning_rate=5"],
       "--config.learning_rate: the search draws it for every run; use "
       "--learning_rate_range"),
      ("corpus search of a formal-language config",
       ["-m", "nsrnn_jax.corpus_search", f"--config={QUICK}",
        f"--workdir={new}"], "runs task 'corpus' configs"),
      ("extra argument", main + [f"--workdir={new}", "extra"],
       "unexpected arguments: extra"),
      ("data --out is a file", ["-m", "nsrnn_jax.data", "--task=dyck",
                                f"--out={a_file}"],
       "--out"),
      ("data --out unwritable", ["-m", "nsrnn_jax.data", "--task=dyck",
                                 "--out=/proc/nsrnn_data"],
       "is not writable"),
      ("data with an empty length interval",
       ["-m", "nsrnn_jax.data", "--task=dyck", f"--out={new}",
        "--train_min_length=50", "--train_max_length=40"],
       "min_length (50) > max_length (40)"),
      # O(n²) exact length tables: refused, not hours of silence.
      ("data with a length whose table takes years",
       ["-m", "nsrnn_jax.data", "--task=dyck", f"--out={new}",
        "--train_max_length=100000000"],
       "--train_max_length is 100,000,000: the exact length table of dyck "
       "up to it sums ~6.0e+16 terms"),
      ("main with a length whose table takes hours",
       main + [f"--workdir={new}", "--config.test_max_length=400000"],
       "config.test_max_length is 400,000: the exact length table of "
       "marked_reversal"),
      ("grid given the learning rate it overwrites",
       ["-m", "nsrnn_jax.grid", f"--config={QUICK}", f"--workdir={new}",
        "--config.learning_rate=0.1"], "--config.learning_rate_grid"),
      # The grid's fields parse (configs/default.py declares them): the
      # command gets as far as its first member's workdir, lr 0.01 restart 2.
      ("grid with its fields set, into a file",
       ["-m", "nsrnn_jax.grid", f"--config={QUICK}", f"--workdir={a_file}",
        "--config.learning_rate_grid=(0.01,)", "--config.num_restarts=3",
        "--config.grid_restart_ids=(2,)", "--config.grid_vary_data_seed=false",
        "--config.grid_model_parallel=1"],
       "a_file/lr_0.01/restart_2' cannot be created"),
      ("evaluate a file", ["-m", "nsrnn_jax.evaluate", f"--workdir={a_file}"],
       "is a file, not a directory"),
      ("evaluate a missing workdir", ["-m", "nsrnn_jax.evaluate",
                                      f"--workdir={new}"], "does not exist"),
      ("evaluate into an unusable --out",
       ["-m", "nsrnn_jax.evaluate", f"--workdir={trained}",
        f"--out={a_file}"], "output directory"),
  ]
  return cases


def _run_forked(argvs, cwd):
  """(exit status, stderr) of `python ARGV` for each argv, in order.

  The commands run in children forked after their common imports
  (tests/cli_forks.py): importing JAX and Flax is each process's cost, and
  ~2 s of CPU 32 times over was most of this test's time.
  """
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, "tests", "cli_forks.py")],
      input=json.dumps(argvs), cwd=cwd, capture_output=True, text=True,
      timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [tuple(r) for r in json.loads(proc.stdout)]


def test_every_bad_input_is_one_line_and_exit_2(tmp_path):
  tmp = str(tmp_path)
  with open(os.path.join(tmp, "a_file"), "w") as f:
    f.write("not a directory")
  os.makedirs(os.path.join(tmp, "bad_configs"))
  with open(os.path.join(tmp, "bad_configs", "no_get.py"), "w") as f:
    f.write("X = 1\n")
  with open(os.path.join(tmp, "bad_configs", "five.py"), "w") as f:
    f.write("def get_config():\n  return 5\n")
  sys.path.insert(0, REPO)
  try:
    from configs import quick  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(REPO)
  config = json.loads(quick.get_config().to_json_best_effort())
  os.makedirs(os.path.join(tmp, "trained"))
  with open(os.path.join(tmp, "trained", "config.json"), "w") as f:
    json.dump(config, f)
  # A run that trained (a config.json alone may be replaced: its run never
  # started).
  with open(os.path.join(tmp, "trained", "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"epoch": 1, "train_loss": 1.0}) + "\n")
  before = _snapshot(tmp)
  cases = _cases(tmp)
  failures = []
  for (name, _, fragment), (returncode, stderr) in zip(
      cases, _run_forked([argv for _, argv, _ in cases], tmp)):
    lines = stderr.strip().splitlines()
    if (returncode != 2 or len(lines) != 1
        or not lines[0].startswith("error: ") or fragment not in lines[0]):
      failures.append(f"{name}: rc={returncode} stderr={stderr[-500:]!r}")
  assert not failures, "\n".join(failures)
  assert _snapshot(tmp) == before  # Nothing created or overwritten.


def test_help_exits_0_with_usage():
  modules = ("nsrnn_jax.main", "nsrnn_jax.data", "nsrnn_jax.evaluate")
  procs = [subprocess.Popen([sys.executable, "-m", m, "--help"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for m in modules]
  for module, proc in zip(modules, procs):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (module, err[-1000:])
    assert "--workdir" in out + err or "--out" in out + err, module


def test_out_of_memory_is_one_line_and_the_fixed_config_runs(tmp_path):
  # A hidden size whose LSTM weights need 16 TB: refused before anything is
  # allocated (train.check_state_fits_memory; XLA's RESOURCE_EXHAUSTED and
  # the operating system's OOM killer came later, cli_test covers the
  # former), one line and exit 2; the workdir it leaves (config.json only,
  # no epoch run) takes the corrected config instead of refusing it.
  workdir = str(tmp_path / "run")
  base = [sys.executable, "-m", "nsrnn_jax.main",
          f"--config={REPO}/configs/quick.py", f"--workdir={workdir}",
          "--config.num_train_batches=4", "--config.num_valid_batches=2",
          "--config.max_epochs=1", "--config.run_test=False",
          # The LSTM: what is tested is the CLI's handling, and its train
          # step compiles in a fraction of the NS-RNN's time.
          "--config.model=lstm"]
  proc = subprocess.run(base + ["--config.hidden_size=1000000"], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2, proc.stderr[-2000:]
  # 4H(H + V + 1) + ... parameters of 4 bytes, five copies (parameters,
  # best parameters, Adam's two moments, a gradient): ~74,500 GiB.
  assert re.fullmatch(r"error: the model has 4,0\d\d,\d{3},\d{3},\d{3} "
                      r"parameters: .* needs 74,5\d\d\.\d GiB, more than "
                      r"the [\d,.]+ GiB of this host; use a smaller "
                      r"hidden_size or stack size", lines[-1]), lines[-1]
  assert len(lines) == 2 and lines[0].startswith("runtime: "), lines
  fixed = subprocess.run(base, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
  assert fixed.returncode == 0, fixed.stderr[-2000:]


@pytest.fixture
def package_only(tmp_path):
  """A PYTHONPATH holding nsrnn_jax but not the repository's configs/."""
  path = tmp_path / "site"
  path.mkdir()
  os.symlink(os.path.join(REPO, "nsrnn_jax"), path / "nsrnn_jax")
  return str(path)


def test_config_file_loads_from_any_working_directory(tmp_path, package_only):
  # `from configs import default` inside the config works from elsewhere.
  env = dict(os.environ, PYTHONPATH=package_only)
  proc = subprocess.run(
      [sys.executable, "-m", "nsrnn_jax.main", f"--config={QUICK}",
       f"--workdir={tmp_path}/run", "--config.max_epochs=0"],
      cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
  # The config loaded (and was validated): the override is what fails.
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip() == "error: config.max_epochs must be >= 1 (got 0)"


def test_an_interrupt_is_one_line_exit_130_and_resumes(tmp_path):
  # Ctrl-C during training: no traceback, the last checkpoint kept; the same
  # command resumes from it.
  workdir = tmp_path / "run"
  argv = [sys.executable, "-m", "nsrnn_jax.main", f"--config={QUICK}",
          f"--workdir={workdir}", "--config.model=lstm",
          "--config.max_epochs=8", "--config.num_train_batches=20",
          "--config.num_valid_batches=2", "--config.test_strings_per_length=1"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  metrics = workdir / "metrics.jsonl"
  deadline = time.time() + 240
  while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
    assert proc.poll() is None, proc.communicate()[1][-1000:]
    assert time.time() < deadline
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-1000:]
  assert "Traceback" not in err
  assert err.strip().splitlines()[-1] == (
      "interrupted: the workdir keeps its last checkpoint (one per epoch); "
      "rerun the same command to resume")
  again = subprocess.run(argv, cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
  assert again.returncode == 0, again.stderr[-1000:]
  assert "resumed from epoch" in again.stdout + again.stderr
