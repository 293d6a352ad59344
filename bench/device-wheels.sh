#!/usr/bin/env bash
# Step 1 of 2, on the dev machine (network, .venv installed): fetch into .whl/ the wheels that the
# lent GPU machine's image lacks, for bench/device.sh to install there with no network.
#
#   bash bench/device-wheels.sh            # then: the device call `bash bench/device.sh`, carry [".whl"]
#
# The image (tool library, device KINDS.md) has python3 3.12, torch 2.11+cu130, transformers 5.17,
# peft (version not documented), accelerate 1.15, huggingface_hub 1.33, safetensors 0.8, and
# pillow, requests, regex, filelock, numpy, httpx, psutil, pyyaml, sentencepiece, protobuf; it has
# no diffusers. What travels, each at the version .venv has (the versions the tests pass with):
#   diffusers  absent there; pyproject pins it to the minor version hotlora mirrors;
#   peft       there, at an undocumented version: device.sh installs this one only when the
#              image's is outside pyproject's pin;
#   torchao    the quant extra's pin (base_quantization: the float8_base and int8_base rows);
#              absent from the image's documented set
#   pillow, requests (+ urllib3, idna, certifi, charset_normalizer)
#              diffusers imports them; the image has them, so device.sh skips them there, but a
#              clean venv with only the image's documented set (the CPU dry-run check) lacks them.
# Not carried: importlib_metadata (diffusers declares it but imports it only on Python < 3.8),
# sentencepiece and protobuf (pyproject lists them; nothing imported on the bench path needs them).
# device.sh installs a wheel only when its package is missing or outside pyproject's pin.
#
# Binary wheels (pillow, charset_normalizer) are fetched for CPython 3.12 (the image) and also for
# this machine's python3 when it is another version, so that `bash bench/device.sh --dry-run` works
# here under a `python3 -m venv`; pip picks the matching one (--find-links). IMAGE_ONLY=1 skips those.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${WHEELS_DIR:-.whl}
VENV_PY=${VENV_PY:-.venv/bin/python}      # reads the tested versions; its pip downloads
IMAGE_PYTHON=3.12
LOCAL_PYTHON=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
LIMIT_MIB=${LIMIT_MIB:-60}                # the device call carries 64 MiB in all, the repo included
PACKAGES=(diffusers peft torchao pillow requests urllib3 idna certifi charset_normalizer)

[ -x "$VENV_PY" ] || { echo "no $VENV_PY: run 'make install' first (the versions are read from it)" >&2; exit 1; }

# name==version of each, from .venv; diffusers and peft must satisfy pyproject's pins.
mapfile -t SPECS < <("$VENV_PY" - "${PACKAGES[@]}" <<'EOF'
import importlib.metadata as md, re, sys, tomllib
from packaging.requirements import Requirement
pins = {}
for dep in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    req = Requirement(dep)
    pins[re.sub(r"[-_.]+", "-", req.name).lower()] = req.specifier
for name in sys.argv[1:]:
    version = md.version(name)
    spec = pins.get(re.sub(r"[-_.]+", "-", name).lower())
    if spec is not None and not spec.contains(version, prereleases=True):
        sys.exit(f".venv has {name} {version}, outside pyproject's {spec}: reinstall .venv first")
    print(f"{name}=={version}")
EOF
)
echo "pinned from $VENV_PY: ${SPECS[*]}"

mkdir -p "$DEST"
rm -f "$DEST"/*.whl          # one version of each: two of one package stop the install there
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
PYTHONS=("$IMAGE_PYTHON")
if [ "${IMAGE_ONLY:-0}" != 1 ] && [ "$LOCAL_PYTHON" != "$IMAGE_PYTHON" ]; then
    PYTHONS+=("$LOCAL_PYTHON")
fi
for pyver in "${PYTHONS[@]}"; do
    echo "== wheels for CPython $pyver"
    "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
        "${PLATFORMS[@]}" -d "$DEST" "${SPECS[@]}"
done

# Every package must have a wheel that CPython 3.12 on x86-64 Linux installs.
"$VENV_PY" - "$DEST" "$IMAGE_PYTHON" "${PACKAGES[@]}" <<'EOF'
import re, sys
from pathlib import Path
from packaging.utils import canonicalize_name, parse_wheel_filename
dest, pyver, names = Path(sys.argv[1]), sys.argv[2].replace(".", ""), sys.argv[3:]
ok = {}
for wheel in dest.glob("*.whl"):
    name, _, _, tags = parse_wheel_filename(wheel.name)
    # cpXY-abi3 (torchao: cp310-abi3) installs on every CPython from X.Y on
    stable = lambda t: t.abi == "abi3" and t.interpreter.startswith("cp3") and int(t.interpreter[3:]) <= int(pyver[1:])
    if any((t.interpreter in (f"cp{pyver}", "py3") or stable(t)) and ("x86_64" in t.platform or t.platform == "any")
           for t in tags):
        ok[name] = wheel.name
missing = [n for n in names if canonicalize_name(n) not in ok]
if missing:
    sys.exit(f"no CPython {sys.argv[2]} x86-64 wheel for: {', '.join(missing)}")
EOF

echo "== $DEST"
total=0
for f in "$DEST"/*.whl; do
    size=$(stat -c %s "$f")
    total=$((total + size))
    printf '%10d  %s\n' "$size" "$(basename "$f")"
done
printf '%10d  total (%s MiB; limit %s MiB)\n' "$total" "$(awk -v b="$total" 'BEGIN{printf "%.1f", b/1048576}')" "$LIMIT_MIB"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "too large: the device call carries 64 MiB in all, the repository included" >&2
    exit 1
fi
