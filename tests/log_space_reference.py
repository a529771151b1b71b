"""Float64 NumPy log-space reference for the generalised stack (tests only).

A direct transcription of rns-vrns-reference.md §1.4 (frozen bottom) and
§1.5 (bottom fix, with the virtual time −1 as an explicit row) in the log
semiring, restricted to the triangle i < j (so it is cheap enough for
T = 500 with small Q, S). Independent of `rns_stack` (shares no code), and
independent of the brute-force enumerator, which cannot reach T = 500.
"""

import numpy as np


def _lse(x, axis):
  peak = np.max(x, axis=axis, keepdims=True)
  peak = np.where(np.isfinite(peak), peak, 0.0)
  with np.errstate(divide="ignore", invalid="ignore"):
    out = np.log(np.sum(np.exp(x - peak), axis=axis, keepdims=True)) + peak
  return np.squeeze(out, axis=axis)


def log_alpha(push, repl, pop, bottom="fixed"):
  """log α_j for j = 0..T of one batch element ([T,Q,S,Q,S]/[T,Q,S,Q]).

  Returns:
    float64 [T+1, Q, S].
  """
  push, repl, pop = (np.asarray(a, np.float64) for a in (push, repl, pop))
  t, q, s = push.shape[:3]
  # lg[i+1, j] = log γ[i→j], rows i = −1..T−1, columns j = 0..T.
  lg = np.full((t + 1, t + 1, q, s, q, s), -np.inf)
  la = np.full((t + 2, q, s), -np.inf)      # la[i+1] = log α_i, i = −1..T
  la[1, 0, 0] = 0.0
  if bottom == "fixed":
    lg[0, 0, 0, 0, 0, 0] = 0.0
    la[0, 0, 0] = 0.0
  for j in range(1, t + 1):
    col = np.full((j + 1, q, s, q, s), -np.inf)           # rows −1..j−1
    col[j] = push[j - 1]
    prev = lg[:j, j - 1]                                  # rows −1..j−2
    col[:j] = _lse(prev[..., None, None] + repl[j - 1], (3, 4))
    if j >= 2:
      # γ′[k][t,y,r] = ⊕_{s,z} γ[k→j−1][t,y,s,z] ⊗ pop[s,z,r], k = 0..j−2.
      m = _lse(lg[1:j, j - 1][..., None] + pop[j - 1], (3, 4))  # k t y r
      # P[i] = ⊕_{k>i,t} γ[i→k][q,x,t,y] ⊗ γ′[k][t,y,r], rows i = −1..j−3.
      left = lg[:j - 1, :j - 1]                           # i+1, k, q x t y
      terms = left[..., None] + m[None, :, None, None]    # i k q x t y r
      pp = np.swapaxes(_lse(terms, (1, 4)), -1, -2)       # i q x r y
      col[:j - 1] = np.logaddexp(col[:j - 1], pp)
    lg[:j + 1, j] = col
    la[j + 1] = _lse(la[:j + 1, :, :, None, None] + col, (0, 1, 2))
  return la[1:]
