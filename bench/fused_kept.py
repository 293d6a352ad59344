"""What fused mode's kept-fraction measurement costs: building a request's merge plan with and
without it (``FusedWriter.min_kept`` None skips it), side by side in one run, tiny models, bf16.

Usage: .venv/bin/python bench/fused_kept.py [--runs 30]
Prints one row per family: median plan time with and without the measurement, and their ratio.
The plan is built once per (adapters, scales) and cached, so a repeated request pays neither.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hotlora import Engine
from hotlora.adapters.binding import Binding
from hotlora.testing import controlled_lora, save_diffusers_lora, save_tiny_model


def plan_ms(engine, bindings, measure: bool, runs: int) -> float:
    writer = engine.writer
    writer.min_kept = 0.0 if measure else None  # None: the plan is built without the measurement
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        writer._plan(bindings)
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hotlora-kept-"))
    print("| family | plan without (ms) | plan with kept (ms) | ratio |\n|---|---|---|---|")
    for family in ("flux", "sdxl"):
        model = save_tiny_model(root / family, family)
        engine = Engine.from_pretrained(model, adapter_mode="fused", batch_size=1, compile=False,
                                        dtype=torch.bfloat16, fused_min_kept=0.0)
        sd = controlled_lora(engine.denoiser, 0.01, rank=16)
        adapter = engine.load_adapter(str(save_diffusers_lora(root / f"{family}-lora", family, sd, rank=16, alpha=16)))
        bindings = {"identity": Binding(adapter, 1.0)}
        rounds = [(plan_ms(engine, bindings, False, args.runs), plan_ms(engine, bindings, True, args.runs))
                  for _ in range(3)]  # interleaved: the machine's drift hits both alike
        without = statistics.median(r[0] for r in rounds)
        with_kept = statistics.median(r[1] for r in rounds)
        print(f"| {family} | {without:.2f} | {with_kept:.2f} | {with_kept / without:.2f} |")


if __name__ == "__main__":
    main()
