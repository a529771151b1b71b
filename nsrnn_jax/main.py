"""Command line: train and evaluate one model with the paper's protocol.

  python -m nsrnn_jax.main --config=configs/quick.py --workdir=/tmp/quick
  python -m nsrnn_jax.main --config=configs/dyck_ns.py --workdir=runs/dyck_ns \
      --config.learning_rate=0.001 --config.data_seed=3

Rerunning the same command on the same workdir resumes from the last
checkpoint. All logic lives in train.train_and_evaluate; this file only
parses flags.
"""

import sys

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from nsrnn_jax import parallel
from nsrnn_jax import train

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Training configuration file (configs/*.py).",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output/resume directory.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False,
    "Call jax.distributed.initialize() (multi-host TPU/GPU, SLURM).")
flags.mark_flags_as_required(["config", "workdir"])


def _parse_flags(argv):
  """Parses flags; an override of an unknown config field is one line."""
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:
    # ml_collections raises these for --config.<name> with an unknown name;
    # the innermost message names the field (and may suggest a fix).
    message = e
    while isinstance(message, BaseException) and message.args:
      message = message.args[0]
    message = " ".join(str(message).split())
    print(f"error: unknown config field {message} (fields: "
          "configs/default.py)", file=sys.stderr)
    sys.exit(2)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Must precede any device use: the backend is fixed at first touch.
  parallel.maybe_initialize_distributed(_DISTRIBUTED.value)
  logging.info("JAX process %d / %d, devices: %s", jax.process_index(),
               jax.process_count(), jax.local_devices())
  config = _CONFIG.value
  try:
    train.validate_config(config)
  except ValueError as e:
    # One line, no traceback: the message names the offending field.
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  train.train_and_evaluate(config, _WORKDIR.value)


if __name__ == "__main__":
  jax.config.config_with_absl()
  app.run(main, flags_parser=_parse_flags)
