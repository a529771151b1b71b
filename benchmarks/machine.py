"""What every benchmark records about the machine it ran on.

`machine_info()` names the JAX backend and devices, the host CPU model, the
load average (other jobs on shared cores skew timings) and the XLA flags;
`matmul_gflops()` measures this machine's jitted float32 matmul throughput
(1024³, full precision), the yardstick of the FLOP-limit ratios;
`save_rows()` writes a benchmark's rows with all of that to
benchmarks/results/.
"""

import contextlib
import os
import platform
import re
import subprocess
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from nsrnn_jax import cli
from nsrnn_jax import parallel

# The checkout: benchmarks/ sits in it.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_revision(repo=REPO):
  """The short commit of the checkout at `repo` (this one by default), with
  "+changes" if tracked files differ from it; None without git (e.g. a
  copied tree on a device machine)."""
  try:
    head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True)
    dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain",
                            "--untracked-files=no"],
                           capture_output=True, text=True, check=True)
  except (OSError, subprocess.CalledProcessError):
    return None
  return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def file_at_revision(revision, path):
  """(text, reason): the repository's `path` as of git `revision`, or
  (None, why not).

  Where the checkout has no git history (a copied working tree, e.g. on a
  device machine), `.baselines/<revision>/<path>` is read instead: write it
  beforehand with `git show <revision>:<path>` (benchmarks/gpu_session.sh).
  """
  try:
    shown = subprocess.run(["git", "-C", REPO, "show", f"{revision}:{path}"],
                           capture_output=True, check=False)
    if not shown.returncode:
      return shown.stdout.decode(), None
    lines = shown.stderr.decode(errors="replace").strip().splitlines()
    reason = lines[-1] if lines else None
  except OSError as e:             # no git on this machine
    reason = str(e)
  copy = os.path.join(REPO, ".baselines", revision, path)
  if os.path.exists(copy):
    with open(copy) as f:
      return f.read(), None
  return None, reason


def module_at_revision(revision, name, missing_ok=False):
  """nsrnn_jax/<name>.py as of git `revision` (or `.baselines/`, as
  `file_at_revision`), as a fresh module (a before/after of a change timed
  in one process); its own imports of the package resolve to the current
  code. Where neither has the file: None with `missing_ok`, else the
  benchmark ends with a one-line error (exit 2)."""
  path = f"nsrnn_jax/{name}.py"
  source, reason = file_at_revision(revision, path)
  if source is None:
    if missing_ok:
      return None
    cli.fail(f"no {path} at git revision {revision!r}"
             + (f" ({reason})" if reason else ""))
  module = types.ModuleType(f"{name}_at_{revision}")
  # The code's file name says where it came from (tracebacks, and the
  # source info JAX and Pallas record read only this name, not the file).
  module.__file__ = f"{revision}:{path}"
  exec(compile(source, module.__file__, "exec"), module.__dict__)  # pylint: disable=exec-used
  return module


def is_revision(revision):
  """Whether git names a commit `revision` in this repository (False
  without git)."""
  try:
    return not subprocess.run(
        ["git", "-C", REPO, "rev-parse", "-q", "--verify",
         f"{revision}^{{commit}}"], capture_output=True, check=False
    ).returncode
  except OSError:            # no git
    return False


def machine_info():
  """A JSON-able description of the machine and software (for results)."""
  devices = jax.devices()
  return {
      "source_revision": source_revision(),
      "backend": jax.default_backend(),
      "device_kind": devices[0].device_kind,
      "device_count": len(devices),
      "cpu_model": parallel.host_cpu_model(),
      "cpu_vector_isa": parallel.host_cpu_vector_isa(),
      "cpu_count": os.cpu_count(),
      # The cores this process may run on (fewer under taskset / a pinned
      # worker); None where the OS does not say.
      "process_cores": (None if parallel.usable_cores() is None
                        else len(parallel.usable_cores())),
      "load_average_1_5_15": list(os.getloadavg()),
      "platform": platform.platform(),
      "jax": jax.__version__,
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "jax_default_matmul_precision": os.environ.get(
          "JAX_DEFAULT_MATMUL_PRECISION", ""),
  }


def device_label(info):
  """Short label, e.g. 'cpu: AMD EPYC (2 cores)' or 'gpu: NVIDIA H200'."""
  if info["backend"] == "cpu":
    return f"cpu: {info['cpu_model']} ({info['cpu_count']} cores)"
  return f"{info['backend']}: {info['device_kind']}"


# Jitted yardstick programs and their inputs, built once per process.
_YARDSTICKS = {}


def _best_seconds(key, build, repeats, timer=time.perf_counter):
  """Best-of-`repeats` time of the yardstick `key` ((fn, arg) from build())."""
  if key not in _YARDSTICKS:
    f, x = build()
    jax.block_until_ready(f(x))
    _YARDSTICKS[key] = (f, x)
  f, x = _YARDSTICKS[key]
  best = float("inf")
  for _ in range(repeats):
    start = timer()
    jax.block_until_ready(f(x))
    best = min(best, timer() - start)
  return max(best, 1e-9)


def median_seconds(fn, *args, repeats=3, warmup=True, cpu=None):
  """Median wall time of fn(*args) over `repeats` calls, in seconds.

  warmup: make one untimed call first (compilation, first-touch memory).
  cpu: a list to append the median process CPU time (all threads) to.
  """
  if warmup:
    jax.block_until_ready(fn(*args))
  times, cpu_times = [], []
  for _ in range(repeats):
    start, cpu_start = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
    cpu_times.append(time.process_time() - cpu_start)
  if cpu is not None:
    cpu.append(float(np.median(cpu_times)))
  return float(np.median(times))


def matmul_gflops(size=1024, repeats=3, clock="wall"):
  """Best-of-`repeats` jitted float32 matmul rate in GFLOP/s (full f32).

  clock="wall" times with the wall clock; clock="cpu" with the process's
  CPU time (all threads), the steadier yardstick on shared, loaded cores.
  """
  def build():
    a = jnp.asarray(np.random.default_rng(0).normal(size=(size, size)),
                    jnp.float32)
    return jax.jit(lambda x: jnp.matmul(x, x, precision="highest")), a

  timer = time.perf_counter if clock == "wall" else time.process_time
  return 2 * size**3 / _best_seconds(("matmul", size), build, repeats,
                                     timer) / 1e9


def read_gbytes_per_s(megabytes=256, repeats=3):
  """Best-of-`repeats` rate of a jitted sum over a float32 array, in GB/s.

  The array (256 MB by default) is larger than the caches, so this is the
  machine's streaming read bandwidth from memory as XLA reaches it, the
  yardstick of the bytes-moved limit (`ns_bytes_limit_s`).
  """
  def build():
    return jax.jit(jnp.sum), jnp.ones((megabytes * 2**20 // 4,), jnp.float32)

  return megabytes * 2**20 / _best_seconds(("read", megabytes), build,
                                           repeats) / 1e9


# Instructions of compiled HLO text that run no code of their own.
_NO_THUNK = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast",
                       "constant"})
# `[ROOT] %name = shape opcode(` of one instruction; shape may be a tuple.
# (A tuple shape may hold `/*index=5*/` comments and nested tuples.)
_HLO_OP = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(?:\(.*?\)|\S+)\s+([\w-]+)\(")


def sequential_ops(hlo_text):
  """Ops one call of a compiled HLO module runs, loops counted per trip.

  `hlo_text`: `jax.jit(f).lower(...).compile().as_text()`. Every instruction
  of the entry computation that runs code (a fusion, a dot, a copy, ...)
  counts one; a while loop one more than its known trip count times the ops
  of its body and condition, a call the ops of the computation it calls, a
  conditional one more than the ops of its largest branch. XLA:CPU runs
  each such op as one thunk, one after another where each needs the last,
  so this count times the cost of one tiny op (`op_dispatch_us`) is a floor
  on the program's time, however fast its arithmetic. A while loop without
  a known trip count, or text without an entry computation, raises
  ValueError.
  """
  computations, current, entry = {}, None, None
  for line in hlo_text.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      current = re.match(r"^(?:ENTRY\s+)?%?(\S+)", line).group(1)
      computations[current] = []
      if line.startswith("ENTRY"):
        entry = current
    elif line.startswith("}"):
      current = None
    elif current is not None:
      computations[current].append(line)

  def count(name):
    total = 0
    for line in computations[name]:
      op = _HLO_OP.match(line)
      if op is None or op.group(1) in _NO_THUNK:
        continue
      if op.group(1) == "while":
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        if trips is None:
          raise ValueError("a while loop without a known trip count: "
                           + line.strip()[:120])
        body = re.search(r"body=%?([\w.\-]+)", line).group(1)
        condition = re.search(r"condition=%?([\w.\-]+)", line).group(1)
        total += 1 + int(trips.group(1)) * (count(body)
                                            + count(condition))
      elif op.group(1) == "call":
        total += count(re.search(r"to_apply=%?([\w.\-]+)", line).group(1))
      elif op.group(1) == "conditional":
        branches = re.search(r"branch_computations=\{([^}]*)\}", line)
        names = ([b.strip().lstrip("%") for b in branches.group(1).split(",")]
                 if branches else
                 [re.search(k + r"=%?([\w.\-]+)", line).group(1)
                  for k in ("true_computation", "false_computation")])
        total += 1 + max(count(b) for b in names)
      else:
        total += 1
    return total

  if entry is None:
    raise ValueError("no ENTRY computation: not the text of an HLO module")
  return count(entry)


# Ops of each `op_dispatch_us` yardstick (its compiled program, counted once).
_DISPATCH_OPS = {}


def op_dispatch_us(repeats=3, ops_per_step=40, steps=160):
  """Best-of-`repeats` time per op of a loop of tiny dependent ops, in µs.

  The yardstick of `sequential_ops`: a `lax.scan` of `steps` steps whose
  body chains `ops_per_step` ops on a 10 x 4 float32 array (cumulative sums
  and sines, which XLA does not fuse into one), timed and divided by the ops
  its compiled program runs (`sequential_ops`). The arrays are as small as
  the NS stack's smallest (batch 10, Q·S = 4), so this is close to XLA's
  fixed cost of running one op (on a CPU, one thunk): ops times this is a
  floor on a program's time however fast its arithmetic.
  """
  def body(x_BxH, _):
    for i in range(ops_per_step):
      x_BxH = jnp.sin(x_BxH) if i % 2 else jnp.cumsum(x_BxH, axis=0)
    return x_BxH, None

  key = ("dispatch", ops_per_step, steps)

  def build():
    f = jax.jit(lambda x: jax.lax.scan(body, x, None, length=steps)[0])
    return f, jnp.ones((10, 4), jnp.float32)

  seconds = _best_seconds(key, build, repeats)
  if key not in _DISPATCH_OPS:                # counted once per process
    f, x = _YARDSTICKS[key]
    _DISPATCH_OPS[key] = sequential_ops(f.lower(x).compile().as_text())
  return seconds * 1e6 / _DISPATCH_OPS[key]


def ns_bytes_limit_s(q, s, n, batch, gbytes_per_s):
  """Lower bound on an NS-RNN train step from the table it must read.

  Each update's pop term reads the filled triangle of the γ table, rows
  i < k < j: B·Q²S²·j²/2 float32 entries at update j, B·Q²S²·n³/6 over the
  forward sweep; the backward reads the table and the same-sized table of
  pop adjoints (W) once more each. In all 3·4·B·Q²S²·n³/6 = 2·B·Q²S²·n³
  bytes, at the measured streaming read rate. (The DP reads the table at
  ~1.5 FLOP per byte, so this bound, not the FLOP limit, is the one a
  kernel could approach on a CPU; the table at n = 80, Q = S = 3, B = 10 is
  21 MB, partly cache-resident, so the bound is conservative.)
  """
  return 2 * batch * q**2 * s**2 * n**3 / (gbytes_per_s * 1e9)


def ns_flop_limit_s(q, s, n, batch, gflops):
  """Lower bound on an NS-RNN train step from its dominant work.

  The pop term costs B·Q³S²·n³/3 multiply-adds in the forward sweep and
  twice that in the backward (issue 11): 2·B·Q³S²·n³ FLOP per step, at the
  measured matmul rate.
  """
  return 2 * batch * q**3 * s**2 * n**3 / (gflops * 1e9)


def save_result(path, result):
  """Writes a benchmark's result JSON (creating its folder) and says where."""
  import json  # pylint: disable=g-import-not-at-top
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  print(f"saved {path}")


# Where benchmarks write their results (benchmarks/results/).
RESULTS_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "benchmarks", "results")


def with_note(base, extra=""):
  """A result's note: `base`, then "; extra" where the run added one
  (e.g. --note "background paused")."""
  return base + (f"; {extra}" if base and extra else extra)


def save_rows(name, rows, note="", out=None, **fields):
  """Saves a benchmark's rows with what `machine_info` says of the machine:
  {machine_info..., device, dtype (float32 unless given), note, fields...,
  rows} to benchmarks/results/<name> (or to `out` where given). Returns
  the result."""
  info = machine_info()
  result = {**info, "device": device_label(info), "dtype": "float32",
            "note": note, **fields, "rows": rows}
  save_result(out or os.path.join(RESULTS_DIR, name), result)
  return result


@contextlib.contextmanager
def window_stacks_at(revision):
  """The models use limited_stack and limited_vrns as of git `revision`
  while inside (a function jitted and first called here keeps them): a
  before/after of a change to the window stacks in one process. None: as
  they are."""
  from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import vrns_model  # pylint: disable=g-import-not-at-top
  if not revision:
    yield
    return
  saved = models.limited_stack, vrns_model.limited_vrns
  models.limited_stack = module_at_revision(revision, "limited_stack")
  vrns_model.limited_vrns = module_at_revision(revision, "limited_vrns")
  try:
    yield
  finally:
    models.limited_stack, vrns_model.limited_vrns = saved
