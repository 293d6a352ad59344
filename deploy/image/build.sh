#!/usr/bin/env bash
# Build hotlora's image on this machine: deploy/image/build.sh [extra podman build args]
#
#   BASE_IMAGE   the base (default: a local Debian bookworm base made with mmdebstrap, kept and
#                reused; or a CUDA runtime image where a registry can be reached)
#   EXTRAS       the extras (default serve,s3,ray)
#   TORCH_SPEC   the torch requirement (default torch==2.13.0: the CPU build where pip's
#                configuration finds it, as on these machines' /opt/wheels)
#   HOTLORA_IMAGE the tag (default localhost/hotlora:dev)
#
# pip inside the build uses this machine's pip configuration (every file and PIP_* variable,
# merged by `pip config list`) and CA bundle, passed as build secrets: they are in no layer. Local
# folders that configuration names (find-links, file:// indexes, constraint files) are mounted
# read-only into the build.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"
setup_podman

if [ -z "${BASE_IMAGE:-}" ]; then
    ensure_local_base
    BASE_IMAGE=$HOTLORA_BASE_IMAGE
fi

secrets=$(mktemp -d)
trap 'rm -rf "$secrets"' EXIT
host_python=$(command -v python3)
"$host_python" -m pip --version >/dev/null 2>&1 || host_python="$ROOT/.venv/bin/python"
"$host_python" - "$secrets" <<'PY'
import os, shutil, subprocess, sys
from urllib.parse import urlparse

out = sys.argv[1]
lines = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                       check=True).stdout.splitlines()
config, mounts = {}, set()
for line in lines:  # `section.key='value'`; `:env:.key` are PIP_* variables (global)
    name, _, value = line.partition("=")
    section, _, key = name.rpartition(".")
    section = "global" if section in (":env:", "") else section
    value = value.strip().strip("'\"")
    if key == "cert":  # the bundle itself is its own secret
        shutil.copy(value, os.path.join(out, "ca.pem"))
        continue
    config.setdefault(section, {})[key] = value
    for word in value.split():
        # A file:// index's pages link to files beside it (../../files/..): mount its parent.
        path = os.path.dirname(urlparse(word).path.rstrip("/")) if word.startswith("file://") else word
        if path.startswith("/") and os.path.exists(path):
            mounts.add(os.path.dirname(path) if os.path.isfile(path) else path)
if not os.path.exists(os.path.join(out, "ca.pem")):
    shutil.copy("/etc/ssl/certs/ca-certificates.crt", os.path.join(out, "ca.pem"))
with open(os.path.join(out, "pip.conf"), "w") as f:
    for section, keys in config.items():
        f.write(f"[{section}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items()))
with open(os.path.join(out, "mounts"), "w") as f:
    f.write("".join(f"{m}\n" for m in sorted(mounts)))
PY
volumes=()
while read -r path; do volumes+=(--volume "$path:$path:ro"); done <"$secrets/mounts"
log "pip configuration for the build: $(tr '\n' ' ' <"$secrets/pip.conf"); mounted: $(tr '\n' ' ' <"$secrets/mounts")"

started=$SECONDS
log "building $HOTLORA_IMAGE on $BASE_IMAGE"
podman build --format docker --network host --layers \
    --file "$HERE/Containerfile" --ignorefile "$HERE/containerignore" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}" --build-arg EXTRAS="${EXTRAS:-serve,s3,ray}" \
    --secret id=pipconf,src="$secrets/pip.conf" --secret id=cabundle,src="$secrets/ca.pem" \
    "${volumes[@]}" --tag "$HOTLORA_IMAGE" "$@" "$ROOT"
log "built $HOTLORA_IMAGE in $((SECONDS - started)) s ($(podman image inspect --format '{{.Size}}' "$HOTLORA_IMAGE") bytes)"
