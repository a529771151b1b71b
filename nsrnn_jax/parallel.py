"""Device mesh, shardings, multi-host start-up and process-local batches.

Scale-out: the batch is sharded on a ``'data'`` mesh axis and the parameters
replicated. The train step is per-device code (`jax.shard_map` in
loop.jitted_steps, `train.train_step(..., data_axis='data')`): each device
differentiates its rows' share of the global mean loss and the gradients are
summed with one psum per step (under plain GSPMD the backward scans'
gradient carries were all-reduced at every time step). Evaluation steps are
per-device code too (loop.jitted_eval): scoring is per string, so they need
no collective at all. A second mesh axis, ``'model'``, carries the K
independently trained models of the loop (stacked parameters, vmapped steps;
size 1 for a single run).

Mesh axes (always both, so code never branches on their presence):

  'model'  K models of a grid (size 1 for a single run)
  'data'   the global batch B is split across this axis

Multi-host: every process calls `maybe_initialize_distributed(True, ...)`
before touching a device, builds only its rows of each global batch
(`process_slice`) and turns them into one global `jax.Array` with
`shard_batch`. Only `is_main_process()` writes metrics.

Typical use::

  parallel.maybe_initialize_distributed(FLAGS.distributed)  # --distributed
  mesh = parallel.make_mesh()
  rows = parallel.process_slice(global_batch_size, mesh)
  batch = parallel.shard_batch({"symbols": symbols_BxN[rows], ...}, mesh)
  params = parallel.replicate(params, mesh)
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence, Union

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

MODEL_AXIS = "model"
DATA_AXIS = "data"
MESH_AXES = (MODEL_AXIS, DATA_AXIS)

# Environment variables read by maybe_initialize_distributed when no explicit
# arguments are given (set by launch/local_multiprocess.sh).
ENV_COORDINATOR = "NSRNN_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "NSRNN_NUM_PROCESSES"
ENV_PROCESS_ID = "NSRNN_PROCESS_ID"

PyTree = Any


# ---------------------------------------------------------------------------
# Multi-host start-up.
# ---------------------------------------------------------------------------


def maybe_initialize_distributed(
    enabled: bool,
    coordinator_address: Optional[str] = None,
    num_processes: Optional[int] = None,
    process_id: Optional[int] = None,
    local_device_ids: Optional[Union[int, Sequence[int]]] = None,
) -> bool:
  """Calls `jax.distributed.initialize` when asked to; safe to call twice.

  With no explicit arguments JAX auto-detects the cluster (Cloud TPU VMs,
  SLURM, Open MPI). Elsewhere (e.g. several processes on localhost) pass
  `coordinator_address`, `num_processes` and `process_id` together, or set
  the environment variables NSRNN_COORDINATOR_ADDRESS, NSRNN_NUM_PROCESSES
  and NSRNN_PROCESS_ID (what launch/local_multiprocess.sh does).

  Must run before anything touches a JAX device (`jax.devices()`, creating an
  array, jitting), because the backend is fixed at that moment.

  Args:
    enabled: when False nothing happens (single-process run).
    coordinator_address: "host:port" of process 0's coordinator service.
    num_processes: total number of processes.
    process_id: this process's index in [0, num_processes).
    local_device_ids: devices this process owns (e.g. its GPU under SLURM).

  Returns:
    True if JAX runs distributed after the call (initialised now or before),
    False if `enabled` is False.

  Raises:
    ValueError: the explicit arguments are incomplete or inconsistent.
    RuntimeError: initialisation failed (the message says why and what to do).
  """
  if not enabled:
    explicit = (coordinator_address, num_processes, process_id)
    if any(a is not None for a in explicit):
      logging.warning(
          "Distributed arguments given but distributed=False; ignoring them.")
    return False
  if jax.distributed.is_initialized():
    # Idempotent: a second call (e.g. main() then train_and_evaluate()) is fine.
    return True
  if coordinator_address is None and num_processes is None and (
      process_id is None):
    # launch/local_multiprocess.sh passes the setup through the environment,
    # so any entry point (main, grid) works without extra flags.
    coordinator_address, num_processes, process_id = _from_environment()
  explicit = {
      "coordinator_address": coordinator_address,
      "num_processes": num_processes,
      "process_id": process_id,
  }
  given = [k for k, v in explicit.items() if v is not None]
  if given and len(given) != len(explicit):
    missing = [k for k in explicit if k not in given]
    raise ValueError(
        "Explicit distributed setup needs coordinator_address, num_processes "
        f"and process_id together; got {given}, missing {missing}. Pass none "
        "of them to auto-detect (Cloud TPU, SLURM, Open MPI).")
  if given:
    if not isinstance(coordinator_address, str) or ":" not in coordinator_address:
      raise ValueError(
          "coordinator_address must be 'host:port', got "
          f"{coordinator_address!r}.")
    if int(num_processes) < 1:
      raise ValueError(f"num_processes must be >= 1, got {num_processes}.")
    if not 0 <= int(process_id) < int(num_processes):
      raise ValueError(
          f"process_id must be in [0, num_processes={num_processes}), got "
          f"{process_id}.")
  if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
    # CPU multi-process runs (tests, local_multiprocess.sh) need a
    # cross-process collectives backend, otherwise every all-reduce fails.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs = dict(explicit)
  kwargs["local_device_ids"] = local_device_ids
  try:
    jax.distributed.initialize(**{k: v for k, v in kwargs.items()
                                  if v is not None})
  except RuntimeError as e:
    raise RuntimeError(
        "jax.distributed.initialize() failed. It must be called before any "
        "JAX device is used (jax.devices(), creating arrays, jit), and every "
        "process must reach the coordinator "
        f"({coordinator_address or 'auto-detected'}). Original error: {e}"
    ) from e
  except ValueError as e:
    raise ValueError(
        "jax.distributed.initialize() could not auto-detect a cluster "
        "(Cloud TPU, SLURM, Open MPI). Pass coordinator_address, "
        f"num_processes and process_id explicitly. Original error: {e}"
    ) from e
  logging.info("Distributed JAX: process %d of %d, %d local / %d global "
               "devices.", jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())
  return True


def use_cpu_devices(num_devices: int) -> None:
  """Splits the CPU backend into `num_devices` devices (e.g. one per core).

  XLA:CPU runs one program on one device mostly on one core; the NS-RNN's
  train step with the batch split over two CPU devices (the 'data' axis)
  ran 1.3-2.1x faster on a 2-core machine (docs/benchmarks.md). 1 leaves
  JAX's default. Like `maybe_initialize_distributed`, it must run before
  anything touches a device. It only changes the CPU backend: on a GPU/TPU
  machine the accelerators stay the devices.

  Raises:
    ValueError: `num_devices` is not a positive integer, or the backend is
      already initialised.
  """
  if (isinstance(num_devices, bool)
      or not isinstance(num_devices, (int, np.integer)) or num_devices < 1):
    raise ValueError(f"cpu_devices must be a positive integer, got "
                     f"{num_devices!r}")
  if num_devices == 1:
    return
  try:
    jax.config.update("jax_num_cpu_devices", int(num_devices))
  except RuntimeError as e:
    raise ValueError("cpu_devices must be set before JAX touches a device "
                     "(the backend is already initialised)") from e


def _from_environment():
  """(coordinator_address, num_processes, process_id) from NSRNN_* variables."""
  env = os.environ
  names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
  values = [env.get(n) for n in names]
  if all(v is None for v in values):
    return None, None, None
  missing = [n for n, v in zip(names, values) if v is None]
  if missing:
    raise ValueError(f"Environment sets only some of {names}; missing "
                     f"{missing}.")
  try:
    return values[0], int(values[1]), int(values[2])
  except ValueError as e:
    raise ValueError(f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be "
                     f"integers, got {values[1]!r} and {values[2]!r}.") from e


def is_main_process() -> bool:
  """True on process 0, the only one that writes metrics and summaries."""
  return jax.process_index() == 0


# ---------------------------------------------------------------------------
# Mesh and shardings.
# ---------------------------------------------------------------------------


def make_mesh(num_data: Optional[int] = None,
              num_models: int = 1) -> jax.sharding.Mesh:
  """Builds the ('model', 'data') device mesh.

  Args:
    num_data: size of the data axis; default: all devices not used by the
      model axis (`jax.device_count() // num_models`).
    num_models: size of the model axis (models of a grid split across devices;
      1 means every device holds every model).

  Returns:
    A mesh with axes ('model', 'data') and Auto axis types, so that the
    unannotated steps of train.py are partitioned by XLA's propagation (with
    JAX's default Explicit axes every op would need sharding-aware code).

  Raises:
    ValueError: sizes are not positive or do not fit the available devices.
  """
  num_devices = jax.device_count()
  if not isinstance(num_models, (int, np.integer)) or num_models < 1:
    raise ValueError(f"num_models must be a positive int, got {num_models!r}.")
  if num_data is None:
    if num_devices % num_models:
      raise ValueError(
          f"num_models={num_models} does not divide the device count "
          f"{num_devices}; pass num_data explicitly.")
    num_data = num_devices // num_models
  if not isinstance(num_data, (int, np.integer)) or num_data < 1:
    raise ValueError(f"num_data must be a positive int, got {num_data!r}.")
  size = int(num_models) * int(num_data)
  if size > num_devices:
    raise ValueError(
        f"Mesh model={num_models} x data={num_data} needs {size} devices, but "
        f"only {num_devices} are available.")
  devices = None
  if size < num_devices:
    if jax.process_count() > 1:
      raise ValueError(
          f"A mesh of {size} devices out of {num_devices} is only supported in "
          "a single process; multi-host meshes must use every device.")
    # A sub-mesh (e.g. benchmarking 1, 2, 4 of 8 devices) uses the first ones.
    devices = jax.devices()[:size]
  return jax.make_mesh((int(num_models), int(num_data)), MESH_AXES,
                       axis_types=(AxisType.Auto, AxisType.Auto),
                       devices=devices)


def data_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Sharding of a batch [B, ...]: rows split over 'data', copies over 'model'."""
  return NamedSharding(mesh, P(DATA_AXIS))


def model_data_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Sharding of stacked batches [K, B, ...] of a grid: K on 'model', B on 'data'."""
  return NamedSharding(mesh, P(MODEL_AXIS, DATA_AXIS))


def model_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Sharding of stacked per-model state [K, ...]: K split over 'model'."""
  return NamedSharding(mesh, P(MODEL_AXIS))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Sharding of parameters and optimizer state: a full copy on every device."""
  return NamedSharding(mesh, P())


def data_axis_size(mesh: jax.sharding.Mesh) -> int:
  """Number of devices the global batch is split across."""
  return int(mesh.shape[DATA_AXIS])


def check_batch_size(global_batch_size: int, mesh: jax.sharding.Mesh) -> None:
  """Raises ValueError unless the global batch splits evenly over 'data'."""
  num_data = data_axis_size(mesh)
  if global_batch_size < 1 or global_batch_size % num_data:
    raise ValueError(
        f"batch_size={global_batch_size} (global) is not divisible by the "
        f"number of devices on the data axis ({num_data}; {jax.device_count()} "
        f"devices in {jax.process_count()} process(es)). Choose a batch size "
        "that is a multiple of it, or a smaller mesh (make_mesh(num_data=...)).")


# ---------------------------------------------------------------------------
# Process-local batches.
# ---------------------------------------------------------------------------


def process_slice(global_batch_size: int,
                  mesh: Optional[jax.sharding.Mesh] = None) -> slice:
  """Rows [start, stop) of a global batch that this process must build.

  With a mesh, the rows are read off the data sharding itself (the rows held by
  this process's devices), so they agree with `shard_batch` for any device
  order. Without one, the batch is split evenly by process index.

  Args:
    global_batch_size: rows of the global batch (all processes together).
    mesh: the training mesh, or None.

  Returns:
    A `slice` into the global batch.

  Raises:
    ValueError: the batch does not split evenly, or this process's rows are
      not contiguous (a mesh layout this function does not support).
  """
  if mesh is None:
    num = jax.process_count()
    if global_batch_size < 1 or global_batch_size % num:
      raise ValueError(
          f"batch_size={global_batch_size} (global) is not divisible by the "
          f"number of processes ({num}).")
    per = global_batch_size // num
    return slice(jax.process_index() * per, (jax.process_index() + 1) * per)
  check_batch_size(global_batch_size, mesh)
  index_map = data_sharding(mesh).addressable_devices_indices_map(
      (global_batch_size,))
  rows = set()
  for (index,) in index_map.values():
    rows.update(range(*index.indices(global_batch_size)))
  start, stop = min(rows), max(rows) + 1
  if len(rows) != stop - start:
    raise ValueError(
        "This process's devices hold non-contiguous rows of the batch; build "
        "the mesh with make_mesh() so that processes own contiguous blocks.")
  return slice(start, stop)


def shard_batch(local_batch: PyTree, mesh: jax.sharding.Mesh,
                model_axis: bool = False) -> PyTree:
  """Turns this process's rows of a batch into global `jax.Array`s.

  Args:
    local_batch: pytree (e.g. {"symbols", "mask"}) of numpy arrays whose
      leading axis is this process's rows of the batch (the rows given by
      `process_slice`), or, with `model_axis`, arrays [K, B_local, ...].
    mesh: the ('model', 'data') mesh.
    model_axis: arrays carry a leading model axis K (grid training); K is
      split over 'model' and the batch over 'data'. Each process passes all K.

  Returns:
    The same pytree of global arrays, sharded P('data') (or P('model','data')).

  Raises:
    ValueError: leaves disagree on the batch size or the global batch is not
      divisible by the data-axis size.
  """
  leaves = jax.tree.leaves(local_batch)
  if not leaves:
    raise ValueError("shard_batch got an empty batch.")
  batch_dim = 1 if model_axis else 0
  local_sizes = {np.shape(x)[batch_dim] if np.ndim(x) > batch_dim else None
                 for x in leaves}
  if None in local_sizes or len(local_sizes) != 1:
    raise ValueError(
        "All batch leaves need the same batch dimension (axis "
        f"{batch_dim}); got shapes {[np.shape(x) for x in leaves]}.")
  (local_rows,) = local_sizes
  # The fraction of the data axis this process holds tells the global size.
  num_data = data_axis_size(mesh)
  local_data_devices = _local_data_axis_positions(mesh)
  global_rows = local_rows * num_data // max(len(local_data_devices), 1)
  if local_rows * num_data % max(len(local_data_devices), 1):
    raise ValueError(
        f"Local batch of {local_rows} rows cannot be split over the "
        f"{len(local_data_devices)} data-axis positions of this process.")
  check_batch_size(global_rows, mesh)
  sharding = model_data_sharding(mesh) if model_axis else data_sharding(mesh)

  def put(x):
    x = np.asarray(x)
    shape = list(x.shape)
    shape[batch_dim] = global_rows
    if model_axis:
      # Every process holds all K models' rows (the model axis may still be
      # split across devices; make_array... slices what each device needs).
      shape[0] = x.shape[0]
    return jax.make_array_from_process_local_data(sharding, x, tuple(shape))

  return jax.tree.map(put, local_batch)


def put_model_batch(batch_K: PyTree, mesh: jax.sharding.Mesh) -> PyTree:
  """Places a host batch {name: [K, B, ...]} held whole by every process.

  Rows are padded with zeros to a multiple of the data axis (a zero mask:
  padded rows contribute nothing); each process contributes its rows.
  """
  num = np.shape(jax.tree.leaves(batch_K)[0])[1]
  extra = -num % data_axis_size(mesh)
  if extra:
    batch_K = jax.tree.map(lambda v: np.concatenate(
        [v, np.zeros(v.shape[:1] + (extra,) + v.shape[2:], v.dtype)], axis=1),
                           batch_K)
  rows = process_slice(num + extra, mesh)
  return shard_batch(jax.tree.map(lambda v: v[:, rows], batch_K), mesh,
                     model_axis=True)


def device_memory_bytes(device=None) -> Optional[int]:
  """Memory one device can hold, in bytes: an accelerator's allocator limit,
  or for a CPU device the host's physical memory (which all CPU devices
  share); None where the runtime does not say."""
  device = jax.local_devices()[0] if device is None else device
  if device.platform != "cpu":
    try:
      stats = device.memory_stats() or {}
    except Exception:  # pylint: disable=broad-except
      return None  # a backend without memory statistics
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def _local_data_axis_positions(mesh: jax.sharding.Mesh) -> set:
  """Indices along 'data' at which this process owns at least one device."""
  ids = np.vectorize(lambda d: d.process_index)(mesh.devices)
  data_pos = list(mesh.axis_names).index(DATA_AXIS)
  mine = np.argwhere(ids == jax.process_index())
  return {int(p[data_pos]) for p in mine}


def replicate(tree: PyTree, mesh: jax.sharding.Mesh) -> PyTree:
  """Places a host pytree (identical on every process) on all devices."""
  sharding = replicated(mesh)
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(
          sharding, np.asarray(x), np.shape(x)), tree)


def shard_models(tree: PyTree, mesh: jax.sharding.Mesh) -> PyTree:
  """Places stacked per-model state [K, ...] with K split over 'model'."""
  sharding = model_sharding(mesh)
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(
          sharding, np.asarray(x), np.shape(x)), tree)


def to_host(tree: PyTree) -> PyTree:
  """Fetches (possibly multi-host) global arrays as numpy on every process."""
  def get(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
  return jax.tree.map(get, tree)


# ---------------------------------------------------------------------------
# Runtime description (first line of a job's log).
# ---------------------------------------------------------------------------


def _cpuinfo_value(keys, cpuinfo: str | None = None) -> str | None:
  """The value of the first /proc/cpuinfo line whose key is one of `keys`
  (lower case), or None where there is none or the file cannot be read."""
  if cpuinfo is None:
    try:
      with open("/proc/cpuinfo") as f:
        cpuinfo = f.read()
    except OSError:
      return None
  for line in cpuinfo.splitlines():
    key, sep, value = line.partition(":")
    if sep and key.strip().lower() in keys:
      return value.strip()
  return None


def host_cpu_model() -> str:
  """This host's CPU model name (from /proc/cpuinfo), or a generic name."""
  model = _cpuinfo_value(("model name",))
  if model is not None:
    return model
  import platform  # pylint: disable=g-import-not-at-top
  return platform.processor() or platform.machine() or "unknown CPU"


# (cpuinfo flag, name), widest first within each architecture (x86, then
# Arm). A wider unit raises the matmul rate a CPU reaches, and so the FLOP
# limit of our benchmarks: AVX2 -> AVX-512 doubled it on our 2-core VMs.
_VECTOR_ISAS = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"),
                ("sve", "SVE"), ("asimd", "NEON"))


def host_cpu_vector_isa(cpuinfo: str | None = None) -> str | None:
  """The widest float vector extension of this host's CPU, e.g. "AVX-512".

  Read from the flags (x86) or features (Arm) line of /proc/cpuinfo; None
  where that cannot be read or names none of the extensions we know. Two
  machines sold under one model name (e.g. "AMD EPYC" in a VM) can differ
  here, and with it their matmul throughput.

  Args:
    cpuinfo: the text of /proc/cpuinfo (read from the host when None).
  """
  flags = set((_cpuinfo_value(("flags", "features"), cpuinfo) or "").split())
  return next((name for flag, name in _VECTOR_ISAS if flag in flags), None)


_SIZE_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}   # sysfs cache sizes


def host_l3_cache_bytes(sysfs: str = "/sys/devices/system/cpu/cpu0/cache"
                        ) -> Optional[int]:
  """The size of the last-level (L3) cache CPU 0 sees, in bytes (Linux
  sysfs: index<i>/level 3, its size "8192K"); None where it cannot be read.
  """
  try:
    entries = sorted(os.listdir(sysfs))
  except OSError:
    return None
  for entry in entries:
    try:
      with open(os.path.join(sysfs, entry, "level")) as f:
        if f.read().strip() != "3":
          continue
      with open(os.path.join(sysfs, entry, "size")) as f:
        size = f.read().strip()
    except OSError:
      continue
    try:
      if size[-1:].upper() in _SIZE_UNITS:
        return int(size[:-1]) * _SIZE_UNITS[size[-1].upper()]
      return int(size)
    except ValueError:
      return None
  return None


def usable_cores() -> Optional[list[int]]:
  """The CPU cores this process may run on (None where the OS cannot say)."""
  if not hasattr(os, "sched_getaffinity"):
    return None
  return sorted(os.sched_getaffinity(0))


def format_cores(cores: Sequence[int]) -> str:
  """Core numbers as ranges, e.g. [0, 1, 2, 5] -> "0-2,5"."""
  runs = []  # [first, last] of each run of consecutive cores.
  for c in sorted(cores):
    if runs and c == runs[-1][1] + 1:
      runs[-1][1] = c
    else:
      runs.append([c, c])
  return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def parse_cores(text: str) -> list[int]:
  """"0-2,5" -> [0, 1, 2, 5]; ValueError (one line) on anything else."""
  cores = set()
  try:
    for part in text.split(","):
      lo, dash, hi = part.strip().partition("-")
      lo, hi = int(lo), int(hi) if dash else int(lo)
      if lo < 0 or hi < lo:
        raise ValueError
      cores.update(range(lo, hi + 1))
  except ValueError:
    raise ValueError(f"--cpu_cores: {text!r} is not a list of core numbers "
                     "or ranges (e.g. 0-3,6)") from None
  return sorted(cores)


def pin_to_cores(cores: Sequence[int]) -> None:
  """Runs this process, and the threads it starts later, on `cores` only.

  Call it before JAX starts its thread pools (before the first computation):
  XLA sizes them by the cores the process may use. Raises a one-line
  ValueError for cores this process may not use, or where the OS has no
  affinity call (Linux has).
  """
  usable = usable_cores()
  if usable is None:
    raise ValueError("--cpu_cores: this OS cannot pin a process to cores")
  unknown = sorted(set(cores) - set(usable))
  if unknown:
    raise ValueError(f"--cpu_cores: core(s) {format_cores(unknown)} not "
                     f"available to this process (it may use "
                     f"{format_cores(usable)})")
  os.sched_setaffinity(0, cores)


def describe_runtime(matmul_precision: str = "highest") -> str:
  """One line naming the backend, the devices and the matmul precision.

  E.g. ``runtime: backend gpu, process 0/1, 1 device(s): 1x NVIDIA H200;
  jax 0.11.2; matmul precision highest``. On a CPU backend the host's CPU
  model and core count are added, so a log says what produced its timings.

  Args:
    matmul_precision: the config's precision name; validated here (a bad
      value raises a one-line ValueError naming config.matmul_precision).
  """
  from nsrnn_jax import ns_stack  # pylint: disable=g-import-not-at-top
  if matmul_precision not in ns_stack.MATMUL_PRECISIONS:
    raise ValueError(
        f"config.matmul_precision must be one of "
        f"{', '.join(ns_stack.MATMUL_PRECISIONS)}; got {matmul_precision!r}")
  kinds = {}
  for d in jax.devices():
    kinds[d.device_kind] = kinds.get(d.device_kind, 0) + 1
  devices = ", ".join(f"{n}x {k}" for k, n in kinds.items())
  line = (f"runtime: backend {jax.default_backend()}, process "
          f"{jax.process_index()}/{jax.process_count()}, "
          f"{jax.device_count()} device(s): {devices}")
  if jax.default_backend() == "cpu":
    isa = host_cpu_vector_isa()
    cores = usable_cores()
    # A process pinned to some of the cores (reproduce --workers) says so.
    pinned = ("" if cores is None or len(cores) >= (os.cpu_count() or 0)
              else f", this process on core(s) {format_cores(cores)}")
    line += (f" [{host_cpu_model()}" + (f", {isa}" if isa else "")
             + f", {os.cpu_count()} cores{pinned}]")
  return line + f"; jax {jax.__version__}; matmul precision {matmul_precision}"
