#!/usr/bin/env bash
# Runs N JAX processes on this machine, connected over localhost.
#
# This is the multi-host code path (jax.distributed.initialize with an explicit
# coordinator, process id and process count) without a cluster: each process
# owns its own CPU devices (or one GPU each with --gpus) and they exchange
# gradients through the CPU collectives backend (gloo). Useful to test a
# multi-host setup before paying for a pod, and what the tests exercise.
#
# Every argument after `--` goes to the Python module unchanged. The module
# gets --distributed; the coordinator address, process count and process id
# travel in NSRNN_COORDINATOR_ADDRESS / NSRNN_NUM_PROCESSES / NSRNN_PROCESS_ID,
# which nsrnn_jax.parallel.maybe_initialize_distributed reads.

set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/local_multiprocess.sh [options] -- [module flags...]

Runs N processes of `python -m MODULE --distributed ...` on localhost; process i
gets NSRNN_COORDINATOR_ADDRESS=localhost:PORT, NSRNN_NUM_PROCESSES=N and
NSRNN_PROCESS_ID=i in its environment.

Options:
  -n, --num_processes N     processes to start (default 2)
  -p, --port PORT           coordinator port on localhost (default 12355)
  -d, --devices_per_process D
                            simulated CPU devices per process (default 1)
  -g, --gpus                give process i the GPU i (CUDA_VISIBLE_DEVICES=i)
                            instead of simulated CPU devices
  -m, --module MODULE       Python module to run (default nsrnn_jax.main;
                            nsrnn_jax.grid trains a grid)
  -l, --log_dir DIR         per-process logs go to DIR/process_<i>.log
                            (default: only process 0 prints, others log to
                            /tmp/nsrnn_jax_local_<port>/)
      --python PY           Python interpreter (default python3)
      --dry_run             print the commands instead of running them
  -h, --help                show this help

Example:
  launch/local_multiprocess.sh -n 2 -- \
      --config=configs/quick.py --workdir=/tmp/nsrnn_mp
EOF
}

num_processes=2
port=12355
devices_per_process=1
gpus=0
module="nsrnn_jax.main"
log_dir=""
python_bin="python3"
dry_run=0
module_args=()

die() {
  echo "local_multiprocess.sh: $*" >&2
  exit 2
}

is_positive_int() {
  [[ "$1" =~ ^[1-9][0-9]*$ ]]
}

while (($#)); do
  case "$1" in
    -n|--num_processes) [[ $# -ge 2 ]] || die "$1 needs a value"; num_processes="$2"; shift 2 ;;
    --num_processes=*) num_processes="${1#*=}"; shift ;;
    -p|--port) [[ $# -ge 2 ]] || die "$1 needs a value"; port="$2"; shift 2 ;;
    --port=*) port="${1#*=}"; shift ;;
    -d|--devices_per_process) [[ $# -ge 2 ]] || die "$1 needs a value"; devices_per_process="$2"; shift 2 ;;
    --devices_per_process=*) devices_per_process="${1#*=}"; shift ;;
    -g|--gpus) gpus=1; shift ;;
    -m|--module) [[ $# -ge 2 ]] || die "$1 needs a value"; module="$2"; shift 2 ;;
    --module=*) module="${1#*=}"; shift ;;
    -l|--log_dir) [[ $# -ge 2 ]] || die "$1 needs a value"; log_dir="$2"; shift 2 ;;
    --log_dir=*) log_dir="${1#*=}"; shift ;;
    --python) [[ $# -ge 2 ]] || die "$1 needs a value"; python_bin="$2"; shift 2 ;;
    --python=*) python_bin="${1#*=}"; shift ;;
    --dry_run|--dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; module_args=("$@"); break ;;
    *) die "unknown option '$1' (module flags go after --; see --help)" ;;
  esac
done

is_positive_int "${num_processes}" || die "--num_processes must be a positive integer, got '${num_processes}'"
is_positive_int "${port}" || die "--port must be a positive integer, got '${port}'"
((port < 65536)) || die "--port must be < 65536, got '${port}'"
is_positive_int "${devices_per_process}" || die "--devices_per_process must be a positive integer, got '${devices_per_process}'"

if [[ -z "${log_dir}" ]]; then
  log_dir="/tmp/nsrnn_jax_local_${port}"
fi

# Prints one process's command line, shell-quoted, as it would be run.
print_command() {
  local i="$1"
  local -a env_vars cmd
  mapfile -t env_vars < <(process_env "${i}")
  cmd=("${python_bin}" -m "${module}" --distributed "${module_args[@]}")
  printf '%s ' env "${env_vars[@]}"
  printf '%q ' "${cmd[@]}"
  printf '> %q 2>&1\n' "${log_dir}/process_${i}.log"
}

# Environment of process i, one VAR=value per line.
process_env() {
  local i="$1"
  echo "NSRNN_COORDINATOR_ADDRESS=localhost:${port}"
  echo "NSRNN_NUM_PROCESSES=${num_processes}"
  echo "NSRNN_PROCESS_ID=${i}"
  if ((gpus)); then
    echo "CUDA_VISIBLE_DEVICES=${i}"
  else
    echo "JAX_PLATFORMS=cpu"
    echo "XLA_FLAGS=--xla_force_host_platform_device_count=${devices_per_process}"
  fi
}

if ((dry_run)); then
  echo "mkdir -p ${log_dir}"
  for ((i = 0; i < num_processes; i++)); do
    print_command "${i}"
  done
  exit 0
fi

mkdir -p "${log_dir}"
pids=()
cleanup() {
  # Stop only the processes this script started.
  for pid in "${pids[@]}"; do
    kill "${pid}" 2>/dev/null || true
  done
}
trap cleanup INT TERM

for ((i = 0; i < num_processes; i++)); do
  mapfile -t env_vars < <(process_env "${i}")
  env "${env_vars[@]}" "${python_bin}" -m "${module}" --distributed \
    "${module_args[@]}" >"${log_dir}/process_${i}.log" 2>&1 &
  pids+=("$!")
done
echo "Started ${num_processes} processes (logs in ${log_dir}); waiting." >&2

status=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "process ${i} failed; see ${log_dir}/process_${i}.log" >&2
    status=1
    cleanup
  fi
done
if ((status == 0)); then
  tail -n 20 "${log_dir}/process_0.log"
fi
exit "${status}"
