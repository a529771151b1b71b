"""Benchmark (static): the Pallas stack kernels compiled for a GPU, on a CPU.

Lowers each kernel of `nsrnn_jax/stack_kernels.py` for CUDA on this machine
(`jax.export(..., platforms=["cuda"])`, as tests/stack_kernels_test.py
does), takes the Triton IR that Pallas generates for it, compiles that IR
with the `triton` package for an NVIDIA target (default sm_90, the H100 and
H200: Triton's own passes, then ptxas), and reads the cubin's resource usage
with `cuobjdump -res-usage`: registers per thread, local memory (spilled
registers), stack and shared memory. No GPU is needed.

What it tells: whether each kernel, at each tile size, gets through the
whole GPU compiler (the tests' lowering check stops at Triton IR), and
whether it spills (local memory > 0: every spilled access goes to memory),
and how many programs fit on one multiprocessor at once (64K registers
each). What it cannot tell: time. `benchmarks/train_step.py
--pallas_kernels --kernel_tiles=...` measures that on a GPU.

Needs the `triton` package, which the project does not depend on (about
1 GB installed); e.g. into its own folder:

  python -m pip install --target /tmp/triton triton
  python benchmarks/kernel_resources.py --triton_path=/tmp/triton \\
      [--qs=2,3] [--length=80] [--batch=10] \\
      [--kernel_tiles=128x32x4,64x16x4,...] [--baseline_ref=REF] \\
      [--arch=90] \\
      [--out=benchmarks/results/kernel_resources.json]

--kernel_tiles takes ROWSxCHUNKxWARPS triples (stack_kernels.ROW_TILE,
KT_CHUNK, NUM_WARPS; a trailing g sets ROW_GRID), as train_step.py's
flag; the default tiles always come first. The kernels are compiled at
the sizes of a train step's largest time block: a table of length + 1
time points, all updates in one block.
"""

import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
from jax import export

import machine
import train_step
from nsrnn_jax import stack_kernels
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Registers of one NVIDIA multiprocessor (sm_70 .. sm_90).
REGISTERS_PER_SM = 65536
_RESOURCES = re.compile(r"(REG|STACK|SHARED|LOCAL):(\d+)")


@contextlib.contextmanager
def captured_triton_ir():
  """Collects the Triton IR (MLIR text) of every pallas_call lowered inside.

  Pallas's Triton lowering keeps the module only long enough to serialise
  it into the custom call; this wraps its private module builder (jax
  0.10-0.11), which is why it lives in a benchmark and not in the package.
  """
  try:
    from jax._src.pallas.triton import pallas_call_registration as reg
    build = reg.lowering.lower_jaxpr_to_triton_module
  except (ImportError, AttributeError) as e:
    cli.fail("this JAX's Pallas Triton lowering has no "
             f"lower_jaxpr_to_triton_module to capture ({e})")
  modules = []

  def capture(*args, **kwargs):
    result = build(*args, **kwargs)
    modules.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  reg.lowering.lower_jaxpr_to_triton_module = capture
  try:
    yield modules
  finally:
    reg.lowering.lower_jaxpr_to_triton_module = build


def kernel_calls(q, s, length, batch, dtype=jnp.float32,
                 kernels=stack_kernels):
  """{kernel name: (function, argument shapes)} at a train step's sizes.

  The table has length + 1 time points (N); the backward's W table holds
  every update's rows (one block); p and j are traced. `kernels`: the
  module (stack_kernels, or an older version of it).
  """
  n = length + 1
  rows = length * q
  shape = lambda *sh: jax.ShapeDtypeStruct(sh, dtype)
  index = jax.ShapeDtypeStruct((), jnp.int32)
  column = shape(batch, s, q, n, q, s)               # [B, Y, R, N, Q, X]
  forward = functools.partial(kernels.forward_update, interpret=False)
  backward = functools.partial(kernels.backward_table_update,
                               row0=1, num_steps=length, interpret=False)
  local_bwd = functools.partial(kernels.local_bwd, interpret=False)
  return {
      "forward_update": (forward, (
          shape(batch, s, n, q, n, q, s), shape(batch, s, n, q), index,
          shape(batch, q, s), shape(batch, q, s, q, s),
          shape(batch, q, s, q, s), shape(batch, q, s, q))),
      "backward_table_update": (backward, (
          shape(batch * s, n * q, n * q * s),
          shape(batch * s, rows, n * q * s), column,
          shape(batch, s, n, q, rows), column, shape(batch, s, n, q),
          index)),
      "local_bwd": (local_bwd, (
          shape(batch, s, q, n, q, s), shape(batch, s, n, q), index,
          shape(batch, q, s),
          (shape(3, batch, q, s, 3 * q * s), shape(batch, s, q, s)),
          (column, shape(batch, s, q, n, q), shape(batch, q, s),
           shape(batch)))),
  }


def triton_ir(fn, args):
  """The Triton IR of the one pallas_call in fn, lowered for CUDA."""
  with captured_triton_ir() as modules:
    export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(
            "__gpu$xla.gpu.triton")])(*args)
  if len(modules) != 1:
    raise RuntimeError(f"expected one Triton module, got {len(modules)}")
  return modules[0]


def compile_for_gpu(triton, ir_text, num_warps, arch, num_stages=3):
  """Compiles Triton IR for CUDA sm_<arch>; its cubin's resource usage.

  num_stages 3 is what Pallas asks for on CUDA when the kernel names none.
  """
  from triton.backends.compiler import GPUTarget
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "kernel.ttir")
    with open(path, "w") as f:
      f.write(ir_text)
    start = time.perf_counter()
    kernel = triton.compile(path, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": num_warps,
                                     "num_stages": num_stages})
    seconds = time.perf_counter() - start
    cubin = os.path.join(tmp, "kernel.cubin")
    with open(cubin, "wb") as f:
      f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends",
                        "nvidia", "bin", "cuobjdump")
    out = subprocess.run([tool, "-res-usage", cubin], capture_output=True,
                         text=True, check=True).stdout
  usage = {k.lower(): int(v) for k, v in _RESOURCES.findall(out)}
  if "reg" not in usage:
    raise RuntimeError(f"no resource usage in cuobjdump's output: {out!r}")
  threads = 32 * num_warps
  usage.update(
      threads=threads, compile_s=seconds,
      ptx_lines=kernel.asm["ptx"].count("\n"),
      programs_per_sm_by_registers=REGISTERS_PER_SM // (usage["reg"] * threads))
  return usage


def settings_of(kernels):
  """A stack_kernels module's (ROW_TILE, KT_CHUNK, NUM_WARPS, ROW_GRID)."""
  return (kernels.ROW_TILE, kernels.KT_CHUNK, kernels.NUM_WARPS,
          getattr(kernels, "ROW_GRID", False))


def load_kernels_at(ref):
  """nsrnn_jax/stack_kernels.py as of git `ref`, as a module of its own
  (None if the file is not there); its imports of the package resolve to
  the current code."""
  return machine.module_at_revision(ref, "stack_kernels", missing_ok=True)


def main():
  parser = cli.OneLineArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--triton_path", default=None,
                      help="folder holding the triton package (pip --target)")
  parser.add_argument("--qs", default="2,3",
                      help="comma-separated Q = S sizes")
  parser.add_argument("--length", type=int, default=80)
  parser.add_argument("--batch", type=int, default=10)
  parser.add_argument("--kernel_tiles",
                      default="64x16x4,128x16x8,64x16x4g,128x16x4g",
                      help="ROWSxCHUNKxWARPS triples besides the "
                      "default tiles")
  parser.add_argument("--baseline_ref", default=None,
                      help="also compile stack_kernels.py as of this git "
                      "ref, at its own default tiles")
  parser.add_argument("--arch", type=int, default=90,
                      help="CUDA compute capability, e.g. 90 (H100/H200)")
  parser.add_argument("--out", type=cli.output_file, default=os.path.join(
      REPO, "benchmarks", "results", "kernel_resources.json"))
  args = parser.parse_args()
  if args.triton_path:
    sys.path.insert(0, args.triton_path)
  # Compile every kernel afresh (compile_s), and keep FMA contraction on,
  # as Triton 3.9's default (it warns that the default will change).
  os.environ["TRITON_ALWAYS_COMPILE"] = "1"
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
  try:
    import triton
  except ImportError:
    parser.error("needs the triton package: python -m pip install --target "
                 "DIR triton, then --triton_path=DIR")
  try:
    sizes = [int(x) for x in args.qs.split(",") if x]
  except ValueError:
    sizes = []
  if not sizes or min(sizes) < 1:
    parser.error(f"--qs {args.qs!r}: positive integers")
  try:
    tiles = train_step.parse_kernel_tiles(args.kernel_tiles)
  except ValueError as e:
    parser.error(f"--kernel_tiles: {e}")
  default = settings_of(stack_kernels)
  tiles = [default] + [t for t in tiles if t != default]
  versions = [("current", stack_kernels, tiles)]
  if args.baseline_ref:
    old = load_kernels_at(args.baseline_ref)
    if old is None:
      parser.error(f"--baseline_ref {args.baseline_ref}: no "
                   "nsrnn_jax/stack_kernels.py at that ref")
    versions.insert(0, (f"baseline {args.baseline_ref}", old,
                        [settings_of(old)]))
  info = machine.machine_info()
  out = {"benchmark": "kernel_resources", "machine": info,
         "device": machine.device_label(info),
         "target": f"cuda sm_{args.arch}", "triton": triton.__version__,
         "jax": jax.__version__, "length": args.length, "batch": args.batch,
         "dtype": "float32",
         "note": "static: Triton IR from Pallas's lowering on this CPU "
                 "machine, compiled by the triton package for the target; "
                 "reg = registers per thread, local = spilled bytes per "
                 "thread, shared = bytes per program; no timing",
         "kernels": []}
  print(f"Pallas stack kernels compiled for {out['target']} (triton "
        f"{triton.__version__}, jax {jax.__version__}) on "
        f"{out['device']}; batch {args.batch}, n = {args.length}")
  print(f"{'code':>16s} {'Q=S':>3s} {'tiles':>15s}  {'kernel':22s} "
        f"{'regs':>4s} "
        f"{'spill B':>7s} {'shared B':>8s} {'progs/SM':>8s} {'compile':>8s}")
  for (code, kernels, version_tiles), qs in (
      (v, qs) for qs in sizes for v in versions):
    for tiles in version_tiles:
      rows, chunk, warps, grid = tiles
      patches = [p for p in train_step.tile_patches(tiles, kernels)
                 if hasattr(kernels, p[1])]    # older code: no ROW_GRID
      with train_step.patched(patches):
        for name, (fn, shapes) in kernel_calls(
            qs, qs, args.length, args.batch, kernels=kernels).items():
          row = {"code": code, "q": qs, "s": qs, "kernel": name,
                 "row_tile": rows, "kt_chunk": chunk, "num_warps": warps,
                 "row_grid": grid}
          try:
            row.update(compile_for_gpu(triton, triton_ir(fn, shapes), warps,
                                       args.arch))
            line = (f"{row['reg']:4d} {row['local']:7d} {row['shared']:8d} "
                    f"{row['programs_per_sm_by_registers']:8d} "
                    f"{row['compile_s']:7.1f}s")
          except Exception as e:  # pylint: disable=broad-except
            # A tile size the compiler rejects is a result, not the end.
            row["error"] = f"{type(e).__name__}: {e}"[:500]
            line = "failed: " + row["error"][:120]
          out["kernels"].append(row)
          print(f"{code:>16s} {qs:3d} {train_step.tiles_label(tiles):>15s}  "
                f"{name:22s} {line}", flush=True)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  print(f"saved {args.out}")


if __name__ == "__main__":
  main()
