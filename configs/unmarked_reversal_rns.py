"""Unmarked reversal, RNS-RNN (DuSell & Chiang 2022, with the 2023 bottom fix).

Run (one restart; vary the seeds for more):

  python -m nsrnn_jax.main --config=configs/unmarked_reversal_rns.py --workdir=runs/unmarked_reversal_rns

(Q, S) = (2, 3) as in the ICLR 2022 CFL experiments (rns-vrns-reference.md
§4.2); unnormalised actions and a state reading (the NS+S+U variant); the
bottom-symbol fix of ICLR 2023 (set --config.stack_bottom=frozen for the ICLR
2022 behaviour). EOS is appended and predicted, and the per-length test bound
has no ln N_L term, as in both later tags (rns-vrns-reference.md §4.1;
--config.predict_eos=False for the CoNLL 2020 protocol). Otherwise the protocol
of configs/default.py. Learning-rate grid {0.01, 0.005, 0.001, 0.0005} as in
ICLR 2022; no published selection, the default is 0.005.
"""

from configs import default


def get_config():
  """Returns the unmarked_reversal x rns configuration."""
  config = default.get_config()
  config.task = "unmarked_reversal"
  config.model = "rns"
  config.num_states = 2
  config.num_stack_symbols = 3
  config.stack_normalize = False
  config.stack_reading = "state"
  config.stack_bottom = "fixed"
  config.stack_window = 0
  config.predict_eos = True
  config.test_bound_includes_num_lengths = False
  config.learning_rate = 0.005  # grid: (0.01, 0.005, 0.001, 0.0005)
  return config
