"""benchmarks/profile_step.py reads traces and HLO correctly.

Oracles: exclusive times of hand-made nested spans; a traced jitted
program whose matmul runs a known number of times (the trace must count
exactly those calls and classify the op by its operands' size).
"""

import types

import jax
import jax.numpy as jnp
import pytest
from jax import lax


@pytest.fixture(scope="module")
def profile_step(load_benchmark):
  return load_benchmark("profile_step")


def test_exclusive_times_subtract_children(profile_step):
  # loop [0, 100) holds a [10, 30) and b [40, 45); c [200, 210) stands alone;
  # a second loop [300, 350) holds a [300, 320) (same start as its parent).
  events = [(0, 100, "loop"), (10, 30, "a"), (40, 45, "b"), (200, 210, "c"),
            (300, 350, "loop"), (300, 320, "a")]
  out = profile_step._exclusive_times(events)
  assert out["loop"] == [(100 - 25) + (50 - 20), 2]
  assert out["a"] == [40, 2]
  assert out["b"] == [5, 1]
  assert out["c"] == [10, 1]


def test_elements_of_shapes(profile_step):
  assert profile_step._elements("f32[20,162,2]{2,1,0}") == 6480
  assert profile_step._elements("f32[]") == 1
  assert profile_step._elements("(f32[2], s32[])") == 0


def test_trace_counts_every_call_of_a_traced_matmul(profile_step, tmp_path):
  # On the host's CPU device on any machine: a GPU backend would launch the
  # loop body as one command buffer, whose trace names none of its ops.
  cpu = jax.devices("cpu")[0]
  big = profile_step.TABLE_ELEMENTS + 4096       # a "table-sized" operand
  table = jax.device_put(jnp.ones((big // 64, 64), jnp.float32), cpu)
  vec = jax.device_put(jnp.ones((3, big // 64), jnp.float32), cpu)

  def body(i, carry, v, t):
    # Depends on i, so XLA cannot hoist the matmul out of the loop.
    return carry + lax.dot(v * i, t, precision=lax.Precision.HIGHEST)

  steps, trips = 2, 7
  f = jax.jit(lambda v, t: lax.fori_loop(
      0, trips, lambda i, c: body(i, c, v, t), jnp.zeros((3, 64), v.dtype)))
  compiled = f.lower(vec, table).compile()
  assert compiled.input_shardings[0][0].device_set == {cpu}
  hlo = profile_step.hlo_instructions(compiled.as_text())
  compiled(vec, table).block_until_ready()
  jax.profiler.start_trace(str(tmp_path))
  for _ in range(steps):
    compiled(vec, table).block_until_ready()
  jax.profiler.stop_trace()
  times, lines = profile_step.read_trace(str(tmp_path), host=True)
  assert lines and all("/device:" not in l for l in lines), lines
  dots = {n: c for n, (_, c) in times.items()
          if n in hlo and profile_step.category(n, hlo[n])
          == "matmul, table-sized"}
  assert list(dots.values()) == [steps * trips], (dots, hlo.keys())
  assert all(ns >= 0 for ns, _ in times.values())


def _line(name, events):
  """A trace line of (start, end, name[, hlo_op stat]) events."""
  return types.SimpleNamespace(name=name, events=[
      types.SimpleNamespace(start_ns=e[0], duration_ns=e[1] - e[0],
                            name=e[2], stats=[("hlo_op", e[3])] if
                            len(e) > 3 else []) for e in events])


def _plane(name, *lines):
  return types.SimpleNamespace(name=name, lines=list(lines))


def test_gpu_traces_count_device_time_once(profile_step):
  # A GPU trace as the profiler writes it: host threads that launch the
  # ops, the device's kernels on a stream (named by CUDA, with an hlo_op
  # stat) and, in some versions, a derived "XLA Ops" line.
  host = _plane("/host:CPU", _line("tf_XLAGpuThread/1",
                                   [(0, 50, "fusion.1"), (60, 70, "dot.2")]))
  stream = _line("Stream #13(Compute)", [(5, 25, "loop_add_kernel", "fusion.1"),
                                         (30, 90, "gemm_kernel", "dot.2")])
  ops = _line("XLA Ops", [(5, 25, "fusion.1"), (30, 90, "dot.2")])
  modules = _line("XLA Modules", [(0, 100, "jit_step")])
  with_ops = profile_step.counted_lines(
      [host, _plane("/device:GPU:0", modules, stream, ops)])
  assert [l.name for _, l in with_ops] == ["XLA Ops"]
  assert dict(profile_step.charge(with_ops)) == {"fusion.1": [20, 1],
                                                "dot.2": [60, 1]}
  # Without the derived line: the stream's kernels, charged to their ops.
  streams = profile_step.counted_lines(
      [host, _plane("/device:GPU:0", modules, stream)])
  assert [l.name for _, l in streams] == ["Stream #13(Compute)"]
  assert dict(profile_step.charge(streams)) == {"fusion.1": [20, 1],
                                               "dot.2": [60, 1]}
  # No device plane (CPU), or one whose lines hold no events (the program
  # ran on the host): the XLA runtime's host threads.
  cpu = profile_step.counted_lines([host])
  assert [l.name for _, l in cpu] == ["tf_XLAGpuThread/1"]
  idle = profile_step.counted_lines(
      [host, _plane("/device:GPU:0", _line("XLA Ops", []),
                    _line("Stream #13(Compute)", []))])
  assert [l.name for _, l in idle] == ["tf_XLAGpuThread/1"]
  # A program run on the CPU backend of a GPU machine, whose GPU plane holds
  # a stray copy: `host` picks the host's threads all the same.
  copies = _plane("/device:GPU:0", _line("XLA Ops", [(0, 5, "MemcpyD2H")]))
  assert [l.name for _, l in profile_step.counted_lines(
      [host, copies], host=True)] == ["tf_XLAGpuThread/1"]
  assert [l.name for _, l in profile_step.counted_lines(
      [host, copies])] == ["XLA Ops"]
  # A command buffer (CUDA graph) is its own kind: its event times the
  # launch of many kernels, none of which it names.
  assert profile_step.category("command_buffer_12", None).startswith(
      "command buffers")
