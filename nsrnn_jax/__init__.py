"""nsrnn_jax: the Nondeterministic Stack RNN of DuSell & Chiang (CoNLL 2020) in JAX/Flax.

The main modules (one concern each; docs/architecture.md lists them all):
  pcfg, languages   probabilistic context-free grammars (exact sampling and
                    inside probabilities) and the tasks: the paper's five,
                    and the later papers' (tasks_ncf), by `languages.get`.
  data, corpus      dataset splits of the paper and their files; text corpora.
  ns_stack          Lang's algorithm for the nondeterministic stack: pure
                    array DP, custom VJP, Viterbi (the CoNLL 2020 reference).
  rns_stack         the share table: the NS-RNN's default stack, the RNS-RNN's;
                    limited_stack, vrns_stack, limited_vrns its later variants.
  models            Flax language models: LSTM, JM, Gref, NS-RNN, RNS-RNN
                    (vrns_model: the VRNS-RNN).
  train, loop       train_and_evaluate(config, workdir): the paper's protocol.
  evaluate          re-evaluation of a trained workdir; scoring API.
  inspection        what a trained stack does on a string.
  reproduce, later_protocol   the papers' grids from one resumable command.
"""

__version__ = "0.1.0"
