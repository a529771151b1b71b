#!/usr/bin/env bash
# Downloads into ./.whl the wheels that benchmarks/gpu_session.sh needs on a
# GPU machine without network access whose image already holds JAX (CUDA),
# Flax, Optax, Orbax, NumPy, PyYAML, absl-py and pytest, but not the rest of
# `.[cuda,test]` (ml-collections, tensorboardX, the notebook test stack).
# Run from the repository root on a machine that reaches PyPI; .whl/ is
# git-ignored and must be carried to the GPU machine with the working tree.
#
#   bash benchmarks/gpu_wheels.sh [python-version, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
mkdir -p .whl
python3 -m pip download -q --only-binary=:all: --python-version "$PYV" \
  --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  ml-collections tensorboardX nbclient nbformat ipykernel
# Drop what the GPU image already has: a second copy (another version)
# would replace the image's own and could break its JAX.
for pkg in absl_py attrs numpy packaging protobuf psutil pygments \
    python_dateutil pyyaml typing_extensions six; do
  rm -f .whl/"${pkg}"-*.whl
done
du -sh .whl
