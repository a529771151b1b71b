"""Capacity study, unmarked reversal with K symbols, LSTM.

Run (one of the 10 random-LR runs of the protocol):

  python -m nsrnn_jax.main --config=configs/capacity_unmarked_reversal_lstm.py --workdir=runs/capacity_unmarked_reversal_lstm

Alphabet size K (the paper: 2, 40, 80, 120, 160, 200): the task is
unmarked_reversal_k<K>, e.g. --config.task=unmarked_reversal_k200; the default is K = 40.

Protocol (DuSell & Chiang 2023; rns-vrns-reference.md §4.3): LR drawn
log-uniformly from [5e-4, 1e-2] per run (--config.learning_rate), 10 runs,
the best by validation CE difference is reported; everything else as in
configs/default.py. The authors also append and predict EOS, which this
config does not (without EOS the CE difference can be slightly negative).

Expected: not yet measured.
"""

from configs import default


def get_config():
  """Returns the unmarked_reversal_k40 x lstm configuration."""
  config = default.get_config()
  config.task = "unmarked_reversal_k40"
  config.model = "lstm"
  config.learning_rate = 0.005  # one draw; see the protocol above
  # Baselines compile in seconds and step in milliseconds: padding to
  # length buckets (exact masking) saves ~4x compile time for <10% more
  # step time (benchmarks/train_step.py --compile_study).
  config.compile_strategy = "bucket"
  return config
