"""The later papers' tasks x models, parameterised: `later.py:<task>,<model>`.

One file for the (task, model) pairs of DuSell & Chiang (ICLR 2023)'s
non-context-free and capacity experiments (rns-vrns-reference.md §4.3) and
of DuSell & Chiang (ICLR 2022)'s context-free study (§4.2):

  python -m nsrnn_jax.main --config=configs/later.py:marked_copy,vrns-2-1-3 \
      --workdir=runs/marked_copy_vrns-2-1-3
  python -m nsrnn_jax.main --config=configs/later.py:dyck_k40,rns-2-3 \
      --workdir=runs/capacity_dyck_k40_rns-2-3 --config.learning_rate=0.002
  python -m nsrnn_jax.main --config=configs/later.py:dyck,ns+s+u-2-3 \
      --workdir=runs/iclr2022_dyck_ns+s+u-2-3

<task> is one of the seven non-context-free tasks (`tasks_ncf.NCF_TASKS`:
count_3, marked_copy, unmarked_copy, unmarked_copy_different_alphabets,
marked_reverse_and_copy, unmarked_reverse_and_copy, count_and_copy), or a
capacity task `marked_reversal_k<K>`, `unmarked_reversal_k<K>`, `dyck_k<K>`
with K symbols / bracket types (the paper: K in 2, 40, 80, 120, 160, 200;
reversal mean length 60, Dyck with each bracket rule split K ways; see
`tasks_ncf`). Any other name `languages.get` accepts (e.g.
`marked_copy_k3`) works too, among them the CoNLL 2020 tasks that the ICLR
2022 study reruns: marked_reversal, unmarked_reversal, padded_reversal,
dyck, hardest_cfl.

<model> (sizes are Q-S-m as in the paper):

  lstm                  the LSTM baseline
  jm-<m>                Joulin-Mikolov stack of width m (the paper: jm-3 for
                        capacity, jm-10 for the non-CF tasks)
  jm-<m>.<m>[.<m>...]   K Joulin-Mikolov stacks of width m side by side, each
                        with its own actions (the paper's jm-3.3.3)
  jm-hidden             Joulin-Mikolov stack that pushes the controller's
                        hidden state (width = hidden_size, d = 20 by default;
                        the paper's non-CF tasks)
  rns-<Q>-<S>           RNS-RNN (unnormalised, state reading, bottom fix):
                        the paper's rns-1-3, rns-2-3 (capacity), rns-3-3
                        (non-CF)
  vrns-<Q>-<S>-<m>      VRNS-RNN with a learned bottom vector: the paper's
                        vrns-1-1-3, vrns-2-1-3, vrns-2-3-3

and the ICLR 2022 context-free study's (§4.2; the CoNLL 2020 bottom, kept
by that paper: ⊥ is never replaced or uncovered):

  gref-<m>              Grefenstette (stratification) stack of width m
  ns-<Q>-<S>            NS-RNN: normalised actions, top-symbol reading
  ns+s-<Q>-<S>          normalised actions, (state, top) reading
  ns+u-<Q>-<S>          unnormalised actions, top-symbol reading
  ns+s+u-<Q>-<S>        unnormalised actions, (state, top) reading (the
                        RNS-RNN of that paper)

(the paper: (Q, S) = (2, 3) on marked and unmarked reversal and Dyck, (3, 3)
on padded reversal and the hardest CFL; JM and Gref with m in 2, 20, 40).

Protocol (rns-vrns-reference.md §4.1-§4.3): lengths 40-80 for training and
validation, 40-100 for the test (100 strings per length), batch 10, Adam,
clip 5, plateau decay x0.9 (patience 5), early stopping (patience 10), at
most 200 epochs, d = 20 -- all configs/default.py values. The learning rate
is drawn per run log-uniformly from [5e-4, 1e-2], 10 runs per (task,
model), and the best run by validation CE difference is reported:
`python -m nsrnn_jax.later_protocol --task=<task> --models=<model>,...
--workdir=<dir>` runs exactly that (resumable, with records and the
summary table); with `--protocol=iclr2022` it runs the ICLR 2022 grid
instead (learning rates 0.01, 0.005, 0.001, 0.0005 x 5 runs each, the
best single run reported). The default here, 0.005, is one draw-like value for a
single run: set --config.learning_rate. EOS is appended and
predicted and the per-length test bound has no ln N_L term, as in the
authors' later experiments (§4.1). One difference from the authors, kept on
purpose: the run-consistent bottom vector (the authors' code
broadcasts v_⊥, §3.3: --config.broadcast_bottom_vector=True reproduces it).

Cost: the (V)RNS stacks are O(n^3) per string. Measured on 2 CPU cores
(AMD EPYC, nothing else running): the first epoch of marked_reversal,
vrns-2-3-3 (1000 batches of lengths 40-80, compilation of each length
included, then validation) took 120 s; the log-space vector stack it ran
on before took ~2.7 s per batch at n = 80 where the share sweep takes
~0.03 s (benchmarks/vrns_stack.py). A run of up to 200 epochs still takes
hours on a CPU.
LSTM, JM and Gref pad to length buckets.

Expected: not yet measured (the paper's figures are plots of the best run).
A bad argument is a one-line ValueError listing the valid forms.
"""

import re

from configs import default

# The models the paper runs on each kind of task (rns-vrns-reference.md
# §4.3): the non-context-free tasks, and the capacity study.
NON_CF_MODELS = ("lstm", "jm-10", "jm-3.3.3", "jm-hidden", "rns-3-3")
CAPACITY_MODELS = ("lstm", "jm-3", "rns-1-3", "rns-2-3", "vrns-1-1-3",
                   "vrns-2-1-3", "vrns-2-3-3")
PAPER_MODELS = tuple(dict.fromkeys(NON_CF_MODELS + CAPACITY_MODELS))
# DuSell & Chiang (ICLR 2022)'s context-free study (rns-vrns-reference.md
# §4.2): its five tasks, the NS-RNN variants' (Q, S) on each, the baselines.
ICLR2022_TASKS = ("marked_reversal", "unmarked_reversal", "padded_reversal",
                  "dyck", "hardest_cfl")
ICLR2022_SIZES = {"marked_reversal": (2, 3), "unmarked_reversal": (2, 3),
                  "dyck": (2, 3), "padded_reversal": (3, 3),
                  "hardest_cfl": (3, 3)}
ICLR2022_VARIANTS = ("ns", "ns+s", "ns+u", "ns+s+u")
ICLR2022_BASELINES = ("lstm", "jm-2", "jm-20", "jm-40", "gref-2", "gref-20",
                      "gref-40")
MODEL_FORMS = ("lstm, jm-<m>, jm-<m>.<m>[.<m>...] (equal widths), "
               "jm-hidden, rns-<Q>-<S>, vrns-<Q>-<S>-<m>, gref-<m>, "
               "ns-<Q>-<S>, ns+s-<Q>-<S>, ns+u-<Q>-<S>, ns+s+u-<Q>-<S>")
# Sizes >= 1 without leading zeros (a size has one spelling: record
# directories are named after it).
_MODEL = re.compile(r"^(?:(?P<lstm>lstm)|jm-(?P<jm>[1-9]\d*(?:\.[1-9]\d*)*)|"
                    r"(?P<jm_hidden>jm-hidden)|"
                    r"rns-(?P<rq>[1-9]\d*)-(?P<rs>[1-9]\d*)|"
                    r"vrns-(?P<vq>[1-9]\d*)-(?P<vs>[1-9]\d*)-(?P<vm>[1-9]\d*)|"
                    r"gref-(?P<gref>[1-9]\d*)|"
                    r"(?P<ns>ns(?:\+s)?(?:\+u)?)-(?P<nq>[1-9]\d*)-(?P<ns_s>[1-9]\d*))$")
USAGE = ("configs/later.py needs ':<task>,<model>', e.g. "
         "configs/later.py:marked_copy,vrns-2-1-3")


def _tasks_text():
  from nsrnn_jax import tasks_ncf  # pylint: disable=g-import-not-at-top
  return (f"{', '.join(tasks_ncf.NCF_TASKS)}, "
          f"{', '.join(f + '_k<K>' for f in tasks_ncf.CAPACITY_FAMILIES)}")


def parse(arg):
  """'<task>,<model>' -> (task, model fields dict); one-line ValueError."""
  from nsrnn_jax import languages  # pylint: disable=g-import-not-at-top
  if not arg or arg.count(",") != 1:
    raise ValueError(f"{USAGE} (got {arg!r})")
  task, spec = (p.strip() for p in arg.split(","))
  try:
    languages.get(task)
  except ValueError as e:
    from nsrnn_jax import tasks_ncf  # pylint: disable=g-import-not-at-top
    reason = str(e) if tasks_ncf.is_task(task) else f"unknown task {task!r}"
    raise ValueError(f"configs/later.py: {reason}; valid tasks: "
                     f"{_tasks_text()} (K >= 2)") from None
  match = _MODEL.match(spec)
  sizes = [int(v) for g in (match.groupdict().values() if match else ())
           if g and g[0].isdigit() for v in g.split(".")]
  widths = set(match["jm"].split(".")) if match and match["jm"] else set()
  if not match or any(v < 1 for v in sizes) or len(widths) > 1:
    raise ValueError(f"configs/later.py: unknown model {spec!r}; valid: "
                     f"{MODEL_FORMS} (sizes >= 1; the paper's: "
                     f"{', '.join(PAPER_MODELS)})")
  g = match.groupdict()
  if g["lstm"]:
    fields = {"model": "lstm"}
  elif g["jm"]:
    widths = g["jm"].split(".")
    fields = {"model": "jm", "stack_embedding_size": int(widths[0]),
              "jm_num_stacks": len(widths)}
  elif g["jm_hidden"]:
    # Width d: set after the defaults, from the config's hidden size.
    fields = {"model": "jm", "jm_push_hidden_state": True}
  elif g["rq"]:
    fields = {"model": "rns", "num_states": int(g["rq"]),
              "num_stack_symbols": int(g["rs"]), "stack_normalize": False,
              "stack_reading": "state", "stack_bottom": "fixed",
              "stack_window": 0}
  elif g["gref"]:
    fields = {"model": "gref", "stack_embedding_size": int(g["gref"])}
  elif g["ns"]:
    # The ICLR 2022 variants: +S reads (state, top), +U leaves the action
    # weights unnormalised; that paper keeps the CoNLL 2020 (frozen) bottom.
    fields = {"model": "rns", "num_states": int(g["nq"]),
              "num_stack_symbols": int(g["ns_s"]),
              "stack_normalize": "+u" not in g["ns"],
              "stack_reading": "state" if "+s" in g["ns"] else "symbol",
              "stack_bottom": "frozen", "stack_window": 0}
  else:
    fields = {"model": "vrns", "num_states": int(g["vq"]),
              "num_stack_symbols": int(g["vs"]),
              "stack_vector_size": int(g["vm"]),
              "stack_bottom_vector": "learned",
              "broadcast_bottom_vector": False}
  return task, fields


def iclr2022_models(task):
  """The ICLR 2022 study's models for one of its tasks; one-line ValueError.

  The baselines, then the four NS-RNN variants at the task's (Q, S).
  """
  if task not in ICLR2022_SIZES:
    raise ValueError(f"the ICLR 2022 study runs no models on {task!r}: its "
                     f"tasks are {', '.join(ICLR2022_TASKS)}")
  q, s = ICLR2022_SIZES[task]
  return ICLR2022_BASELINES + tuple(f"{v}-{q}-{s}" for v in ICLR2022_VARIANTS)


def paper_models(task):
  """The paper's models for `task` (a task name); one-line ValueError."""
  from nsrnn_jax import tasks_ncf  # pylint: disable=g-import-not-at-top
  if task in tasks_ncf.NCF_TASKS:
    return NON_CF_MODELS
  family, _, size = task.rpartition("_k")
  if family in tasks_ncf.CAPACITY_FAMILIES and size.isdigit():
    return CAPACITY_MODELS
  raise ValueError(
      f"the paper runs no models on {task!r}: its tasks are "
      f"{', '.join(tasks_ncf.NCF_TASKS)} (models "
      f"{', '.join(NON_CF_MODELS)}) and "
      f"{', '.join(f + '_k<K>' for f in tasks_ncf.CAPACITY_FAMILIES)} "
      f"(models {', '.join(CAPACITY_MODELS)})")


def get_config(arg=None):
  """The configuration of `<task>,<model>` (see the module docstring)."""
  task, fields = parse(arg)
  config = default.get_config()
  config.task = task
  for name, value in fields.items():
    config[name] = value
  if config.jm_push_hidden_state:
    # One stack as wide as the hidden state (what it pushes), derived from
    # it: a --config.hidden_size override resizes the stack with it. (A
    # derived reference, not the same one: setting the width must not set
    # the hidden size; a width other than it then fails validation.)
    config.stack_embedding_size = config.get_ref("hidden_size") * 1
  # Both later tags predict EOS; their test bound has no ln N_L (§4.1).
  config.predict_eos = True
  config.test_bound_includes_num_lengths = False
  # One draw of the log-uniform [5e-4, 1e-2] protocol; set per run.
  config.learning_rate = 0.005
  if config.model in ("lstm", "jm", "gref"):
    # Baselines compile in seconds and step in milliseconds: padding to
    # length buckets (exact masking) saves ~4x compile time for <10% more
    # step time (benchmarks/train_step.py --compile_study).
    config.compile_strategy = "bucket"
  return config
