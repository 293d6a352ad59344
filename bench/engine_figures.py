"""Engine figures on the tiny models: compile warm-up, prepare and swap time, eager vs compiled pack time.

Usage: .venv/bin/python bench/engine_figures.py [--out bench/results] [--runs 3]
Writes engine_figures.json and engine_figures.md. Ratios are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a file, Python puts bench/ first on sys.path: bench.harness needs the checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import markdown_table, use_repo_compile_cache, write_results  # noqa: E402

use_repo_compile_cache()


def prepare_ms(engine, request: dict, pack: int, steps: int, runs: int = 50) -> float:
    """Median ms of ``engine.prepare`` for a typical request: a prompt and two adapters already in the
    store's RAM tier (the first call fetches them), everything a request costs before the swap
    (parameters checked, adapters resolved and validated, text and slot layouts planned)."""
    def once() -> float:
        began = time.perf_counter()
        engine.prepare("a portrait", adapters=request, num_images=pack, num_inference_steps=steps,
                       output_type="latent")
        return (time.perf_counter() - began) * 1000

    once()
    return statistics.median(once() for _ in range(runs))


def measure(family: str, model_dir: Path, runs: int, pack: int, steps: int) -> dict:
    from hotlora import Engine
    from hotlora.settings import StoreConfig

    adapters_dir = model_dir / "adapters"
    request = {"identity": (adapters_dir / "identity-diffusers", 0.9), "style": (adapters_dir / "style-diffusers", 0.7)}
    refs = {slot: (str(path), scale) for slot, (path, scale) in request.items()}
    store = StoreConfig(cache_dir=model_dir.parent / f"{family}-cache", local_roots=(adapters_dir,))
    row = {"family": family}
    for compiled in (False, True):
        began = time.perf_counter()
        engine = Engine.from_pretrained(model_dir, target_rank=8, batch_size=pack, compile=compiled, store=store)
        ready = time.perf_counter() - began
        # Resolved as a request's are: validated, then packed for the slots' layout.
        loaded = engine.resolve(refs)
        other = {"identity": loaded["style"], "style": loaded["identity"]}
        swaps, packed_writes = [], 0
        for i in range(50):
            report = engine.writer.swap(loaded if i % 2 else other)
            swaps.append(report.ms)
            packed_writes += report.packed_writes
        packs = []
        for _ in range(runs):
            result = engine.generate("a portrait", adapters=request, num_images=pack, num_inference_steps=steps,
                                     output_type="latent")
            packs.append(sum(result.timings.generate_ms))
        key = "compiled" if compiled else "eager"
        row[f"{key}_prepare_ms"] = round(prepare_ms(engine, refs, pack, steps), 3)
        row[f"{key}_ready_s"] = round(ready, 2)
        row[f"{key}_pack_ms"] = round(statistics.median(packs), 1)
        row[f"{key}_swap_ms"] = round(statistics.median(swaps), 3)
        row[f"{key}_packed_share"] = round(packed_writes / (2 * 50), 2)
        row["slot_bytes"] = engine.writer.nbytes
        row["recompiles"] = engine.recompiles
        row["compile_mode"] = engine.compile_mode or row.get("compile_mode")
    row["compiled_speedup"] = round(row["eager_pack_ms"] / row["compiled_pack_ms"], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pack", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    from hotlora.testing import save_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("flux", "sdxl"):
            model = save_tiny_model(Path(tmp) / family, family)
            rows.append(measure(family, model, args.runs, args.pack, args.steps))
    table = markdown_table(
        ["family", "warm-up compiled (s)", "ready eager (s)", "prepare (ms)", "swap both slots (ms)",
         "pack eager (ms)", "pack compiled (ms)", "speedup", "recompiles"],
        [[r["family"], r["compiled_ready_s"], r["eager_ready_s"], r["compiled_prepare_ms"], r["compiled_swap_ms"],
          r["eager_pack_ms"], r["compiled_pack_ms"], f"{r['compiled_speedup']}x", r["recompiles"]] for r in rows])
    write_results(args.out, "engine_figures", {"args": vars(args), "rows": rows}, table,
                  f"Pack of {args.pack} at batch {args.pack}, {args.steps} steps, median of {args.runs}.")


if __name__ == "__main__":
    main()
