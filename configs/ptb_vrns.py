"""Penn Treebank language modelling: the memory-limited VRNS-RNN (ICLR 2023).

  python -m nsrnn_jax.main --config=configs/ptb_vrns.py \
      --config.corpus_dir=data/ptb --workdir=runs/ptb_vrns

configs/ptb_lstm.py's protocol with the vector stack, Q = 1 state, S = 5
stack symbols and vectors of m = 20 (ICLR 2023's VRNS 1-5-20; also 1-1-256,
1-1-32, 2-3-10, 3-3-5), a learned bottom vector and the window D = 35. Not
run here (see ptb_lstm.py).
"""

from configs import ptb_lstm


def get_config():
  """Returns the PTB VRNS-RNN configuration."""
  config = ptb_lstm.get_config()
  config.model = "vrns"
  config.num_states = 1
  config.num_stack_symbols = 5
  config.stack_vector_size = 20
  config.stack_bottom_vector = "learned"
  config.stack_window = 35
  return config
