#!/usr/bin/env bash
# CI's image smoke test (see docs/deploy.md): build the image, run it the way an operator would
# (read-only root, non-root, cache volumes, config file, keys file), generate with two adapters of
# the built-in tiny model, restart and check the compile cache made it ready faster, then run the
# Kubernetes Deployment (deploy/k8s/overlays/cpu) under `podman kube play` and generate through it.
#
#   deploy/image/smoke.sh            # SKIP_BUILD=1: use the image already tagged $HOTLORA_IMAGE
#
# Every wait is bounded; everything it creates is removed on exit, pass or fail; a failure prints
# the container's log.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"
setup_podman

READY_TIMEOUT_S=${READY_TIMEOUT_S:-900}   # a cold compile of the tiny model on a busy 2-core machine
NAME=hotlora-smoke-$$
PORT=${SMOKE_PORT:-18765}
VOLUMES=("$NAME-adapters" "$NAME-compile" "$NAME-jobs")
WORK=$(mktemp -d)
KUBE_YAML="$WORK/kube.yaml"
KEY=""
SERVER=$NAME   # the container whose log a failure prints
export PYTHON=${PYTHON:-$ROOT/.venv/bin/python}   # kube-render.sh: PyYAML and the dev extra's kubectl

cleanup() {
    local rc=$?
    if [ $rc -ne 0 ]; then
        log "smoke test failed (exit $rc); the server's log:"
        podman logs "$SERVER" 2>&1 | grep -v -E '"GET /(readyz|healthz) ' | tail -n 60 | sed 's/^/    /' >&2 || true
    fi
    podman rm -f -t 5 "$NAME" >/dev/null 2>&1 || true
    [ -f "$KUBE_YAML" ] && podman kube down "$KUBE_YAML" >/dev/null 2>&1 || true
    podman volume rm -f "${VOLUMES[@]}" "$NAME-config" >/dev/null 2>&1 || true
    rm -rf "$WORK"
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- helpers ---------------------------------------------------------------------------------

# podman without its complaints that there is no systemd to schedule health checks on (this
# script runs the checks itself); everything else it says is kept.
podman() { command podman "$@" 2> >(grep -v 'systemd connection' >&2); }

# Seconds (with a fraction) since the epoch.
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# wait_ready <what> <command that prints /readyz's status code>: bounded by READY_TIMEOUT_S.
wait_ready() {
    local what=$1 started=$SECONDS code
    shift
    while :; do
        code=$("$@" 2>/dev/null || true)
        [ "$code" = 200 ] && return 0
        case $code in *'"failed":null'*|'') ;; *'"failed":'*) die "$what: start-up failed: $code" ;; esac
        [ $((SECONDS - started)) -ge "$READY_TIMEOUT_S" ] && die "$what not ready after ${READY_TIMEOUT_S}s (last /readyz: ${code:-no answer})"
        if [ "$(podman inspect --format '{{.State.Running}}' "$SERVER" 2>/dev/null)" = false ]; then
            die "$what exited before it was ready"
        fi
        sleep 2
    done
}

# /readyz's status code, or its body when it is not 200 (wait_ready stops at a failed start-up).
readyz() { local body; body=$("$@") || return 0; [ "${body#*\"ready\":true}" != "$body" ] && echo 200 || echo "$body"; }
readyz_from_host() { readyz curl -s --max-time 5 "http://127.0.0.1:$PORT/readyz"; }

# generate <curl-like runner...>: two adapters from the tiny model's catalog, two packs that swap
# both slots; checks the answer carries the images and names the adapters it used.
generate_twice() {
    local out
    for adapters in '{"identity": "identity-diffusers", "style": {"ref": "style-kohya", "scale": 0.8}}' \
                    '{"identity": "identity-peft", "style": "style-xlabs"}'; do
        out=$("$@" "{\"prompt\": \"a watercolor fox\", \"num_images\": 2, \"seed\": 1, \"adapters\": $adapters}") \
            || die "generate with $adapters: $out"
        python3 - "$out" <<'PY' || die "unexpected answer: ${out:0:300}"
import json, sys
body = json.loads(sys.argv[1])
assert len(body["images"]) == 2 and all(len(i) > 100 for i in body["images"]), body.keys()
assert set(body["adapters"]) == {"identity", "style"}, body["adapters"]
PY
    done
}

generate_from_host() {
    curl -sS --fail-with-body --max-time 300 "http://127.0.0.1:$PORT/v1/generate" \
        -H "authorization: Bearer $KEY" -H 'content-type: application/json' -d "$1"
}

# job_roundtrip <base URL> <curl...>: one generation as a job (`Prefer: respond-async`): a 202 with
# a Location, polled (at most 60 times) until it succeeds, its content fetched. The job's record
# and result are written to jobs_dir: a folder the image (and the Deployment) must make writable.
job_roundtrip() {
    local base=$1 location="" body="" status="" code
    shift
    location=$("$@" -sS -o /dev/null -D - --max-time 60 "$base/v1/generate" -H "authorization: Bearer $KEY" \
               -H 'content-type: application/json' -H 'prefer: respond-async' \
               -d '{"prompt": "a watercolor fox", "seed": 1, "adapters": {"identity": "identity-diffusers"}}' \
               | tr -d '\r' | sed -n 's/^[Ll]ocation: //p') || die "the job request failed"
    [ -n "$location" ] || die "a job request got no Location"
    for _ in $(seq 60); do
        body=$("$@" -sS --max-time 10 -H "authorization: Bearer $KEY" "$base$location") || die "polling $location: $body"
        status=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["status"])' "$body") \
            || die "polling $location: ${body:0:300}"
        case $status in succeeded) break ;; failed|cancelled) die "the job $status: ${body:0:300}" ;; esac
        sleep 2
    done
    [ "$status" = succeeded ] || die "the job was still $status after 60 polls"
    code=$("$@" -s -o /dev/null -w '%{http_code}' --max-time 30 -H "authorization: Bearer $KEY" "$base$location/content")
    [ "$code" = 200 ] || die "the job's content answered $code"
}

# --- 1. build ----------------------------------------------------------------------------------
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    "$HERE/build.sh"
fi
podman image exists "$HOTLORA_IMAGE" || die "no image $HOTLORA_IMAGE"

# --- 2. a key, a config file ---------------------------------------------------------------------
keys=$(podman run --rm --network none --entrypoint hotlora "$HOTLORA_IMAGE" keys new --name smoke \
       --scopes generate,prefetch,metrics,admin 2>/dev/null)
KEY=$(sed -n 1p <<<"$keys")
sed -n 2p <<<"$keys" >"$WORK/api-keys"   # only the hash: readable by the container's user
# The Deployment's own config file (deploy/k8s/base), so the kube play pod below has the same
# compile fingerprint and can load what this container compiled.
PYTHON="$PYTHON" "$HERE/kube-render.sh" "$HOTLORA_IMAGE" "$NAME" "$WORK/api-keys" --config >"$WORK/hotlora.toml"
grep -q '^target_rank = 32' "$WORK/hotlora.toml" || die "unexpected deploy/k8s/base/hotlora.toml"
chmod 0644 "$WORK/api-keys" "$WORK/hotlora.toml"

# --- 3. first start: read-only root, caches on volumes ---------------------------------------------
run_args=(--name "$NAME" --read-only -p "127.0.0.1:$PORT:8000"
          -v "${VOLUMES[0]}:/var/cache/hotlora/adapters" -v "${VOLUMES[1]}:/var/cache/hotlora/compile"
          -v "${VOLUMES[2]}:/var/cache/hotlora/jobs"
          -v "$WORK/hotlora.toml:/etc/hotlora/hotlora.toml:ro" -v "$WORK/api-keys:/run/secrets/hotlora/api-keys:ro"
          -e HOTLORA_DEVICE=cpu -e HOTLORA_MAX_BATCH_SIZE=2)
log "starting $NAME ($HOTLORA_IMAGE, read-only root)"
started=$(now)
podman run -d "${run_args[@]}" "$HOTLORA_IMAGE" >/dev/null
for _ in $(seq 30); do podman healthcheck run "$NAME" >/dev/null 2>&1 && break; sleep 2; done
podman healthcheck run "$NAME" >/dev/null || die "healthcheck (/healthz) never passed"
[ "$(podman inspect --format '{{.State.Health.Status}}' "$NAME")" = healthy ] || die "not healthy"
log "healthy after $(elapsed "$started") s; waiting for /readyz"
wait_ready "first start" readyz_from_host
first_ready=$(elapsed "$started")
log "ready after $first_ready s (first start: builds the tiny model, compiles from scratch)"

# --- 4. checks ------------------------------------------------------------------------------------
# The container's processes as the host sees them (rootful, no user namespace: the same uids).
pid=$(podman inspect --format '{{.State.Pid}}' "$NAME")
uids=$(ps -o uid= -p "$pid" --ppid "$pid" | sort -u | tr -d ' ' | tr '\n' ' ')
[ -n "$uids" ] || die "no processes listed"
for uid in $uids; do [ "$uid" != 0 ] || die "a process runs as root (uids: $uids)"; done
log "processes run as uid(s) $uids"
podman exec "$NAME" sh -c 'touch /opt/hotlora/x' 2>/dev/null && die "the root filesystem is writable"
logs=$(podman logs "$NAME" 2>&1)   # (not piped into grep -q: pipefail would see podman's SIGPIPE)
grep -q "target rank 32" <<<"$logs" || die "the mounted config file was not used"
grep -q "API keys required: 1 key" <<<"$logs" || die "the mounted keys file was not used"
code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 10 "http://127.0.0.1:$PORT/v1/generate" \
       -H 'content-type: application/json' -d '{"prompt": "x"}')
[ "$code" = 401 ] || die "a request without a key got $code, not 401"
generate_twice generate_from_host
log "generated with two adapter pairs"
job_roundtrip "http://127.0.0.1:$PORT" curl
podman exec "$NAME" sh -c 'ls /var/cache/hotlora/jobs/job_*.json' >/dev/null || die "no job record on the jobs volume"
log "a job ran to completion (its record on the jobs volume)"

# The engine process killed inside the container (as a segfault or the OOM killer would end it):
# the server stays up (/healthz 200 throughout), a new engine process starts, and it serves again.
engine_pid() { curl -s --max-time 5 "http://127.0.0.1:$PORT/readyz" \
               | "$PYTHON" -c 'import json, sys; print((json.load(sys.stdin).get("engine") or {}).get("engine_pid", ""))'; }
old_engine=$(engine_pid)
[ -n "$old_engine" ] || die "/readyz names no engine process"
podman exec "$NAME" sh -c "kill -9 $old_engine"
started=$(now)
while :; do
    [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "http://127.0.0.1:$PORT/healthz")" = 200 ] \
        || die "/healthz failed while the engine restarted"
    new_engine=$(engine_pid)
    [ -n "$new_engine" ] && [ "$new_engine" != "$old_engine" ] && break
    [ "$(elapsed "$started" | cut -d. -f1)" -ge "$READY_TIMEOUT_S" ] && die "no new engine process after ${READY_TIMEOUT_S}s"
    sleep 1
done
wait_ready "engine restart" readyz_from_host
log "engine process $old_engine killed: engine process $new_engine ready after $(elapsed "$started") s"
restarts=$(curl -s --max-time 5 -H "authorization: Bearer $KEY" "http://127.0.0.1:$PORT/metrics" \
           | grep '^hotlora_engine_restarts_total{cause="signal"}' | awk '{print $2}')
[ "${restarts%.*}" = 1 ] || die "hotlora_engine_restarts_total{cause=\"signal\"} is '${restarts}', not 1"
generate_twice generate_from_host
podman exec "$NAME" sh -c 'ls /var/cache/hotlora/compile/artifacts/compile-artifacts-*.bin' >/dev/null \
    || die "no compile artifacts on the compile volume"
# Inductor's precompiled header, which a restart needs before it can look up a cached kernel, is
# kept with the compile artifacts (HOTLORA_KEEP_COMPILER_HEADERS), not only in the container's new /tmp.
podman exec "$NAME" sh -c 'ls /var/cache/hotlora/compile/artifacts/precompiled-headers/*.gch' >/dev/null \
    || die "no precompiled header kept with the compile artifacts"

# --- 5. restart: the compile cache is reused ------------------------------------------------------------
log "restarting $NAME"
podman stop -t 30 "$NAME" >/dev/null
started=$(now)
podman start "$NAME" >/dev/null
wait_ready "restart" readyz_from_host
second_ready=$(elapsed "$started")
logs=$(podman logs "$NAME" 2>&1)
grep -q "loaded compile artifacts from" <<<"$logs" || die "the restart did not load the compile artifacts"
grep -q "restored inductor's precompiled headers" <<<"$logs" || die "the restart built the precompiled header again"
mapfile -t warm < <(grep -o 'warm: [0-9.]*s' <<<"$logs" | grep -o '[0-9.]*')
[ ${#warm[@]} -ge 2 ] || die "expected two warm-up lines, got ${#warm[@]}"
mapfile -t graphs < <(grep -o 'warm: [0-9.]*s, [0-9]* graphs' <<<"$logs" | awk '{print $3}')
[ ${#graphs[@]} -eq ${#warm[@]} ] || die "warm-up lines without a graph count"
log "ready after $second_ready s on restart (first start $first_ready s); warm-up ${warm[0]} s -> ${warm[-1]} s" \
    "(${graphs[0]} -> ${graphs[-1]} graphs: dynamo traces them again, loading what was compiled)"
awk -v a="$second_ready" -v b="$first_ready" 'BEGIN { exit !(a < b) }' || die "the restart was not faster"
generate_twice generate_from_host
# The Deployment's cache claims become this container's volumes: the pod below must load the
# compile artifacts, as a rescheduled pod on the shared cache volumes does.
podman rm -f -t 30 "$NAME" >/dev/null

# --- 6. the Kubernetes Deployment under podman kube play ---------------------------------------------
log "podman kube play of deploy/k8s/overlays/cpu"
"$HERE/kube-render.sh" "$HOTLORA_IMAGE" "$NAME" "$WORK/api-keys" >"$KUBE_YAML"
podman kube play --replace "$KUBE_YAML" >/dev/null
# kube play names a Deployment's containers <deployment>-pod-<replica>-<container>.
container=$(podman ps --format '{{.Names}}' | grep -m1 -- "^$NAME-pod-" || true)
[ -n "$container" ] || die "kube play started no container"
SERVER=$container
readyz_in_pod() { readyz podman exec "$container" curl -s --max-time 5 http://127.0.0.1:8000/readyz; }
started=$(now)
wait_ready "kube play pod" readyz_in_pod
log "kube play pod ready after $(elapsed "$started") s"
logs=$(podman logs "$container" 2>&1)
grep -q "loaded compile artifacts from" <<<"$logs" || die "the pod did not load the compile artifacts"
generate_in_pod() {
    podman exec "$container" curl -sS --fail-with-body --max-time 300 http://127.0.0.1:8000/v1/generate \
        -H "authorization: Bearer $KEY" -H 'content-type: application/json' -d "$1"
}
generate_twice generate_in_pod
job_roundtrip http://127.0.0.1:8000 podman exec "$container" curl
[ "$(podman exec "$container" id -u)" != 0 ] || die "the pod runs as root"
log "smoke test passed"
