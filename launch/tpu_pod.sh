#!/usr/bin/env bash
# Creates a Cloud TPU VM (pod slice), copies this repository to every worker,
# installs it there and runs training on all workers at once.
#
# Every TPU VM worker runs the same command with --distributed;
# jax.distributed.initialize() auto-detects the pod (coordinator, process id,
# process count) from the TPU metadata. Use a gs:// workdir (or another
# filesystem all workers share) so Orbax can write checkpoints from all hosts.

set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/tpu_pod.sh [options] STEP... -- [module flags...]

Steps (run in the order given; `all` = create copy install run):
  create    gcloud compute tpus tpu-vm create
  copy      tar this repository and scp it to every worker (--worker=all)
  install   pip install jax[tpu] and the package on every worker
  run       python -m MODULE --distributed [module flags] on every worker
  delete    delete the TPU VM
  all       create copy install run

Options:
      --name NAME             TPU VM name (default nsrnn-jax)
      --zone ZONE             zone (default us-central2-b)
      --accelerator_type T    e.g. v4-8, v4-32, v5litepod-16 (default v4-32)
      --version V             TPU VM software version (default tpu-ubuntu2204-base)
      --project P             GCP project (default: gcloud's configured one)
      --spot                  create a spot (preemptible) TPU VM
  -m, --module MODULE         module to run (default nsrnn_jax.main; or nsrnn_jax.grid)
      --remote_dir DIR        checkout location on the workers (default nsrnn_jax)
      --dry_run               print the commands instead of running them
  -h, --help                  show this help

Example:
  launch/tpu_pod.sh --accelerator_type v4-32 all -- \
      --config=configs/hardest_cfl_ns.py --workdir=gs://my-bucket/runs/hardest_ns
EOF
}

name="nsrnn-jax"
zone="us-central2-b"
accelerator_type="v4-32"
version="tpu-ubuntu2204-base"
project=""
spot=0
module="nsrnn_jax.main"
remote_dir="nsrnn_jax"
dry_run=0
steps=()
module_args=()

die() {
  echo "tpu_pod.sh: $*" >&2
  exit 2
}

while (($#)); do
  case "$1" in
    --name) [[ $# -ge 2 ]] || die "$1 needs a value"; name="$2"; shift 2 ;;
    --name=*) name="${1#*=}"; shift ;;
    --zone) [[ $# -ge 2 ]] || die "$1 needs a value"; zone="$2"; shift 2 ;;
    --zone=*) zone="${1#*=}"; shift ;;
    --accelerator_type|--accelerator-type) [[ $# -ge 2 ]] || die "$1 needs a value"; accelerator_type="$2"; shift 2 ;;
    --accelerator_type=*|--accelerator-type=*) accelerator_type="${1#*=}"; shift ;;
    --version) [[ $# -ge 2 ]] || die "$1 needs a value"; version="$2"; shift 2 ;;
    --version=*) version="${1#*=}"; shift ;;
    --project) [[ $# -ge 2 ]] || die "$1 needs a value"; project="$2"; shift 2 ;;
    --project=*) project="${1#*=}"; shift ;;
    --spot) spot=1; shift ;;
    -m|--module) [[ $# -ge 2 ]] || die "$1 needs a value"; module="$2"; shift 2 ;;
    --module=*) module="${1#*=}"; shift ;;
    --remote_dir) [[ $# -ge 2 ]] || die "$1 needs a value"; remote_dir="$2"; shift 2 ;;
    --remote_dir=*) remote_dir="${1#*=}"; shift ;;
    --dry_run|--dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    create|copy|install|run|delete) steps+=("$1"); shift ;;
    all) steps+=(create copy install run); shift ;;
    --) shift; module_args=("$@"); break ;;
    *) die "unknown option or step '$1' (module flags go after --; see --help)" ;;
  esac
done

((${#steps[@]})) || die "no step given (create, copy, install, run, delete or all; see --help)"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
archive="/tmp/${name}-src.tar.gz"

common=(--zone="${zone}")
if [[ -n "${project}" ]]; then
  common+=(--project="${project}")
fi

# Runs (or, with --dry_run, prints) one command, shell-quoted.
run_cmd() {
  if ((dry_run)); then
    printf '%q ' "$@"
    printf '\n'
  else
    "$@"
  fi
}

# Shell-quotes its arguments into one string (for --command=...).
quote_all() {
  local out
  out="$(printf '%q ' "$@")"
  echo "${out% }"
}

step_create() {
  local -a cmd=(gcloud compute tpus tpu-vm create "${name}" "${common[@]}"
                --accelerator-type="${accelerator_type}" --version="${version}")
  if ((spot)); then
    cmd+=(--spot)
  fi
  run_cmd "${cmd[@]}"
}

step_copy() {
  # A tarball of the tracked tree keeps outputs and virtualenvs off the pod.
  run_cmd git -C "${repo_root}" archive --format=tar.gz --prefix="${remote_dir}/" -o "${archive}" HEAD
  run_cmd gcloud compute tpus tpu-vm scp "${archive}" "${name}:~/" "${common[@]}" --worker=all
  run_cmd gcloud compute tpus tpu-vm ssh "${name}" "${common[@]}" --worker=all \
    --command="rm -rf ~/${remote_dir} && tar -xzf ~/$(basename "${archive}") -C ~"
}

step_install() {
  run_cmd gcloud compute tpus tpu-vm ssh "${name}" "${common[@]}" --worker=all \
    --command="pip install -U 'jax[tpu]' && pip install -e ~/${remote_dir}"
}

step_run() {
  local remote
  remote="cd ~/${remote_dir} && python3 -m $(quote_all "${module}") --distributed"
  if ((${#module_args[@]})); then
    remote+=" $(quote_all "${module_args[@]}")"
  fi
  run_cmd gcloud compute tpus tpu-vm ssh "${name}" "${common[@]}" --worker=all \
    --command="${remote}"
}

step_delete() {
  run_cmd gcloud compute tpus tpu-vm delete "${name}" "${common[@]}" --quiet
}

for step in "${steps[@]}"; do
  "step_${step}"
done
