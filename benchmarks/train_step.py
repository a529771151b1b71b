"""Benchmark: one full training step (forward, loss, backward, clip, Adam).

Batch 10, length 80 (marked reversal, V = 3) for the NS-RNN (Q = S = 2 and
Q = S = 3), JM and Gref (m = 20) and the LSTM, through the same
`train.train_step` that training uses, at full float32 matmul precision
unless --precision says otherwise.

For the NS-RNN it also reports the step time over a FLOP limit: the pop
term's 2·B·Q³S²·n³ FLOP (forward + backward, issue 11) at this machine's
jitted 1024³ float32 matmul rate, measured in the same run (interleaved with
the steps, best rate kept). All variants of one model are compiled first and
then timed in alternation (order reversed every round), so their ratios
come from the same conditions.

Variants (each adds rows; the plain row is always measured):
  --unroll=2,4          time-loop scan unroll factors (config.scan_unroll;
                        every model, and the NS stack's sweeps)
  --baseline_ref=REF    the NS models with nsrnn_jax/ns_stack.py, and the
                        rns models with nsrnn_jax/rns_stack.py, as of git
                        REF (loaded by path), for before/after ratios
  --cpu_devices=2       the batch split over N CPU devices through loop.py's
                        per-device step (what `main --cpu_devices=N` runs;
                        re-executes itself with N CPU devices)
  --batch_chunk=10,2    the NS models with config.stack_batch_chunk = N
                        (the plain row chooses automatically; a baseline
                        ref from before the field runs the whole batch);
                        with --cpu_devices, on the devices too (each
                        device's share of the batch in chunks of N)
  --gref_cumsum         Gref with its "sum of the strengths above" by
                        lax.cumsum, as before it became one matmul
  --other_residuals     LSTM, JM and Gref with their time loops storing the
                        other set of a step's residuals for the backward:
                        every one (plain autodiff) where the model stores
                        only its matmuls' outputs, and the reverse
                        (models.PRODUCTS_ONLY_LOOPS, keep_products_only)
  --lstm_two_products   every model with its LSTM's gates as two products
                        added (x·w_ih + h·w_hh), as before they became one
                        product of [x, h] with [w_ih; w_hh]
  --contractions_by_sum
                        the NS models (shares table) with
                        rns_stack.COLUMN_CONTRACTIONS = "reduce" (the
                        update's column-sized contractions as multiply and
                        sum), and with TABLE_CONTRACTIONS = "reduce" too
                        (every contraction of the stack); each row of the
                        model records the dot_general count of its lowered
                        step, which shows the setting took
  --table_matmul_cost   the NS models (shares table) once more with the
                        stack's table-sized products (rns_stack._table_dot:
                        the pop matmul, the backward's M̃ cotangent and W
                        products) replaced by zeros of their shape: not a
                        valid step (wrong values), a measurement: its time
                        below the plain row's is what those products cost
  --table_layouts       the NS models (shares table) once more with each
                        rns_stack.TABLE_LAYOUT other than the one the
                        backend gets by default ("chunks" on CPU, "square"
                        elsewhere)
  --dispatch_floor      every row (no variant added) also gets the number
                        of ops its compiled step runs one after another,
                        loops counted per trip (machine.sequential_ops),
                        times the cost of one small op measured in the
                        same run (machine.op_dispatch_us): on a CPU, where
                        XLA runs each op as a thunk, a floor on the step
                        that no faster arithmetic gets under
  --pallas_kernels      the NS models (shares table) with the stack's
                        updates as Pallas kernels (rns_stack.UPDATE_KERNELS
                        = "pallas", nsrnn_jax/stack_kernels.py: one per
                        forward update, one for the backward's table part;
                        for GPUs: on CPU they run interpreted, for
                        correctness only)
  --kernel_tiles 128x32x4,64x16x4g
                        with --pallas_kernels: one more Pallas variant per
                        (stack_kernels.ROW_TILE, KT_CHUNK, NUM_WARPS) triple;
                        a trailing g: ROW_GRID (a program per row tile)

With --compile_study it also measures what the compile strategy costs: the
compile time of the train step and the step time at several lengths, and
from these the time of the first epoch and of 100 epochs under
"per_length" (one executable per length, no padding) and "bucket" (pad to
config.length_buckets).

Writes benchmarks/results/train_step_<backend>.json (machine, CPU model and
load average included); `python benchmarks/report.py` turns the committed
JSON into the tables of README and docs/benchmarks.md. Figures from elsewhere (the authors' PyTorch) are
in results/reference_pytorch.json, never here.

  python benchmarks/train_step.py [--models=ns22,ns33,jm,gref,lstm]
      [--length=80 (or 41,60,80)] [--repeats=5] [--unroll=1]
      [--baseline_ref=HEAD~3]
      [--cpu_devices=2] [--compile_study --study_model=ns22,jm]
"""

import contextlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
import types
import typing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np

import machine
from configs import default
from nsrnn_jax import loop
from nsrnn_jax import models
from nsrnn_jax import ns_stack
from nsrnn_jax import parallel
from nsrnn_jax import rns_stack
from nsrnn_jax import stack_kernels
from nsrnn_jax import train
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

BATCH = 10
# Model settings and the project's targets (issues 4 and 11; targets, not
# measurements).
SETTINGS = {
    # The NS-RNN as configured by default (stack_table "shares": rns_stack,
    # exact for any finite log-weights) and on ns_stack's scaled table
    # (faster; can flush in float32: models.NS_TABLES).
    "ns22": dict(model="ns", num_states=2, num_stack_symbols=2,
                 stack_table="shares"),
    "ns33": dict(model="ns", num_states=3, num_stack_symbols=3,
                 stack_table="shares"),
    # Padded reversal's NS-RNN (paper section 5.5); not in the default list.
    "ns32": dict(model="ns", num_states=3, num_stack_symbols=2,
                 stack_table="shares"),
    "ns22_scaled": dict(model="ns", num_states=2, num_stack_symbols=2,
                        stack_table="scaled"),
    "ns33_scaled": dict(model="ns", num_states=3, num_stack_symbols=3,
                        stack_table="scaled"),
    "jm": dict(model="jm", stack_embedding_size=20),
    "gref": dict(model="gref", stack_embedding_size=20),
    "lstm": dict(model="lstm"),
}
TARGETS_S = {
    "cpu": {"ns22": 0.060, "ns33": 0.250, "jm": 0.005, "gref": 0.005,
            "lstm": 0.002},
    "gpu": {"ns22": 0.003, "ns33": 0.004, "jm": 0.0015, "gref": 0.0015,
            "lstm": 0.0015},
}
# CPU target of issue 11: an NS step within this factor of the FLOP limit.
CPU_LIMIT_RATIO_TARGET = 6.0


def _config(name, precision, overrides=None):
  config = default.get_config()
  for k, v in {**SETTINGS[name], **(overrides or {})}.items():
    config[k] = v
  config.matmul_precision = precision
  return config


def _symbols(length, batch_size=BATCH, seed=0):
  rng = np.random.default_rng(seed)
  return rng.integers(0, 3, size=(batch_size, length)).astype(np.int32)


def _stack_module(run_coupled, module=ns_stack):
  """{module name: the module with `run_coupled` replaced} for `Variant`."""
  shim = types.SimpleNamespace(**vars(module))
  shim.run_coupled = run_coupled
  return {module.__name__.rsplit(".", 1)[-1]: shim}


class Baseline(typing.NamedTuple):
  """--baseline_ref: the stacks' `run_coupled` as of `ref` and whether that
  ref's models.py already chose the stack's batch chunk."""
  ref: str
  ns_stack: typing.Any
  rns_stack: typing.Any
  chunks_batch: bool


def load_baseline(ref, stack="ns_stack"):
  """`run_coupled` of nsrnn_jax/<stack>.py as of git `ref` (None if absent;
  `machine.module_at_revision`): its own imports of the package (rns_stack's
  helpers from ns_stack) resolve to the current code.
  """
  module = machine.module_at_revision(ref, stack, missing_ok=True)
  if module is None:
    return None
  params = inspect.signature(module.run_coupled).parameters

  def run_coupled(*args, **kwargs):
    # An older stack may not take these; it then runs at its own default.
    for k in ("precision", "unroll"):
      if k not in params:
        kwargs.pop(k, None)
    return module.run_coupled(*args, **kwargs)

  return run_coupled


@contextlib.contextmanager
def patched(patches):
  """(object, attribute, value) triples set for the block, then restored."""
  saved = [(o, a, getattr(o, a)) for o, a, _ in patches]
  for o, a, value in patches:
    setattr(o, a, value)
  try:
    yield
  finally:
    for o, a, value in saved:
      setattr(o, a, value)


class Variant:
  """One compiled train step (a fresh jit, traced with its own stack).

  `stacks` maps a stack module's name in models.py ("ns_stack",
  "rns_stack") to the module to trace with instead; `patches`, (object,
  attribute, value) triples, are set likewise while the step is traced.
  With `count_dots`, `dots` is the number of dot_generals in the lowered
  step (traced under the same stacks and patches).
  """

  def __init__(self, name, label, length, precision, stacks=None,
               num_devices=None, overrides=None, patches=(),
               count_dots=False):
    self.name, self.label = name, label
    config = _config(name, precision, overrides)
    model = models.build(config, vocab_size=3)
    state = train.create_train_state(config, jax.random.key(0), model)
    batch = train.make_batch(_symbols(length))
    self.keep_state = num_devices is not None
    if num_devices is not None:
      # The library's data-parallel path: loop.py's per-device step (K = 1
      # model, batch split over 'data', gradients summed once per step).
      mesh = parallel.make_mesh(num_data=num_devices)
      state = state.replace(**parallel.shard_models(
          jax.tree.map(lambda x: np.asarray(x)[None], state.arrays()), mesh))
      batch = parallel.put_model_batch(
          {k: np.asarray(v)[None] for k, v in batch.items()}, mesh)
      # Donates its state argument: time_once carries the returned state.
      self.step = loop.jitted_steps(mesh).train
    else:
      # A fresh function object: its own trace, not shared with variants.
      self.step = jax.jit(lambda s, b: train.train_step(s, b))
    self.state, self.batch = state, batch
    # A stack module swapped in is one more patch, of models.
    self.patches = list(patches) + [
        (models, k, module) for k, module in (stacks or {}).items()]
    self.dots = (self.lower().as_text().count("dot_general") if count_dots
                 else None)
    with patched(self.patches):
      start, cpu_start = time.perf_counter(), time.process_time()
      s, m = self.step(state, batch)
      jax.block_until_ready(m["loss"])
    if self.keep_state:
      self.state = s
    self.compile_s = time.perf_counter() - start
    self.compile_cpu_s = time.process_time() - cpu_start
    self.times, self.cpu_times = [], []

  def lower(self):
    """The step lowered (traced) under this variant's stacks and patches."""
    with patched(self.patches):
      return self.step.lower(self.state, self.batch)

  def sequential_ops(self):
    """Ops one call of the compiled step runs, loops counted per trip.

    machine.sequential_ops of this variant's program, compiled once more;
    None (printed) where the program has a loop without a known trip count,
    so that a backend printing its loops otherwise costs the floor, not the
    run's other rows.
    """
    with patched(self.patches):
      text = self.lower().compile().as_text()
    try:
      return machine.sequential_ops(text)
    except ValueError as e:
      print(f"{self.name} {self.label}: no dispatch floor ({e})", flush=True)
      return None

  def time_once(self):
    start, cpu_start = time.perf_counter(), time.process_time()
    s, m = self.step(self.state, self.batch)
    jax.block_until_ready((s.params, m["loss"]))
    if self.keep_state:
      self.state = s
    self.times.append(time.perf_counter() - start)
    self.cpu_times.append(time.process_time() - cpu_start)


def cumsum_sum_above(strength_BxT, precision="highest"):
  """Gref's "sum of the strengths above" as it was up to e89574a: a reverse
  `lax.cumsum` shifted by one (the `--gref_cumsum` variant)."""
  del precision
  inclusive = jax.lax.cumsum(strength_BxT, axis=1, reverse=True)
  return jnp.concatenate([inclusive[:, 1:], jnp.zeros_like(inclusive[:, :1])],
                         axis=1)


def two_products_lstm_step(params, carry, x_BxI, precision="highest"):
  """`models.lstm_step` as it was up to 2a55cd1: the gates' pre-activations
  as two products added, x·w_ih + h·w_hh (the `--lstm_two_products`
  variant)."""
  h_BxH, c_BxH = carry
  gates_Bx4H = (models._mm(x_BxI, params["w_ih"], precision) + params["b_ih"]
                + models._mm(h_BxH, params["w_hh"], precision)
                + params["b_hh"])
  i_BxH, f_BxH, g_BxH, o_BxH = jnp.split(gates_Bx4H, 4, axis=-1)
  c_BxH = (jax.nn.sigmoid(f_BxH) * c_BxH
           + jax.nn.sigmoid(i_BxH) * jnp.tanh(g_BxH))
  h_BxH = jax.nn.sigmoid(o_BxH) * jnp.tanh(c_BxH)
  return (h_BxH, c_BxH), h_BxH


def parse_kernel_tiles(text):
  """[(ROW_TILE, KT_CHUNK, NUM_WARPS, ROW_GRID)] of stack_kernels from
  "ROWSxCHUNKxWARPS[g],...": powers of two; a trailing g sets ROW_GRID (a
  program per row tile). ValueError on anything else."""
  out = []
  for t in (t for t in text.split(",") if t):
    grid = t.endswith("g")
    try:
      sizes = [int(v) for v in t[:-1 if grid else None].split("x")]
    except ValueError:
      sizes = []
    if len(sizes) != 3 or min(sizes) < 1 or any(v & (v - 1) for v in sizes):
      raise ValueError(f"{t!r}: want ROWSxCHUNKxWARPS, powers of two, with "
                       "g after for a program per row tile (e.g. 64x16x4g)")
    out.append((*sizes, grid))
  return out


def tiles_label(tiles):
  """"rows/chunk/warps[ grid]" of a parse_kernel_tiles entry."""
  rows, chunk, warps, grid = tiles
  return f"{rows}/{chunk}/{warps}" + (" grid" if grid else "")


def tile_patches(tiles, module=stack_kernels):
  """(module, attribute, value) patches that set those kernel settings."""
  return [(module, k, v) for k, v in zip(
      ("ROW_TILE", "KT_CHUNK", "NUM_WARPS", "ROW_GRID"), tiles)]


# Label of the --table_matmul_cost variant (its values are not a step's).
TABLE_MATMULS_ZEROED = "table matmuls zeroed (cost)"


def zero_table_dot(lhs, rhs, rhs_contracting, prec):
  """`rns_stack._table_dot`'s result shape, all zeros (--table_matmul_cost).

  Tied to both operands by a negligible term, so XLA keeps every op that
  makes them (the table, the W table and M̃ are still built); only the
  products themselves are gone.
  """
  del prec
  n = rhs.shape[2] if rhs_contracting == 1 else rhs.shape[1]
  tie = 0.0 * (lhs[:, :1, :1].sum() + rhs[:, :1, :1].sum())
  return jnp.zeros(lhs.shape[:2] + (n,), lhs.dtype) + tie


def bench_model(name, length, repeats, precision, unrolls, baseline,
                cpu_devices, batch_chunks=(), gref_cumsum=False,
                contractions_by_sum=False, pallas_kernels=False,
                kernel_tiles=(), lstm_two_products=False,
                other_residuals=False, table_matmul_cost=False,
                table_layouts=False, dispatch_floor=False):
  """Rows for one model: every variant, timed in alternation.

  `kernel_tiles`: (ROW_TILE, KT_CHUNK, NUM_WARPS, ROW_GRID) settings of
  stack_kernels, one more Pallas variant each (with `pallas_kernels`);
  one that fails to compile gives a row with its error instead (an
  "error" field, no times). `dispatch_floor`: every row also gets the ops
  its compiled step runs one after another (`sequential_ops`) times the
  machine's cost of one small op (`op_dispatch_us`, measured in the same
  run), a floor no arithmetic speed-up gets under.
  """
  failed = []
  on_shares = (SETTINGS[name]["model"] == "ns"
               and SETTINGS[name]["stack_table"] == "shares")
  reduce = contractions_by_sum and on_shares
  pallas = pallas_kernels and on_shares
  # The dot_general count of each lowered step shows that a setting took.
  variants = [Variant(name, "current", length, precision,
                      count_dots=reduce or pallas)]
  if reduce:
    column = (rns_stack, "COLUMN_CONTRACTIONS", "reduce")
    variants += [
        Variant(name, "column contractions by sum", length, precision,
                patches=[column], count_dots=True),
        Variant(name, "all stack contractions by sum", length, precision,
                patches=[column, (rns_stack, "TABLE_CONTRACTIONS", "reduce")],
                count_dots=True)]
  if table_layouts and on_shares:
    # pylint: disable-next=protected-access
    default = "chunks" if rns_stack._chunked_table() else "square"
    for layout in ("chunks", "square"):
      if layout != default:
        variants.append(Variant(name, f"table layout {layout}", length,
                                precision,
                                patches=[(rns_stack, "TABLE_LAYOUT", layout)]))
  if table_matmul_cost and on_shares:
    variants.append(Variant(name, TABLE_MATMULS_ZEROED, length, precision,
                            patches=[(rns_stack, "_table_dot",
                                      zero_table_dot)]))
  if pallas:
    on_kernels = (rns_stack, "UPDATE_KERNELS", "pallas")
    variants.append(Variant(
        name, "updates as Pallas kernels", length, precision,
        patches=[on_kernels], count_dots=True))
    for tiles in kernel_tiles:
      label = f"Pallas kernels {tiles_label(tiles)}"
      try:
        variants.append(Variant(
            name, label, length, precision,
            patches=[on_kernels] + tile_patches(tiles)))
      except Exception as e:  # pylint: disable=broad-except
        # A tile size the GPU cannot compile (registers, shared memory)
        # is a result of the sweep, not the end of it.
        failed.append({"model": name, "variant": label,
                       "error": f"{type(e).__name__}: {e}"[:500]})
        print(f"{name:5s} {label:26s} failed: {failed[-1]['error'][:200]}",
              flush=True)
  if other_residuals and name in ("lstm", "jm", "gref"):
    # The other side of models.PRODUCTS_ONLY_LOOPS for this model.
    only_products = name not in models.PRODUCTS_ONLY_LOOPS
    variants.append(Variant(
        name, "only products stored" if only_products
        else "every residual stored", length, precision,
        {"PRODUCTS_ONLY_LOOPS": models.PRODUCTS_ONLY_LOOPS ^ {name}}))
  if lstm_two_products:
    variants.append(Variant(name, "LSTM gates as two products", length,
                            precision, {"lstm_step": two_products_lstm_step}))
  if gref_cumsum and name == "gref":
    variants.append(Variant(name, "sum above by lax.cumsum", length,
                            precision,
                            {"_exclusive_sum_above": cumsum_sum_above}))
  # Stack models get the FLOP / bytes limit columns; the baseline variant
  # swaps the module that computes the stack: ns_stack for the scaled
  # table, rns_stack for the shares table.
  is_ns = SETTINGS[name]["model"] == "ns"
  on_ns_stack = is_ns and SETTINGS[name]["stack_table"] == "scaled"
  stack = ns_stack if on_ns_stack else rns_stack
  # config.scan_unroll: every model's time loop (the NS stack's sweeps too);
  # the plain row runs the default (automatic: models.auto_scan_unroll).
  auto_unroll = models.auto_scan_unroll(SETTINGS[name]["model"])
  unroll_of = {"current": auto_unroll}
  for u in unrolls:
    if u != auto_unroll:
      unroll_of[f"unroll={u}"] = u
      variants.append(Variant(name, f"unroll={u}", length, precision,
                              overrides={"scan_unroll": u}))
  if is_ns:
    for c in batch_chunks:
      variants.append(Variant(name, f"batch_chunk={c}", length, precision,
                              overrides={"stack_batch_chunk": c}))
  if baseline is not None and is_ns:
    old = baseline.ns_stack if on_ns_stack else baseline.rns_stack
    if old is not None:
      # A ref from before models.stack_batch_chunk ran the whole batch.
      variants.append(Variant(
          name, f"baseline {baseline.ref}", length, precision,
          _stack_module(old, stack),
          overrides=(None if baseline.chunks_batch
                     else {"stack_batch_chunk": BATCH})))
  if cpu_devices > 1:
    variants.append(Variant(name, f"{cpu_devices} devices (batch split)",
                            length, precision, num_devices=cpu_devices))
    if is_ns:
      for c in batch_chunks:
        variants.append(Variant(
            name, f"{cpu_devices} devices, batch_chunk={c}", length,
            precision, num_devices=cpu_devices,
            overrides={"stack_batch_chunk": c}))
  ops = [v.sequential_ops() if dispatch_floor else None for v in variants]
  gflops, cpu_gflops, gbytes, dispatch_us = [], [], [], []
  for i in range(repeats):
    if dispatch_floor and any(o is not None for o in ops):
      dispatch_us.append(machine.op_dispatch_us())
    gflops.append(machine.matmul_gflops())
    cpu_gflops.append(machine.matmul_gflops(clock="cpu"))
    if is_ns:
      gbytes.append(machine.read_gbytes_per_s())
    # Alternate the order, so that no variant always runs first.
    for v in (variants if i % 2 == 0 else variants[::-1]):
      v.time_once()
  rate, cpu_rate = max(gflops), max(cpu_gflops)
  backend = jax.default_backend()
  rows = []
  for v, v_ops in zip(variants, ops):
    row = {"model": name, "variant": v.label, "length": length,
           "batch": BATCH, "precision": precision, "compile_s": v.compile_s,
           "step_s": statistics.median(v.times), "min_step_s": min(v.times),
           "times_s": v.times, "matmul_gflops": rate,
           "cpu_step_s": statistics.median(v.cpu_times),
           "cpu_times_s": v.cpu_times, "matmul_gflops_cpu_time": cpu_rate,
           "target_s": TARGETS_S.get(backend, {}).get(name),
           "scan_unroll": unroll_of.get(v.label, auto_unroll)}
    if v.dots is not None:
      row["dot_generals"] = v.dots
    floor = ""
    if v_ops is not None:
      # The best per-op time: the floor is a lower bound.
      row.update(sequential_ops=v_ops, op_dispatch_us=min(dispatch_us),
                 dispatch_floor_s=v_ops * min(dispatch_us) * 1e-6)
      row["dispatch_floor_ratio"] = row["min_step_s"] / row["dispatch_floor_s"]
      floor = (f", {row['dispatch_floor_ratio']:4.1f}x dispatch floor "
               f"({row['dispatch_floor_s'] * 1e3:.2f} ms: {v_ops} ops)")
    if is_ns:
      row["stack_table"] = SETTINGS[name]["stack_table"]
      q, s = SETTINGS[name]["num_states"], SETTINGS[name]["num_stack_symbols"]
      limit = machine.ns_flop_limit_s(q, s, length, BATCH, rate)
      # The CPU-time ratio (step and matmul both in process CPU time) is
      # the steadier one on shared cores; on an idle machine both agree.
      cpu_limit = machine.ns_flop_limit_s(q, s, length, BATCH, cpu_rate)
      bytes_limit = machine.ns_bytes_limit_s(q, s, length, BATCH,
                                             max(gbytes))
      row.update(flop_limit_s=limit, limit_ratio=row["min_step_s"] / limit,
                 limit_ratio_median=row["step_s"] / limit,
                 limit_ratio_cpu_time=row["cpu_step_s"] / cpu_limit,
                 read_gbytes_per_s=max(gbytes), bytes_limit_s=bytes_limit,
                 bytes_limit_ratio=row["min_step_s"] / bytes_limit)
    rows.append(row)
    ratio = (f"  {row['limit_ratio']:5.1f}x FLOP limit ({limit * 1e3:.2f} ms),"
             f" {row['bytes_limit_ratio']:4.1f}x bytes limit "
             f"({bytes_limit * 1e3:.2f} ms)" if is_ns else "")
    print(f"{name:5s} {v.label:26s} compile {v.compile_s:6.1f} s  step "
          f"median {row['step_s'] * 1e3:8.2f} ms  min "
          f"{row['min_step_s'] * 1e3:8.2f} ms  CPU time "
          f"{row['cpu_step_s'] * 1e3:8.2f} ms{ratio}"
          + (f", {v.dots} dot_generals" if v.dots is not None else "")
          + floor,
          flush=True)
  for row in rows[1:]:
    row["min_step_over_current"] = row["min_step_s"] / rows[0]["min_step_s"]
    row["cpu_step_over_current"] = row["cpu_step_s"] / rows[0]["cpu_step_s"]
  return rows + failed


def compile_study(name, lengths, buckets, repeats, precision, epochs=100,
                  steps_per_epoch=1000):
  """Measures compile/step time per length; totals for both strategies.

  Times are process CPU times (compile: the first call; step: median of
  `repeats`): on shared, loaded cores wall times vary several-fold, CPU
  times much less. On an idle machine the step's wall time is lower (XLA
  uses both cores for parts of it).
  """
  measured, compile_wall = {}, {}
  needed = sorted(set(lengths) | {b for b in buckets
                                  if min(lengths) <= b <= max(buckets)})
  for n in needed:
    v = Variant(name, f"length {n}", n, precision)
    for _ in range(repeats):
      v.time_once()
    measured[n] = (v.compile_cpu_s, statistics.median(v.cpu_times))
    compile_wall[n] = v.compile_s
    print(f"  {name} length {n:3d}: compile {v.compile_cpu_s:6.2f} s CPU "
          f"({v.compile_s:6.2f} s wall), step {measured[n][1] * 1e3:8.2f} ms "
          f"CPU", flush=True)
  # Interpolate the step time over all training lengths from the measured
  # ones (it is smooth in n); compile time is taken as the mean.
  xs = np.array(sorted(measured))
  step_at = lambda n: float(np.interp(n, xs, [measured[x][1] for x in xs]))
  compile_mean = float(np.mean([measured[x][0] for x in xs]))
  train_lengths = list(range(41, 80, 2))  # marked reversal: 20 odd lengths
  bucket_of = lambda n: min(b for b in buckets if b >= n)
  per_epoch_pl = steps_per_epoch * np.mean([step_at(n) for n in train_lengths])
  per_epoch_bk = steps_per_epoch * np.mean(
      [step_at(bucket_of(n)) for n in train_lengths])
  used_buckets = sorted({bucket_of(n) for n in train_lengths})
  result = {
      "model": name, "clock": "process CPU time",
      "measured": {str(k): v for k, v in measured.items()},
      "compile_mean_s": compile_mean, "steps_per_epoch": steps_per_epoch,
      "compile_wall_s": {str(k): w for k, w in compile_wall.items()},
      "per_length": {"compiles": len(train_lengths),
                     "compile_total_s": compile_mean * len(train_lengths),
                     "epoch_steps_s": float(per_epoch_pl)},
      "bucket": {"buckets": used_buckets, "compiles": len(used_buckets),
                 "compile_total_s": compile_mean * len(used_buckets),
                 "epoch_steps_s": float(per_epoch_bk)},
  }
  for key in ("per_length", "bucket"):
    r = result[key]
    r["first_epoch_s"] = r["compile_total_s"] + r["epoch_steps_s"]
    r[f"{epochs}_epochs_s"] = r["compile_total_s"] + epochs * r["epoch_steps_s"]
    print(f"  {name} {key:10s}: {r['compiles']:2d} compiles = "
          f"{r['compile_total_s']:7.1f} s, steps/epoch "
          f"{r['epoch_steps_s']:7.1f} s, {epochs} epochs "
          f"{r[f'{epochs}_epochs_s']:8.1f} s", flush=True)
  return result


def _reexec_with_devices(n):
  """Runs this script again with N simulated CPU devices; returns its rc."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={n}").strip()
  env["NSRNN_BENCH_CHILD"] = "1"
  return subprocess.call([sys.executable, os.path.abspath(__file__)]
                         + sys.argv[1:], env=env)


def build_parser():
  """The command line's flags (a test checks gpu_session.sh's commands)."""
  parser = cli.OneLineArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models",
                      default="ns22,ns33,ns22_scaled,ns33_scaled,jm,gref,lstm")
  parser.add_argument("--length", default=[80], type=cli.int_list,
                      help="comma-separated string lengths n; every model "
                      "and variant is measured at each")
  parser.add_argument("--repeats", type=cli.positive_int, default=5)
  parser.add_argument("--precision", default="highest",
                      choices=ns_stack.MATMUL_PRECISIONS)
  parser.add_argument("--unroll", default=[1], type=cli.int_list,
                      help="comma-separated scan unroll factors "
                      "(config.scan_unroll)")
  parser.add_argument("--baseline_ref", default=None,
                      help="git ref of an ns_stack.py to compare against")
  parser.add_argument("--cpu_devices", type=cli.positive_int, default=1)
  parser.add_argument("--batch_chunk", default=[], type=cli.int_list,
                      help="comma-separated config.stack_batch_chunk values "
                      "(NS models; the plain row is automatic)")
  parser.add_argument("--gref_cumsum", action="store_true",
                      help="add a Gref variant with the cumsum it had before")
  parser.add_argument("--other_residuals", action="store_true",
                      help="add LSTM, JM and Gref variants whose time loop "
                      "stores the other set of residuals for the backward: "
                      "only its matmuls' outputs where it stores every one, "
                      "and the reverse (models.PRODUCTS_ONLY_LOOPS)")
  parser.add_argument("--lstm_two_products", action="store_true",
                      help="add a variant of every model with the LSTM's "
                      "gates as two products added (their form before "
                      "they became one product)")
  parser.add_argument("--table_layouts", action="store_true",
                      help="add NS variants (shares table) with the other "
                      "rns_stack.TABLE_LAYOUT (chunks / square)")
  parser.add_argument("--dispatch_floor", action="store_true",
                      help="every row also gets the ops its compiled step "
                      "runs one after another times the machine's cost of "
                      "one small op (measured in the same run): a floor")
  parser.add_argument("--table_matmul_cost", action="store_true",
                      help="add NS variants (shares table) with the stack's "
                      "table-sized products zeroed: what they cost (not a "
                      "valid step)")
  parser.add_argument("--pallas_kernels", action="store_true",
                      help="add NS variants with the stack's updates as "
                      "Pallas kernels (stack_kernels; GPUs)")
  parser.add_argument("--kernel_tiles", default="",
                      help="with --pallas_kernels: comma-separated "
                      "ROWSxCHUNKxWARPS triples (stack_kernels.ROW_TILE, "
                      "KT_CHUNK, NUM_WARPS; powers of two; a trailing g "
                      "sets ROW_GRID), one more variant each")
  parser.add_argument("--contractions_by_sum", action="store_true",
                      help="add NS variants with the stack update's "
                      "column-sized, then all, contractions as multiply and "
                      "sum (rns_stack)")
  parser.add_argument("--compile_study", action="store_true")
  parser.add_argument("--study_model", default="ns22,jm",
                      help="comma-separated models for --compile_study")
  parser.add_argument("--study_lengths", default=[41, 61, 79],
                      type=cli.int_list)
  parser.add_argument("--buckets", default=[50, 60, 70, 80],
                      type=cli.int_list)
  parser.add_argument("--conditions", default=None,
                      help="how the run was made (e.g. pinned to one core, "
                      "background paused): recorded in the JSON and shown "
                      "by report.py")
  parser.add_argument("--out", type=cli.output_file, default=None,
                      help="default results/train_step_<backend>.json")
  return parser


def main():
  parser = build_parser()
  args = parser.parse_args()
  unknown = [n for n in args.models.split(",") if n and n not in SETTINGS]
  if unknown:
    parser.error(f"--models: unknown {', '.join(unknown)}; choose from "
                 f"{', '.join(SETTINGS)}")
  if (args.cpu_devices > jax.device_count() and jax.default_backend() == "cpu"
      and not os.environ.get("NSRNN_BENCH_CHILD")):
    sys.exit(_reexec_with_devices(args.cpu_devices))
  info = machine.machine_info()
  print(parallel.describe_runtime(args.precision))
  out = {"machine": info, "device": machine.device_label(info),
         "precision": args.precision,
         "note": "step_s = median, min_step_s = best of the timed calls "
                 "(wall clock); cpu_step_s = median process CPU time (all "
                 "threads); limit_ratio = min_step_s / flop_limit_s; "
                 "limit_ratio_cpu_time = cpu_step_s / the same limit at the "
                 "matmul's CPU-time rate; bytes_limit_ratio = min_step_s / "
                 "bytes_limit_s (the table reads, 2*B*Q^2*S^2*n^3 bytes, at "
                 "the streaming read rate of a jitted sum over 256 MB)"}
  if args.conditions:
    out["conditions"] = args.conditions
  # What else decides the numbers: XLA flags and JAX's precision default.
  out["env"] = {k: os.environ[k] for k in
                ("XLA_FLAGS", "JAX_DEFAULT_MATMUL_PRECISION") if k in os.environ}
  names = [n for n in args.models.split(",") if n]
  if not args.length or min(args.length) < 1:
    parser.error("--length: want comma-separated string lengths >= 1")
  try:
    kernel_tiles = parse_kernel_tiles(args.kernel_tiles)
  except ValueError as e:
    parser.error(f"--kernel_tiles: {e}")
  if kernel_tiles and not args.pallas_kernels:
    parser.error("--kernel_tiles needs --pallas_kernels")
  unrolls = args.unroll
  baseline = None
  if args.baseline_ref:
    baseline = Baseline(
        args.baseline_ref, load_baseline(args.baseline_ref),
        load_baseline(args.baseline_ref, "rns_stack"),
        "stack_batch_chunk" in (machine.file_at_revision(
            args.baseline_ref, "nsrnn_jax/models.py")[0] or ""))
    if baseline.ns_stack is None and baseline.rns_stack is None:
      parser.error(f"--baseline_ref {args.baseline_ref}: no stack module at "
                   "that ref (git, or .baselines/<ref>/)")
    try:
      out["baseline_ref"] = subprocess.run(
          ["git", "-C", REPO, "rev-parse", args.baseline_ref],
          capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
      out["baseline_ref"] = args.baseline_ref      # from .baselines/
  path = args.out or os.path.join(REPO, "benchmarks", "results",
                                  f"train_step_{info['backend']}.json")
  os.makedirs(os.path.dirname(path), exist_ok=True)

  def save():
    # Saved after every model, so a run stopped by a time limit keeps what
    # it measured.
    out["machine"]["load_average_at_end"] = list(os.getloadavg())
    with open(path, "w") as f:
      json.dump(out, f, indent=1)

  if names:
    out["steps"] = []
    for length in args.length:
      for name in names:
        rows = bench_model(
            name, length, args.repeats, args.precision, unrolls, baseline,
            args.cpu_devices,
            args.batch_chunk,
            args.gref_cumsum, args.contractions_by_sum, args.pallas_kernels,
            kernel_tiles, args.lstm_two_products, args.other_residuals,
            args.table_matmul_cost, args.table_layouts, args.dispatch_floor)
        # Variants that did not compile are kept apart from the timed rows.
        out["steps"] += [r for r in rows if "error" not in r]
        failed = [r for r in rows if "error" in r]
        if failed:
          out.setdefault("failed_variants", []).extend(failed)
        save()
  if args.compile_study:
    out["compile_study"] = []
    for name in args.study_model.split(","):
      out["compile_study"].append(compile_study(
          name, args.study_lengths, args.buckets, args.repeats,
          args.precision))
      save()
  save()
  print(f"saved {path}")


if __name__ == "__main__":
  main()
