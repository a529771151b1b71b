#!/usr/bin/env bash
# The expensive cells of the reproduction on one GPU, as one prepared call.
#
# Runs `python -m nsrnn_jax.reproduce` for each task given (default: the NS-RNN
# on padded reversal and the hardest CFL, whose Q=3 stacks are the costliest on
# a CPU) with the restarts and learning rates of one task trained at once on a
# model axis. It stops at the budget, then packs the run directories
# (checkpoints included) and the new records into one archive per task, so the
# runs can be resumed on any other machine: unpack the archive in the
# repository root and rerun the same reproduce command.

set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: launch/reproduce_gpu.sh [options] [TASK ...]

Options:
  -b, --budget_minutes M   stop every task's runs at the first epoch boundary
                           after M minutes in all (default 8)
  -m, --models LIST        models to run (default ns)
  -l, --learning_rates L   learning rates (default 0.005)
  -r, --restarts R         restarts (default 5)
  -w, --workdir_root DIR   run directories go to DIR/<task> (default runs)
  -o, --out DIR            where the per-task archives go (default $OUT, else .)
      --resume ARCHIVE     unpack a previous archive before running (repeatable)
      --python PY          Python interpreter (default python3)
      --dry_run            print the commands instead of running them
  -h, --help               show this help

TASK defaults to: padded_reversal hardest_cfl
USAGE
}

budget=8
models=ns
learning_rates=0.005
restarts=5
workdir_root=runs
out="${OUT:-.}"
python=python3
dry_run=0
resume=()
tasks=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -b|--budget_minutes) budget="$2"; shift 2 ;;
    -m|--models) models="$2"; shift 2 ;;
    -l|--learning_rates) learning_rates="$2"; shift 2 ;;
    -r|--restarts) restarts="$2"; shift 2 ;;
    -w|--workdir_root) workdir_root="$2"; shift 2 ;;
    -o|--out) out="$2"; shift 2 ;;
    --resume) resume+=("$2"); shift 2 ;;
    --python) python="$2"; shift 2 ;;
    --dry_run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) tasks+=("$1"); shift ;;
  esac
done
if [[ ${#tasks[@]} -eq 0 ]]; then
  tasks=(padded_reversal hardest_cfl)
fi

run() {
  if [[ $dry_run -eq 1 ]]; then
    printf '%q ' "$@"; printf '\n'
  else
    "$@"
  fi
}

for archive in "${resume[@]+"${resume[@]}"}"; do
  run tar -xzf "$archive"
done
start=$(date +%s)
for task in "${tasks[@]}"; do
  spent=$(( ($(date +%s) - start) / 60 ))
  left=$(( budget - spent ))
  if [[ $left -le 0 ]]; then
    echo "budget spent before $task" >&2
    break
  fi
  # Exit code 3 = stopped at the budget (rerun to continue): not a failure.
  run "$python" -m nsrnn_jax.reproduce --task="$task" \
    --workdir="$workdir_root/$task" --models="$models" \
    --learning_rates="$learning_rates" --restarts="$restarts" \
    --execution=model_axis --budget_minutes="$left" || [[ $? -eq 3 ]]
  run tar -czf "$out/reproduce_$task.tar.gz" "$workdir_root/$task" \
    "results/$task"
done
