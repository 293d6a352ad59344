"""Chunk size by measurement: the engine with ``batch_size="auto"`` against every fixed chunk size it
chooses among, side by side in one process (same model, adapters, size and steps).

    python -m bench.batch [--model DIR] [--size WxH] [--pack 6] [--steps 4] [--runs 5]

The tiny model at its own 32x32 is launch-bound (batching wins); at 128x128 (4,096 tokens) it is
compute-bound on a CPU, where a big batch can lose. Neither predicts a GPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

# Run as a file, Python puts bench/ first on sys.path: bench.harness needs the checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (
    allow_many_compiled_engines, markdown_table, use_repo_compile_cache, write_results,
)

use_repo_compile_cache()

from bench.ablation import PROMPT, adapter_pairs, measure  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--family", default="flux")
    parser.add_argument("--size", help="WIDTHxHEIGHT (default: the model's)")
    parser.add_argument("--pack", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default="batch")
    args = parser.parse_args()

    from hotlora import Engine
    from hotlora.settings import parse_size
    from hotlora.engine.warmup import candidates
    from hotlora.testing import save_tiny_model

    allow_many_compiled_engines()
    model = Path(args.model) if args.model else save_tiny_model(Path(tempfile.mkdtemp()) / args.family, args.family)
    pairs = adapter_pairs(model, max(3, args.runs), args.rank)
    size = dict(zip(("height", "width"), parse_size(args.size))) if args.size else {}
    rows, chunks = {}, {}
    configurations = [(f"batch {b}", {"batch_size": b}) for b in candidates(args.pack)]
    configurations.append(("auto", {"batch_size": "auto", "max_batch_size": args.pack}))
    for label, options in configurations:
        engine = Engine.from_pretrained(model, target_rank=args.rank, compile=True, **size, **options)
        rows[label] = measure(lambda p, e=engine: e.generate(
            PROMPT, adapters={"identity": (str(p[0]), 1.0), "style": (str(p[1]), 0.8)}, num_images=args.pack,
            num_inference_steps=args.steps, output_type="latent"), pairs, args.runs)
        chunks[label] = engine.chunks
    best = min((k for k in rows if k != "auto"), key=lambda k: rows[k]["pack_ms"])
    for row in rows.values():
        row["vs_best_fixed"] = round(row["pack_ms"] / rows[best]["pack_ms"], 3)
    table = markdown_table(["configuration", "pack ms (median)", "vs best fixed", "new graphs"],
                           [[k, v["pack_ms"], f"{v['vs_best_fixed']}x", v["new_graphs"]] for k, v in rows.items()])
    chosen = next(iter(chunks["auto"].values()), {})
    table += f"\n\nauto chose chunk {chosen.get('chosen')} (warm-up ms per image: {chosen.get('ms_per_image')})"
    write_results(args.out, args.name, {"args": vars(args), "rows": rows, "auto": chunks["auto"], "best_fixed": best},
                  table, f"pack of {args.pack}, {args.steps} steps, size {args.size or 'the model default'}")


if __name__ == "__main__":
    main()
