#!/usr/bin/env bash
# Full-size Flux figures on a GPU machine of your own where the project is installed in .venv
# (CUDA torch): bench/device.sh under .venv's python, results in $OUT (default bench/results).
# On a lent GPU machine (no .venv, no network, no diffusers) run `bash bench/device.sh` with the
# wheels of bench/device-wheels.sh instead: docs/benchmarks.md has the recipe.
# DEVICE_BUDGET_S (default 530) bounds the whole run; extra arguments go to bench/gpu_flux.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ ! -x "$PY" ]; then
    echo "no $PY: on a lent GPU machine run 'bash bench/device.sh' (see docs/benchmarks.md)" >&2
    exit 1
fi
PYTHON=$PY OUT=${OUT:-bench/results} exec bash bench/device.sh "$@"
