"""A cold start against a restart of the server's default engine, and where each one's time goes.

Usage: .venv/bin/python bench/restart.py [--runs 1] [--family flux]
Each start is its own process running ``Engine.from_pretrained`` with ``hotlora serve``'s engine
configuration (3 writer states, batch "auto" up to 6, the chunk-size measurement) and a
``compile_cache_dir``. Cold: an empty inductor cache and no compile artifacts. Restart: the same
two folders, as a restarted server or a new container on the cache volume has them. The child
times the phases by wrapping the engine's own functions and reads torch's own counters
(``torch._dynamo.utils.compilation_time_metrics``, what ``compile_times()`` prints, and ``counters``). Writes bench/results/restart.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHILD = r"""
import json, sys, time
import torch
from torch._dynamo.utils import compilation_time_metrics, counters
from hotlora import Engine
import hotlora.engine.core as core
import hotlora.engine.warm as warm
import hotlora.engine.warmup as warmup
from hotlora.engine.pipeline import CompileArtifacts, graph_count
from hotlora.settings.server import ServerConfig

phases = {}
def timed(owner, name, label):
    inner = getattr(owner, name)
    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            phases[label] = phases.get(label, 0.0) + time.perf_counter() - began
    setattr(owner, name, wrapper)

timed(core, "load_model", "load")
timed(warm, "install_expert_writers", "writers")
timed(warm, "install_text_writer", "writers")
timed(warm, "measured_chunks", "chunk measurement")
timed(CompileArtifacts, "load", "artifacts load")
timed(CompileArtifacts, "save", "artifacts saves")
passes = []
run = warmup._run
def counted(engine, batch, height, width, scale, prompt="warm-up", **keywords):  # keywords: tasks, frames
    graphs, began = graph_count(), time.perf_counter()
    run(engine, batch, height, width, scale, prompt, **keywords)
    passes.append({"batch": batch, "s": round(time.perf_counter() - began, 2), "graphs": graph_count() - graphs})
warmup._run = counted
ran = []
warm_up = warm.warm_up
warm.warm_up = lambda *args, **kwargs: ran.append(warm_up(*args, **kwargs)) or ran[-1]

model, cache = sys.argv[1], sys.argv[2]
began = time.perf_counter()
engine = Engine.from_pretrained(model, ServerConfig(model=model, compile_cache_dir=cache).engine_config())
total = time.perf_counter() - began
def spent(name):  # what torch.compile's dynamo_timed regions recorded (compile_times() prints the same)
    return round(sum(compilation_time_metrics.get(name, [])), 1)
print("RESULT " + json.dumps({
    "engine_s": round(total, 1), "warmup_s": round(engine.warm.warmup_s, 1),
    "phases": {name: round(s, 1) for name, s in phases.items()},
    "dynamo_compile_s": spent("_compile.compile_inner"), "bytecode_tracing_s": spent("bytecode_tracing"),
    "build_guards_s": spent("build_guards"), "backend_s": spent("OutputGraph.call_user_compiler"),
    "graphs": graph_count(), "passes_run": len(ran[0]),
    "passes_skipped": engine.warm.warmup_skipped, "artifacts_loaded": engine.compile_artifacts_loaded,
    "aot_autograd": dict(counters["aot_autograd"]), "fx_graph_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
    "fx_graph_cache_misses": counters["inductor"]["fxgraph_cache_miss"], "passes": passes}))
"""


def start(model: Path, folder: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}
    load_before, began = os.getloadavg()[0], time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, str(model), str(folder / "compile")], env=env,
                          capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return {"process_s": round(time.perf_counter() - began, 1),
            "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
            **json.loads(line.removeprefix("RESULT "))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="flux")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    from bench.harness import markdown_table, write_results
    from hotlora.testing import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = save_tiny_model(tmp / args.family, args.family)
        runs = []
        for run in range(args.runs):
            folder = tmp / f"run-{run}"
            runs.append({"cold": start(model, folder), "restart": start(model, folder)})

    def median(kind, *path):
        values = []
        for run in runs:
            value = run[kind]
            for key in path:
                value = value.get(key, 0.0) if isinstance(value, dict) else 0.0
            values.append(value)
        return round(statistics.median(values), 1)

    rows = [[label, median("cold", *path), median("restart", *path)] for label, path in [
        ("engine start to warm (s)", ("engine_s",)), ("process start to warm (s)", ("process_s",)),
        ("load (s)", ("phases", "load")), ("writers (s)", ("phases", "writers")),
        ("warm-up (s)", ("warmup_s",)), ("  dynamo, all of it (s)", ("dynamo_compile_s",)),
        ("  of which bytecode tracing (s)", ("bytecode_tracing_s",)), ("  of which guards (s)", ("build_guards_s",)),
        ("  of which AOT autograd + inductor, or their cache loads (s)", ("backend_s",)),
        ("chunk measurement (s)", ("phases", "chunk measurement")),
        ("artifacts load (s)", ("phases", "artifacts load")), ("artifacts saves (s)", ("phases", "artifacts saves")),
        ("graphs compiled", ("graphs",)), ("warm-up passes run", ("passes_run",)),
        ("warm-up passes skipped", ("passes_skipped",)), ("FX graph cache hits", ("fx_graph_cache_hits",)),
        ("FX graph cache misses", ("fx_graph_cache_misses",))]]
    ratio = median("restart", "engine_s") / median("cold", "engine_s")
    rows.append(["restart / cold (engine)", "", f"{ratio:.0%}"])
    loads = [load for run in runs for start_ in run.values() for load in start_["load_average"]]
    rows.append(["load average (1 min), lowest-highest at the starts' ends", "", f"{min(loads)}-{max(loads)}"])
    table = markdown_table(["", "cold", "restart"], rows)
    write_results(args.out, "restart", {"args": vars(args), "runs": runs, "restart_over_cold": round(ratio, 3)},
                  table, f"Median of {args.runs} run(s); the server's default engine on the tiny {args.family} model.")


if __name__ == "__main__":
    main()
