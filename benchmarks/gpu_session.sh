#!/usr/bin/env bash
# One GPU session for issue 11: the whole test suite with default environment
# variables, then the GPU benchmarks at full float32, all within ~8 minutes
# (phase limits: install ~20 s, tests 220 s, benchmarks 170 + 40 + 40 + 60 s).
#
# Run from the repository root on a machine with one NVIDIA GPU and $OUT set:
#
#   bash benchmarks/gpu_session.sh              # install, tests, benchmarks
#   bash benchmarks/gpu_session.sh tests        # install and tests only
#   bash benchmarks/gpu_session.sh bench        # install and benchmarks only
#
# (two calls fit the device tool's 10-minute limit per command better than
# one when the suite is slow there). TESTS_TIMEOUT (default 220 s) bounds the
# test phase.
#
# Writes to $OUT (at most 8 files): env.txt, tests.log, bench.log,
# train_step_gpu.json (precision highest, scan unroll 1/2/4 of both NS
# stack tables, NS models first so a cut-off run keeps them),
# train_step_gpu_default.json (JAX's default precision, for the cost of full
# float32), train_step_gpu_cmdbuf.json (XLA command buffers incl. WHILE),
# scale_gpu.json (K vmapped models, per-model lengths). Copy the JSON files
# to benchmarks/results/ and run `python benchmarks/report.py`.
#
# Installs nothing beyond `pip install -e '.[cuda,test]'`. A machine without
# network access resolves it from the packages already installed plus the
# wheels in ./.whl (prepared beforehand with benchmarks/gpu_wheels.sh on a
# machine that reaches PyPI, and carried along); if the extras cannot be
# resolved offline it falls back to installing the package alone.
#
# Each phase has its own time limit, so a slow phase cannot eat the others'.
set -uo pipefail
what=${1:-all}
case "$what" in all|tests|bench) ;; *) echo "usage: $0 [all|tests|bench]" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to a writable directory}"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
start=$(date +%s)
phase() { echo "=== $* (t=$(( $(date +%s) - start )) s)" | tee -a "$OUT/bench.log"; }

{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv 2>&1; $PY --version; uname -a
} > "$OUT/env.txt" 2>&1

phase "install"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile .whl/*.whl \
    >> "$OUT/bench.log" 2>&1 || echo "wheel install failed" >> "$OUT/bench.log"
fi
if ! $PY -m pip install -q --no-build-isolation --no-index \
    --find-links .whl -e '.[cuda,test]' >> "$OUT/bench.log" 2>&1; then
  echo "offline resolution of .[cuda,test] failed; installing the package alone" \
    | tee -a "$OUT/bench.log"
  $PY -m pip install -q --no-build-isolation --no-index --no-deps -e . \
    >> "$OUT/bench.log" 2>&1
fi
$PY -m pip list 2>/dev/null | grep -i -E "^(jax|jaxlib|jax-cuda|flax|optax|orbax|ml.collections|tensorboardx|nbclient|ipykernel) " \
  >> "$OUT/env.txt"
$PY -c "from nsrnn_jax import parallel; print(parallel.describe_runtime())" \
  2>&1 | tee -a "$OUT/env.txt" "$OUT/bench.log"

if [ "$what" != bench ]; then
phase "test suite (default environment variables)"
env -u JAX_DEFAULT_MATMUL_PRECISION -u XLA_FLAGS timeout "${TESTS_TIMEOUT:-220}" \
  $PY -m pytest -q -p no:cacheprovider --durations=15 tests > "$OUT/tests.log" 2>&1
echo "pytest exit code $?" | tee -a "$OUT/tests.log" "$OUT/bench.log"
tail -n 3 "$OUT/tests.log" >> "$OUT/bench.log"
fi
[ "$what" = tests ] && { phase "done"; exit 0; }

phase "train step, full float32, scan unroll 1/2/4"
timeout 170 $PY benchmarks/train_step.py --repeats=7 --unroll=1,2,4 \
  --out "$OUT/train_step_gpu.json" >> "$OUT/bench.log" 2>&1
echo "exit $?" >> "$OUT/bench.log"

phase "train step, JAX default precision (cost of full float32)"
timeout 40 $PY benchmarks/train_step.py --models=ns22,ns33 --repeats=10 \
  --precision=default --out "$OUT/train_step_gpu_default.json" \
  >> "$OUT/bench.log" 2>&1
echo "exit $?" >> "$OUT/bench.log"

phase "train step, XLA command buffers including WHILE/CONDITIONAL"
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1" \
  timeout 40 $PY benchmarks/train_step.py --models=ns22,lstm --repeats=10 \
  --out "$OUT/train_step_gpu_cmdbuf.json" >> "$OUT/bench.log" 2>&1
echo "exit $?" >> "$OUT/bench.log"

phase "scale: K = 1, 20 vmapped NS-RNNs, per-model lengths 60/80"
timeout 60 $PY benchmarks/scale.py --ks=1,20 --lengths=60,80 --steps=4 \
  --repeats=3 --skip_devices --out "$OUT/scale_gpu.json" \
  >> "$OUT/bench.log" 2>&1
echo "exit $?" >> "$OUT/bench.log"
phase "done"
