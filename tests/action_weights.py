"""Random stack-action log-weights shared by the stack and model tests."""

import numpy as np


def log_weights(rng, batch, steps, q, s, kind="norm"):
  """Random push [B,T,Q,S,Q,S], replace (same) and pop [B,T,Q,S,Q] log-weights.

  kind: 'norm' (each (q, x) row a log-softmax of N(0, 1) logits over all its
  push, replace and pop actions), 'unnorm' (N(0, 1) log-weights), 'neginf'
  ('norm' with −inf entries). Sharpened weights, sharpness × 'norm', are
  sub-normalised: their mass decays faster than the largest weights.
  """
  push = rng.normal(size=(batch, steps, q, s, q, s))
  repl = rng.normal(size=(batch, steps, q, s, q, s))
  pop = rng.normal(size=(batch, steps, q, s, q))
  if kind in ("norm", "neginf"):
    flat = np.concatenate([push.reshape(batch, steps, q, s, -1),
                           repl.reshape(batch, steps, q, s, -1), pop], -1)
    flat = flat - np.log(np.exp(flat).sum(-1, keepdims=True))
    n = q * s
    push = flat[..., :n].reshape(push.shape)
    repl = flat[..., n:2 * n].reshape(push.shape)
    pop = flat[..., 2 * n:]
  if kind == "neginf":
    repl = np.where(rng.random(repl.shape) < 0.3, -np.inf, repl)
    pop = np.where(rng.random(pop.shape) < 0.3, -np.inf, pop)
    push = np.where(rng.random(push.shape) < 0.1, -np.inf, push)
  return push, repl, pop
