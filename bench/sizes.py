"""Many sizes from one warm engine: dynamic size dimensions against one static graph per size.

Usage: .venv/bin/python bench/sizes.py [--families flux,sdxl] [--batch 2] [--runs 3] [--out bench/results]

Per family, three kinds of engine, each built in a fresh process with an EMPTY inductor cache (so
warm-up times are cold compiles and comparable):

* ``dynamic``: one engine serving every size, the sequence (Flux) / spatial (SDXL) dimensions
  turned dynamic at warm-up (dynamo's automatic dynamic shapes, duck shaping off);
* ``static``: one engine serving every size, one static graph per size and batch shape
  (``torch.compile(dynamic=False)``);
* ``alone``: an engine compiled for one size only (today's single-size engine), once per size: the
  speed a size would have if it were the only one.

Reported: dynamo graphs compiled by the warm-up, warm-up seconds, and per size the denoising time
per step for a full pack (``(t(6 steps) - t(2 steps)) / 4``, so text encoding and set-up cancel
out; each t the fastest of ``--runs``, since on a shared machine other load only ever adds time),
with its ratio to the ``alone`` engine. Run it on a quiet machine: the latency columns are noise
when anything else competes for the cores. Writes bench/results/sizes.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {  # WIDTHxHEIGHT; distinct sequence lengths (Flux) and latent shapes (SDXL), three aspect ratios
    "flux": ["32x32", "48x32", "32x64"],
    "sdxl": ["64x64", "96x64", "64x128"],
}
STEPS = (2, 6)


def child(spec: dict) -> dict:
    """One engine, in this (fresh) process: build it, warm it, time every size it serves."""
    import torch

    import hotlora.engine.core as core
    from hotlora import Engine
    from hotlora.config import parse_size
    from hotlora.engine.pipeline import graph_count

    core.DYNAMIC_SIZES[spec["family"]] = spec["mode"] != "static"
    engine = Engine.from_pretrained(spec["model"], target_rank=8, batch_size=spec["batch"], compile=True,
                                    sizes=spec["sizes"])
    graphs = graph_count()
    torch._dynamo.config.error_on_recompile = True
    per_step = {}
    for size in spec["sizes"]:
        height, width = parse_size(size)

        def pack_ms(steps: int) -> float:
            result = engine.generate("a cat", num_images=spec["batch"], num_inference_steps=steps, height=height,
                                     width=width, output_type="latent")
            return sum(result.timings.generate_ms)

        pack_ms(STEPS[0])  # first call at this size after the others: nothing cold in the timings
        short = min(pack_ms(STEPS[0]) for _ in range(spec["runs"]))
        long = min(pack_ms(STEPS[1]) for _ in range(spec["runs"]))
        per_step[size] = round((long - short) / (STEPS[1] - STEPS[0]), 2)
    return {"graphs": graphs, "warmup_s": round(engine.warmup_s, 1), "per_step_ms": per_step,
            "recompiles": engine.recompiles, "dynamic_sizes": engine.dynamic_sizes}


def run_child(spec: dict, tmp: Path) -> dict:
    inductor = Path(tempfile.mkdtemp(dir=tmp, prefix="inductor-"))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    began = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True,
                          text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"child {spec['mode']} {spec['sizes']} failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = round(time.perf_counter() - began, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default="flux,sdxl")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from hotlora.benchmarking import markdown_table, write_results
    from hotlora.testing import save_tiny_model

    rows, data = [], {"args": vars(args), "sizes": SIZES, "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for family in args.families.split(","):
            model = save_tiny_model(tmp / family, family, target_rank=8)
            base = {"family": family, "model": str(model), "batch": args.batch, "runs": args.runs}
            results = {mode: run_child({**base, "mode": mode, "sizes": SIZES[family]}, tmp)
                       for mode in ("dynamic", "static")}
            alone = {size: run_child({**base, "mode": "alone", "sizes": [size]}, tmp) for size in SIZES[family]}
            results["alone"] = {"graphs": sum(r["graphs"] for r in alone.values()),
                                "warmup_s": round(sum(r["warmup_s"] for r in alone.values()), 1),
                                "per_step_ms": {s: r["per_step_ms"][s] for s, r in alone.items()},
                                "recompiles": sum(r["recompiles"] for r in alone.values()), "engines": alone}
            data["families"][family] = results
            for mode, label in (("dynamic", "one engine, dynamic sizes"), ("static", "one engine, a graph per size"),
                                ("alone", "one engine per size (sum)")):
                r = results[mode]
                steps = [f"{r['per_step_ms'][s]} ({r['per_step_ms'][s] / results['alone']['per_step_ms'][s]:.2f}x)"
                         for s in SIZES[family]]
                rows.append([family, label, r["graphs"], r["warmup_s"], *steps, r["recompiles"]])
    headers = ["family", "engine", "graphs compiled", "warm-up s (cold)", *[f"ms/step {i + 1} (vs alone)"
                                                                         for i in range(3)], "recompiles"]
    table = markdown_table(headers, rows)
    sizes = "; ".join(f"{f}: {', '.join(s)}" for f, s in SIZES.items())
    description = (f"Tiny models. Sizes (WIDTHxHEIGHT) "
                   f"{sizes}; batch size {args.batch} (warm-up batches 1 and {args.batch}, SDXL with and without "
                   f"CFG); denoising ms per step of a full pack, fastest of {args.runs}; every engine built in a "
                   f"fresh process with an empty inductor cache.")
    write_results(args.out, "sizes", data, table, description)


if __name__ == "__main__":
    main()
