"""Quick start: RNS-RNN (Q = 2, S = 3, bottom fix) on short strings.

  python -m nsrnn_jax.main --config=configs/quick_rns.py --workdir=/tmp/rns_quick
  python -m nsrnn_jax.main --config=configs/quick_rns.py --config.task=dyck \
      --workdir=/tmp/rns_quick_dyck

The quick.py protocol (strings of length 9-21, 300 training batches of 10,
at most 45 epochs, 5 length buckets) with model "rns". Add
--config.stack_window=8 --config.truncation_length=8 for the memory-limited
stack with truncated BPTT. Measured on 2 shared CPU cores: see
docs/architecture.md ("Training check" under the rns_stack section).
"""

from configs import quick


def get_config():
  """Returns the quick-start RNS-RNN configuration."""
  config = quick.get_config()
  config.model = "rns"
  config.num_states = 2
  config.num_stack_symbols = 3
  config.stack_normalize = False
  config.stack_reading = "state"
  config.stack_bottom = "fixed"
  config.stack_window = 0
  config.truncation_length = 0
  return config
