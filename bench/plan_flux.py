"""The memory plan of full-size Flux.1-dev (hotlora plan flux-dev) on 80 GB and 141 GB cards.

Usage: PYTHONPATH=src .venv/bin/python bench/plan_flux.py
Packs of 6 (max_batch_size 6) at 1024x1024 and 1024x1536, target ranks 16/64/128, slots vs fused
vs a quantized base (int8_weight_only, float8), bf16 on CUDA. Exact bytes of every part from the
meta-device model; activations from the calibrated model (bench/plan_calibrate.py). Writes
bench/results/plan_flux.{json,md}. Runs on a CPU in about a minute: nothing is allocated.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hotlora.settings import EngineConfig
from hotlora.engine.plan import ACCELERATORS, format_bytes, plan_memory
from hotlora.engine.plan.planner import MAX_CHUNK_SEARCHED

ROOT = Path(__file__).resolve().parents[1]
GPUS = ("h100-80gb", "h200-141gb")
MODES = {"slots": {}, "fused": {"adapter_mode": "fused"},
         "slots + int8 base": {"base_quantization": "int8_weight_only"},
         "slots + float8 base": {"base_quantization": "float8"}}
RANKS = (16, 64, 128)
SIZES = "1024x1024,1024x1536"


def _chunk(size) -> str:
    return f"{size.largest_chunk}+" if size.largest_chunk == MAX_CHUNK_SEARCHED else str(size.largest_chunk)


def main() -> int:
    rows, results = [], []
    for gpu in GPUS:
        for mode, options in MODES.items():
            for rank in RANKS if mode != "fused" else (RANKS[-1],):  # fused holds no rank-sized buffer
                config = EngineConfig(target_rank=rank, sizes=SIZES, max_batch_size=6, **options)
                plan = plan_memory("flux-dev", config, device="cuda", budget=ACCELERATORS[gpu], budget_name=gpu)
                results.append({"gpu": gpu, "mode": mode, "rank": rank, **plan.as_dict()})
                parts = {p.name: p for p in plan.parts}
                writer = next(p for p in plan.parts if "LoRA buffers" in p.name or p.name == "fused pristine copy")
                where = "" if writer.where == "device" else " (host)"
                square, tall = plan.sizes
                rows.append(
                    f"| {gpu} | {mode} | {rank if mode != 'fused' else 'any'} | "
                    f"{format_bytes(parts['transformer'].bytes)} | {format_bytes(writer.bytes)}{where} | "
                    f"{format_bytes(plan.static_bytes)} | {format_bytes(plan.static_bytes + square.activation_bytes)} | "
                    f"{format_bytes(plan.static_bytes + tall.activation_bytes)} | {_chunk(square)} / "
                    f"{_chunk(tall)} | {'fits' if plan.fits else 'does not fit'} |")
    header = ("| GPU | adapters | rank | transformer | slots / pristine | static | peak 1024x1024 x6 | "
              "peak 1024x1536 x6 | largest chunk (1024² / 1024x1536) | pack of 6 |\n"
              "|---|---|---|---|---|---|---|---|---|---|")
    out = ROOT / "bench/results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_flux.json").write_text(json.dumps(results, indent=2))
    table = header + "\n" + "\n".join(rows) + "\n"
    (out / "plan_flux.md").write_text("Command: `PYTHONPATH=src .venv/bin/python bench/plan_flux.py` (meta device, "
                                      "no GPU needed)\n\n" + table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
