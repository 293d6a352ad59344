#!/usr/bin/env bash
# Step 2 of 2: the one command for a lent GPU machine (no network, its own python3, nothing of
# .venv). First, on the dev machine: `bash bench/device-wheels.sh`. Then one device call:
#
#   command: bash bench/device.sh        carry: [".whl"]        timeout_s: 600
#
# 1. installs from .whl/ what the machine's python3 lacks, or has outside the specifier
#    device-wheels.sh recorded for it (.whl/manifest.json; pip --no-index --no-deps --target
#    .cache/devdeps), and prepends that and src/ to PYTHONPATH;
# 2. preflight: imports torch, diffusers, peft, transformers, hotlora, hotlora.engine and every
#    import statement of bench/gpu_flux.py and the bench modules it imports (bench/device_env.py
#    reads them from the source, so a module renamed in hotlora needs no edit here), runs a bf16
#    matmul and a torch.compile on the GPU, and prints versions and nvidia-smi: a broken
#    environment fails here in about a minute (rc 3), before any GPU time goes to the bench;
# 3. runs bench/gpu_flux.py at full size (1024x1536, 30 steps, pack 6, rank 128), the most valuable
#    figures first: slots on every Linear with two rank-128 adapters (the pack time to set against
#    the seed article's 40.6 s on an H100), its swap rows and the memory plan against
#    torch.cuda.max_memory_allocated (plan_check); no slots (the overhead's baseline); the bf16
#    fused-kept rows (eager auto mode: what a bf16 merge keeps of 0.1/0.3/1% adapters, the path
#    auto takes, output effect fused vs unfused); the FP8 and int8 bases (torchao; pack time, swap,
#    denoiser bytes, CUDA peak, effect kept against the bf16 base); a rank bucket of 32; fused mode
#    (pack time and the fused swap against a copy of the touched bytes); attention only; eager;
#    fused with host restore; as far as the budget goes, each row within its own share of it.
#    Each result is written to $OUT/gpu.json as soon as it is measured; the log goes to $OUT/device.log.
#    torchao travels in .whl; if it does not import there, preflight warns and only the two
#    quantized rows fail (recorded as error_*), not the call.
# The whole command stops within DEVICE_BUDGET_S (530 s): gpu_flux.py starts no measurement it
# does not expect to finish in time, and `timeout` kills it 25 s before the end, which leaves time
# to print the summary. Extra arguments go to gpu_flux.py, e.g. a second call for what the first
# one skipped: `bash bench/device.sh --configs attention_only,eager_every_linear,fused_host`.
# MODEL=wan runs the Wan rows instead (Wan 2.1 T2V 1.3B, random bf16 weights, 480x832, 81 frames, 30
# steps with true CFG, one video a pack, rank 128: every_linear with its swap rows, no_slots, the rank
# bucket, attention only, eager): `MODEL=wan bash bench/device.sh`.
# MODEL=families runs bench/families.py's rows instead, one per image family with a published configuration
# (its real-width blocks, one of each kind, random bf16 weights; 1024x1024 latents' worth of tokens, pack 2,
# 8 steps, rank 128 with buckets 0/32/128: swap, no adapters against no slots, a rank-32 adapter against
# plain diffusers unfused, mixed batch against one at a time) into $OUT/gpu-families.{json,md}; it starts
# no family it does not expect to finish: `MODEL=families bash bench/device.sh`.
#
#   bash bench/device.sh --dry-run        # here, on the CPU, in minutes: tiny sizes, eager (float8_base is
#                                         # skipped with a message: FP8 needs CUDA)
# PYTHON picks the interpreter (default python3), OUT the results folder (default ./out, ignored by
# git), WHEELS_DIR the wheels (default .whl), DEVDEPS where they are installed (.cache/devdeps).
# The check of this script in CI, as the machine would run it: tests/integration/test_device_bench.py.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
STARTED=$(date +%s)
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${OUT:-$REPO/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
MODEL=${MODEL:-flux}  # flux; wan: Wan 2.1 T2V 1.3B at 480x832, 81 frames, one video a pack; families
BENCH_MODULE=bench.gpu_flux
if [ "$MODEL" = families ]; then BENCH_MODULE=bench.families; fi
export BENCH_MODULE
if [ "$DRY" = 1 ]; then BUDGET=${DEVICE_BUDGET_S:-240}; else BUDGET=${DEVICE_BUDGET_S:-530}; fi
DEPS=${DEVDEPS:-$REPO/.cache/devdeps}
WHEELS=${WHEELS_DIR:-$REPO/.whl}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$REPO/.cache/inductor}

elapsed() { echo $(( $(date +%s) - STARTED )); }

install_missing() {
    echo "== [$(elapsed)s] wheels: install what $PY lacks or has outside the recorded pins ($WHEELS/manifest.json)"
    rm -rf "$DEPS"
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "  no $WHEELS/*.whl: nothing to install (on a lent machine: run 'bash bench/device-wheels.sh' on the"
        echo "  dev machine first and carry [\".whl\"]); the import check below says what is missing"
        return 0
    fi
    local wanted
    wanted=$("$PY" -m bench.device_deps install-list "$WHEELS") || return 1
    if [ -n "$wanted" ]; then
        # Only the carried wheels: the dev machine's pip settings (extra indexes, find-links, constraints) stay out.
        # shellcheck disable=SC2086
        env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
            "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --find-links "$WHEELS" --target "$DEPS" $wanted || return 1
        echo "  installed into $DEPS: $(echo $wanted)"
    else
        echo "  nothing to install"
    fi
}

preflight() {
    echo "== [$(elapsed)s] imports and versions ($PY)"
    DRY=$DRY "$PY" - <<'EOF'
import importlib, importlib.metadata as md, os, platform, sys, time
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

dry = os.environ["DRY"] == "1"
print(f"python {platform.python_version()} at {sys.executable}")
failed = []
from bench.device_env import BASE_MODULES, bench_imports, check_imports

for name in BASE_MODULES:
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - every failure is reported, then the run stops
        failed.append(name)
        print(f"  FAIL {name}: {type(exc).__name__}: {exc}")
        continue
    print(f"  ok   {name} {getattr(module, '__version__', '')} ({os.path.dirname(getattr(module, '__file__', '') or '')})")
try:  # only the quantized rows (float8_base, int8_base) need it: a failure here is a warning
    import torchao
    print(f"  ok   torchao {torchao.__version__} ({os.path.dirname(torchao.__file__)})")
except Exception as exc:  # noqa: BLE001
    print(f"  WARN torchao: {type(exc).__name__}: {exc} (the float8_base and int8_base rows will fail)")
# Every import statement of the bench (bench/gpu_flux.py, or MODEL's) and the bench modules it imports.
imports = bench_imports(os.environ["BENCH_MODULE"])
bench_failed = check_imports(imports)
for line in bench_failed:
    print(f"  FAIL {line}")
print(f"  {len(imports) - len(bench_failed)} of {len(imports)} imports of {os.environ['BENCH_MODULE']} and its bench "
      "modules ok")
if bench_failed:
    failed.append("bench imports")

# Declared requirements of hotlora (pyproject), diffusers and peft against what is installed.
import tomllib
reqs = [("hotlora", d) for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]]
for dist in ("diffusers", "peft"):
    reqs += [(dist, r) for r in (md.requires(dist) or [])]
for owner, text in reqs:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        print(f"  note: {owner} declares {text}; not installed")
        continue
    if not req.specifier.contains(have, prereleases=True):
        print(f"  note: {owner} declares {text}; installed {have}")

import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}")
if not dry:
    if not torch.cuda.is_available():
        failed.append("torch.cuda")
    else:
        print(f"  {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}, "
              f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(10):
            b = a @ a
        torch.cuda.synchronize()
        print(f"  bf16 4096^3 matmul: {10 * 2 * 4096**3 / (time.perf_counter() - began) / 1e12:.0f} TFLOP/s (cold)")
        began = time.perf_counter()
        f = torch.compile(lambda x: torch.nn.functional.gelu(x @ x.T) + 1)
        f(a)
        torch.cuda.synchronize()
        print(f"  torch.compile smoke test: {time.perf_counter() - began:.1f} s")
if failed:
    sys.exit(f"preflight FAILED: {', '.join(failed)}")
print("preflight ok")
EOF
}

summary() {
    echo "== [$(elapsed)s] summary of $OUT/gpu.json"
    "$PY" - "$OUT/gpu.json" <<'EOF'
import json, sys
try:
    report = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    sys.exit(f"no results: {exc}")
print(f"device: {report.get('device')}  torch {report.get('torch')}  elapsed {report.get('elapsed_s')} s"
      f"  done: {report.get('done', False)}")
for label in report.get("configs_done", []):
    row = report[label]
    keys = ("build_s", "warmup_s", "pack_ms", "wall_ms", "swap_ms", "overhead_pct", "compile_speedup", "cuda_peak_gib",
            "denoiser_bytes", "effect_vs_bf16", "recompiles", "skipped", "error")
    print(f"  {label:26s} " + "  ".join(f"{k}={row[k]}" for k in keys if k in row))
for row in report.get("swap", []):
    print(f"  swap rank {row['rank']:4d}  {row['bytes']:>12d} B  swap {row['swap_ms']} ms  copy_ {row['copy_ms']} ms"
          f"  ratio {row['swap_over_copy']}x")
row = report.get("plan_check")
if row:
    measured = row["measured_peak_above_static_gib"]
    print(f"  plan_check {row['size']} chunk {row['chunk']}: planned activations {row['planned_activation_gib']} GiB, "
          + (f"measured {measured} GiB above static, ratio {row['planned_over_measured']}"
             if isinstance(measured, (int, float)) else f"not measured: {measured}"))
for key in ("swap_fused", "swap_fused_host"):
    row = report.get(key)
    if row:
        print(f"  {key} {row['rank']}  {row['bytes']:>12d} B from {row['restore']}  swap {row['swap_ms']} ms"
              f"  copy_ {row['copy_ms']} ms  ratio {row['swap_over_copy']}x  prepare {row['prepare_ms']} ms")
for row in report.get("fused_kept_rows", []):
    print(f"  fused_kept {row['magnitude']:.1%}: merge keeps {row.get('fused_kept')}, auto serves "
          f"{row.get('auto_serves')}, prepare {row.get('prepare_ms')} ms, swap fused {row.get('fused_swap_ms')} / "
          f"slots {row.get('slots_swap_ms')} ms, output effect fused vs unfused {row.get('effect_fused_vs_unfused')}")
for key, value in report.items():
    if key.startswith(("skipped_", "error_")) or key in ("killed", "running"):
        print(f"  {key}: {str(value).splitlines()[-1] if value else value}")
EOF
}

main() {
    echo "== hotlora device bench ($( [ "$DRY" = 1 ] && echo 'dry run, CPU' || echo 'GPU' )); budget ${BUDGET}s; OUT=$OUT"
    echo "   $(uname -srm); $(nproc) cores; $(date -u +%FT%TZ)"
    install_missing || { echo "wheel install FAILED"; return 2; }
    export PYTHONPATH="$DEPS:$REPO/src:$REPO${PYTHONPATH:+:$PYTHONPATH}"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
            --format=csv || true
    else
        echo "no nvidia-smi"
    fi
    preflight || { echo "preflight FAILED: no GPU time spent on the bench"; return 3; }

    local args left hard
    if [ "$DRY" = 1 ] && [ "$MODEL" = families ]; then
        args=(--widths tiny --families sd3 --runs 1 --swap-repeats 3)
    elif [ "$MODEL" = families ]; then
        args=(--widths wide --latent-side 128 --pack 2 --steps 8 --runs 3 --target-rank 128)
    elif [ "$DRY" = 1 ] && [ "$MODEL" = wan ]; then
        args=(--model wan --device cpu --height 16 --width 16 --frames 5 --steps 2 --pack 1 --rank 4 --layers 1
              --heads 2 --text-width 64 --swap-repeats 3)
    elif [ "$DRY" = 1 ]; then
        args=(--device cpu --height 64 --width 64 --steps 2 --pack 2 --rank 4 --layers 1 --single-layers 1
              --heads 2 --text-width 256 --swap-repeats 3)
    elif [ "$MODEL" = wan ]; then
        args=(--model wan --height 480 --width 832 --frames 81 --steps 30 --pack 1 --rank 128)
    else
        args=(--height 1024 --width 1536 --steps 30 --pack 6 --rank 128)
    fi
    if [ "$DRY" = 1 ] && [ "${DRY_COMPILE:-0}" != 1 ]; then args+=(--no-compile); fi
    left=$(( BUDGET - $(elapsed) ))
    hard=$(( left - 25 ))                  # kill the bench 25 s before the end: time for the summary
    if [ "$hard" -lt 30 ]; then echo "no time left for the bench"; return 4; fi
    echo "== [$(elapsed)s] $BENCH_MODULE: ${hard}s hard limit, soft budget $(( hard - 15 ))s"
    if [ "$MODEL" = families ]; then args+=(--name gpu-families); fi
    timeout --signal=TERM --kill-after=10 "$hard" \
        "$PY" -u -m "$BENCH_MODULE" "${args[@]}" --budget-s $(( hard - 15 )) --out "$OUT" "$@"
    local rc=$?
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "bench stopped by the hard limit (rc $rc); results so far are in $OUT"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=clocks.sm,memory.used,temperature.gpu,power.draw --format=csv || true
    fi
    if [ "$MODEL" = families ]; then cat "$OUT/gpu-families.md" 2>/dev/null || echo "no results"; else summary; fi
    echo "== [$(elapsed)s] done (bench rc $rc); files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
    return "$rc"
}

main "$@" 2>&1 | tee "$OUT/device.log"
exit "${PIPESTATUS[0]}"
