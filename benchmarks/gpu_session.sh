#!/usr/bin/env bash
# One GPU session for issue 11: the whole test suite with JAX's default
# numerics environment, then the GPU benchmarks at full float32, in phases
# that each get a time limit and share one deadline.
#
# Run from the repository root on a machine with one NVIDIA GPU and $OUT set:
#
#   bash benchmarks/gpu_session.sh                   # every phase, in order
#   bash benchmarks/gpu_session.sh tests ns scale    # these phases only
#   DEADLINE=560 bash benchmarks/gpu_session.sh ...  # stop by t = 560 s
#
# Phases (in the order they run; the install always runs first):
#   tests      the whole suite, pytest-xdist over TEST_WORKERS (14) processes
#              where the image has it (README's command uses at most 8);
#              JAX_DEFAULT_MATMUL_PRECISION and XLA_FLAGS unset (the tests'
#              conftest turns GPU memory preallocation off so the workers
#              share the GPU: memory only, not numerics). Cut at its limit,
#              it is finished by a second call: copy the first call's
#              tests.xml into the tree (e.g. .gpu/tests_1.xml, untracked, so
#              it travels) and run the phase again with
#              TESTS_DONE=.gpu/tests_1.xml: that run leaves out the tests
#              the first finished, and gpu_suite.json counts both parts
#   ns         train step of the NS-RNN, Q=S=2 and 3, config.scan_unroll 1, 8
#   baselines  train step of LSTM, JM, Gref, scan_unroll 1, 8 and 80 (full)
#   scale      20 vmapped NS-RNNs at length 80, scan_unroll 1 and 8
#   precision  NS train steps at JAX's default (reduced) matmul precision
#   cmdbuf     LSTM and NS (unroll 8) with XLA command buffers incl. WHILE
#   profile    where each model's train step spends its GPU time, op by op
#              (benchmarks/profile_step.py; device time of the "XLA Ops"
#              trace line: which kernels of an update dominate)
#   fewerops   NS train step against its code before the fewer-ops update
#              (0bd0077; docs/benchmarks.md "Later CPU runs"), and Gref against its
#              cumsum form (--gref_cumsum). The device's copy of the
#              tree has no git history: first, here,
#                for f in ns_stack rns_stack models; do mkdir -p \
#                  .baselines/0bd0077/nsrnn_jax && git show \
#                  0bd0077:nsrnn_jax/$f.py > .baselines/0bd0077/nsrnn_jax/$f.py; done
#              (untracked, so it travels; delete it afterwards)
#   contractions NS train step with the update's contractions as
#              multiply and sum (rns_stack.COLUMN_CONTRACTIONS = "reduce":
#              the column-sized ones; TABLE_CONTRACTIONS too: all of them),
#              fusible with the elementwise work around them, against the
#              default dots; then the profile of the all-by-sum step
#   pallas     NS train step with the stack's updates as Pallas (Triton)
#              kernels (rns_stack.UPDATE_KERNELS = "pallas",
#              nsrnn_jax/stack_kernels.py) against the XLA updates, at
#              the default tiles and at each of KERNEL_TILES (ROW_TILE x
#              KT_CHUNK x NUM_WARPS triples; a trailing g: a program per
#              row tile, stack_kernels.ROW_GRID)
#   pallas_profile  the profile of the NS step on the Pallas kernels
#   pallas_scale    20 vmapped NS-RNNs at length 80 on the Pallas kernels
#              (pallas_call batched over the model axis by vmap)
#   residuals  LSTM, JM, Gref and NS (Q=S=2) train steps with each
#              baseline's loop storing the other set of residuals
#              (--other_residuals: JM every one, LSTM and Gref only the
#              matmuls' outputs; models.PRODUCTS_ONLY_LOOPS) and with the
#              LSTM's gates as two products (--lstm_two_products); docs/benchmarks.md
#              "Fewer ops per step"
#   corpus     corpus train steps at PTB size (benchmarks/corpus_step.py:
#              LSTM-256, RNS 2-3 and VRNS 1-5-20 with D = 35, one-hot input
#              and input_lookup; docs/benchmarks.md "Corpus training at PTB size")
#   later      the later stacks' newest paths: the unlimited VRNS on the
#              share sweep against the RNS and NS stacks
#              (benchmarks/vrns_stack.py --compare, no git revision on the
#              device) and the windowed stack's hand-written gradient
#              against autodiff (benchmarks/window_vjp.py)
#
# Writes to $OUT (a device call brings back at most 8 files: give each call
# a few phases): env.txt, tests.log, tests.xml (pytest's JUnit report),
# gpu_suite.json (the suite's record,
# benchmarks/suite_record.py: add the cause of any failure), bench.log and one
# JSON per benchmark phase (train_step_gpu_ns.json, ..._baselines.json,
# ..._default.json, ..._cmdbuf.json, scale_gpu_unroll{1,8}.json,
# profile_step_gpu.json, ..._contractions_by_sum.json,
# profile_step_gpu_reduce_all.json, train_step_gpu_pallas_kernels.json,
# profile_step_gpu_pallas.json, scale_gpu_pallas.json,
# train_step_gpu_residuals.json, corpus_step_gpu.json). Copy them to
# benchmarks/results/ and run `python benchmarks/report.py`.
#
# tests/benchmarks_gpu_session_test.py parses every phase's commands with
# the benchmarks' own flags on CPU, so a typo costs no device time.
#
# Installs nothing beyond the package: the wheels in ./.whl that the image
# lacks (benchmarks/gpu_wheels.sh fetches them on a machine with network
# access), then `pip install --no-deps -e .`.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT to a writable directory}"
PY=${PYTHON:-python3}
DEADLINE=${DEADLINE:-100000}
export PYTHONUNBUFFERED=1
start=$(date +%s)
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(tests ns baselines scale precision cmdbuf profile fewerops contractions pallas pallas_profile pallas_scale residuals corpus later)
for p in "${phases[@]}"; do
  case "$p" in tests|ns|baselines|scale|precision|cmdbuf|profile|fewerops|contractions|pallas|pallas_profile|pallas_scale|residuals|corpus|later) ;;
    *) echo "error: unknown phase $p" >&2; exit 2 ;; esac
done
elapsed() { echo $(( $(date +%s) - start )); }
log() { echo "=== $* (t=$(elapsed) s)" | tee -a "$OUT/bench.log"; }
# limit N: N seconds, or what is left before the deadline if less.
limit() { local left=$(( DEADLINE - $(elapsed) )); (( left < $1 )) && echo "$left" || echo "$1"; }

{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv 2>&1; $PY --version; uname -a; nproc
} > "$OUT/env.txt" 2>&1

log "install"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile .whl/*.whl \
    >> "$OUT/bench.log" 2>&1 || echo "wheel install failed" >> "$OUT/bench.log"
fi
# The tests and benchmarks also run from the checkout without the install
# (setup.cfg puts the root on pytest's path; PYTHONPATH for subprocesses).
$PY -m pip install -q --no-build-isolation --no-index --no-deps -e . \
  >> "$OUT/bench.log" 2>&1 || {
  echo "package install failed; using PYTHONPATH=$PWD" >> "$OUT/bench.log"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; }
$PY -m pip list 2>/dev/null | grep -i -E "^(jax|jaxlib|jax-cuda13-plugin|flax|optax|orbax-checkpoint|ml.collections|tensorboardx|pytest|pytest-xdist|nbclient|ipykernel) " \
  >> "$OUT/env.txt"
$PY -c "from nsrnn_jax import parallel; print(parallel.describe_runtime())" \
  2>&1 | tee -a "$OUT/env.txt" "$OUT/bench.log"

# bench NAME LIMIT [ENV=VALUE ...] -- ARGS: one benchmark process.
bench() {
  local name=$1 secs; secs=$(limit "$2"); shift 2
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  if (( secs < 20 )); then log "skip $name (deadline)"; return; fi
  log "$name (limit $secs s)"
  env "${envs[@]}" timeout "$secs" "$PY" "$@" >> "$OUT/bench.log" 2>&1
  echo "exit $?" >> "$OUT/bench.log"
}

TS=benchmarks/train_step.py
for p in "${phases[@]}"; do
  case "$p" in
    tests)
      # ~850 tests: 280 s on an H100 at 711 tests (gpu_suite_h100.json).
      secs=$(limit "${TESTS_TIMEOUT:-480}")
      log "test suite (limit $secs s)"
      xdist=()
      $PY -c "import xdist" 2>/dev/null && xdist=(-n "${TEST_WORKERS:-14}")
      xml=$OUT/tests.xml
      # A second call finishes a suite the first cut at its limit: the
      # first call's tests.xml, copied into the tree, as TESTS_DONE.
      done_env=() parts=()
      if [ -n "${TESTS_DONE:-}" ]; then
        [ -f "$TESTS_DONE" ] || { echo "error: TESTS_DONE=$TESTS_DONE is not a file" >&2; exit 2; }
        done_env=("NSRNN_TEST_DONE=$(realpath "$TESTS_DONE")") parts=("$TESTS_DONE")
        log "leaving out the tests $TESTS_DONE finished"
      fi
      # At the limit pytest gets SIGINT, so it stops and still writes the
      # JUnit report of the tests that finished (a kill 30 s later if not).
      env -u JAX_DEFAULT_MATMUL_PRECISION -u XLA_FLAGS "${done_env[@]}" \
        timeout -s INT -k 30 \
        "$secs" "$PY" -m pytest -q -p no:cacheprovider "${xdist[@]}" \
        --durations=25 --junitxml="$xml" tests > "$OUT/tests.log" 2>&1
      code=$?
      echo "pytest exit code $code (${xdist[*]:-no xdist})" | tee -a "$OUT/tests.log" "$OUT/bench.log"
      tail -n 3 "$OUT/tests.log" >> "$OUT/bench.log"
      # The record for results/gpu_suite_<gpu>.json (docs/benchmarks.md's suite line);
      # marked interrupted when the limit struck.
      "$PY" benchmarks/suite_record.py "${parts[@]}" "$xml" --out "$OUT/gpu_suite.json" \
        --exit_code "$code" \
        --command "python3 -m pytest -q -p no:cacheprovider ${xdist[*]} tests" \
        --environment "JAX_DEFAULT_MATMUL_PRECISION and XLA_FLAGS unset; XLA_PYTHON_CLIENT_PREALLOCATE=false (the workers share the GPU's memory)" \
        >> "$OUT/bench.log" 2>&1 ;;
    ns)
      bench "NS train step, full float32, unroll 1/8" 170 -- $TS \
        --models=ns22,ns33 --unroll=1,8 --repeats=9 \
        --out "$OUT/train_step_gpu_ns.json" ;;
    baselines)
      bench "LSTM/JM/Gref train step, unroll 1/8/80" 150 -- $TS \
        --models=lstm,jm,gref --unroll=1,8,80 --repeats=15 \
        --out "$OUT/train_step_gpu_baselines.json" ;;
    scale)
      for u in 1 8; do
        bench "scale: 20 vmapped NS-RNNs, unroll $u" 70 -- \
          benchmarks/scale.py --ks=20 --lengths=80 --steps=4 --repeats=3 \
          --skip_devices --scan_unroll=$u --out "$OUT/scale_gpu_unroll$u.json"
      done ;;
    precision)
      bench "NS train step, JAX default precision" 60 -- $TS \
        --models=ns22,ns33 --repeats=9 --precision=default \
        --out "$OUT/train_step_gpu_default.json" ;;
    cmdbuf)
      bench "XLA command buffers incl. WHILE" 60 \
        XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1" \
        -- $TS --models=lstm,ns22 --unroll=8 --repeats=9 \
        --out "$OUT/train_step_gpu_cmdbuf.json" ;;
    profile)
      bench "profile of the train steps, op by op" 150 -- \
        benchmarks/profile_step.py --models=ns22,ns33,jm,gref,lstm --top=15 \
        --out "$OUT/profile_step_gpu.json" ;;
    fewerops)
      bench "NS train step vs 0bd0077 (before fewer ops per update)" 120 -- \
        $TS --models=ns22,ns33 --baseline_ref=0bd0077 --repeats=9 \
        --out "$OUT/train_step_gpu_fewer_ops.json"
      bench "Gref train step vs its cumsum form, unroll 1/8" 60 -- \
        $TS --models=gref --gref_cumsum --unroll=1,8 --repeats=9 \
        --out "$OUT/train_step_gpu_gref_matmul.json" ;;
    contractions)
      bench "NS train step, contractions by sum vs dots" 150 -- \
        $TS --models=ns22,ns33 --contractions_by_sum --repeats=9 \
        --out "$OUT/train_step_gpu_contractions_by_sum.json"
      bench "profile of the NS step, all contractions by sum" 90 -- \
        benchmarks/profile_step.py --models=ns22,ns33 --top=15 \
        --contractions=reduce_all --out "$OUT/profile_step_gpu_reduce_all.json" ;;
    residuals)
      bench "train steps: the other residuals stored, the LSTM's two products" 150 -- \
        $TS --models=jm,lstm,gref,ns22 --other_residuals --lstm_two_products \
        --repeats=15 --out "$OUT/train_step_gpu_residuals.json" ;;
    pallas)
      bench "NS train step, the stack's updates as Pallas kernels" 240 -- \
        $TS --models=ns33,ns22 --pallas_kernels --repeats=7 \
        --kernel_tiles="${KERNEL_TILES:-64x16x4,64x16x4g,128x16x4g}" \
        --out "$OUT/train_step_gpu_pallas_kernels.json" ;;
    pallas_profile)
      bench "profile of the NS step on the Pallas kernels" 90 -- \
        benchmarks/profile_step.py --models=ns22,ns33 --top=15 \
        --update_kernels=pallas --out "$OUT/profile_step_gpu_pallas.json" ;;
    pallas_scale)
      bench "scale: 20 vmapped NS-RNNs on the Pallas kernels" 90 -- \
        benchmarks/scale.py --ks=20 --lengths=80 --steps=4 --repeats=3 \
        --skip_devices --update_kernels=pallas \
        --out "$OUT/scale_gpu_pallas.json" ;;
    corpus)
      bench "corpus train steps at PTB size, one-hot input vs lookup" 150 -- \
        benchmarks/corpus_step.py --models=lstm,rns,vrns --reps=5 \
        --out "$OUT/corpus_step_gpu.json" ;;
    later)
      bench "VRNS share sweep against the RNS and NS stacks, n = 80" 120 -- \
        benchmarks/vrns_stack.py --compare --reps=7 \
        --out "$OUT/vrns_stack_speed_gpu.json"
      bench "windowed stack: hand-written gradient against autodiff" 150 -- \
        benchmarks/window_vjp.py --reps=7 --out "$OUT/window_vjp_gpu.json"
      bench "NS train step, the table in column chunks against square" 150 -- \
        $TS --models=ns22,ns33 --table_layouts --dispatch_floor --repeats=9 \
        --out "$OUT/train_step_gpu_table_layouts.json" ;;
  esac
done
log "done"
