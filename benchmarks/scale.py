"""Scale-out throughput: vmapped model axis K and simulated data-parallel devices.

Measures training strings per second of train.py's `train_step` for the
NS-RNN (Q = S = 2, 20 hidden units, batch 10):

1. K = 1, 5, 20 models vmapped in one program (grid.py's model axis) versus
   K sequential runs (K separate single-model steps, the way independent runs
   share a machine: their throughput is that of one model). As in grid.py,
   each model draws its own string length at every step (from --lengths)
   and the K batches of a step are right-padded to the longest of them; the
   sequential runs step each model at its own length. Compilation (one per
   distinct padded length) is excluded from the timings.
2. 1, 2, 4, 8 simulated CPU devices on the 'data' axis (a subprocess with
   --xla_force_host_platform_device_count=8; global batch 8 x devices... see
   DEVICE_BATCH). On a 2-core CPU the simulated devices share the same cores,
   so this measures overhead, not speed-up.

Timings are medians of repeated runs after compilation; other jobs may share
the CPU, so compare ratios within one run.

  python benchmarks/scale.py [--length=80] [--lengths=40,60,80] [--steps=4]

Prints a table and writes benchmarks/results/scale_<backend>.json (with the
machine / device description).
"""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import numpy as np

import machine
from configs import default
from nsrnn_jax import grid
from nsrnn_jax import parallel
from nsrnn_jax import rns_stack
from nsrnn_jax import train
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

BATCH = 10
DEVICE_BATCH = 8  # Divisible by 1, 2, 4, 8 devices.


def ns_config(batch_size=BATCH, scan_unroll=1):
  c = default.get_config()
  c.scan_unroll = scan_unroll
  c.model = "ns"
  c.num_states = 2
  c.num_stack_symbols = 2
  c.batch_size = batch_size
  return c


def _batches(num, length, batch, seed=0):
  rng = np.random.default_rng(seed)
  return [train.make_batch(rng.integers(0, 3, (batch, length), dtype=np.int32))
          for _ in range(num)]


def draw_lengths(lengths, k, steps, seed=0):
  """[steps][k] string lengths, each model drawing its own at every step."""
  rng = np.random.default_rng(seed)
  return [[int(x) for x in rng.choice(lengths, size=k)] for _ in range(steps)]


def bench_model_axis(ks, lengths, steps, repeats, save=None, scan_unroll=1):
  """Strings/s of K vmapped models vs K sequential single-model runs."""
  config = ns_config(scan_unroll=scan_unroll)
  rng = np.random.default_rng(1)
  symbols = {n: rng.integers(0, 3, (BATCH, n), dtype=np.int32)
             for n in lengths}
  # One model stepping at each length (the sequential runs' cost per step).
  single = train.create_train_state(config, jax.random.key(0))
  step1 = jax.jit(train.train_step)
  t_single, cpu_single = {}, {}
  for n in lengths:
    batch = train.make_batch(symbols[n])
    jax.block_until_ready(step1(single, batch)[1]["loss"])  # Compile.
    cpu = []
    t_single[n] = machine.median_seconds(
        lambda batch=batch: step1(single, batch)[1]["loss"], repeats=repeats,
        warmup=False, cpu=cpu)
    cpu_single[n] = cpu[0]
  rows = []
  for k in ks:
    draws = draw_lengths(lengths, k, steps, seed=k)
    states = [train.create_train_state(config, jax.random.key(i))
              for i in range(k)]
    state_k = grid.stack_states(states)
    step_k = jax.jit(jax.vmap(train.train_step))
    # Each step's K batches padded to the longest of them, as grid.py does.
    stacked = [grid.stack_batches([symbols[n] for n in draw])
               for draw in draws]
    for b in {b["symbols"].shape[-1]: b for b in stacked}.values():
      jax.block_until_ready(step_k(state_k, b)[1]["loss"])  # Compile.

    def run_k(state_k=state_k, step_k=step_k, stacked=stacked):
      s = state_k
      for b in stacked:
        s, m = step_k(s, b)
      return m["loss"]

    cpu = []
    t_k = machine.median_seconds(run_k, repeats=repeats, warmup=False,
                                 cpu=cpu) / steps
    cpu_k = cpu[0] / steps
    # K runs one after another, each model at its own length every step.
    t_seq = sum(t_single[n] for draw in draws for n in draw) / steps
    cpu_seq = sum(cpu_single[n] for draw in draws for n in draw) / steps
    vmapped = k * BATCH / t_k
    sequential = k * BATCH / t_seq
    rows.append({"K": k, "lengths_drawn": draws,
                 "step_time_vmapped_s": t_k,
                 "step_time_sequential_s": t_seq,
                 "strings_per_s_vmapped": vmapped,
                 "strings_per_s_sequential": sequential,
                 "speedup": vmapped / sequential,
                 # Process CPU time: steadier than wall time on shared cores.
                 "cpu_step_time_vmapped_s": cpu_k,
                 "cpu_step_time_sequential_s": cpu_seq,
                 "speedup_cpu_time": cpu_seq / cpu_k})
    if save is not None:
      save(rows, t_single)
  return rows, t_single


def bench_devices_child(length, steps, repeats):
  """Runs inside the 8-device subprocess; prints JSON rows."""
  config = ns_config(DEVICE_BATCH)
  batches = _batches(steps, length, DEVICE_BATCH)
  rows = []
  for d in (1, 2, 4, 8):
    mesh = parallel.make_mesh(num_data=d)
    state = train.create_train_state(config, jax.random.key(0))
    state = state.replace(**parallel.replicate(state.arrays(), mesh))
    step = jax.jit(train.train_step)
    sharded = [parallel.shard_batch(b, mesh) for b in batches]
    state, _ = step(state, sharded[0])

    def run(state=state, step=step, sharded=sharded):
      s = state
      for b in sharded:
        s, m = step(s, b)
      return m["loss"]

    t = machine.median_seconds(run, repeats=repeats, warmup=False) / steps
    rows.append({"devices": d, "step_time_s": t,
                 "strings_per_s": DEVICE_BATCH / t})
  print("JSON:" + json.dumps(rows))


def bench_devices(length, steps, repeats):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  result = subprocess.run(
      [sys.executable, __file__, "--devices_child", f"--length={length}",
       f"--steps={steps}", f"--repeats={repeats}"],
      env=env, capture_output=True, text=True, check=False)
  if result.returncode:
    raise RuntimeError(result.stderr[-3000:])
  line = [l for l in result.stdout.splitlines() if l.startswith("JSON:")][-1]
  return json.loads(line[len("JSON:"):])


def build_parser():
  """The command line's flags (a test checks gpu_session.sh's commands)."""
  parser = cli.OneLineArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--length", type=int, default=80,
                      help="the longest length (and the devices' length)")
  parser.add_argument("--lengths", default=None,
                      help="comma-separated lengths the models draw from "
                           "(default: length/2, 3*length/4, length)")
  parser.add_argument("--steps", type=cli.positive_int, default=4)
  parser.add_argument("--repeats", type=cli.positive_int, default=3)
  parser.add_argument("--ks", default="1,5,20")
  parser.add_argument("--devices_child", action="store_true")
  parser.add_argument("--skip_devices", action="store_true")
  parser.add_argument("--scan_unroll", type=int, default=1,
                      help="config.scan_unroll of the models (K axis only)")
  parser.add_argument("--update_kernels", default="xla",
                      choices=rns_stack.UPDATE_KERNEL_MODES,
                      help="rns_stack.UPDATE_KERNELS: 'pallas' runs the "
                      "stack's updates as Pallas kernels (stack_kernels; "
                      "GPUs), batched over K by vmap (K axis only)")
  parser.add_argument("--out", type=cli.output_file, default=None,
                      help="default results/scale_<backend>.json")
  return parser


def main():
  parser = build_parser()
  args = parser.parse_args()
  # Read when the steps are traced, all of them after this.
  rns_stack.UPDATE_KERNELS = args.update_kernels
  if args.devices_child:
    bench_devices_child(args.length, args.steps, args.repeats)
    return
  ks = [int(k) for k in args.ks.split(",")]
  lengths = ([int(n) for n in args.lengths.split(",")] if args.lengths else
             sorted({args.length // 2, 3 * args.length // 4, args.length}))
  info = machine.machine_info()
  path = args.out or os.path.join(REPO, "benchmarks", "results",
                                  f"scale_{info['backend']}.json")
  os.makedirs(os.path.dirname(path), exist_ok=True)

  def save(model_rows, t_single, device_rows=()):
    # Saved after every K, so a run stopped by a time limit keeps its rows.
    info["load_average_at_end"] = list(os.getloadavg())
    with open(path, "w") as f:
      json.dump({"machine": info, "device": machine.device_label(info),
                 "lengths": lengths, "length": args.length, "batch": BATCH,
                 "steps": args.steps, "repeats": args.repeats,
                 "scan_unroll": args.scan_unroll,
                 "update_kernels": args.update_kernels,
                 "single_step_s_by_length": {
                     str(n): t for n, t in t_single.items()},
                 "model_axis": model_rows, "devices": list(device_rows)},
                f, indent=1)

  model_rows, t_single = bench_model_axis(ks, lengths, args.steps,
                                          args.repeats, save,
                                          args.scan_unroll)
  print(f"NS-RNN Q=S=2, batch {BATCH}, scan unroll {args.scan_unroll}, "
        f"stack updates {args.update_kernels}, "
        f"lengths drawn from {lengths}, "
        f"{machine.device_label(info)}")
  print(f"{'K':>3} {'vmapped s/step':>15} {'vmapped str/s':>14} "
        f"{'sequential str/s':>17} {'speed-up':>9}")
  for r in model_rows:
    print(f"{r['K']:>3} {r['step_time_vmapped_s']:>15.4f} "
          f"{r['strings_per_s_vmapped']:>14.1f} "
          f"{r['strings_per_s_sequential']:>17.1f} {r['speedup']:>8.2f}x")
  device_rows = []
  if not args.skip_devices:
    device_rows = bench_devices(args.length, args.steps, args.repeats)
    print(f"\nData-parallel, global batch {DEVICE_BATCH}, simulated CPU devices")
    print(f"{'devices':>7} {'s/step':>9} {'strings/s':>10}")
    for r in device_rows:
      print(f"{r['devices']:>7} {r['step_time_s']:>9.4f} "
            f"{r['strings_per_s']:>10.1f}")
  save(model_rows, t_single, device_rows)
  print(f"saved {path}")


if __name__ == "__main__":
  main()
