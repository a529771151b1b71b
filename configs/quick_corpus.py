"""Quick start for corpus language modelling: a windowed RNS-RNN on a stream.

First write a small corpus (Dyck-2 sentences, one per line), then train:

  python -m nsrnn_jax.corpus --task=dyck --out=/tmp/dyck_corpus
  python -m nsrnn_jax.main --config=configs/quick_corpus.py \
      --workdir=/tmp/corpus_quick

The PTB protocol (corpus_train.py, rns-vrns-reference.md §4.4) at toy
size: the three files as token streams with <eos> after each sentence, 8
contiguous rows, chunks of 20 tokens with the state carried between them,
SGD with LR ÷ 1.5 after each epoch without improvement and early stopping
after 2. --config.corpus_dir=DIR takes any directory of train/valid/test.txt
(or ptb.*.txt); --config.model=vrns swaps the model, and
--config.model=lstm --config.stack_window=0 the LSTM (which has no stack
window to set). Measured: see README ("Corpus language modelling").
"""

from configs import ptb_lstm


def get_config():
  """Returns the quick corpus configuration (ptb_lstm.py's protocol, small)."""
  config = ptb_lstm.get_config()
  config.corpus_dir = "/tmp/dyck_corpus"
  config.model = "rns"
  config.hidden_size = 20
  config.num_states = 2
  config.num_stack_symbols = 3
  config.stack_window = 10
  config.batch_size = 8
  config.eval_batch_size = 0
  config.bptt_length = 20
  config.learning_rate = 1.0
  config.clip_norm = 1.0
  config.init_scale = 0.0  # the models' own initialisers at this size
  config.input_lookup = False  # 5 tokens: nothing to gain
  config.max_epochs = 30
  return config
