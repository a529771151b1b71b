"""Penn Treebank language modelling: the LSTM-256 baseline (ICLR 2022/2023).

Get Mikolov's PTB (ptb.train.txt, ptb.valid.txt, ptb.test.txt; 10k words,
<unk> already in place) into a directory, then:

  python -m nsrnn_jax.main --config=configs/ptb_lstm.py \
      --config.corpus_dir=data/ptb --workdir=runs/ptb_lstm

rns-vrns-reference.md §4.4: one stream, 32 contiguous rows, chunks of 35
tokens, one LSTM layer of 256 units, no dropout, every parameter
U[−0.05, 0.05], SGD with gradient clipping, LR ÷ 1.5 after each epoch
without improvement, stop after 2, at most 100 epochs. The authors draw
the LR from log-uniform[1, 100] and the clip threshold from
log-uniform[0.0112, 1.12], 10 samples per model, and keep the best
validation run; the values here are those ranges' geometric midpoints, and
nsrnn_jax.corpus_search runs the search:

  python -m nsrnn_jax.corpus_search --config=configs/ptb_lstm.py \
      --config.corpus_dir=data/ptb --workdir=runs/ptb_lstm_search --runs=10

Deviation: the input row of the LSTM's input matrix is looked up directly
(input_lookup; no separate embedding layer, which would be of width 4H).
Not run here (PTB is not in the repository; a CPU epoch is long).
"""

from configs import default


def get_config():
  """Returns the PTB LSTM configuration."""
  config = default.get_config()
  config.task = "corpus"
  config.corpus_dir = "data/ptb"
  config.model = "lstm"
  config.hidden_size = 256
  config.batch_size = 32
  config.eval_batch_size = 32
  config.bptt_length = 35
  config.optimizer = "sgd"
  config.learning_rate = 10.0
  config.clip_norm = 0.112
  config.init_scale = 0.05
  config.input_lookup = True  # 10k words: a lookup, not a one-hot product
  config.max_epochs = 100
  config.lr_decay_factor = 1 / 1.5
  config.lr_decay_patience = 0
  config.lr_decay_threshold = 0.0
  config.early_stopping_patience = 1
  return config
