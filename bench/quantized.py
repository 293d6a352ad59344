"""A quantized base (``base_quantization``) against the float one, tiny Flux, eager: the denoiser's
weight bytes (``describe()["denoiser_bytes"]``) and the median pack time of one tiny request.
One run, side by side; a ratio to read, never asserted (docs/benchmarks.md, "Quantized base").

    .venv/bin/python bench/quantized.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from hotlora import Engine
from hotlora.testing import random_lora, save_diffusers_lora, save_tiny_model

REPEATS = 7


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="hotlora-quant-"))
    model = save_tiny_model(root / "flux", "flux", target_rank=8)
    rows = {}
    for method in ("none", "int8_weight_only"):
        engine = Engine.from_pretrained(model, target_rank=8, batch_size=2, compile=False, base_quantization=method)
        linears = dict(engine.ceiling.modules)
        adapters = {"identity": (save_diffusers_lora(root / f"id-{method}", "flux", random_lora(linears, 8, seed=1),
                                                     rank=8, alpha=8), 1.0)}
        times = []
        for _ in range(REPEATS + 1):  # the first is a warm-up
            began = time.perf_counter()
            engine.generate("a cat", adapters=adapters, num_images=2, num_inference_steps=4, output_type="latent")
            times.append((time.perf_counter() - began) * 1000)
        rows[method] = (engine.describe()["denoiser_bytes"], statistics.median(times[1:]))
    base_bytes, base_ms = rows["none"]
    print("| base_quantization | denoiser weight bytes | ratio | pack ms (eager, median) | ratio |")
    print("|---|---|---|---|---|")
    for method, (nbytes, ms) in rows.items():
        print(f"| {method} | {nbytes:,} | {nbytes / base_bytes:.2f} | {ms:.1f} | {ms / base_ms:.2f} |")


if __name__ == "__main__":
    main()
