"""benchmarks/train_step.py's analysis variants measure what they say.

Oracle: the lowered program. The --table_matmul_cost variant must remove
exactly the stack's table-sized products (the pop matmul of every column
chunk in every forward time block, M̃'s cotangent per chunk and the W
product in every backward block) and nothing else that the step computes,
or its time difference would not be their cost.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from nsrnn_jax import rns_stack

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_table_matmul_cost_variant_drops_only_the_table_products(
    load_benchmark):
  train_step = load_benchmark("train_step")
  length = 50                # two time blocks (rns_stack._time_blocks)
  current = train_step.Variant("ns22", "current", length, "highest",
                               count_dots=True)
  zeroed = train_step.Variant(
      "ns22", train_step.TABLE_MATMULS_ZEROED, length, "highest",
      patches=[(rns_stack, "_table_dot", train_step.zero_table_dot)],
      count_dots=True)
  # pylint: disable-next=protected-access
  blocks = len(rns_stack._time_blocks(length - 1))
  assert blocks >= 2
  # Block b (0-based) of the forward: one pop matmul per column chunk
  # (b + 1); of the backward: M̃'s cotangent per chunk (b + 1) and the W
  # product (1).
  assert current.dots - zeroed.dots == blocks * (blocks + 1) + blocks
  # The same step otherwise: it trains (finite loss) and runs.
  zeroed.time_once()
  _, metrics = zeroed.step(zeroed.state, zeroed.batch)
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("script", ["train_step.py", "concurrent_steps.py"])
def test_an_unknown_model_is_one_line_and_exit_2(script):
  # Before anything is measured (the machine's matmul and read rates come
  # first), not a KeyError traceback (train_step) or a child's exit status
  # (concurrent_steps) after them.
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, "benchmarks", script),
       "--models=ns22,ns2", f"--out={os.devnull}"],
      capture_output=True, text=True, timeout=300, check=False)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
  assert "--models: unknown ns2; choose from ns22, ns33" in lines[0]


@pytest.mark.parametrize("flag,message", [
    ("--batch_chunk=0,x", "--batch_chunk must be comma-separated integers"),
    ("--batch_chunk=-1", "--batch_chunk must be comma-separated integers"),
    ("--modes=pinned,loose", "--modes must name free and/or pinned")])
def test_concurrent_steps_bad_variant_is_one_line_and_exit_2(flag, message):
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, "benchmarks", "concurrent_steps.py"),
       "--models=ns32", flag, f"--out={os.devnull}"],
      capture_output=True, text=True, timeout=300, check=False)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
  assert message in lines[0]
