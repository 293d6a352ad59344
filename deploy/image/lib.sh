# Shared by build.sh and smoke.sh (sourced, not run): where state lives and how podman is set up
# on a machine like this one (rootful Debian podman; see docs/deploy.md, "Building the image").
# shellcheck shell=bash

HOTLORA_IMAGE=${HOTLORA_IMAGE:-localhost/hotlora:dev}
HOTLORA_BASE_IMAGE=${HOTLORA_BASE_IMAGE:-localhost/hotlora-base:bookworm}
# State kept between runs on one machine (containers.conf, the base tarball's log): outside the
# repository, so a clean checkout reuses it.
HOTLORA_IMAGE_STATE=${HOTLORA_IMAGE_STATE:-/var/tmp/hotlora-image}

log() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# podman, runc and mmdebstrap from Debian; nothing else is fetched from outside the registries.
ensure_tools() {
    local missing=()
    command -v podman >/dev/null || missing+=(podman)
    command -v runc >/dev/null || missing+=(runc)
    command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing ${missing[*]} (apt)"
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

# Our own containers.conf, used through CONTAINERS_CONF (the machine's files are left alone):
# crun refuses this machine's hybrid cgroups, so runc; podman's default ulimits are above this
# machine's hard limits, so a container would not start: use the hard limits themselves.
containers_conf() {
    mkdir -p "$HOTLORA_IMAGE_STATE"
    local nofile nproc
    nofile=$(ulimit -Hn)
    nproc=$(ulimit -Hu)
    [ "$nofile" = unlimited ] && nofile=1048576
    if [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; then nproc=32768; fi
    cat >"$HOTLORA_IMAGE_STATE/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
CONF
    export CONTAINERS_CONF="$HOTLORA_IMAGE_STATE/containers.conf"
}

setup_podman() {
    [ "$(id -u)" = 0 ] || die "run as root (rootful podman: this machine has no user namespaces for rootless)"
    ensure_tools
    containers_conf
}

# The local base: Debian bookworm minbase with Python, made by mmdebstrap from the apt sources this
# machine already uses (no registry is reachable here) and imported once; reused while it exists.
# Where a registry is reachable, pass BASE_IMAGE=<a CUDA runtime image> to build.sh instead.
BASE_PACKAGES=python3,python3-venv,ca-certificates,curl,wget,tini
ensure_local_base() {
    if podman image exists "$HOTLORA_BASE_IMAGE"; then
        log "base $HOTLORA_BASE_IMAGE exists: reused"
        return
    fi
    local sources=() tar="$HOTLORA_IMAGE_STATE/bookworm-base.tar" started=$SECONDS
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
        sources=(/etc/apt/sources.list.d/debian.sources)
    elif [ -s /etc/apt/sources.list ]; then
        sources=(/etc/apt/sources.list)
    else
        sources=("deb http://deb.debian.org/debian bookworm main")
    fi
    log "building the base $HOTLORA_BASE_IMAGE with mmdebstrap (${sources[*]})"
    mmdebstrap --quiet --variant=minbase --include="$BASE_PACKAGES" \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        bookworm "$tar" "${sources[@]}" || die "mmdebstrap"
    podman import --quiet --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' --change 'CMD ["/bin/bash"]' "$tar" "$HOTLORA_BASE_IMAGE" >/dev/null || die "podman import"
    rm -f "$tar"
    log "base built in $((SECONDS - started)) s"
}
