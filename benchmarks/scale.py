"""Scale-out throughput: vmapped model axis K and simulated data-parallel devices.

Measures training strings per second of train.py's `train_step` for the
NS-RNN (Q = S = 2, 20 hidden units, batch 10):

1. K = 1, 5, 20 models vmapped in one program (grid.py's model axis) versus
   K sequential runs (K separate single-model steps, the way independent runs
   share a machine: their throughput is that of one model).
2. 1, 2, 4, 8 simulated CPU devices on the 'data' axis (a subprocess with
   --xla_force_host_platform_device_count=8; global batch 8 x devices... see
   DEVICE_BATCH). On a 2-core CPU the simulated devices share the same cores,
   so this measures overhead, not speed-up.

Timings are medians of repeated runs after compilation; other jobs may share
the CPU, so compare ratios within one run.

  python benchmarks/scale.py [--length=40] [--steps=5] [--quick]

Prints a table and writes benchmarks/results/scale.json.
"""

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np

from configs import default
from nsrnn_jax import grid
from nsrnn_jax import parallel
from nsrnn_jax import train

BATCH = 10
DEVICE_BATCH = 8  # Divisible by 1, 2, 4, 8 devices.


def ns_config(batch_size=BATCH):
  c = default.get_config()
  c.model = "ns"
  c.num_states = 2
  c.num_stack_symbols = 2
  c.batch_size = batch_size
  return c


def _median_time(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _batches(num, length, batch, seed=0):
  rng = np.random.default_rng(seed)
  return [train.make_batch(rng.integers(0, 3, (batch, length), dtype=np.int32))
          for _ in range(num)]


def bench_model_axis(ks, length, steps, repeats):
  """Strings/s of K vmapped models vs K sequential single-model runs."""
  config = ns_config()
  batches = _batches(steps, length, BATCH)
  single = train.create_train_state(config, jax.random.key(0))
  step1 = jax.jit(train.train_step)
  state = single
  state, _ = step1(state, batches[0])  # Compile.

  def run_single():
    s = state
    for b in batches:
      s, m = step1(s, b)
    return m["loss"]

  t_single = _median_time(run_single, repeats) / steps
  rows = []
  for k in ks:
    states = [train.create_train_state(config, jax.random.key(i))
              for i in range(k)]
    state_k = grid.stack_states(states)
    step_k = jax.jit(jax.vmap(train.train_step))
    stacked = [grid.stack_batches([b["symbols"]] * k) for b in batches]
    state_k, _ = step_k(state_k, stacked[0])  # Compile.

    def run_k(state_k=state_k, step_k=step_k, stacked=stacked):
      s = state_k
      for b in stacked:
        s, m = step_k(s, b)
      return m["loss"]

    t_k = _median_time(run_k, repeats) / steps
    vmapped = k * BATCH / t_k
    sequential = BATCH / t_single  # K runs one after another.
    rows.append({"K": k, "step_time_vmapped_s": t_k,
                 "step_time_single_s": t_single,
                 "strings_per_s_vmapped": vmapped,
                 "strings_per_s_sequential": sequential,
                 "speedup": vmapped / sequential})
  return rows


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

    t = _median_time(run, repeats) / steps
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


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--length", type=int, default=40)
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--ks", default="1,5,20")
  parser.add_argument("--devices_child", action="store_true")
  parser.add_argument("--skip_devices", action="store_true")
  args = parser.parse_args()
  if args.devices_child:
    bench_devices_child(args.length, args.steps, args.repeats)
    return
  ks = [int(k) for k in args.ks.split(",")]
  model_rows = bench_model_axis(ks, args.length, args.steps, args.repeats)
  print(f"NS-RNN Q=S=2, batch {BATCH}, length {args.length}, "
        f"{jax.device_count()} device(s), {os.cpu_count()} CPU(s)")
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
  out_dir = os.path.join(REPO, "benchmarks", "results")
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "scale.json"), "w") as f:
    json.dump({"length": args.length, "batch": BATCH, "steps": args.steps,
               "repeats": args.repeats, "cpu_count": os.cpu_count(),
               "jax": jax.__version__, "model_axis": model_rows,
               "devices": device_rows}, f, indent=1)


if __name__ == "__main__":
  main()
