"""Tests of nsrnn_jax.parallel: mesh, validation, 8 devices, two processes.

Tests that need several devices or processes run tests/multiprocess_worker.py
in subprocesses (the device count is fixed when JAX starts), so the rest of
the suite keeps one CPU device.
"""

import glob
import json
import os
import socket
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from nsrnn_jax import checkpointing
from nsrnn_jax import metrics as metrics_lib
from nsrnn_jax import parallel

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
WORKER = os.path.join(TESTS, "multiprocess_worker.py")
sys.path.insert(0, TESTS)
import multiprocess_worker as worker  # pylint: disable=g-import-not-at-top,wrong-import-position


def _env(**extra):
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("NSRNN_", "XLA_FLAGS"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO, **extra)
  return env


# ---------------------------------------------------------------------------
# Single-process unit tests.
# ---------------------------------------------------------------------------


def test_make_mesh_axes_and_shardings():
  mesh = parallel.make_mesh()
  assert mesh.axis_names == ("model", "data")
  assert dict(mesh.shape) == {"model": 1, "data": jax.device_count()}
  assert parallel.data_sharding(mesh).spec == jax.P("data")
  assert parallel.model_data_sharding(mesh).spec == jax.P("model", "data")
  assert parallel.replicated(mesh).spec == jax.P()


@pytest.mark.parametrize("kwargs,message", [
    ({"num_models": 0}, "num_models"),
    ({"num_data": 0}, "num_data"),
    ({"num_data": 2, "num_models": 4}, "needs 8 devices"),
])
def test_make_mesh_rejects_bad_sizes(kwargs, message):
  with pytest.raises(ValueError, match=message):
    parallel.make_mesh(**kwargs)


def test_batch_size_not_divisible_by_data_axis_names_both():
  fake_mesh = types.SimpleNamespace(shape={"model": 1, "data": 8})
  with pytest.raises(ValueError, match=r"batch_size=10 .*data axis \(8"):
    parallel.check_batch_size(10, fake_mesh)
  parallel.check_batch_size(16, fake_mesh)  # Divisible: no error.


def test_process_slice_single_process_is_everything():
  assert parallel.process_slice(10) == slice(0, 10)
  assert parallel.process_slice(10, parallel.make_mesh()) == slice(0, 10)


def test_shard_batch_roundtrip_and_errors():
  mesh = parallel.make_mesh()
  local = {"symbols": np.arange(12, dtype=np.int32).reshape(4, 3),
           "mask": np.ones((4, 3), np.float32)}
  batch = parallel.shard_batch(local, mesh)
  np.testing.assert_array_equal(parallel.to_host(batch["symbols"]),
                                local["symbols"])
  assert batch["symbols"].sharding.spec == jax.P("data")
  stacked = parallel.shard_batch({"s": np.zeros((2, 4, 3))}, mesh,
                                 model_axis=True)
  assert stacked["s"].sharding.spec == jax.P("model", "data")
  with pytest.raises(ValueError, match="same batch dimension"):
    parallel.shard_batch({"a": np.zeros((4, 3)), "b": np.zeros((5, 3))}, mesh)
  with pytest.raises(ValueError, match="empty"):
    parallel.shard_batch({}, mesh)


def test_replicate_keeps_values():
  mesh = parallel.make_mesh()
  tree = {"w": np.arange(6.0).reshape(2, 3), "b": np.float32(2.5)}
  out = parallel.replicate(tree, mesh)
  assert out["w"].sharding.is_fully_replicated
  np.testing.assert_array_equal(parallel.to_host(out)["w"], tree["w"])
  assert float(parallel.to_host(out)["b"]) == 2.5


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_use_cpu_devices_rejects_non_positive_integers(bad):
  with pytest.raises(ValueError, match="positive integer"):
    parallel.use_cpu_devices(bad)


def test_use_cpu_devices_after_backend_start_is_a_clear_error():
  jax.devices()  # the backend is up in this process
  parallel.use_cpu_devices(1)  # the default: nothing to change
  with pytest.raises(ValueError, match="before JAX touches a device"):
    parallel.use_cpu_devices(2)


def test_initialize_disabled_is_a_no_op():
  assert parallel.maybe_initialize_distributed(False) is False
  assert jax.process_count() == 1


@pytest.mark.parametrize("kwargs,message", [
    ({"coordinator_address": "localhost:1234"}, "missing"),
    ({"coordinator_address": "nohostport", "num_processes": 2,
      "process_id": 0}, "host:port"),
    ({"coordinator_address": "localhost:1", "num_processes": 2,
      "process_id": 2}, r"process_id must be in \[0, num_processes=2\)"),
    ({"coordinator_address": "localhost:1", "num_processes": 0,
      "process_id": 0}, "num_processes must be >= 1"),
])
def test_initialize_rejects_inconsistent_arguments(kwargs, message):
  with pytest.raises(ValueError, match=message):
    parallel.maybe_initialize_distributed(True, **kwargs)


def test_initialize_rejects_partial_environment(monkeypatch):
  monkeypatch.setenv(parallel.ENV_COORDINATOR, "localhost:1234")
  monkeypatch.delenv(parallel.ENV_NUM_PROCESSES, raising=False)
  monkeypatch.delenv(parallel.ENV_PROCESS_ID, raising=False)
  with pytest.raises(ValueError, match="NSRNN_NUM_PROCESSES"):
    parallel.maybe_initialize_distributed(True)


# ---------------------------------------------------------------------------
# 8 simulated devices (subprocess).
# ---------------------------------------------------------------------------


def test_eight_devices_match_one_device(tmp_path):
  out = tmp_path / "devices.json"
  result = subprocess.run(
      [sys.executable, WORKER, "devices", str(out), "ns"],
      env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"),
      capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  got = json.loads(out.read_text())
  assert got["device_count"] == 8
  assert got["mesh"] == {"model": 1, "data": 8}
  assert got["params_replicated"]
  # Same global batch, gradients averaged over 8 shards: equal up to float32
  # rounding of the reordered sums (NS-RNN, 3 Adam steps).
  np.testing.assert_allclose(got["losses"], got["reference_losses"],
                             rtol=1e-5)
  assert got["max_param_diff"] <= 1e-5 * max(1.0, got["param_scale"])


# ---------------------------------------------------------------------------
# Two processes on localhost (subprocesses, gloo CPU collectives).
# ---------------------------------------------------------------------------


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("two_process"))
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, WORKER, "multiprocess", workdir],
      env=_env(NSRNN_COORDINATOR_ADDRESS=f"localhost:{port}",
               NSRNN_NUM_PROCESSES="2", NSRNN_PROCESS_ID=str(i)),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=300)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, output in zip(procs, outputs):
    assert p.returncode == 0, output[-3000:]
  return workdir


def test_two_processes_match_single_process(two_process_run):
  config = worker.tiny_config("lstm")
  ref_losses, _, _ = worker.reference_run(config, worker.global_batches(3))
  for i in range(2):
    with open(os.path.join(two_process_run, f"losses_{i}.json")) as f:
      got = json.load(f)
    assert got["process_count"] == 2 and got["device_count"] == 2
    # Each process built only its half of every global batch.
    assert got["rows"] == [4 * i, 4 * i + 4]
    np.testing.assert_allclose(got["losses"], ref_losses, rtol=1e-5)


def test_only_process_zero_wrote_metrics(two_process_run):
  records = metrics_lib.read_jsonl(
      os.path.join(two_process_run, "metrics.jsonl"))
  assert [r["epoch"] if "epoch" in r else r.get("step") for r in records] == [
      1, 2, 3]
  assert len(glob.glob(os.path.join(two_process_run, "events.out.*"))) == 1


def test_two_process_checkpoint_restores_in_one_process(two_process_run):
  config = worker.tiny_config("lstm")
  _, ref_params, ref_state = worker.reference_run(
      config, worker.global_batches(3))
  manager = checkpointing.make_manager(
      os.path.join(two_process_run, "checkpoints"))
  try:
    step, arrays, host = checkpointing.restore_latest(manager,
                                                      ref_state.arrays())
  finally:
    checkpointing.close(manager)
  assert step == worker.NUM_STEPS and host["steps"] == worker.NUM_STEPS
  assert int(arrays["step"]) == worker.NUM_STEPS
  for got, want in zip(jax.tree.leaves(arrays["params"]),
                       jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_describe_runtime_names_backend_devices_and_precision():
  line = parallel.describe_runtime("highest")
  assert "\n" not in line
  assert line.startswith(f"runtime: backend {jax.default_backend()}")
  assert f"{jax.device_count()} device(s): " in line
  assert jax.devices()[0].device_kind in line
  assert line.endswith("matmul precision highest")
  assert parallel.describe_runtime("default").endswith(
      "matmul precision default")
  with pytest.raises(ValueError, match="config.matmul_precision"):
    parallel.describe_runtime("tf32")


@pytest.mark.parametrize("text, want", [
    ("model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma avx512f "
     "avx512bw\n", "AVX-512"),
    ("flags\t\t: fpu sse2 avx avx2 fma\n", "AVX2"),
    ("flags\t\t: fpu sse2\n", None),
    ("Features\t: fp asimd evtstrm sve\n", "SVE"),
    ("Features\t: fp asimd evtstrm\n", "NEON"),
    ("processor\t: 0\n", None),
])
def test_host_cpu_vector_isa_reads_the_widest_extension(text, want):
  assert parallel.host_cpu_vector_isa(text) == want


def test_cores_parse_and_format_as_ranges():
  assert parallel.parse_cores("0-2,5") == [0, 1, 2, 5]
  assert parallel.parse_cores(" 3 , 1") == [1, 3]
  assert parallel.format_cores([5, 0, 2, 1]) == "0-2,5"
  assert parallel.format_cores([7]) == "7"
  for text in ("", "a", "2-1", "-1", "1-", "0,,1"):
    with pytest.raises(ValueError, match="not a list of core numbers"):
      parallel.parse_cores(text)


@pytest.mark.skipif(parallel.usable_cores() is None
                    or len(parallel.usable_cores()) < 2,
                    reason="pins a process to one of 2+ usable cores")
def test_a_pinned_process_runs_on_its_cores_and_says_so():
  # In a fresh process: pinning this one would change the other tests.
  core = parallel.usable_cores()[-1]
  code = ("from nsrnn_jax import parallel; "
          f"parallel.pin_to_cores([{core}]); "
          "print(parallel.usable_cores()); print(parallel.describe_runtime())")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True, env={**os.environ,
                                                   "JAX_PLATFORMS": "cpu"})
  cores_line, runtime = out.stdout.strip().splitlines()[-2:]
  assert cores_line == f"[{core}]"
  assert f", this process on core(s) {core}]" in runtime
  # A process that may use every core names no share.
  if len(parallel.usable_cores()) == os.cpu_count():
    assert "this process on" not in parallel.describe_runtime()
  with pytest.raises(ValueError, match="not available to this process"):
    parallel.pin_to_cores([max(parallel.usable_cores()) + 1000])


def test_describe_runtime_names_the_cpu_vector_extension():
  if jax.default_backend() != "cpu":
    pytest.skip("the host CPU is named on the CPU backend only")
  isa = parallel.host_cpu_vector_isa()
  line = parallel.describe_runtime("highest")
  assert (f", {isa}, " in line) == (isa is not None)


def test_host_l3_cache_bytes_reads_the_level_3_entry(tmp_path):
  # sysfs as Linux lays it out: index0-2 are L1d, L1i, L2; index3 the L3.
  for i, (level, size) in enumerate([("1", "32K"), ("1", "32K"),
                                     ("2", "512K"), ("3", "8192K")]):
    d = tmp_path / f"index{i}"
    d.mkdir()
    (d / "level").write_text(level + "\n")
    (d / "size").write_text(size + "\n")
  assert parallel.host_l3_cache_bytes(str(tmp_path)) == 8 * 2**20
  (tmp_path / "index3" / "size").write_text("32M\n")
  assert parallel.host_l3_cache_bytes(str(tmp_path)) == 32 * 2**20
  (tmp_path / "index3" / "size").write_text("lots\n")
  assert parallel.host_l3_cache_bytes(str(tmp_path)) is None
  (tmp_path / "index3" / "level").write_text("2\n")   # no L3 at all
  assert parallel.host_l3_cache_bytes(str(tmp_path)) is None
  assert parallel.host_l3_cache_bytes(str(tmp_path / "missing")) is None
