"""Benchmark: how many sweeps the stack margin proves exact, and how many are.

`rns_stack.share_margin` proves a float32 share sweep exact (flush-free)
per batch element when its margin is above `rns_stack.exact_margin`. This
counts, on the same inputs, the elements proven by the product margin (the
current `share_margin`), by the factor margin it replaced (`share_margin`
of rns_stack.py as of --baseline, loaded with `machine.module_at_revision`)
and the elements whose float32 values actually are exact: readings within
2e-5 and log Σα within 1e-5 (relative, at least 1e-5) of the same sweep in
float64, itself proven by its float64 margin (elements where it is not are
left out and counted). Inputs: unnormalised N(0, scale²) log-weights,
B = 40 per scale, n = 24, Q = S = 2, fixed bottom, float32.

A certificate is sound if it never proves an inexact element ("proven, not
exact" must be 0); the closer its count to "exact", the less conservative.

Usage:

  python benchmarks/margin_certificates.py [--baseline REV] [--note "..."]

Prints a table and writes benchmarks/results/margin_certificates.json.
"""

import os
import sys

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position

import machine  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top,wrong-import-position

B, N, Q = 40, 24, 2
SCALES = (1, 2, 3, 4, 5, 6, 8, 10, 30, 60)
# The last commit whose rns_stack.share_margin is the factor margin.
FACTOR_REVISION = "4ee2779"


def actions(scale, rng):
  """(push, repl, pop) float64 [B, N, ...] log-weights N(0, scale²)."""
  shapes = [(B, N, Q, Q, Q, Q)] * 2 + [(B, N, Q, Q, Q)]
  return [scale * rng.normal(size=sh) for sh in shapes]


def exact_elements(acts):
  """(float32 elements equal to float64 up to rounding [B] bool, float64
  reference proven [B] bool)."""
  a32 = [jnp.asarray(a, jnp.float32) for a in acts]
  hat, mass = rns_stack.run(*a32)
  rho = np.asarray(rns_stack.readout(hat)[0], np.float64)
  mass = np.asarray(mass, np.float64)
  with jax.enable_x64(True):
    a64 = [jnp.asarray(a, jnp.float64) for a in acts]
    hat64, mass64 = rns_stack.run(*a64)
    rho64 = np.asarray(rns_stack.readout(hat64)[0])
    mass64 = np.asarray(mass64)
    proven64 = np.asarray(rns_stack.share_margin(*a64)) > (
        rns_stack.exact_margin(np.float64))
  err_rho = np.abs(rho - rho64).reshape(B, -1).max(1)
  err_mass = np.abs(mass - mass64).reshape(B, -1).max(1)
  scale = np.maximum(1, np.abs(mass64).reshape(B, -1).max(1))
  return (err_rho < 2e-5) & (err_mass < 1e-5 * scale), proven64


def row(scale, rng, factor_margin):
  """Counts of one scale: proven by each margin, exact, and unsound."""
  acts = actions(scale, rng)
  a32 = [jnp.asarray(a, jnp.float32) for a in acts]
  threshold = rns_stack.exact_margin(np.float32)
  product = np.asarray(rns_stack.share_margin(*a32)) > threshold
  factor = np.asarray(factor_margin(*a32)) > threshold
  exact, reference = exact_elements(acts)
  keep = reference
  return {"scale": scale, "B": B, "n": N, "Q": Q, "S": Q,
          "reference_not_proven": int((~keep).sum()),
          "elements": int(keep.sum()),
          "exact": int((exact & keep).sum()),
          "proven_product": int((product & keep).sum()),
          "proven_factor": int((factor & keep).sum()),
          "proven_not_exact_product": int((product & keep & ~exact).sum()),
          "proven_not_exact_factor": int((factor & keep & ~exact).sum())}


def main():
  parser = cli.OneLineArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--baseline", default=FACTOR_REVISION,
                      help="revision whose rns_stack.share_margin is the "
                      "factor margin")
  parser.add_argument("--note", default="")
  args = parser.parse_args()
  old = machine.module_at_revision(args.baseline, "rns_stack")
  rng = np.random.default_rng(0)
  print("| scale | elements | exact | proven (product) | proven (factor) | "
        "proven, not exact |")
  print("|---|---|---|---|---|---|")
  rows = []
  for scale in SCALES:
    r = row(scale, rng, old.share_margin)
    rows.append(r)
    print(f"| {scale} | {r['elements']} | {r['exact']} | "
          f"{r['proven_product']} | {r['proven_factor']} | "
          f"{r['proven_not_exact_product']} / "
          f"{r['proven_not_exact_factor']} |", flush=True)
  machine.save_rows("margin_certificates.json", rows, args.note,
                    baseline=args.baseline,
                    margin_kind=rns_stack.MARGIN_KIND)


if __name__ == "__main__":
  main()
