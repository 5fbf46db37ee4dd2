#!/usr/bin/env bash
# The packages `kiln serve` needs that the GPU machine's image lacks (FastAPI and what it pulls in),
# as Python 3.12 x86-64 wheels in .whl/ (git-ignored), at the versions installed here:
#   bash benchmarks/gpu_wheels.sh            (here, in the repository's venv)
# then name .whl in the device call's carry; gpu_suite.sh's serving part installs them there.
set -euo pipefail
cd "$(dirname "$0")/.."
git_dir=$(git rev-parse --git-dir)
mkdir -p "$git_dir/info"
grep -qx "/.whl/" "$git_dir/info/exclude" 2>/dev/null || echo "/.whl/" >> "$git_dir/info/exclude"
packages="fastapi starlette uvicorn pydantic pydantic_core typing-inspection annotated-doc annotated-types
opentelemetry-api typing_extensions"
# shellcheck disable=SC2086
pins=$(python -m pip show $packages 2>/dev/null | awk '/^Name:/ {name = $2} /^Version:/ {print name "==" $2}')
rm -rf .whl
# shellcheck disable=SC2086
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $pins
ls .whl
