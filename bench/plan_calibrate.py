"""Calibrate the activation model of `hotlora plan` (src/hotlora/engine/plan/activations.py).

Usage: PYTHONPATH=src .venv/bin/python bench/plan_calibrate.py
Builds Flux.1-dev's transformer at its real width (3072) with 1 double + 1 single block, its real
VAE (hotlora.fullsize.flux), and SDXL's U-Net at its real widths with one transformer layer per
level (SDXL_UNET below), from the published configurations, zero weights, on the CPU;
measures the allocator's peak over one forward / one decode at a few small sizes and batches
(activations.peak_allocated), with and without the engine's slots installed (SlotsWriter, the LoRA
layers the engine runs), in float32 and bfloat16; fits k by least squares through the origin and
writes src/hotlora/engine/plan/coefficients.py (the fitted values, the points, the command) and
bench/results/plan_calibrate.{json,md}. ~3.5 GB peak RSS, ~10 minutes on 2 cores.
"""

from __future__ import annotations

import json
import platform
import pprint
import sys
import time
from pathlib import Path

import torch

from hotlora.engine.plan.activations import (
    empty_model, fit, flux_blocks, flux_forward_peak, unet_forward_peak, vae_decode_peak,
)
from hotlora.engine.writers.slots import SlotsWriter
from hotlora.fullsize.flux import TRANSFORMER, VAE
from hotlora.fullsize.sdxl import UNET as SDXL_PUBLISHED_UNET

ROOT = Path(__file__).resolve().parents[1]
# (batch, side of the image-token grid, text tokens). Below ~100 tokens fixed buffers (bfloat16
# matmul and attention workspaces, ~2 MiB) still show; from there on the peak is linear.
FLUX_POINTS = [(1, 8, 32), (2, 8, 32), (1, 12, 32)]
# (images, height, width): one image and batches are fitted apart (activations.py says why).
VAE_POINTS = {"one": [(1, 64, 64), (1, 128, 128), (1, 128, 192)], "batch": [(2, 64, 64), (2, 128, 128), (4, 64, 64)]}
# (batch, latent height, latent width): multiples of 4 (two downsamplings). The last is held out:
# predicted from the fit of the others, and reported.
SDXL_POINTS = [(1, 16, 16), (2, 16, 16), (1, 24, 24)]
SDXL_HELD_OUT = (3, 16, 24)
# SDXL's published U-Net configuration (hotlora.fullsize.sdxl: 2,567,463,684 parameters, 743 Linear
# layers), with one transformer layer per level instead of 1/2/10 (see activations.py: only one
# layer of a level is alive at a time).
SDXL_UNET = {**SDXL_PUBLISHED_UNET, "transformer_layers_per_block": [1, 1, 1]}
SLOT_RANK = 64  # two slots: a rank-128 PEFT adapter; the LoRA temporaries are a few % of the peak


def calibrate_flux(dtype: torch.dtype) -> dict:
    width = TRANSFORMER["num_attention_heads"] * TRANSFORMER["attention_head_dim"]
    element = torch.empty((), dtype=dtype).element_size()
    out = {}
    model = flux_blocks(TRANSFORMER, 1, 1, dtype)
    for writer in ("none", "slots"):
        if writer == "slots":
            SlotsWriter(model, "flux", ("identity", "style"), SLOT_RANK)
        points = []
        for batch, side, text in FLUX_POINTS:
            units = batch * (side * side + text) * width * element
            points.append((units, flux_forward_peak(model, batch, side, text)))
        k, c = fit(points)
        out[writer] = {"k": round(k, 4), "c": round(c), "points": [
            {"batch": b, "image_tokens": s * s, "text_tokens": t, "peak_bytes": p}
            for (b, s, t), (_, p) in zip(FLUX_POINTS, points)]}
    return out


def calibrate_sdxl(dtype: torch.dtype) -> dict:
    from diffusers import UNet2DConditionModel

    width = SDXL_UNET["block_out_channels"][0]
    element = torch.empty((), dtype=dtype).element_size()
    unet = empty_model(lambda: UNet2DConditionModel.from_config(SDXL_UNET), dtype)
    out = {}
    for writer in ("none", "slots"):
        if writer == "slots":
            SlotsWriter(unet, "sdxl", ("identity", "style"), SLOT_RANK)
        points = [(b * h * w * width * element, unet_forward_peak(unet, b, h, w)) for b, h, w in SDXL_POINTS]
        k, c = fit(points)
        b, h, w = SDXL_HELD_OUT
        held_out = unet_forward_peak(unet, b, h, w)
        out[writer] = {"k": round(k, 4), "c": round(c), "points": [
            {"batch": b, "latent_height": h, "latent_width": w, "peak_bytes": p}
            for (b, h, w), (_, p) in zip(SDXL_POINTS, points)],
            "held_out": {"batch": b, "latent_height": h, "latent_width": w, "peak_bytes": held_out,
                         "predicted_bytes": round(k * b * h * w * width * element + c)}}
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
        k, c = fit(points)
        out[regime] = {"k": round(k, 4), "c": round(c), "points": [{"images": n, "height": h, "width": w, "peak_bytes": p}
                                                              for (n, h, w), (_, p) in zip(chosen, points)]}
    return out


def main() -> int:
    began = time.perf_counter()
    results = {"flux": {"denoiser": {}}, "sdxl": {"denoiser": {}}, "vae": {"decode": {}}}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        results["flux"]["denoiser"][name] = calibrate_flux(dtype)
        results["sdxl"]["denoiser"][name] = calibrate_sdxl(dtype)
        results["vae"]["decode"][name] = calibrate_vae(dtype)
        print(name, json.dumps(results["flux"]["denoiser"][name]), json.dumps(results["vae"]["decode"][name]),
              file=sys.stderr)
    table = {part: {what: {d: {k: (v["k"], v["c"]) for k, v in by.items()} for d, by in fitted.items()}
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
    rows = ["| part | dtype | writer | k | c (MiB) | points (peak MiB) |", "|---|---|---|---|---|---|"]
    for dtype, by in results["flux"]["denoiser"].items():
        for writer, v in by.items():
            pts = ", ".join(f"b{p['batch']} T{p['image_tokens'] + p['text_tokens']}: {p['peak_bytes'] / 2**20:.1f}"
                            for p in v["points"])
            rows.append(f"| Flux transformer (1+1 blocks, width 3072) | {dtype} | {writer} | {v['k']} | "
                        f"{v['c'] / 2**20:.1f} | {pts} |")
    for dtype, by in results["sdxl"]["denoiser"].items():
        for writer, v in by.items():
            pts = ", ".join(f"b{p['batch']} {p['latent_width']}x{p['latent_height']}: {p['peak_bytes'] / 2**20:.1f}"
                            for p in v["points"])
            held = v["held_out"]
            pts += (f"; held out b{held['batch']} {held['latent_width']}x{held['latent_height']}: predicted "
                    f"{held['predicted_bytes'] / 2**20:.1f}, measured {held['peak_bytes'] / 2**20:.1f}")
            rows.append(f"| SDXL U-Net (real widths, 1 transformer layer per level) | {dtype} | {writer} | "
                        f"{v['k']} | {v['c'] / 2**20:.1f} | {pts} |")
    for dtype, by in results["vae"]["decode"].items():
        for regime, v in by.items():
            pts = ", ".join(f"{p['images']}x{p['width']}x{p['height']}: {p['peak_bytes'] / 2**20:.1f}"
                            for p in v["points"])
            rows.append(f"| Flux VAE decode ({regime} image{'s' if regime == 'batch' else ''}) | {dtype} | - | "
                        f"{v['k']} | {v['c'] / 2**20:.1f} | {pts} |")
    (out / "plan_calibrate.md").write_text(
        f"Command: `PYTHONPATH=src .venv/bin/python bench/plan_calibrate.py` ({machine}, "
        f"{time.perf_counter() - began:.0f} s)\n\n" + "\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
