"""nsrnn_jax: the Nondeterministic Stack RNN of DuSell & Chiang (CoNLL 2020) in JAX/Flax.

Modules (one concern each):
  pcfg          probabilistic context-free grammars: normal-form transforms,
                exact length-conditioned sampling, exact inside probabilities.
  languages     the paper's five formal-language tasks (public API).
  data          dataset splits of the paper, on-disk format and CLI.
  ns_stack      Lang's algorithm for the nondeterministic stack: pure array DP.
  models        Flax language models: LSTM, JM, Gref and NS-RNN.
  train         train_and_evaluate(config, workdir): the paper's protocol.
  evaluate      re-evaluation of a trained workdir; scoring API.
"""

__version__ = "0.1.0"
