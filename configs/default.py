"""Default configuration: every field of the training protocol, commented.

The defaults are the paper's protocol (DuSell & Chiang 2020, section 5.5) and
the authors' code (reference-behaviour.md sections 4-6): NS-RNN with Q = S = 2
on marked reversal. Task x model configs import this file and override a few
fields. Run:

  python -m nsrnn_jax.main --config=configs/default.py --workdir=/tmp/nsrnn

Any field can be overridden on the command line, e.g.
`--config.learning_rate=0.001 --config.task=dyck`.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the default (paper-protocol) configuration."""
  config = ml_collections.ConfigDict()

  # --- Task and model -------------------------------------------------------
  # Formal language: marked_reversal, unmarked_reversal, padded_reversal, dyck
  # or hardest_cfl (languages.TASKS), a later paper's task (tasks_ncf,
  # languages.get), or "corpus" (a text corpus: corpus_dir).
  config.task = "marked_reversal"
  # Language model: lstm (no stack), jm (Joulin-Mikolov), gref (Grefenstette),
  # ns (nondeterministic stack RNN), rns (renormalising NS-RNN + variants) or
  # vrns (vector NS stack, ICLR 2023).
  config.model = "ns"
  # Hidden units of the LSTM controller (paper: 20 for every model).
  config.hidden_size = 20
  # NS-RNN: number of PDA states Q (state 0 is the start state).
  config.num_states = 2
  # NS-RNN: number of stack symbols S, including the bottom symbol 0.
  config.num_stack_symbols = 2
  # NS-RNN: action-layer init, "uniform" U[-0.1, 0.1] (authors' code) or "xavier" (paper's text).
  config.ns_action_init = "uniform"
  # NS/RNS/VRNS stack's dynamic program: "shares" (exact unless a run ~80 nats
  # behind comes back: rns_stack), "log" (exact for any finite log-weights;
  # stack 4-23x slower, VRNS ~100x) or, NS only, "scaled" (float32 can flush).
  config.stack_table = "shares"
  # NS/RNS/VRNS on "shares": each epoch also records the validation strings'
  # (corpus: stream rows') smallest product margin (valid_stack_margin, nats)
  # and the fraction proven exact (above ~-40 in float32:
  # rns_stack.share_margin), the final results and test table the best
  # parameters', with the unproven test strings scored again in float64;
  # ~1 stack forward more per string.
  config.valid_stack_margin = False
  # NS-RNN: strings the stack runs at once (0 = automatic: on CPU chunks
  # whose table fits 10 MiB, on accelerators all; else the largest divisor
  # of the device's batch not above it).
  config.stack_batch_chunk = 0
  # JM/Gref: stack embedding size m (grid value; the paper does not publish
  # the selected value, 20 is the middle of the grid).
  config.stack_embedding_size = 20
  # JM/Gref: the grid searched for m in the paper (documentation; the grid
  # search itself is a launcher over --config.stack_embedding_size).
  config.stack_embedding_size_grid = (2, 20, 40)
  # JM: stacks side by side, each of width m with its own actions (ICLR 2023's
  # JM-3.3.3 is 3 stacks of m = 3; the reading is their tops concatenated).
  config.jm_num_stacks = 1
  # JM: push the controller's hidden state itself instead of a learned
  # sigmoid projection (needs jm_num_stacks * m == hidden_size).
  config.jm_push_hidden_state = False
  # Stack variant of model "rns" (the CoNLL 2020 ns model is always
  # normalised, symbol reading, frozen bottom, unlimited: ns refuses a
  # window or truncation, vrns a frozen bottom, rather than ignore them).
  # rns-vrns-reference.md. Log-softmax the action weights per (q, x) row
  # (NS, NS+S) instead of using them unnormalised (RNS: NS+U, NS+S+U).
  config.stack_normalize = False
  # Reading fed to the controller: "state" (Q*S, over (state, top); RNS) or
  # "symbol" (S, over the top symbol; CoNLL 2020).
  config.stack_reading = "state"
  # Bottom symbol: "fixed" (ICLR 2023 fix: the bottom can be replaced and
  # uncovered) or "frozen" (CoNLL 2020 / ICLR 2022 behaviour).
  config.stack_bottom = "fixed"
  # Memory-limited stack window D for 'rns' and 'vrns' (0 = unlimited; D >= 1
  # keeps gamma only within D of the diagonal, linear time in the length).
  config.stack_window = 0
  # Truncated BPTT chunk length in controller steps for a limited stack (0 =
  # no truncation); state crosses chunk boundaries, gradients do not (a
  # chunk's last update trains the action layer with the fixed bottom, as in
  # ICLR 2023, and gets no gradient with the frozen one, as in ICLR 2022).
  config.truncation_length = 0
  # VRNS: size m of the vector carried by each stack element.
  config.stack_vector_size = 3
  # VRNS: bottom vector v_⊥: learned (sigmoid of a parameter), one or zero.
  config.stack_bottom_vector = "learned"
  # VRNS: reproduce the authors' code, which puts v_⊥ in every (state,
  # symbol) of the initial reading (phantom start configurations); False is
  # the run-consistent bottom (rns-vrns-reference.md §3.3).
  config.broadcast_bottom_vector = False

  # --- Optimiser --------------------------------------------------------------
  # Initial Adam learning rate (grid value; see learning_rate_grid).
  config.learning_rate = 0.005
  # The grid searched for the learning rate in the paper.
  config.learning_rate_grid = (0.01, 0.005, 0.001, 0.0005)
  # Adam beta1 / beta2 / epsilon (PyTorch defaults, used by the authors).
  config.adam_b1 = 0.9
  config.adam_b2 = 0.999
  config.adam_eps = 1e-8
  # Global L2 norm for gradient clipping (of the sum-over-positions loss).
  config.clip_norm = 5.0
  # Optimizer after clipping: "adam" (the paper) or "sgd" (PTB, ICLR 2022/23).
  config.optimizer = "adam"

  # --- Corpus language modelling (task "corpus"; corpus_train.py) -----------
  # Directory of train/valid/test.txt (or Mikolov's ptb.*.txt), one sentence
  # per line; "" unless task is "corpus".
  config.corpus_dir = ""
  # Tokens per truncated-BPTT chunk T (one optimizer step per chunk; PTB 35).
  config.bptt_length = 35
  # Rows of the validation/test stream (0 = batch_size).
  config.eval_batch_size = 0
  # Every parameter ~ U[-s, s] (PTB 0.05); 0 = the models' own initialisers.
  config.init_scale = 0.0
  # lstm/rns/vrns: read the input by row lookup, not a one-hot product (same
  # values; LSTM steps 3.2-5.5x faster at PTB's 10k words; GPU gradients not
  # bitwise reproducible: a scatter-add).
  config.input_lookup = False

  # --- Data ------------------------------------------------------------------
  # Strings per training / validation batch (every batch has one length).
  config.batch_size = 10
  # Number of training batches (built once; only their order is shuffled).
  config.num_train_batches = 1000
  # Number of validation batches (1000 strings for batch size 10).
  config.num_valid_batches = 100
  # Interval of string lengths for training and validation (inclusive).
  config.train_min_length = 40
  config.train_max_length = 80
  # Interval of string lengths of the test set (inclusive).
  config.test_min_length = 40
  config.test_max_length = 100
  # Test strings per valid length (one test batch per length).
  config.test_strings_per_length = 100
  # Whether the per-length test lower bound includes ln N_L,test (the number
  # of valid test lengths). True reproduces the paper's figures; False is the
  # conll2020 code's test.py (curves shift up by ln(N_L,test)/length).
  # Reference-behaviour.md section 6.
  config.test_bound_includes_num_lengths = True
  # Append EOS (output index V) to every string and predict it from h_n, as
  # the ICLR 2022/2023 experiments do (rns-vrns-reference.md §4.1): n + 1
  # targets, perplexities and bounds over |w| + 1 symbols. False = CoNLL 2020.
  config.predict_eos = False

  # --- Schedule (PyTorch ReduceLROnPlateau + early stopping) ----------------
  # Maximum number of epochs.
  config.max_epochs = 200
  # Learning-rate multiplier applied on a plateau of validation perplexity.
  config.lr_decay_factor = 0.9
  # Epochs without improvement tolerated; the LR decays on the next one.
  config.lr_decay_patience = 5
  # Relative improvement threshold of the plateau detector (mode "rel").
  config.lr_decay_threshold = 1e-4
  # Early stopping: stop on the (patience + 1)-th epoch without a strict
  # improvement of validation perplexity.
  config.early_stopping_patience = 10

  # --- Seeds ----------------------------------------------------------------
  # Seed of the training and validation data (each restart has its own).
  config.data_seed = 1
  # Seed of the parameter initialisation.
  config.param_seed = 1
  # Seed of the per-epoch shuffle of the batch order.
  config.shuffle_seed = 1
  # Seed of the test set (0 in the paper: identical for every run).
  config.test_seed = 0

  # --- Grid (python -m nsrnn_jax.grid; a single run ignores these) ----------
  # Restarts per learning rate of learning_rate_grid; restart r adds r to
  # param_seed and shuffle_seed (and data_seed: grid_vary_data_seed).
  config.num_restarts = 5
  # Train only these restarts, e.g. (1, 2) to split a grid over machines;
  # () trains all num_restarts.
  config.grid_restart_ids = ()
  # Each restart draws its own training/validation data (the paper's
  # protocol); False shares restart 0's.
  config.grid_vary_data_seed = True
  # Devices on the mesh's model axis (the K models sharded over them).
  config.grid_model_parallel = 1

  # --- Numerics and compilation ---------------------------------------------
  # Parameter / activation dtype: float32 (paper) or float64 (needs x64).
  config.dtype = "float32"
  # Matmul precision of every contraction: "highest" (full float32), "high", "default".
  config.matmul_precision = "highest"
  # lax.scan unroll factor of the time loop (same values; not for vrns or a
  # windowed rns stack); 0 = automatic: 8 for lstm and jm on GPUs, else 1.
  config.scan_unroll = 0
  # How distinct string lengths are compiled: "per_length" (one jit cache
  # entry per length, no padding) or "bucket" (pad to the next bucket
  # boundary with an exact mask). per_length is faster overall for the
  # NS-RNN; the baselines' configs use bucket. See README "Compilation
  # across lengths".
  config.compile_strategy = "per_length"
  # Bucket boundaries (upper lengths) used when compile_strategy="bucket".
  config.length_buckets = (50, 60, 70, 80, 90, 100)

  # --- Checkpoints and logging ----------------------------------------------
  # Save the full training state every this many epochs (1 = every epoch).
  config.checkpoint_every_epochs = 1
  # Number of recent checkpoints kept (>= 2 so a good one always survives).
  config.checkpoints_to_keep = 2
  # Stop this invocation after this many epochs (0 = no limit); rerunning on
  # the same workdir resumes. Used to test interruption.
  config.stop_after_epochs = 0
  # Show a tqdm progress bar (process 0 only).
  config.progress_bar = True
  # Evaluate on the test set at the end of training.
  config.run_test = True
  return config
