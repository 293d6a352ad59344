#!/usr/bin/env bash
# Step 1 of 2, on the dev machine (network, .venv installed): fetch into .whl/ the wheels that the
# lent GPU machine's image lacks, for bench/device.sh to install there with no network.
#
#   bash bench/device-wheels.sh            # then: the device call `bash bench/device.sh`, carry [".whl"]
#
# What travels is derived, not listed (bench/device_deps.py): pyproject's dependencies and the quant
# extra (torchao: the float8_base and int8_base rows), followed through .venv's installed metadata
# as pip would resolve them on the image's Python 3.12 on x86-64 Linux, less the image's own
# packages (bench/device-image.txt), each at .venv's version (the one the tests pass with). A
# package the image has travels too where its version there is outside a requirement, or unknown
# and the requirement has an upper bound (peft: hotlora mirrors it call for call, so pins the minor
# version; device.sh installs it only if the machine's own is outside the pin). It prints each
# package and why, and writes .whl/manifest.json, which device.sh reads.
#
# Wheels come for CPython 3.12 (the image) and, when this machine's python3 is another version, for
# that one as well, with the image's small packages that a leaner venv lacks (pillow, requests, ...),
# so that `bash bench/device.sh --dry-run` works here (docs/benchmarks.md); IMAGE_ONLY=1 skips those.
# The device call carries 64 MiB in all, the repository's files included: the wheels get what the
# repository leaves, less MARGIN_MIB (LIMIT_MIB overrides). Downloads stay in .cache/device-wheels
# (WHEEL_CACHE), so a rerun with the same versions needs no network.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${WHEELS_DIR:-.whl}
VENV_PY=${VENV_PY:-.venv/bin/python}      # reads the tested versions; its pip downloads
IMAGE_PYTHON=3.12
LOCAL_PYTHON=$(${DRY_PYTHON:-python3} -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
CARRY_MIB=64
MARGIN_MIB=${MARGIN_MIB:-2}

[ -x "$VENV_PY" ] || { echo "no $VENV_PY: run 'make install' first (the versions are read from it)" >&2; exit 1; }

if [ -n "${LIMIT_MIB:-}" ]; then
    limit=$((LIMIT_MIB * 1048576))
else
    # What the device call sends besides .whl: tracked files and untracked ones git does not ignore
    # (a tracked file deleted in the work tree is listed but not sent: stat skips it).
    repo_bytes=$(git ls-files -z -co --exclude-standard 2>/dev/null | { xargs -0 -r stat -c %s 2>/dev/null || true; } \
        | awk '{s += $1} END {print s + 0}')
    limit=$(( (CARRY_MIB - MARGIN_MIB) * 1048576 - repo_bytes ))
    echo "repository: $(awk -v b="$repo_bytes" 'BEGIN{printf "%.1f", b/1048576}') MiB of the device call's $CARRY_MIB MiB"
fi
LOCAL=()
if [ "${IMAGE_ONLY:-0}" != 1 ]; then LOCAL=(--local-python "$LOCAL_PYTHON"); fi

"$VENV_PY" -m bench.device_deps fetch --dest "$DEST" --python "$IMAGE_PYTHON" "${LOCAL[@]}" \
    --limit-bytes "$limit" --cache "${WHEEL_CACHE:-.cache/device-wheels}"
