"""Tests of launch/: --help, dry runs (exact commands), bad input, shellcheck."""

import os
import shlex
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO, "launch")
SCRIPTS = ("local_multiprocess.sh", "slurm.sbatch", "tpu_pod.sh",
           "reproduce_gpu.sh", "reproduce_array.sbatch")


def _run(script, *args):
  return subprocess.run(["bash", os.path.join(LAUNCH, script), *args],
                        capture_output=True, text=True, timeout=60,
                        check=False)


def _lines(stdout):
  return [shlex.split(line) for line in stdout.strip().splitlines()]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_exits_zero_and_documents_dry_run(script):
  result = _run(script, "--help")
  assert result.returncode == 0, result.stderr
  assert "Usage:" in result.stdout
  assert "--dry_run" in result.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_unknown_option_is_a_clear_error(script):
  result = _run(script, "--no_such_option")
  assert result.returncode == 2
  assert "unknown option" in result.stderr
  assert "--no_such_option" in result.stderr


def test_local_multiprocess_dry_run_prints_one_command_per_process():
  result = _run("local_multiprocess.sh", "--dry_run", "-n", "3", "-p", "23456",
                "-d", "2", "--log_dir", "/tmp/logs", "--",
                "--config=configs/quick.py", "--workdir=/tmp/run dir")
  assert result.returncode == 0, result.stderr
  lines = _lines(result.stdout)
  assert lines[0] == ["mkdir", "-p", "/tmp/logs"]
  assert len(lines) == 4
  for i, words in enumerate(lines[1:]):
    assert words == [
        "env", "NSRNN_COORDINATOR_ADDRESS=localhost:23456",
        "NSRNN_NUM_PROCESSES=3", f"NSRNN_PROCESS_ID={i}", "JAX_PLATFORMS=cpu",
        "XLA_FLAGS=--xla_force_host_platform_device_count=2",
        "python3", "-m", "nsrnn_jax.main", "--distributed",
        "--config=configs/quick.py",
        "--workdir=/tmp/run dir", ">", f"/tmp/logs/process_{i}.log", "2>&1"]


def test_local_multiprocess_gpus_and_module():
  result = _run("local_multiprocess.sh", "--dry_run", "--gpus",
                "--module", "nsrnn_jax.grid", "-n", "2")
  assert result.returncode == 0, result.stderr
  lines = _lines(result.stdout)[1:]
  assert [w[4] for w in lines] == ["CUDA_VISIBLE_DEVICES=0",
                                   "CUDA_VISIBLE_DEVICES=1"]
  assert all(w[5:8] == ["python3", "-m", "nsrnn_jax.grid"] for w in lines)


@pytest.mark.parametrize("bad", [["-n", "0"], ["-n", "two"], ["-p", "70000"],
                                 ["-d", "-1"]])
def test_local_multiprocess_rejects_bad_numbers(bad):
  result = _run("local_multiprocess.sh", "--dry_run", *bad)
  assert result.returncode == 2
  assert "must be" in result.stderr


def test_slurm_dry_run_is_one_srun_with_distributed():
  result = _run("slurm.sbatch", "--dry_run", "--venv", "/opt/venv", "--",
                "--config=configs/dyck_ns.py", "--workdir=/shared/a b")
  assert result.returncode == 0, result.stderr
  assert _lines(result.stdout) == [
      ["source", "/opt/venv/bin/activate"],
      ["srun", "--kill-on-bad-exit=1", "python3", "-m", "nsrnn_jax.main",
       "--distributed", "--config=configs/dyck_ns.py",
       "--workdir=/shared/a b"]]


def test_slurm_sbatch_header_has_one_task_per_gpu():
  with open(os.path.join(LAUNCH, "slurm.sbatch")) as f:
    header = [l for l in f if l.startswith("#SBATCH")]
  opts = dict(l.split()[1].lstrip("-").split("=", 1) for l in header)
  assert opts["ntasks-per-node"] == opts["gpus-per-node"]


def test_slurm_refuses_to_run_outside_a_job():
  env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  result = subprocess.run(["bash", os.path.join(LAUNCH, "slurm.sbatch")],
                          capture_output=True, text=True, env=env,
                          timeout=60, check=False)
  assert result.returncode == 2
  assert "not inside a SLURM job" in result.stderr


def test_reproduce_array_dry_run_is_one_run_at_a_time():
  result = _run("reproduce_array.sbatch", "--dry_run", "--venv", "/opt/venv",
                "--python=python3.11", "--", "--task=all",
                "--workdir=/shared/a b")
  assert result.returncode == 0, result.stderr
  assert _lines(result.stdout) == [
      ["source", "/opt/venv/bin/activate"],
      ["python3.11", "-m", "nsrnn_jax.reproduce", "--workers=1",
       "--task=all", "--workdir=/shared/a b"]]
  # Each task is one lane of the shared grid: no workers of its own.
  result = _run("reproduce_array.sbatch", "--dry_run", "--", "--task=all",
                "--workers=2")
  assert result.returncode == 2 and "leave out --workers" in result.stderr


def test_reproduce_array_header_stops_runs_at_a_checkpoint():
  with open(os.path.join(LAUNCH, "reproduce_array.sbatch")) as f:
    header = [l for l in f if l.startswith("#SBATCH")]
  opts = dict(l.split()[1].lstrip("-").split("=", 1) for l in header)
  # SIGINT to the batch shell, which execs Python: the run's own Ctrl-C
  # handling (stop at the last epoch checkpoint) before the time limit.
  assert opts["signal"].startswith("B:INT@")
  assert opts["ntasks"] == "1"
  env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  result = subprocess.run(
      ["bash", os.path.join(LAUNCH, "reproduce_array.sbatch"), "--",
       "--task=dyck"], capture_output=True, text=True, env=env, timeout=60,
      check=False)
  assert result.returncode == 2
  assert "not inside a SLURM job" in result.stderr


def test_tpu_pod_dry_run_all_runs_on_every_worker():
  result = _run("tpu_pod.sh", "--dry_run", "--name", "pod1", "--zone",
                "europe-west4-a", "--accelerator_type", "v4-16", "--project",
                "proj", "all", "--", "--config=configs/quick.py",
                "--workdir=gs://bucket/run")
  assert result.returncode == 0, result.stderr
  lines = _lines(result.stdout)
  assert lines[0] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "pod1",
                      "--zone=europe-west4-a", "--project=proj",
                      "--accelerator-type=v4-16",
                      "--version=tpu-ubuntu2204-base"]
  assert lines[1][:3] == ["git", "-C", REPO]
  assert lines[2][:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
  # Every remote step targets all workers.
  for words in lines[2:]:
    assert "--worker=all" in words
  install = lines[4][-1]
  assert install.startswith("--command=")
  assert "pip install -U 'jax[tpu]'" in install
  assert "pip install -e ~/nsrnn_jax" in install
  run = shlex.split(lines[5][-1][len("--command="):])
  assert run == ["cd", "~/nsrnn_jax", "&&", "python3", "-m", "nsrnn_jax.main",
                 "--distributed", "--config=configs/quick.py",
                 "--workdir=gs://bucket/run"]
  assert len(lines) == 6


def test_tpu_pod_needs_a_step():
  result = _run("tpu_pod.sh", "--dry_run")
  assert result.returncode == 2
  assert "no step given" in result.stderr


def test_tpu_pod_delete():
  result = _run("tpu_pod.sh", "--dry_run", "--spot", "create", "delete")
  lines = _lines(result.stdout)
  assert "--spot" in lines[0]
  assert lines[1] == ["gcloud", "compute", "tpus", "tpu-vm", "delete",
                      "nsrnn-jax", "--zone=us-central2-b", "--quiet"]


def test_shellcheck_clean(shellcheck):
  result = subprocess.run(
      [shellcheck, *[os.path.join(LAUNCH, s) for s in SCRIPTS]],
      capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode == 0, result.stdout
