"""Calibrate the activation model of `hotlora plan` (src/hotlora/engine/plan/activations.py).

Usage: PYTHONPATH=src .venv/bin/python bench/plan_calibrate.py [--only wan-vae|video-vae|sana|images]
Builds Flux.1-dev's transformer at its real width (3072) with 1 double + 1 single block, its real
VAE (hotlora.fullsize.flux), and SDXL's U-Net at its real widths with one transformer layer per
level (SDXL_UNET below), from the published configurations, zero weights, on the CPU;
measures the allocator's peak over one forward / one decode at a few small sizes and batches
(activations.peak_allocated), with and without the engine's slots installed (SlotsWriter, the LoRA
layers the engine runs), in float32 and bfloat16; fits k by least squares through the origin and
writes src/hotlora/engine/plan/coefficients.py (the fitted values, the points, the command) and
bench/results/plan_calibrate.{json,md}. ~3.5 GB peak RSS, ~10 minutes on 2 cores. Wan 2.1's causal
video VAE (real width, base_dim 96) is measured over sizes at 5 frames and over frame counts at one
size (activations.py: its ``(k, c, f)``), in float32 only (bfloat16 reuses that fit: a bf16 Conv3d on
this CPU takes minutes a point); ``--only wan-vae`` measures just that (~2 minutes) and
keeps the other parts' results from bench/results/plan_calibrate.json. LTX-Video's VAE (real
widths, a non-causal decoder: every frame decoded at once) is measured the same way, in the same
``(k, c, f)`` form, where ``f`` then carries the whole decoder's activations per decoded frame;
``--only video-vae`` measures every video VAE. Sana's DC-AE (an image decoder of another architecture:
EfficientViT blocks, a 32x spatial factor) gets its own fit (``dc_ae_decode``, ``f`` = 0) over sizes
at one image, in float32 and bfloat16, and Sana's transformer (real width 2240, one block) as Flux's
is; ``--only sana`` measures just those. Wan 2.2's residual VAE (TI2V-5B's: decoder_base_dim
256, a 2 x 2 patch, 16x spatial) is another architecture: it gets its own fit (``residual_vae_decode``)
at the same points, with ``--only wan-vae`` too. The other image families (Z-Image, Qwen-Image and
2.1, FLUX.2 dev and klein, SD3, Chroma) are measured through their own pipelines with their denoisers
at the published widths (``IMAGE_POINTS`` says how), SD1.5's U-Net as SDXL's, and Qwen-Image's two
VAEs decoding one image; ``--only images`` measures just those (~16 minutes).
"""

from __future__ import annotations

import argparse
import json
import platform
import pprint
import sys
import tempfile
import time
from pathlib import Path

import torch

from hotlora.engine.plan.activations import (
    empty_model, fit, flux_blocks, flux_forward_peak, sana_blocks, sana_forward_peak, unet_forward_peak,
    vae_decode_peak, vae_width, video_vae_decode_peak,
)
from hotlora.fullsize._encoders import WAN21_VAE
from hotlora.fullsize.ltx_video import VAE as LTX_VIDEO_VAE
from hotlora.fullsize.sana_1600m import TRANSFORMER as SANA_TRANSFORMER, VAE as SANA_VAE
from hotlora.fullsize.wan22_ti2v_5b import VAE as WAN22_VAE
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
# Wan's VAE, (latent frames, height, width): sizes at 5 frames fit k; frame counts (5, 21, 41) at one size fit f.
WAN_VAE_SIZES = [(2, 64, 64), (2, 128, 128), (2, 64, 128)]
WAN_VAE_FRAMES = [(2, 64, 64), (6, 64, 64), (11, 64, 64)]
# LTX-Video's VAE (32x spatial, 8x temporal), the same two series: sizes at 9 frames, frame counts at one size.
LTX_VAE_SIZES = [(2, 64, 64), (2, 128, 128), (2, 64, 128)]
LTX_VAE_FRAMES = [(2, 64, 64), (4, 64, 64), (6, 64, 64)]
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
    return calibrate_unet("sdxl", SDXL_UNET, SDXL_POINTS, SDXL_HELD_OUT, dtype)


def calibrate_unet(family: str, config: dict, points: list, held_out: tuple, dtype: torch.dtype) -> dict:
    """A U-Net's ``(k, c)`` per latent pixel x its first level's channels, with and without the
    slots, at ``points`` (batch, latent height, latent width), one more ``held_out``."""
    from diffusers import UNet2DConditionModel

    width = config["block_out_channels"][0]
    element = torch.empty((), dtype=dtype).element_size()
    unet = empty_model(lambda: UNet2DConditionModel.from_config({k: v for k, v in config.items()
                                                                 if not k.startswith("_")}), dtype)
    out = {}
    for writer in ("none", "slots"):
        if writer == "slots":
            SlotsWriter(unet, family, ("identity", "style"), SLOT_RANK)
        measured = [(b * h * w * width * element, unet_forward_peak(unet, b, h, w)) for b, h, w in points]
        k, c = fit(measured)
        b, h, w = held_out
        held = unet_forward_peak(unet, b, h, w)
        out[writer] = {"k": round(k, 4), "c": round(c), "points": [
            {"batch": b, "latent_height": h, "latent_width": w, "peak_bytes": p}
            for (b, h, w), (_, p) in zip(points, measured)],
            "held_out": {"batch": b, "latent_height": h, "latent_width": w, "peak_bytes": held,
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


def calibrate_wan_vae(dtype: torch.dtype) -> dict:
    from diffusers import AutoencoderKLWan

    return calibrate_video_vae(AutoencoderKLWan, WAN21_VAE, 4, WAN_VAE_SIZES, WAN_VAE_FRAMES, dtype)


def calibrate_wan22_vae(dtype: torch.dtype) -> dict:
    """Wan 2.2's residual VAE (TI2V-5B's, decoder_base_dim 256 over a 2 x 2 patch), at the same points."""
    from diffusers import AutoencoderKLWan

    return calibrate_video_vae(AutoencoderKLWan, WAN22_VAE, 4, WAN_VAE_SIZES, WAN_VAE_FRAMES, dtype)


def calibrate_ltx_vae(dtype: torch.dtype) -> dict:
    from diffusers import AutoencoderKLLTXVideo

    return calibrate_video_vae(AutoencoderKLLTXVideo, LTX_VIDEO_VAE, 8, LTX_VAE_SIZES, LTX_VAE_FRAMES, dtype)


def calibrate_video_vae(cls, config: dict, temporal: int, sizes, frame_counts, dtype: torch.dtype) -> dict:
    """A video VAE's ``(k, c, f)``: ``f`` from frame counts at one size, then ``k`` and ``c`` from sizes
    at one frame count (what ``f`` leaves). ``temporal``: decoded frames per latent frame."""
    vae = empty_model(lambda: cls.from_config({k: v for k, v in config.items() if not k.startswith("_")}), dtype)
    element = torch.empty((), dtype=dtype).element_size()
    channels = vae_width(config)

    def frames(latent: int) -> int:
        return temporal * (latent - 1) + 1

    measured = {point: video_vae_decode_peak(vae, 1, *point) for point in dict.fromkeys(sizes + frame_counts)}
    f, _ = fit([(frames(n) * h * w * 3 * element, measured[(n, h, w)]) for n, h, w in frame_counts])
    k, c = fit([(h * w * channels * element, measured[(n, h, w)] - f * frames(n) * h * w * 3 * element)
                for n, h, w in sizes])
    return {"k": round(k, 4), "c": round(c), "f": round(f, 4), "points": [
        {"latent_frames": n, "frames": frames(n), "height": h, "width": w, "peak_bytes": p}
        for (n, h, w), p in measured.items()]}


# Sana's DC-AE, (height, width) of one image: latents 8x8 to 16x16 (32x); below 256 x 256 the fixed
# buffers bend the line (128 x 128 peaked at half of 256 x 256's, not a quarter).
DC_AE_SIZES = [(256, 256), (384, 384), (512, 512)]


def calibrate_dc_ae(dtype: torch.dtype) -> dict:
    """Sana's DC-AE (real widths) decoding one image at ``DC_AE_SIZES``: ``(k, c)`` in a family VAE's
    form, ``f`` = 0 (an image decoder: nothing grows with frames)."""
    from diffusers import AutoencoderDC

    vae = empty_model(lambda: AutoencoderDC.from_config({k: v for k, v in SANA_VAE.items() if not k.startswith("_")}),
                      dtype)
    element = torch.empty((), dtype=dtype).element_size()
    channels = vae_width(SANA_VAE)
    measured = {(h, w): vae_decode_peak(vae, 1, h, w) for h, w in DC_AE_SIZES}
    k, c = fit([(h * w * channels * element, peak) for (h, w), peak in measured.items()])
    return {"k": round(k, 4), "c": round(c), "f": 0.0, "points": [
        {"frames": 1, "height": h, "width": w, "peak_bytes": peak} for (h, w), peak in measured.items()]}


# Sana's transformer, (batch, latent side): image tokens 256 to 1024 (1024 x 1024 is 32 x 32) against
# its 300 caption tokens; the last is held out (predicted from the others' fit, and reported).
SANA_POINTS = [(1, 16), (2, 16), (1, 24)]
SANA_HELD_OUT = (1, 32)


def calibrate_sana(dtype: torch.dtype) -> dict:
    """Sana's transformer at its real width, one block (only one block's activations are alive at a
    time), with and without the slots: ``k`` per image token x width (the plan's tokens exclude the
    caption's 300, which ``c`` and ``k`` absorb)."""
    width = SANA_TRANSFORMER["num_attention_heads"] * SANA_TRANSFORMER["attention_head_dim"]
    element = torch.empty((), dtype=dtype).element_size()
    model = sana_blocks(SANA_TRANSFORMER, 1, dtype)
    out = {}
    for writer in ("none", "slots"):
        if writer == "slots":
            SlotsWriter(model, "sana", ("identity", "style"), SLOT_RANK)
        points = [(b * side * side * width * element, sana_forward_peak(model, b, side)) for b, side in SANA_POINTS]
        k, c = fit(points)
        b, side = SANA_HELD_OUT
        held_out = sana_forward_peak(model, b, side)
        out[writer] = {"k": round(k, 4), "c": round(c), "points": [
            {"batch": b, "latent_side": side, "peak_bytes": p} for (b, side), (_, p) in zip(SANA_POINTS, points)],
            "held_out": {"batch": b, "latent_side": side, "peak_bytes": held_out,
                         "predicted_bytes": round(k * b * side * side * width * element + c)}}
    return out


# Image families calibrated through their own pipeline (``activations.pipeline_denoiser_peak``): the
# tiny pipeline with its denoiser rebuilt at the published widths, one block of each kind
# (bench/families.py's ``wide`` model: the first published configuration of the family), zero
# weights, the prompt's text cut to ``TEXT_TOKENS_CALIBRATED`` where the pipeline takes
# ``max_sequence_length`` (at full size image tokens outnumber text tokens: so here). Per family,
# (images, image side in pixels): 256, 2 x 256 and 1024 image tokens fitted, 2 x 1024 held out (an
# extrapolation, as the plan's sizes are; the tiny VAEs and patch sizes differ, hence the sides).
# The double-stream-only models (SD3, Qwen-Image) at 1024 and 2304: there a text token costs less
# than an image token (the image stream's MLP holds the peak), so they are fitted where image tokens
# outnumber the text's many times, as at full size (SD3's 77 CLIP tokens are never cut; at 256 image
# tokens a fit over image and text tokens alike came out 7% under a held-out point).
# Krea 2 is not here: its plan counts image tokens only (a generic family's ``plan_tokens``) while
# its blocks run the text too.
IMAGE_POINTS = {
    "zimage": [(1, 64), (2, 64), (1, 128), (2, 128)],
    "qwenimage": [(1, 256), (2, 256), (1, 384), (2, 384)],
    "qwenimage21": [(1, 256), (2, 256), (1, 512), (2, 512)],
    "flux2": [(1, 32), (2, 32), (1, 64), (2, 64)],
    "flux2-klein": [(1, 32), (2, 32), (1, 64), (2, 64)],
    "sd3": [(1, 64), (2, 64), (1, 96), (2, 96)],
    "chroma": [(1, 32), (2, 32), (1, 64), (2, 64)],
}
TEXT_TOKENS_CALIBRATED = 64
CALIBRATION_PROMPT = "a watercolor fox in a misty pine forest at dawn, soft light"
# SD1.5's U-Net at its published widths (one transformer layer per level, as published): as SDXL's.
SD15_POINTS = [(1, 16, 16), (2, 16, 16), (1, 24, 24)]
SD15_HELD_OUT = (2, 16, 24)


def wide_pipeline(family, dtype: torch.dtype, root: Path):
    """The family's tiny pipeline with its denoiser at the published widths (one block of each kind),
    zero weights (activation memory does not depend on their values), in ``dtype``, and the call's
    options. SD3's position table keeps its published size (the tiny one caps the image at 64 pixels)."""
    import inspect

    from diffusers import DiffusionPipeline

    sys.path.insert(0, str(ROOT))
    from bench.families import published_denoiser, tiny_model, wide_config

    pipeline = DiffusionPipeline.from_pretrained(str(tiny_model(family, root)), local_files_only=True)
    denoiser = getattr(pipeline, family.denoiser)
    published = published_denoiser(family)
    config = wide_config(dict(denoiser.config), published)
    if "pos_embed_max_size" in published:
        config["pos_embed_max_size"] = published["pos_embed_max_size"]
    # Built on the CPU, not the meta device (``empty_model``): some keep tables outside their buffers
    # (Qwen-Image's rotary frequencies), which ``to_empty`` would leave without data.
    wide = type(denoiser).from_config(config).to(dtype).eval()
    with torch.no_grad():
        for tensor in wide.parameters():
            tensor.zero_()
    pipeline.register_modules(**{family.denoiser: wide})
    pipeline.to(dtype)
    pipeline.set_progress_bar_config(disable=True)
    takes_length = "max_sequence_length" in inspect.signature(pipeline.__call__).parameters
    return pipeline, config, ({"max_sequence_length": TEXT_TOKENS_CALIBRATED} if takes_length else {})


def calibrate_image_family(name: str, dtype: torch.dtype, root: Path) -> dict:
    """One image family's denoiser ``(k, c)`` with and without the slots (see IMAGE_POINTS)."""
    from hotlora.engine.plan.activations import pipeline_denoiser_peak
    from hotlora.families import family_named

    family = family_named(name)
    pipeline, config, options = wide_pipeline(family, dtype, root)
    width = family.plan_tokens({family.denoiser: config}, 0)[1]
    element = torch.empty((), dtype=dtype).element_size()
    *fitted, held_out = IMAGE_POINTS[name]
    out = {}
    for writer in ("none", "slots"):
        if writer == "slots":
            SlotsWriter(getattr(pipeline, family.denoiser), name, ("identity", "style"), SLOT_RANK)
        measured = [(images, side, *pipeline_denoiser_peak(pipeline, family, images, side, side, CALIBRATION_PROMPT,
                                                           **options))
                    for images, side in (*fitted, held_out)]
        k, c = fit([(tokens * width * element, peak) for _, _, tokens, peak in measured[:-1]])
        images, side, tokens, peak = measured[-1]
        out[writer] = {"k": round(k, 4), "c": round(c), "width": width, "points": [
            {"images": i, "side": s, "batch_tokens": t, "peak_bytes": p} for i, s, t, p in measured[:-1]],
            "held_out": {"images": images, "side": side, "batch_tokens": tokens, "peak_bytes": peak,
                         "predicted_bytes": round(k * tokens * width * element + c)}}
    return out


# Qwen-Image's VAEs decode an image as one latent frame of a causal video VAE (Wan 2.1's architecture;
# Qwen-Image 2.1's a residual one at 16x): neither the AutoencoderKL fit (2.8x under a measured
# 256 x 256 decode) nor Wan's 81-frame fit (2.5x over) describes one frame. (height, width) of one
# image, the last held out; float32 only, as Wan's (a bfloat16 Conv3d takes minutes a point here).
QWEN_VAE_SIZES = [(128, 128), (192, 192), (256, 256), (256, 384)]


def calibrate_image_vae(family: str) -> dict:
    """One image through a Qwen-Image family's own VAE (published config), at ``QWEN_VAE_SIZES``:
    ``(k, c)`` in a family VAE's form, ``f`` = 0 (nothing grows with frames)."""
    import diffusers

    from hotlora.fullsize import qwen_image, qwen_image_21

    config = (qwen_image if family == "qwenimage" else qwen_image_21).COMPONENTS["vae"]
    cls = getattr(diffusers, config.get("_class_name", "AutoencoderKLQwenImage"))
    vae = empty_model(lambda: cls.from_config({k: v for k, v in config.items() if not k.startswith("_")}), torch.float32)
    channels = vae_width(config)
    *fitted, held_out = QWEN_VAE_SIZES
    measured = {(h, w): video_vae_decode_peak(vae, 1, 1, h, w) for h, w in QWEN_VAE_SIZES}
    k, c = fit([(h * w * channels * 4, measured[(h, w)]) for h, w in fitted])
    h, w = held_out
    return {"k": round(k, 4), "c": round(c), "f": 0.0, "points": [
        {"frames": 1, "height": h, "width": w, "peak_bytes": measured[(h, w)]} for h, w in fitted],
        "held_out": {"height": h, "width": w, "peak_bytes": measured[held_out],
                     "predicted_bytes": round(k * h * w * channels * 4 + c)}}


def calibrate_sd15(dtype: torch.dtype) -> dict:
    """SD1.5's U-Net at its published widths, as SDXL's."""
    from hotlora.fullsize.sd15 import UNET

    return calibrate_unet("sd15", UNET, SD15_POINTS, SD15_HELD_OUT, dtype)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=("wan-vae", "video-vae", "sana", "images"), default=None,
                        help="measure one part; the others' results are kept from bench/results/plan_calibrate.json")
    args = parser.parse_args()
    began = time.perf_counter()
    out = ROOT / "bench/results"
    if args.only:
        results = json.loads((out / "plan_calibrate.json").read_text())["results"]
    else:
        results = {"flux": {"denoiser": {}}, "sdxl": {"denoiser": {}}, "vae": {"decode": {}}}
    results.setdefault("wan", {"vae_decode": {}})
    results.setdefault("ltx", {"vae_decode": {}})
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        if not args.only:
            results["flux"]["denoiser"][name] = calibrate_flux(dtype)
            results["sdxl"]["denoiser"][name] = calibrate_sdxl(dtype)
            results["vae"]["decode"][name] = calibrate_vae(dtype)
            print(name, json.dumps(results["flux"]["denoiser"][name]), json.dumps(results["vae"]["decode"][name]),
                  file=sys.stderr)
    # Wan's VAE in float32 only: a bfloat16 Conv3d on this CPU (no bf16 kernels) took over 7 minutes for
    # the smallest point. bfloat16 plans use the float32 fit at 2 bytes an element (the Flux VAE's
    # bfloat16 k came out 0.95-1.25x its float32 k: a margin of that order, said in the plan's docs).
    for family, part, calibrate in (("wan", "vae_decode", calibrate_wan_vae),
                                    ("wan", "residual_vae_decode", calibrate_wan22_vae),
                                    ("ltx", "vae_decode", calibrate_ltx_vae)):
        if (args.only == "wan-vae" and family != "wan") or args.only in ("sana", "images"):
            continue
        video = calibrate(torch.float32)
        results[family][part] = {"float32": video, "bfloat16": {**video, "measured_in": "float32"}}
        print(family, part, "float32", json.dumps(video), file=sys.stderr)

    if args.only in (None, "sana"):
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            results.setdefault("sana", {}).setdefault("dc_ae_decode", {})[name] = calibrate_dc_ae(dtype)
            results["sana"].setdefault("denoiser", {})[name] = calibrate_sana(dtype)
            print("sana", name, json.dumps(results["sana"]["dc_ae_decode"][name]),
                  json.dumps(results["sana"]["denoiser"][name]), file=sys.stderr)

    if args.only in (None, "images"):
        with tempfile.TemporaryDirectory() as root:  # the families' tiny pipelines, saved once
            for dtype in (torch.float32, torch.bfloat16):
                name = str(dtype).removeprefix("torch.")
                for family in IMAGE_POINTS:
                    results.setdefault(family, {}).setdefault("denoiser", {})[name] = \
                        calibrate_image_family(family, dtype, Path(root))
                    print(family, name, json.dumps(results[family]["denoiser"][name]), file=sys.stderr)
                results.setdefault("sd15", {}).setdefault("denoiser", {})[name] = calibrate_sd15(dtype)
                print("sd15", name, json.dumps(results["sd15"]["denoiser"][name]), file=sys.stderr)
        for family, part in (("qwenimage", "vae_decode"), ("qwenimage21", "residual_vae_decode")):
            image_vae = calibrate_image_vae(family)
            results[family][part] = {"float32": image_vae, "bfloat16": {**image_vae, "measured_in": "float32"}}
            print(family, part, json.dumps(image_vae), file=sys.stderr)

    def fitted(by: dict):  # by writer or regime ((k, c)); a family's own VAE has no writer ((k, c, f))
        return (by["k"], by["c"], by["f"]) if "f" in by else {k: (v["k"], v["c"]) for k, v in by.items()}

    table = {part: {what: {d: fitted(by) for d, by in fits.items()} for what, fits in parts.items()}
             for part, parts in results.items()}
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    source = (f'"""Activation coefficients of ``hotlora plan`` (activations.py says what they mean).\n\n'
              f"Written by ``PYTHONPATH=src python bench/plan_calibrate.py`` ({machine}); the measured points\n"
              f'are in bench/results/plan_calibrate.json. Do not edit by hand: run the script again."""\n\n'
              f"COEFFICIENTS = {pprint.pformat(table, indent=4, width=100)}\n")
    (ROOT / "src/hotlora/engine/plan/coefficients.py").write_text(source)
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
    for dtype, by in results.get("sana", {}).get("denoiser", {}).items():
        for writer, v in by.items():
            pts = ", ".join(f"b{p['batch']} T{p['latent_side'] ** 2}: {p['peak_bytes'] / 2**20:.1f}" for p in v["points"])
            held = v["held_out"]
            pts += (f"; held out b{held['batch']} T{held['latent_side'] ** 2}: predicted "
                    f"{held['predicted_bytes'] / 2**20:.1f}, measured {held['peak_bytes'] / 2**20:.1f}")
            rows.append(f"| Sana transformer (1 block, width 2240, 300 caption tokens) | {dtype} | {writer} | {v['k']} | "
                        f"{v['c'] / 2**20:.1f} | {pts} |")
    for family in (*IMAGE_POINTS, "sd15"):
        for dtype, by in results.get(family, {}).get("denoiser", {}).items():
            for writer, v in by.items():
                held = v["held_out"]
                if family == "sd15":
                    label = "SD1.5 U-Net (published widths)"
                    pts = ", ".join(f"b{p['batch']} {p['latent_width']}x{p['latent_height']}: "
                                    f"{p['peak_bytes'] / 2**20:.1f}" for p in v["points"])
                    pts += (f"; held out b{held['batch']} {held['latent_width']}x{held['latent_height']}: predicted "
                            f"{held['predicted_bytes'] / 2**20:.1f}, measured {held['peak_bytes'] / 2**20:.1f}")
                else:
                    label = f"{family} denoiser (one block of each kind, width {v['width']})"
                    pts = ", ".join(f"{p['images']}x{p['side']}px BT{p['batch_tokens']}: {p['peak_bytes'] / 2**20:.1f}"
                                    for p in v["points"])
                    pts += (f"; held out {held['images']}x{held['side']}px BT{held['batch_tokens']}: predicted "
                            f"{held['predicted_bytes'] / 2**20:.1f}, measured {held['peak_bytes'] / 2**20:.1f}")
                rows.append(f"| {label} | {dtype} | {writer} | {v['k']} | {v['c'] / 2**20:.1f} | {pts} |")
    for dtype, by in results["vae"]["decode"].items():
        for regime, v in by.items():
            pts = ", ".join(f"{p['images']}x{p['width']}x{p['height']}: {p['peak_bytes'] / 2**20:.1f}"
                            for p in v["points"])
            rows.append(f"| Flux VAE decode ({regime} image{'s' if regime == 'batch' else ''}) | {dtype} | - | "
                        f"{v['k']} | {v['c'] / 2**20:.1f} | {pts} |")
    for family, part, label in (("wan", "vae_decode", "Wan 2.1"), ("wan", "residual_vae_decode", "Wan 2.2 (TI2V-5B)"),
                                ("ltx", "vae_decode", "LTX-Video"), ("sana", "dc_ae_decode", "Sana DC-AE f32c32"),
                                ("qwenimage", "vae_decode", "Qwen-Image (one image)"),
                                ("qwenimage21", "residual_vae_decode", "Qwen-Image 2.1 (one image)")):
        for dtype, v in results.get(family, {}).get(part, {}).items():
            pts = ", ".join(f"{p['frames']}f {p['width']}x{p['height']}: {p['peak_bytes'] / 2**20:.1f}" for p in v["points"])
            if "held_out" in v:
                held = v["held_out"]
                pts += (f"; held out {held['width']}x{held['height']}: predicted {held['predicted_bytes'] / 2**20:.1f}, "
                        f"measured {held['peak_bytes'] / 2**20:.1f}")
            measured_in = f" (the {v['measured_in']} fit)" if "measured_in" in v else ""
            rows.append(f"| {label} VAE decode (k; f = {v['f']} per decoded frame's pixels x 3) | {dtype}{measured_in} | - | "
                        f"{v['k']} | {v['c'] / 2**20:.1f} | {pts} |")
    (out / "plan_calibrate.md").write_text(
        f"Command: `PYTHONPATH=src .venv/bin/python bench/plan_calibrate.py{' --only ' + args.only if args.only else ''}` "
        f"({machine}, "
        f"{time.perf_counter() - began:.0f} s)\n\n" + "\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
