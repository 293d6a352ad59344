#!/usr/bin/env bash
# Full-size Flux figures on a GPU machine of your own where the project is installed in .venv
# (CUDA torch): bench/device.sh under .venv's python, results in $OUT (default bench/results).
# On a lent GPU machine (no .venv, no network, no diffusers) run `bash bench/device.sh` with the
# wheels of bench/device-wheels.sh instead: docs/benchmarks.md has the recipe.
# DEVICE_BUDGET_S (default 530) bounds the whole run; extra arguments go to bench/gpu_flux.py.
#
# Then the sizes rows (issue 16): bench/sizes.py --full-flux at FULL_SIZES, the pack time per size
# with dynamic graphs against an engine compiled for that size alone (and a twin of one: the
# noise), every engine warm in its own process, timed interleaved; results in
# $OUT/sizes-gpu.{json,md}. Real Flux blocks (width 3072), 4 + 8 of them: every block of a type runs
# one compiled graph, so the ratio is the full model's, and the six engines fit on one GPU at once.
# SIZES_ROWS=0 skips them, SIZES_ROWS=only runs only them; SIZES_ARGS adds arguments (e.g.
# "--modes dynamic,static --rounds 9"). Not bounded by DEVICE_BUDGET_S: six cold compiles at full
# size. With --dry-run: tiny blocks and sizes on the CPU, eager.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ ! -x "$PY" ]; then
    echo "no $PY: on a lent GPU machine run 'bash bench/device.sh' (see docs/benchmarks.md)" >&2
    exit 1
fi
OUT=${OUT:-bench/results}
FULL_SIZES=1024x1024,832x1216,1216x832,1024x1536  # WIDTHxHEIGHT: square, portrait, landscape, the seed article's

sizes_rows() {
    local args
    if [ "${1:-}" = "--dry-run" ]; then  # proves the plumbing in a minute; the figures mean nothing
        args=(--device cpu --no-compile --sizes 64x64,48x80 --layers 1 --single-layers 1 --heads 2
              --text-width 256 --batch 1 --steps 2 --rounds 2)
    else
        args=(--sizes "$FULL_SIZES" --layers 4 --single-layers 8 --batch 2 --steps 10 --rounds 5 --modes dynamic)
    fi
    # shellcheck disable=SC2086  # SIZES_ARGS is a list of words
    "$PY" -u -m bench.sizes --full-flux "${args[@]}" --out "$OUT" --name sizes-gpu ${SIZES_ARGS:-}
}

rc=0
if [ "${SIZES_ROWS:-1}" != only ]; then
    PYTHON=$PY OUT=$OUT bash bench/device.sh "$@" || rc=$?
fi
if [ "${SIZES_ROWS:-1}" != 0 ]; then
    echo "== sizes rows: bench/sizes.py --full-flux (results in $OUT/sizes-gpu.md)"
    sizes_rows "${1:-}" || rc=$?
fi
exit "$rc"
