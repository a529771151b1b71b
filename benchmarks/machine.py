"""What every benchmark records about the machine it ran on.

`machine_info()` names the JAX backend and devices, the host CPU model, the
load average (other jobs on shared cores skew timings) and the XLA flags;
`matmul_gflops()` measures this machine's jitted float32 matmul throughput
(1024³, full precision), the yardstick of the FLOP-limit ratios.
"""

import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from nsrnn_jax import parallel


def machine_info():
  """A JSON-able description of the machine and software (for results)."""
  devices = jax.devices()
  return {
      "backend": jax.default_backend(),
      "device_kind": devices[0].device_kind,
      "device_count": len(devices),
      "cpu_model": parallel.host_cpu_model(),
      "cpu_count": os.cpu_count(),
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


_MATMUL = {}


def matmul_gflops(size=1024, repeats=3, clock="wall"):
  """Best-of-`repeats` jitted float32 matmul rate in GFLOP/s (full f32).

  clock="wall" times with the wall clock; clock="cpu" with the process's
  CPU time (all threads), the steadier yardstick on shared, loaded cores.
  """
  if size not in _MATMUL:
    a = jnp.asarray(np.random.default_rng(0).normal(size=(size, size)),
                    jnp.float32)
    f = jax.jit(lambda x: jnp.matmul(x, x, precision="highest"))
    jax.block_until_ready(f(a))
    _MATMUL[size] = (f, a)
  f, a = _MATMUL[size]
  timer = time.perf_counter if clock == "wall" else time.process_time
  best = float("inf")
  for _ in range(repeats):
    start = timer()
    jax.block_until_ready(f(a))
    best = min(best, timer() - start)
  return 2 * size**3 / max(best, 1e-9) / 1e9


def ns_flop_limit_s(q, s, n, batch, gflops):
  """Lower bound on an NS-RNN train step from its dominant work.

  The pop term costs B·Q³S²·n³/3 multiply-adds in the forward sweep and
  twice that in the backward (issue 11): 2·B·Q³S²·n³ FLOP per step, at the
  measured matmul rate.
  """
  return 2 * batch * q**3 * s**2 * n**3 / (gflops * 1e9)
