"""Shared pieces of the generalised-stack tests (rns_stack, log_stack).

* `readings_loss`: a scalar of a table's readings and log Σα whose gradient
  reaches every action (a weighted sum, a square, the log-mass).
* `reference_mass_and_readings`: log Σα and state readings of a batch from
  the float64 NumPy reference (`log_space_reference`, fixed bottom).
* `run_that_comes_back`: actions where a run falls e^-big behind and then
  overtakes (the share table's flush limit), with the oracle's answer.
* `tanh_controller` / `tanh_params`: a small tanh controller for the coupled
  sweeps (`run_coupled`), unnormalised actions scaled by 4, vocabulary `V`,
  hidden size `H`.
"""

import jax
import jax.numpy as jnp
import numpy as np

import log_space_reference
import pda_oracle
from nsrnn_jax import rns_stack

H, V = 5, 3


def readings_loss(fn, c, e, bottom):
  """loss(push, repl, pop) = Σ c·ρ + 0.3 Σ ρ² + 0.1 Σ e·log Σα of
  `fn(push, repl, pop, bottom)` (state readings; a dead log-mass is 0)."""
  def loss(push, repl, pop):
    hat, log_mass = fn(push, repl, pop, bottom)
    rho, _ = rns_stack.readout(hat)
    safe = jnp.where(jnp.isfinite(log_mass), log_mass, 0)
    return (jnp.sum(c * rho) + 0.3 * jnp.sum(rho ** 2)
            + 0.1 * jnp.sum(e * safe))
  return loss


def tanh_controller(q, s, reading):
  """(step_fn, reading size) for `run_coupled`."""
  size = q * s if reading == "state" else s

  def step_fn(p, h, x, rho):
    assert rho.shape[-1] == size
    h = jnp.tanh(jax.nn.one_hot(x, V, dtype=rho.dtype) @ p["wx"]
                 + rho @ p["wr"] + h @ p["wh"] + p["b"])
    acts = rns_stack.split_action_logits(h @ p["wa"] * 4.0, q, s, False)
    return h, acts, h @ p["wo"]

  return step_fn, size


def tanh_params(rng, q, s, size):
  """N(0, 1) parameters of `tanh_controller` (recurrence scaled by 0.5)."""
  return {"wx": rng.normal(size=(V, H)), "wr": rng.normal(size=(size, H)),
          "wh": 0.5 * rng.normal(size=(H, H)), "b": rng.normal(size=H),
          "wa": rng.normal(size=(H, q * s * (2 * q * s + q))),
          "wo": rng.normal(size=(H, V))}


def run_that_comes_back(big, dtype):
  """Q = 1, S = 3, fixed bottom: update 2 reaches (0, 2) by a push of
  weight 1 from the run with 1 on top and by a replace of weight e^big;
  update 3 pops; update 4 pushes with weight e^(2 big) from (0, 1), which
  only the push run of update 2 left under its top.

  Returns:
    ((push, repl, pop) [1, 4, ...] of `dtype`, the brute-force oracle's
    symbol reading and log Σα at update 4).
  """
  ninf = -np.inf
  push = np.full((1, 4, 1, 3, 1, 3), ninf)
  repl, pop = np.full_like(push, ninf), np.full((1, 4, 1, 3, 1), ninf)
  push[0, 0, 0, 0, 0, 1] = 0.0
  push[0, 1, 0, 1, 0, 2], repl[0, 1, 0, 1, 0, 2] = 0.0, big
  pop[0, 2, 0, 2, 0] = 0.0
  push[0, 3, 0, 1, 0, 1], push[0, 3, 0, 0, 0, 2] = 2 * big, 0.0
  want_reading, want_mass = pda_oracle.readings_and_log_mass(
      push[0], repl[0], pop[0], bottom="fixed")
  return (tuple(a.astype(dtype) for a in (push, repl, pop)),
          want_reading[4], want_mass[4])


def reference_mass_and_readings(push, repl, pop):
  """(log Σα [B, T+1], state readings [B, T+1, Q·S]) of [B, T, ...]
  actions by `log_space_reference` (float64, fixed bottom)."""
  want = [log_space_reference.log_alpha(push[b], repl[b], pop[b])
          for b in range(len(push))]
  mass = np.stack([np.logaddexp.reduce(w.reshape(len(w), -1), 1)
                   for w in want])
  rho = np.stack([np.exp(w.reshape(len(w), -1) - m[:, None])
                  for w, m in zip(want, mass)])
  return mass, rho
