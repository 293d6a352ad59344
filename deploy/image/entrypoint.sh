#!/bin/sh
# `hotlora serve` with the image's conventions: a config file mounted at $HOTLORA_CONFIG_FILE and
# API keys mounted at $HOTLORA_API_KEYS_SECRET are used when they are there; HOTLORA_* variables
# and arguments given to the container override the file (the server's own precedence).
set -eu
# Inductor keeps its precompiled C++ header (and a few caches) in the temp dir,
# tempfile.gettempdir()/torchinductor_<user>, whatever TORCHINDUCTOR_CACHE_DIR says, and it needs the
# header to look up even a cached kernel. /tmp is a fresh tmpfs in each container (read-only root, a
# pod's emptyDir), so every start built the header again: 6.6 s of g++ on 2 cores inside the first
# warm-up pass of a restart. It lives on the compile volume instead (a header cut short by a kill
# is not used: g++ skips a precompiled header it cannot read and compiles from the source).
if [ -n "${TORCHINDUCTOR_CACHE_DIR:-}" ]; then
    kept="$(dirname "$TORCHINDUCTOR_CACHE_DIR")/inductor-tmp"
    link="${TMPDIR:-/tmp}/torchinductor_$(id -un 2>/dev/null || echo "uid_$(id -u)")"
    if [ ! -e "$link" ] && mkdir -p "$kept" 2>/dev/null; then
        ln -s "$kept" "$link"
    fi
fi
if [ -z "${HOTLORA_API_KEYS_FILE:-}" ] && [ -f "$HOTLORA_API_KEYS_SECRET" ]; then
    HOTLORA_API_KEYS_FILE=$HOTLORA_API_KEYS_SECRET
    export HOTLORA_API_KEYS_FILE
fi
if [ -f "$HOTLORA_CONFIG_FILE" ]; then
    exec hotlora serve --config "$HOTLORA_CONFIG_FILE" "$@"
fi
exec hotlora serve "$@"
