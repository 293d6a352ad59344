"""Mixed-adapter batches against one request at a time, under the same load, in one run.

Usage: .venv/bin/python bench/mixed.py [--users 24] [--batch 6] [--steps 4] [--family flux] [--out bench/results]

A load of many users with small packs (1-3 images, each user its own adapter pair) is submitted
to a Worker at a fixed arrival rate; the same arrival schedule runs against a slot engine (one
request per forward pass, `mixed=False`) and a bank engine (`mixed=True`). Reported: throughput
(images/s), p50/p95 request latency, and the memory the adapter slots or banks take.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a file, Python puts bench/ first on sys.path: bench.harness needs the checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import markdown_table, use_repo_compile_cache, write_results  # noqa: E402

use_repo_compile_cache()


def run_load(engine, jobs_spec, arrival_s: float, steps: int) -> dict:
    from hotlora.engine.worker import Job, Worker

    worker = Worker(lambda: engine, max_queue=len(jobs_spec) + 1, max_batch_delay_s=0.01)
    worker.start()
    jobs = []
    began = time.monotonic()
    for prompt, adapters, n, seed in jobs_spec:
        job = Job(engine.prepare(prompt, adapters=adapters, num_images=n, seed=seed, num_inference_steps=steps,
                                 output_type="latent"))
        worker.submit(job)
        jobs.append(job)
        time.sleep(arrival_s)
    latencies = []
    for job in jobs:
        job.future.result(timeout=600)
        latencies.append(time.monotonic() - job.enqueued)
    wall = time.monotonic() - began
    worker.stop(drain_timeout_s=5)
    images = sum(n for _, _, n, _ in jobs_spec)
    ordered = sorted(latencies)
    return {"images_per_s": round(images / wall, 2), "p50_ms": round(1000 * statistics.median(ordered), 1),
            "p95_ms": round(1000 * ordered[int(0.95 * (len(ordered) - 1))], 1), "wall_s": round(wall, 2),
            "merged_batches": worker.batches, "recompiles": engine.recompiles, "adapter_bytes": engine.writer.nbytes}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--users", type=int, default=24)
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--arrival-ms", type=float, default=5.0)
    parser.add_argument("--family", default="flux")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()

    from hotlora import Engine
    from hotlora.testing import save_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model(Path(tmp) / args.family, args.family)
        names = sorted(p for p in (model / "adapters").iterdir() if p.name not in ("README.json", "catalog.toml"))
        rng = random.Random(0)
        spec = [("a portrait", {"identity": (str(rng.choice(names)), round(rng.uniform(0.5, 1.2), 2)),
                                "style": (str(rng.choice(names)), round(rng.uniform(0.3, 1.0), 2))},
                 rng.choice([1, 2, 3]), i) for i in range(args.users)]
        engines = {label: Engine.from_pretrained(model, target_rank=8, batch_size=args.batch, compile=True, mixed=mixed)
                   for label, mixed in (("one request per pass", False), ("mixed batches", True))}
        for run in range(args.runs):  # alternate, so both see the same machine noise
            for label, engine in engines.items():
                rows.append({"config": label, "run": run, **run_load(engine, spec, args.arrival_ms / 1000, args.steps)})
    summary = []
    for label in engines:
        mine = [r for r in rows if r["config"] == label]
        summary.append({"config": label, **{k: statistics.median(r[k] for r in mine)
                                            for k in ("images_per_s", "p50_ms", "p95_ms", "merged_batches")},
                        "adapter_bytes": mine[0]["adapter_bytes"], "recompiles": max(r["recompiles"] for r in mine)})
    base = summary[0]["images_per_s"]
    for row in summary:
        row["throughput_ratio"] = round(row["images_per_s"] / base, 2)
    table = markdown_table(
        ["config", "images/s", "ratio", "p50 ms", "p95 ms", "merged batches", "adapter memory (bytes)", "recompiles"],
        [[r["config"], r["images_per_s"], f"{r['throughput_ratio']}x", r["p50_ms"], r["p95_ms"], r["merged_batches"],
          r["adapter_bytes"], r["recompiles"]] for r in summary])
    write_results(args.out, "mixed", {"args": vars(args), "runs": rows, "summary": summary}, table,
                  f"{args.users} users, packs of 1-3, batch {args.batch}, {args.steps} steps, arrivals every "
                  f"{args.arrival_ms} ms, median of {args.runs}.")


if __name__ == "__main__":
    main()
