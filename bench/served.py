"""A request through the server against the same engine called in-process, side by side in one run.

Usage: .venv/bin/python bench/served.py [--model DIR] [--dtype float32|bfloat16] [--requests 8]
                                        [--steps 4] [--images 3] [--rounds 2] [--size PX] [--no-compile]
                                        [--target-rank 8] [--identity REF --style REF] [--name served]

The full-size SDXL architecture (``python -m hotlora.fullsize.sdxl build .cache/fullsize/sdxl``, its
kohya rank-32 and diffusers rank-128 adapters):

    .venv/bin/python bench/served.py --model .cache/fullsize/sdxl --dtype bfloat16 --size 256 --images 1 \
        --steps 2 --requests 4 --target-rank 128 --identity .cache/fullsize/sdxl/adapters/kohya-r32.safetensors \
        --style .cache/fullsize/sdxl/adapters/diffusers-r128 --name served-sdxl-full

Three ways to run the same requests (one prompt, both slots filled with the model's sample
adapters, the same seeds), each in a fresh process so that none inherits another's threads:

- ``engine``: ``Engine.from_pretrained`` and ``engine.generate`` on the main thread of a process
  that runs nothing else (the Python API);
- ``served``: ``hotlora serve`` (the engine in its own process, the default), requests over HTTP;
- ``served-thread``: ``hotlora serve`` with ``engine_process = false``, the engine on a thread of
  the server's process (how every server ran before the engine process): the row that shows the
  thread effect (torch work slower on a thread once another live thread has run an OpenMP region).

For each: the engine's own time per request (``generate_ms``: denoise and decode; the server's
``Server-Timing``), and, served, the request's wall time at the client with its queue, prepare and
encode parts apart. Ratios are against ``engine``. Rounds alternate the order. Writes
bench/results/served.{json,md}.
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

from bench.harness import markdown_table, use_repo_compile_cache, write_results  # noqa: E402

use_repo_compile_cache()
REPO = Path(__file__).resolve().parents[1]
PROMPT = "a portrait in the style"


def adapters_of(args, model: Path) -> dict:
    """Both slots' adapters: ``--identity`` / ``--style``, else the tiny model's samples."""
    root = model / "adapters"
    identity, style = args.identity or root / "identity-diffusers", args.style or root / "style-diffusers"
    return {"identity": {"ref": str(Path(identity).resolve()), "scale": 1.0},
            "style": {"ref": str(Path(style).resolve()), "scale": 0.7}}


def adapter_roots(args, model: Path) -> str:
    """The folders the served ways may read adapters from (``--local-roots``)."""
    refs = [Path(a["ref"]) for a in adapters_of(args, model).values()]
    return os.pathsep.join(sorted({str(r if r.is_dir() else r.parent) for r in refs}))


ENGINE_ALONE = r"""
import json, sys, time
from hotlora import Engine
args = json.loads(sys.argv[1])
engine = Engine.from_pretrained(args["model"], slots=("identity", "style"), target_rank=args["target_rank"],
                                batch_size=args["images"], compile=args["compile"], dtype=args["dtype"],
                                height=args["size"], width=args["size"])
out = []
for i in range(args["warm"] + args["requests"]):
    began = time.perf_counter()
    result = engine.generate(args["prompt"], adapters={k: (v["ref"], v["scale"]) for k, v in args["adapters"].items()},
                             num_images=args["images"], num_inference_steps=args["steps"], seed=i)
    wall = (time.perf_counter() - began) * 1000
    if i >= args["warm"]:
        out.append({"wall_ms": wall, "generate_ms": sum(result.timings.generate_ms),
                    "swap_ms": result.timings.swap_ms, "recompiles": result.recompiles})
print("RESULT " + json.dumps(out))
"""


def run_engine_alone(args, model: Path) -> list[dict]:
    spec = {"model": str(model), "images": args.images, "compile": not args.no_compile, "dtype": args.dtype,
            "warm": 1, "requests": args.requests, "size": args.size, "steps": args.steps, "prompt": PROMPT,
            "adapters": adapters_of(args, model), "target_rank": args.target_rank}
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run([sys.executable, "-c", ENGINE_ALONE, json.dumps(spec)], capture_output=True, text=True,
                          env=env, timeout=3600)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the in-process engine failed:\n{done.stderr[-4000:]}")
    return json.loads(line.removeprefix("RESULT "))


def run_served(args, model: Path, engine_process: bool, port: int) -> list[dict]:
    import httpx

    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    command = [str(Path(sys.executable).parent / "hotlora"), "serve", "--model", str(model), "--port", str(port),
               "--target-rank", str(args.target_rank), "--batch-size", str(args.images), "--dtype", args.dtype,
               "--local-roots", adapter_roots(args, model), *(("--height", str(args.size), "--width", str(args.size))
                                                           if args.size else ()),
               "--engine-process" if engine_process else "--no-engine-process"]
    if args.no_compile:
        command.append("--no-compile")
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 1800
            while True:
                if server.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"hotlora serve exited:\n{log.read()[-4000:]}")
                try:
                    if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("hotlora serve never became ready")
                time.sleep(0.5)
            out = []
            with httpx.Client(timeout=600) as client:
                for i in range(1 + args.requests):
                    body = {"prompt": PROMPT, "adapters": adapters_of(args, model), "num_images": args.images,
                            "num_inference_steps": args.steps, "seed": i}
                    began = time.perf_counter()
                    answer = client.post(f"{url}/v1/generate", json=body)
                    wall = (time.perf_counter() - began) * 1000
                    answer.raise_for_status()
                    if i == 0:
                        continue
                    timings = answer.json()["timings"]
                    out.append({"wall_ms": wall, **{k: timings[k] for k in
                                ("generate_ms", "swap_ms", "queue_ms", "prepare_ms", "encode_ms", "total_ms")},
                                "recompiles": answer.json()["recompiles"]})
            return out
        finally:
            server.terminate()
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                server.kill()


def summary(rows: list[dict]) -> dict:
    return {key: round(statistics.median(r[key] for r in rows), 2) for key in rows[0] if key != "recompiles"} | {
        "recompiles": max(r["recompiles"] for r in rows), "runs": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a local model directory (default: tiny Flux)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--images", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--size", type=int, default=None, help="height and width (default: the model's)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--target-rank", type=int, default=8)
    parser.add_argument("--identity", default=None, help="the identity slot's adapter (default: the tiny model's sample)")
    parser.add_argument("--style", default=None, help="the style slot's adapter (default: the tiny model's sample)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--name", default="served")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from hotlora.tiny import save_tiny_model

        model = REPO / ".cache" / "bench" / "tiny-flux"
        if not (model / "model_index.json").is_file():
            save_tiny_model(model, "flux")
    variants = {"engine": lambda: run_engine_alone(args, model),
                "served": lambda: run_served(args, model, True, args.port),
                "served-thread": lambda: run_served(args, model, False, args.port + 1)}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in order:
            print(f"round {round_ + 1}: {name}", flush=True)
            runs[name] += variants[name]()
    results = {name: summary(rows) for name, rows in runs.items()}
    base = results["engine"]
    rows = []
    for name, r in results.items():
        rows.append([name, r["generate_ms"], round(r["generate_ms"] / base["generate_ms"], 3), r["wall_ms"],
                     round(r["wall_ms"] / base["wall_ms"], 3), r.get("queue_ms", "-"), r.get("prepare_ms", "-"),
                     r.get("encode_ms", "-"), r["recompiles"], r["runs"]])
    table = markdown_table(["way", "generate ms (median)", "vs engine", "request wall ms", "vs engine", "queue ms",
                            "prepare ms", "encode ms", "recompiles", "requests"], rows)
    adapters = ", ".join(f"{slot} {Path(a['ref']).name} x{a['scale']}" for slot, a in adapters_of(args, model).items())
    description = (f"Model {model.name}, {args.size or 'default'} px, {args.dtype}, target rank {args.target_rank} "
                   f"({adapters}), "
                   f"{'eager' if args.no_compile else 'compiled'}, "
                   f"{args.images} images x {args.steps} steps per request, both slots filled, "
                   f"{args.requests} requests x {args.rounds} rounds per way (after one warm request), orders "
                   "alternating. generate: the engine's denoise and decode; wall: the whole request at the "
                   "caller (served: HTTP, fetch from the RAM cache, prepare, queue, IPC, PNG encoding).")
    write_results(args.out, args.name, {"args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                                        "runs": runs}, table, description)


if __name__ == "__main__":
    main()
