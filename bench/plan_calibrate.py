"""Calibrate the activation model of `hotlora plan` (src/hotlora/engine/plan/activations.py).

Usage: PYTHONPATH=src .venv/bin/python bench/plan_calibrate.py
Builds Flux.1-dev's transformer at its real width (3072) with 1 double + 1 single block, and its
real VAE, from the published configurations (hotlora.fullsize.flux), zero weights, on the CPU;
measures the allocator's peak over one forward / one decode at a few small sizes and batches
(activations.peak_allocated), with and without the engine's slots installed (SlotBank, the LoRA
layers the engine runs), in float32 and bfloat16; fits k by least squares through the origin and
writes src/hotlora/engine/plan/coefficients.py (the fitted values, the points, the command) and
bench/results/plan_calibrate.{json,md}. ~2.6 GB peak RSS, a few minutes on 2 cores.
"""

from __future__ import annotations

import json
import platform
import pprint
import sys
import time
from pathlib import Path

import torch

from hotlora.engine.plan.activations import fit, flux_blocks, flux_forward_peak, vae_decode_peak, empty_model
from hotlora.engine.writers.slots import SlotBank
from hotlora.fullsize.flux import TRANSFORMER, VAE

ROOT = Path(__file__).resolve().parents[1]
# (batch, side of the image-token grid, text tokens). Below ~100 tokens fixed buffers (bfloat16
# matmul and attention workspaces, ~2 MiB) still show; from there on the peak is linear.
FLUX_POINTS = [(1, 8, 32), (2, 8, 32), (1, 12, 32)]
# (images, height, width): one image and batches are fitted apart (activations.py says why).
VAE_POINTS = {"one": [(1, 128, 128), (1, 128, 192)], "batch": [(2, 128, 128), (4, 64, 64)]}
SLOT_RANK = 64  # two slots: a rank-128 PEFT adapter; the LoRA temporaries are a few % of the peak


def calibrate_flux(dtype: torch.dtype) -> dict:
    width = TRANSFORMER["num_attention_heads"] * TRANSFORMER["attention_head_dim"]
    element = torch.empty((), dtype=dtype).element_size()
    out = {}
    model = flux_blocks(TRANSFORMER, 1, 1, dtype)
    for writer in ("none", "slots"):
        if writer == "slots":
            SlotBank(model, "flux", ("identity", "style"), SLOT_RANK)
        points = []
        for batch, side, text in FLUX_POINTS:
            units = batch * (side * side + text) * width * element
            points.append((units, flux_forward_peak(model, batch, side, text)))
        out[writer] = {"k": round(fit(points), 4), "points": [
            {"batch": b, "image_tokens": s * s, "text_tokens": t, "peak_bytes": p}
            for (b, s, t), (_, p) in zip(FLUX_POINTS, points)]}
    return out


def calibrate_vae(dtype: torch.dtype) -> dict:
    from diffusers import AutoencoderKL

    vae = empty_model(lambda: AutoencoderKL.from_config({k: v for k, v in VAE.items() if not k.startswith("_")}),
                      dtype)
    element = torch.empty((), dtype=dtype).element_size()
    channels = VAE["block_out_channels"][0]
    out = {}
    for regime, chosen in VAE_POINTS.items():
        points = [(n * h * w * channels * element, vae_decode_peak(vae, n, h, w)) for n, h, w in chosen]
        out[regime] = {"k": round(fit(points), 4), "points": [{"images": n, "height": h, "width": w, "peak_bytes": p}
                                                              for (n, h, w), (_, p) in zip(chosen, points)]}
    return out


def main() -> int:
    began = time.perf_counter()
    results = {"flux": {"denoiser": {}}, "vae": {"decode": {}}}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        results["flux"]["denoiser"][name] = calibrate_flux(dtype)
        results["vae"]["decode"][name] = calibrate_vae(dtype)
        print(name, json.dumps(results["flux"]["denoiser"][name]), json.dumps(results["vae"]["decode"][name]),
              file=sys.stderr)
    table = {part: {what: {d: {k: v["k"] for k, v in by.items()} for d, by in fitted.items()}
                    for what, fitted in parts.items()} for part, parts in results.items()}
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    source = (f'"""Activation coefficients of ``hotlora plan`` (activations.py says what they mean).\n\n'
              f"Written by ``PYTHONPATH=src python bench/plan_calibrate.py`` ({machine}); the measured points\n"
              f'are in bench/results/plan_calibrate.json. Do not edit by hand: run the script again."""\n\n'
              f"COEFFICIENTS = {pprint.pformat(table, indent=4, width=100)}\n")
    (ROOT / "src/hotlora/engine/plan/coefficients.py").write_text(source)
    out = ROOT / "bench/results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_calibrate.json").write_text(json.dumps({"machine": machine, "results": results}, indent=2))
    rows = ["| part | dtype | writer | k | points (units -> peak MiB) |", "|---|---|---|---|---|"]
    for dtype, by in results["flux"]["denoiser"].items():
        for writer, v in by.items():
            pts = ", ".join(f"b{p['batch']} T{p['image_tokens'] + p['text_tokens']}: {p['peak_bytes'] / 2**20:.1f}"
                            for p in v["points"])
            rows.append(f"| Flux transformer (1+1 blocks, width 3072) | {dtype} | {writer} | {v['k']} | {pts} |")
    for dtype, by in results["vae"]["decode"].items():
        for regime, v in by.items():
            pts = ", ".join(f"{p['images']}x{p['width']}x{p['height']}: {p['peak_bytes'] / 2**20:.1f}"
                            for p in v["points"])
            rows.append(f"| Flux VAE decode ({regime} image{'s' if regime == 'batch' else ''}) | {dtype} | - | "
                        f"{v['k']} | {pts} |")
    (out / "plan_calibrate.md").write_text(
        f"Command: `PYTHONPATH=src .venv/bin/python bench/plan_calibrate.py` ({machine}, "
        f"{time.perf_counter() - began:.0f} s)\n\n" + "\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
