"""Dyck, RNS-RNN 2-3 (DuSell & Chiang 2022, with the 2023 bottom fix).

  python -m nsrnn_jax.main --config=configs/dyck_rns.py --workdir=runs/dyck_rns

(Q, S) = (2, 3) as in the ICLR 2022 CFL experiments (rns-vrns-reference.md
§4.2); the same fields as `configs/later.py:dyck,rns-2-3` (unnormalised
actions, state reading, bottom fix, EOS predicted, test bound without ln N_L;
see there), with ICLR 2022's learning-rate grid {0.01, 0.005, 0.001, 0.0005}
(no published selection; the default is 0.005). Expected: not yet measured
at the paper's sizes (configs/quick_rns.py trains in minutes).
"""

from configs import later


def get_config():
  """Returns the dyck x rns configuration."""
  config = later.get_config("dyck,rns-2-3")
  config.learning_rate = 0.005  # grid: (0.01, 0.005, 0.001, 0.0005)
  return config
