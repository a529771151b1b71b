"""Command line: train and evaluate one model with the paper's protocol.

  python -m nsrnn_jax.main --config=configs/quick.py --workdir=/tmp/quick
  python -m nsrnn_jax.main --config=configs/dyck_ns.py --workdir=runs/dyck_ns \
      --config.learning_rate=0.001 --config.data_seed=3
  python -m nsrnn_jax.main --config=configs/dyck_ns.py --workdir=runs/dyck_ns \
      --cpu_devices=2       # both cores of a 2-core CPU (NS-RNN: 1.3-2.1x)

Rerunning the same command on the same workdir resumes from the last
checkpoint. Compiled steps persist in --compilation_cache (default
~/.cache/nsrnn_jax/xla), so reruns and later runs of the same model start
fast. All logic lives in train.train_and_evaluate; this file only
parses flags (bad input: one line on stderr, exit 2; see cli.py).
"""

import jax
from absl import flags

from nsrnn_jax import cli
from nsrnn_jax import parallel
from nsrnn_jax import train

_CONFIG = cli.define_config_file(
    "config", "Training configuration file (configs/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output/resume directory.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False,
    "Call jax.distributed.initialize() (multi-host TPU/GPU, SLURM).")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 1,
    "On the CPU backend, split each batch over this many devices (one per "
    "core to use; the batch size must be a multiple). 2 on 2 cores: NS-RNN "
    "steps 1.3-2.1x faster, LSTM/JM/Gref steps slightly slower.")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", cli.DEFAULT_COMPILATION_CACHE,
    "Directory of the persistent XLA compilation cache ('' = off): later "
    "runs, restarts and resumes of the same model skip compilation.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  """Backend set-up from the flags, then `train.train_and_evaluate`."""
  del argv
  if _CONFIG.value.get("task") == "corpus":
    # Corpus steps allocate hundreds of MiB of temporaries per call.
    cli.reexec_with_huge_pages()
  # Must precede any device use: the backend is fixed at first touch.
  parallel.use_cpu_devices(_CPU_DEVICES.value)
  cli.use_compilation_cache(_COMPILATION_CACHE.value)
  parallel.maybe_initialize_distributed(_DISTRIBUTED.value)
  train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  jax.config.config_with_absl()
  cli.run(main)
