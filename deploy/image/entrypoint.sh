#!/bin/sh
# `hotlora serve` with the image's conventions: a config file mounted at $HOTLORA_CONFIG_FILE and
# API keys mounted at $HOTLORA_API_KEYS_SECRET are used when they are there; HOTLORA_* variables
# and arguments given to the container override the file (the server's own precedence).
set -eu
if [ -z "${HOTLORA_API_KEYS_FILE:-}" ] && [ -f "$HOTLORA_API_KEYS_SECRET" ]; then
    HOTLORA_API_KEYS_FILE=$HOTLORA_API_KEYS_SECRET
    export HOTLORA_API_KEYS_FILE
fi
if [ -f "$HOTLORA_CONFIG_FILE" ]; then
    exec hotlora serve --config "$HOTLORA_CONFIG_FILE" "$@"
fi
exec hotlora serve "$@"
