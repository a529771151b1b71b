"""Benchmark: where one training step's time goes, op by op.

Traces a few full train steps (the same program as `benchmarks/train_step.py`:
batch 10, length 80 unless --length says otherwise, full float32) with `jax.profiler`, reads the trace back
(`jax.profiler.ProfileData`) and charges every traced XLA op its exclusive
time (its own span minus the spans of the ops it contains, e.g. a while loop
minus its body's ops), matched to the compiled HLO by instruction name. It
prints, per model, the time by kind of op (table-sized matmuls, other
matmuls, elementwise/reduction fusions, copies and slices, loop overhead,
runtime) and the ops that take the most, with their shape and source line,
and saves JSON.

Which trace lines count: on a GPU the device's "XLA Ops" line, or its
stream lines with each kernel charged to its HLO op (device time;
host-side launch events are left out so nothing is counted twice);
on the CPU the XLA:CPU runtime's threads. On a GPU, XLA by default
launches runs of kernels as one CUDA graph ("command buffer"), whose trace
event names none of the ops inside and times the launch, not the kernels:
so this benchmark turns command buffers off (XLA_FLAGS
--xla_gpu_enable_command_buffer=, set before JAX starts) unless
--command_buffers is given, and the untraced step time it prints is then
that of the program without them. XLA:CPU splits some ops over
its threads, so the CPU's "busy" total can exceed the step's wall time;
shares of the busy total are the figure to read. The tracer adds its own
overhead; the untraced step time is printed beside it.

  python benchmarks/profile_step.py [--models=ns22,ns33] [--steps=3]
      [--length=80]
      [--top=12] [--command_buffers] [--contractions=dot|reduce|reduce_all]
      [--update_kernels=xla|pallas] [--cpu_devices=N]
      [--out=benchmarks/results/profile_step_<backend>.json]

--contractions traces the stack's update with rns_stack.COLUMN_CONTRACTIONS
= "reduce" ("reduce"), and TABLE_CONTRACTIONS too ("reduce_all");
--update_kernels=pallas with rns_stack.UPDATE_KERNELS = "pallas" (the
stack's updates as Pallas kernels: stack_kernels).
"""

import collections
import glob
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax

import machine
import train_step
from nsrnn_jax import rns_stack
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

# `%name = shape opcode(...)` of an HLO instruction; shape may be a tuple.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(\([^=]*?\)|\S+)\s+([\w-]+)\(")
_KIND = re.compile(r"kind=(\w+)")
_OP_NAME = re.compile(r'op_name="([^"]+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# Matmul-like ops that read a table-sized operand (≥ this many elements).
TABLE_ELEMENTS = 100_000


def hlo_instructions(hlo_text):
  """{instruction name: {opcode, shape, kind, source, largest operand}}.

  The largest operand is counted in elements, from the operands' own
  instructions (a fusion's line names its operands, not their shapes).
  """
  found, operands = {}, {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    name, shape, opcode = m.groups()
    kind = _KIND.search(line)
    src = _OP_NAME.search(line)
    args = line[m.end():].split(")", 1)[0]
    operands[name] = re.findall(r"%([\w.-]+)", args)
    target = _TARGET.search(line)
    found[name] = {"opcode": opcode, "shape": shape,
                   "kind": kind.group(1) if kind else "",
                   "target": target.group(1) if target else "",
                   "source": "/".join(src.group(1).split("/")[-2:])
                             if src else ""}
  for name, info in found.items():
    info["largest_operand"] = max(
        (_elements(found[o]["shape"]) for o in operands[name] if o in found),
        default=0)
  return found


def _elements(shape):
  """Elements of an array shape like f32[20,162,2]{2,1,0} (0 for tuples)."""
  m = re.match(r"^\w+\[([\d,]*)\]", shape)
  if not m:
    return 0
  n = 1
  for d in m.group(1).split(","):
    if d:
      n *= int(d)
  return n


def category(name, info):
  """The kind of op an event is, for the per-kind totals."""
  if name.startswith("command_buffer"):
    return "command buffers (CUDA graphs, ops not separable)"
  if info is None:
    # On the CPU this includes the ops XLA:CPU does not trace one by one
    # (its small loop fusions run inside their loop body's executor).
    return "runtime, untraced ops"
  op = info["opcode"]
  # A dot, a fusion around one (XLA:CPU's YNNPACK fusions also take
  # reductions: the source line tells them apart), or a GEMM library call.
  matmul = (op == "dot" or "gemm" in name
            or info["source"].endswith("dot_general")
            or re.search(r"gemm|matmul|cublas", info.get("target", ""), re.I))
  if matmul:
    return ("matmul, table-sized" if info["largest_operand"]
            >= TABLE_ELEMENTS else "matmul, small")
  if op in ("while", "conditional", "call"):
    return "loop overhead (while, untraced work)"
  if op in ("copy", "dynamic-update-slice", "dynamic-slice", "pad",
            "concatenate", "slice", "transpose", "broadcast") or any(
                w in name for w in ("copy", "slice", "pad", "broadcast")):
    return "copies, slices, pads"
  return "elementwise / reduction fusions"


def _exclusive_times(events):
  """{name: [exclusive ns, count]} of one trace line (nested spans)."""
  out = collections.defaultdict(lambda: [0, 0])
  stack = []                      # [end, name, start, time of children]

  def close(item):
    end, name, start, children = item
    out[name][0] += (end - start) - children
    out[name][1] += 1
    if stack:
      stack[-1][3] += end - start

  for start, end, name in sorted(events, key=lambda e: (e[0], -e[1])):
    while stack and stack[-1][0] <= start:
      close(stack.pop())
    stack.append([end, name, start, 0])
  while stack:
    close(stack.pop())
  return out


def _op_name(event):
  """The HLO instruction an event ran: its `hlo_op` stat (GPU kernels) or
  its name (XLA:CPU's events and the derived "XLA Ops" line)."""
  for key, value in event.stats:
    if key in ("hlo_op", "hlo_op_name"):
      return str(value)
  return event.name


_Line = collections.namedtuple("_Line", "name events")


def counted_lines(planes, host=False):
  """[(plane name, line)] of a trace whose events count as work.

  A device plane (GPU/TPU): its "XLA Ops" line if the trace has one, else
  its stream lines (kernels, named by their `hlo_op` stat), where these
  hold events. With `host` (the program ran on the CPU backend, though the
  machine may have a GPU whose planes hold stray copies), or without such
  lines: the host's XLA:CPU runtime threads.
  """
  # The profiler's planes, lines and events are iterators: read them once.
  planes = [(plane.name, [_Line(l.name, list(l.events)) for l in plane.lines])
            for plane in planes]
  chosen = []
  for name, lines in planes:
    if name.startswith("/device:") and not host:
      ops = [l for l in lines if l.name == "XLA Ops" and l.events]
      chosen += [(name, l) for l in (ops or [
          l for l in lines if l.name.startswith("Stream") and l.events])]
  if not chosen:                   # CPU: the XLA:CPU runtime's threads.
    chosen = [(name, l) for name, lines in planes
              for l in lines if l.name.startswith("tf_XLA")]
  return chosen


def charge(chosen):
  """{op name: [exclusive ns, count]} summed over the chosen lines."""
  total = collections.defaultdict(lambda: [0, 0])
  for _, line in chosen:
    events = [(e.start_ns, e.start_ns + e.duration_ns, _op_name(e))
              for e in line.events]
    for name, (ns, count) in _exclusive_times(events).items():
      if "wait for completion" in name:   # idle, not work
        continue
      total[name][0] += ns
      total[name][1] += count
  return total


def read_trace(trace_dir, host=False):
  """({op name: [exclusive ns, count]}, [the lines counted]) of a trace;
  `host`: the traced program ran on the CPU backend (`counted_lines`)."""
  path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                          recursive=True))[-1]
  chosen = counted_lines(jax.profiler.ProfileData.from_file(path).planes,
                         host)
  return charge(chosen), [f"{p} / {l.name}" for p, l in chosen]


def contraction_patches(mode, update_kernels="xla"):
  """`train_step.Variant` patches for --contractions and --update_kernels
  (rns_stack settings)."""
  return [(rns_stack, "COLUMN_CONTRACTIONS",
           "dot" if mode == "dot" else "reduce"),
          (rns_stack, "TABLE_CONTRACTIONS",
           "reduce" if mode == "reduce_all" else "dot"),
          (rns_stack, "UPDATE_KERNELS", update_kernels)]


def profile_model(name, steps, top, trace_root, contractions="dot",
                  num_devices=None, update_kernels="xla", length=80):
  """Step time untraced and traced, and the per-op / per-kind breakdown.

  num_devices: None profiles the plain jitted step on one device; N, the
  data-parallel step with the batch split over N devices (loop.py's, what
  `main --cpu_devices=N` runs); its trace sums the devices' threads.
  """
  v = train_step.Variant(name, "current", length, "highest",
                         patches=contraction_patches(contractions,
                                                     update_kernels),
                         num_devices=num_devices)
  compiled = v.lower().compile()
  hlo = hlo_instructions(compiled.as_text())
  state = v.state

  def run_once():
    # The data-parallel step donates its state: carry the returned one.
    nonlocal state
    s, m = compiled(state, v.batch)
    jax.block_until_ready(m["loss"])
    if v.keep_state:
      state = s

  for _ in range(3):
    run_once()
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    run_once()
    best = min(best, time.perf_counter() - start)
  trace_dir = os.path.join(trace_root, name)
  jax.profiler.start_trace(trace_dir)
  start = time.perf_counter()
  for _ in range(steps):
    run_once()
  traced = (time.perf_counter() - start) / steps
  jax.profiler.stop_trace()
  times, lines = read_trace(trace_dir, host=jax.default_backend() == "cpu")
  busy = sum(ns for ns, _ in times.values()) / steps
  kinds = collections.Counter()
  for op, (ns, _) in times.items():
    kinds[category(op, hlo.get(op))] += ns / steps
  ops = []
  for op, (ns, count) in sorted(times.items(), key=lambda kv: -kv[1][0])[:top]:
    info = hlo.get(op) or {}
    ops.append({"op": op, "kind": category(op, hlo.get(op)),
                "ms_per_step": ns / steps / 1e6,
                "calls_per_step": count / steps,
                "us_per_call": ns / count / 1e3 if count else 0.0,
                "shape": info.get("shape", ""),
                "source": info.get("source", "")})
  return {"model": name, "step_ms_untraced_best": best * 1e3,
          "step_ms_traced_mean": traced * 1e3, "steps_traced": steps,
          "busy_ms_per_step": busy / 1e6, "trace_lines": lines,
          "by_kind_ms_per_step": {k: t / 1e6 for k, t in kinds.most_common()},
          "top_ops": ops}


def print_result(r):
  """One model's profile as a table on stdout."""
  print(f"\n{r['model']}: step {r['step_ms_untraced_best']:.2f} ms untraced "
        f"(best), {r['step_ms_traced_mean']:.2f} ms traced; busy "
        f"{r['busy_ms_per_step']:.2f} ms per step on "
        f"{len(r['trace_lines'])} trace line(s)")
  busy = r["busy_ms_per_step"] or 1.0
  for kind, ms in r["by_kind_ms_per_step"].items():
    print(f"  {kind:40s} {ms:9.2f} ms  {100 * ms / busy:5.1f}%")
  print(f"  {'op':34s} {'ms/step':>8s} {'calls':>6s} {'us/call':>8s}  "
        f"shape / source")
  for o in r["top_ops"]:
    print(f"  {o['op'][:34]:34s} {o['ms_per_step']:8.2f} "
          f"{o['calls_per_step']:6.0f} {o['us_per_call']:8.1f}  "
          f"{o['shape'][:32]} {o['source'][-48:]}")


def build_parser():
  """The command line's flags (a test checks gpu_session.sh's commands)."""
  parser = cli.OneLineArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="ns22,ns33",
                      help=f"of {','.join(train_step.SETTINGS)}")
  parser.add_argument("--steps", type=cli.positive_int, default=3)
  parser.add_argument("--top", type=cli.positive_int, default=12)
  parser.add_argument("--length", type=cli.positive_int, default=80,
                      help="string length n of the batch")
  parser.add_argument("--out", type=cli.output_file, default=None)
  parser.add_argument("--contractions", default="dot",
                      choices=("dot", "reduce", "reduce_all"),
                      help="the stack update's contractions (rns_stack)")
  parser.add_argument("--update_kernels", default="xla",
                      choices=rns_stack.UPDATE_KERNEL_MODES,
                      help="the stack's updates as XLA ops or Pallas kernels")
  parser.add_argument("--cpu_devices", type=cli.positive_int, default=1,
                      help="profile the data-parallel step with the batch "
                      "split over this many CPU devices")
  parser.add_argument("--command_buffers", action="store_true",
                      help="keep XLA's GPU command buffers (CUDA graphs) on; "
                      "their kernels then cannot be told apart")
  return parser


def main():
  parser = build_parser()
  args = parser.parse_args()
  names = [m for m in args.models.split(",") if m]
  unknown = [m for m in names if m not in train_step.SETTINGS]
  if unknown:
    parser.error(f"unknown model(s) {', '.join(unknown)} (known: "
                 f"{', '.join(train_step.SETTINGS)})")
  if args.cpu_devices > 1:
    # Before JAX starts its backend; only the CPU backend is split.
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  if not args.command_buffers:
    # Before JAX starts its backend (it reads XLA_FLAGS then); a no-op on
    # CPU. The flag given last wins, so one already in XLA_FLAGS yields.
    os.environ["XLA_FLAGS"] = ("--xla_gpu_enable_command_buffer= "
                               + os.environ.get("XLA_FLAGS", ""))
  info = machine.machine_info()
  print(f"profile of one train step on {machine.device_label(info)} "
        f"(batch {train_step.BATCH}, length {args.length}, full float32)")
  results = []
  with tempfile.TemporaryDirectory() as trace_root:
    for name in names:
      r = profile_model(name, args.steps, args.top, trace_root,
                        args.contractions,
                        args.cpu_devices if args.cpu_devices > 1 else None,
                        args.update_kernels, args.length)
      print_result(r)
      results.append(r)
  out = args.out or os.path.join(
      os.path.dirname(os.path.abspath(__file__)), "results",
      f"profile_step_{info['backend']}.json")
  with open(out, "w") as f:
    json.dump({"benchmark": "profile_step", "machine": info,
               "device": machine.device_label(info),
               "date": time.strftime("%Y-%m-%d"), "batch": train_step.BATCH,
               "length": args.length, "table_elements": TABLE_ELEMENTS,
               "command_buffers": bool(args.command_buffers),
               "contractions": args.contractions,
               "update_kernels": args.update_kernels,
               "cpu_devices": args.cpu_devices,
               "models": results}, f, indent=1)
  print(f"saved {out}")


if __name__ == "__main__":
  main()
