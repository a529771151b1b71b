"""Quick start for the VRNS-RNN (Q-S-m = 2-3-3, learned bottom vector).

Short marked-reversal strings, as configs/quick.py, with the vector stack:

  python -m nsrnn_jax.main --config=configs/quick_vrns.py --workdir=/tmp/vrns_quick

Strings of length 9-21 (test 9-31), 100 training batches of 10, at most 20
epochs, 5 length buckets. Measured on 2 CPU cores shared with other jobs
(load ~14; default seeds, first 4 epochs): the training loss falls 13.55 ->
12.39 -> 11.79 -> 11.33 nats/string and the validation cross-entropy
difference 0.433 -> 0.367 -> 0.341 -> 0.281 nats/symbol; the first epoch
(compilation) took ~170 s, later ones ~40 s. A full run is not yet measured.
"""

from configs import default


def get_config():
  """Returns the VRNS quick-start configuration."""
  config = default.get_config()
  config.task = "marked_reversal"
  config.model = "vrns"
  config.num_states = 2
  config.num_stack_symbols = 3
  config.stack_vector_size = 3
  config.stack_bottom_vector = "learned"
  config.learning_rate = 0.005
  config.num_train_batches = 100
  config.num_valid_batches = 10
  config.train_min_length = 9
  config.train_max_length = 21
  config.test_min_length = 9
  config.test_max_length = 31
  config.test_strings_per_length = 10
  config.max_epochs = 20
  config.compile_strategy = "bucket"
  config.length_buckets = (13, 17, 21, 25, 31)
  return config
