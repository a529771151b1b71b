"""Unmarked reversal, LSTM: the paper's setting (section 5.5).

Run (one restart; vary the seeds for the 5 restarts):

  python -m nsrnn_jax.main --config=configs/unmarked_reversal_lstm.py --workdir=runs/unmarked_reversal_lstm

Grid (paper): --config.learning_rate in learning_rate_grid; the selected
value is not published, the default is 0.005.

Expected (paper's figure data):
  validation curve: not in the paper's source (figure missing);
  test CE difference, mean over lengths 40-80 / 81-100: 0.1741 / 0.2673.
"""

from configs import default


def get_config():
  """Returns the unmarked_reversal x lstm configuration."""
  config = default.get_config()
  config.task = "unmarked_reversal"
  config.model = "lstm"
  config.learning_rate = 0.005  # grid: (0.01, 0.005, 0.001, 0.0005)
  # Baselines compile in seconds and step in milliseconds: padding to
  # length buckets (exact masking) saves ~4x compile time for <10% more
  # step time (benchmarks/train_step.py --compile_study).
  config.compile_strategy = "bucket"
  return config
