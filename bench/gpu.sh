#!/usr/bin/env bash
# For a lent GPU machine with no network (e.g. an H200): full-size Flux with random bf16 weights,
# the engine's swap / steady-state / compile figures at 1024x1536, 30 steps, batch 6, rank 128.
# Sized for ~8 minutes: gpu_flux.py stops starting new measurements after --budget-s (420 s) and
# writes bench/results/gpu.json after every measurement. Prerequisite: the CUDA build of torch
# and the project installed in .venv (see README). NEVER RUN YET: no session has had a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 540 "$PY" -m bench.gpu_flux --height 1024 --width 1536 --steps 30 --pack 6 --rank 128 --budget-s 420 "$@"
cat bench/results/gpu.json
