"""Penn Treebank language modelling: the memory-limited RNS-RNN (ICLR 2022).

  python -m nsrnn_jax.main --config=configs/ptb_rns.py \
      --config.corpus_dir=data/ptb --workdir=runs/ptb_rns

configs/ptb_lstm.py's protocol with the renormalising stack, Q = 2 states
and S = 3 stack symbols (one of ICLR 2022's PTB settings; ICLR 2023 adds
1-29, 2-13, 4-5: --config.num_states / --config.num_stack_symbols), the
window D = 35 = the chunk length, and the ICLR 2023 bottom fix (a chunk's
last update trained by the next chunk; --config.stack_bottom=frozen for
ICLR 2022's). Not run here (see ptb_lstm.py).
"""

from configs import ptb_lstm


def get_config():
  """Returns the PTB RNS-RNN configuration."""
  config = ptb_lstm.get_config()
  config.model = "rns"  # default.py's variant: RNS (NS+S+U), bottom fix
  config.num_states = 2
  config.num_stack_symbols = 3
  config.stack_window = 35
  return config
