"""Capacity study, marked reversal with K symbols, VRNS-RNN 2-3-3 (learned bottom).

Run (one of the 10 random-LR runs of the protocol):

  python -m nsrnn_jax.main --config=configs/capacity_marked_reversal_vrns.py --workdir=runs/capacity_marked_reversal_vrns

Alphabet size K (the paper: 2, 40, 80, 120, 160, 200): the task is
marked_reversal_k<K>, e.g. --config.task=marked_reversal_k200; the default is K = 40.
The paper's other VRNS sizes (Q-S-m): 1-1-3 with --config.num_states=1
--config.num_stack_symbols=1, and 2-1-3 with --config.num_stack_symbols=1.

Protocol (DuSell & Chiang 2023; rns-vrns-reference.md §4.3): LR drawn
log-uniformly from [5e-4, 1e-2] per run (--config.learning_rate), 10 runs,
the best by validation CE difference is reported; everything else as in
configs/default.py. The authors also append and predict EOS, which this
config does not. The authors' code uses the broadcast bottom vector
(--config.broadcast_bottom_vector=True reproduces it); the default here is
the run-consistent bottom.

Cost: the vector stack is O(n^3) per string; at lengths 40-80 an epoch of
1000 batches takes hours on a CPU (benchmarks/vrns_stack.py), so run it on
an accelerator.

Expected: not yet measured.
"""

from configs import default


def get_config():
  """Returns the marked_reversal_k40 x vrns configuration."""
  config = default.get_config()
  config.task = "marked_reversal_k40"
  config.model = "vrns"
  config.num_states = 2
  config.num_stack_symbols = 3
  config.stack_vector_size = 3
  config.stack_bottom_vector = "learned"
  config.broadcast_bottom_vector = False
  config.learning_rate = 0.005  # one draw; see the protocol above
  return config
