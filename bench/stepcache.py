"""Step cache: speedup and its quality cost, against the uncached compiled engine, same seeds.

Usage: .venv/bin/python bench/stepcache.py [--thresholds 0.3 0.6 0.9] [--steps 20] [--pack 6] [--runs 3]
Writes bench/results/stepcache.{json,md}: pack time, speedup, PSNR (dB) and max |difference| of the
decoded images against the uncached output. Random-weight tiny models need high thresholds.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path

# Run as a file, Python puts bench/ first on sys.path: bench.harness needs the checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (  # noqa: E402
    allow_many_compiled_engines, markdown_table, use_repo_compile_cache, write_results,
)

use_repo_compile_cache()

import numpy as np  # noqa: E402

allow_many_compiled_engines()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * math.log10(1.0 / mse)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.6, 0.9])
    parser.add_argument("--backend", default="dbcache")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pack", type=int, default=6)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    from hotlora import Engine
    from hotlora.engine.stepcache import StepCache
    from hotlora.testing import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model(Path(tmp) / "flux", "flux")
        adapters = {"identity": (str(model / "adapters" / "identity-diffusers"), 0.9),
                    "style": (str(model / "adapters" / "style-kohya.safetensors"), 0.6)}
        engines = {"uncached": Engine.from_pretrained(model, target_rank=8, batch_size=args.pack)}
        for t in args.thresholds:
            engines[f"{args.backend} {t}"] = Engine.from_pretrained(
                model, target_rank=8, batch_size=args.pack, step_cache=StepCache(args.backend, threshold=t, warmup_steps=2))
        times = {label: [] for label in engines}
        images = {}
        for _ in range(args.runs):
            for label, engine in engines.items():
                result = engine.generate("a portrait", adapters=adapters, num_images=args.pack,
                                         num_inference_steps=args.steps, output_type="np", seed=3)
                times[label].append(sum(result.timings.generate_ms))
                images[label] = result.images
    base = statistics.median(times["uncached"])
    rows = [{"config": label, "pack_ms": round(statistics.median(v), 1),
             "speedup": round(base / statistics.median(v), 2),
             "psnr_db": round(psnr(images[label], images["uncached"]), 2),
             "max_abs_diff": round(float(np.abs(images[label] - images["uncached"]).max()), 4),
             "recompiles": engines[label].recompiles} for label, v in times.items()]
    table = markdown_table(
        ["config", "pack ms", "speedup", "PSNR vs uncached (dB)", "max abs diff", "recompiles"],
        [[r["config"], r["pack_ms"], f"{r['speedup']}x", r["psnr_db"], r["max_abs_diff"], r["recompiles"]] for r in rows])
    write_results(args.out, "stepcache", {"args": vars(args), "rows": rows}, table, str(vars(args)))


if __name__ == "__main__":
    main()
