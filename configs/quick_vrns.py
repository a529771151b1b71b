"""Quick start for the VRNS-RNN (Q-S-m = 2-3-3, learned bottom vector).

Short marked-reversal strings, as configs/quick.py, with the vector stack:

  python -m nsrnn_jax.main --config=configs/quick_vrns.py --workdir=/tmp/vrns_quick

Strings of length 9-21 (test 9-31), 100 training batches of 10, at most 20
epochs, 5 length buckets. Expected (one full run, default seeds, jax 0.10.2,
2 quiet CPU cores; benchmarks/results/vrns_quick_training.json): the
validation cross-entropy difference falls 0.433 -> 0.281 (epoch 4) -> 0.053
nats/symbol (best, epoch 17); test difference 0.018 on the training lengths
and 0.48 on the longer ones; ~0.2 s per epoch after a ~9 s first epoch
(compilation), under 20 s in all (the log-space vector stack it ran on
before took ~10 s per epoch).
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
