"""benchmarks/kernel_resources.py captures the stack kernels' Triton IR.

Oracles: each kernel lowers to one Triton function of its own name; and
the IR does not grow with the sequence length, which is what keeps every
loop over rows and columns a loop in the kernel (a loop unrolled in Python
repeats its loads once per tile: the kernels then took 60 s to compile
for a GPU and used all 255 registers). Compiling for a GPU needs the
`triton` package, which CI does not install; that test skips without it.
"""

import os

import jax
import pytest

KERNELS = {"forward_update": "_update_kernel",
           "backward_table_update": "_backward_table_kernel",
           "local_bwd": "_local_bwd_kernel"}


@pytest.fixture(scope="module")
def kernel_resources(load_benchmark):
  return load_benchmark("kernel_resources")


@pytest.fixture(scope="module")
def ir_by_length(kernel_resources):
  """{length: {kernel: Triton IR}} at Q = S = 2, batch 2."""
  out = {}
  for length in (6, 30):
    calls = kernel_resources.kernel_calls(2, 2, length, 2)
    out[length] = {name: kernel_resources.triton_ir(fn, shapes)
                   for name, (fn, shapes) in calls.items()}
  return out


def test_each_kernel_is_one_triton_function(ir_by_length):
  for name, ir in ir_by_length[6].items():
    assert ir.count("tt.func public") == 1
    assert f"@{KERNELS[name]}(" in ir


def test_kernel_code_does_not_grow_with_the_length(ir_by_length):
  for name in KERNELS:
    loads = [ir_by_length[n][name].count("tt.load") for n in (6, 30)]
    assert loads[0] == loads[1] > 0, (name, loads)


def test_kernels_compile_for_a_hopper_gpu(kernel_resources, ir_by_length):
  if jax.default_backend() != "cpu":
    pytest.skip("on a GPU, tests/stack_kernels_test.py runs the kernels "
                "compiled by jaxlib's own Triton")
  triton = pytest.importorskip("triton")
  for name, ir in ir_by_length[6].items():
    usage = kernel_resources.compile_for_gpu(triton, ir, num_warps=4,
                                             arch=90)
    assert 0 < usage["reg"] <= 255, name
    assert usage["local"] == 0, (name, usage)   # no spilled registers


def test_kernel_tile_flags(load_benchmark):
  train_step = load_benchmark("train_step")
  assert train_step.parse_kernel_tiles("64x16x4,128x32x8g,") == [
      (64, 16, 4, False), (128, 32, 8, True)]
  for bad in ("3x1x1", "64x16", "64x16x4x2", "ax16x4", "64x16x4q", "0x16x4"):
    with pytest.raises(ValueError, match="ROWSxCHUNKxWARPS"):
      train_step.parse_kernel_tiles(bad)
  assert train_step.tiles_label((64, 16, 4, True)) == "64/16/4 grid"


def test_kernels_of_another_revision_lower_as_the_current(
    kernel_resources, ir_by_length, tmp_path, monkeypatch):
  # --baseline_ref loads stack_kernels.py from git or .baselines/ into a
  # module that has no file on disk (machine.module_at_revision): Pallas
  # must lower it all the same. Oracle: the same source gives the same IR.
  machine = kernel_resources.machine
  with open(os.path.join(machine.REPO, "nsrnn_jax",
                         "stack_kernels.py")) as f:
    source = f.read()
  monkeypatch.setattr(machine, "REPO", str(tmp_path))   # no git here
  copy = tmp_path / ".baselines" / "abc1234" / "nsrnn_jax"
  copy.mkdir(parents=True)
  (copy / "stack_kernels.py").write_text(source)
  old = kernel_resources.load_kernels_at("abc1234")
  assert old.__file__ == "abc1234:nsrnn_jax/stack_kernels.py"
  assert kernel_resources.settings_of(old) == kernel_resources.settings_of(
      kernel_resources.stack_kernels)
  calls = kernel_resources.kernel_calls(2, 2, 6, 2, kernels=old)
  for name, (fn, shapes) in calls.items():
    ir = kernel_resources.triton_ir(fn, shapes)
    assert ir == ir_by_length[6][name], name
  assert kernel_resources.load_kernels_at("def5678") is None
