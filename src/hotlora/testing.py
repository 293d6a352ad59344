"""Test helpers: adapters written the way real tools write them, and the plain diffusers reference.

The tiny models and their sample adapters live in ``hotlora.tiny`` (the serve path uses them
too); they are re-exported here so tests import one module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch

from hotlora.tiny import (
    TINY_SIZE, build_tiny_flux, build_tiny_pipeline, build_tiny_sdxl, denoiser_linears, kohya_flux_lora,
    random_lora, save_diffusers_lora, save_kohya_sdxl_lora, save_peft_lora, save_tiny_model, write_sample_adapters,
    xlabs_flux_lora,
)

__all__ = [  # the tiny models' helpers, re-exported, and this module's own
    "TINY_SIZE", "build_tiny_flux", "build_tiny_pipeline", "build_tiny_sdxl", "denoiser_linears", "kohya_flux_lora",
    "random_lora", "save_diffusers_lora", "save_kohya_sdxl_lora", "save_peft_lora", "save_tiny_model",
    "write_sample_adapters", "xlabs_flux_lora", "sd_scripts_sdxl_lora", "sd_scripts_metadata",
    "save_kohya_flux_lora_file", "ai_toolkit_flux_lora", "plain_diffusers_reference",
]


def sd_scripts_sdxl_lora(unet_sd: Mapping[str, torch.Tensor], layers_per_block: int, alpha: float,
                         text_encoders: Mapping[str, Mapping[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """kohya sd-scripts' SDXL layout (``sdxl_train_network.py``): U-Net attention modules under their
    SGM (Stability's original) block numbers, ``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``;
    text encoders as ``lora_te1_*`` / ``lora_te2_*``; ``lora_down`` / ``lora_up`` and a scalar ``.alpha``
    per module. ``unet_sd`` and ``text_encoders`` ({"te1": sd, "te2": sd}) are in PEFT key form."""

    def sgm_name(module: str) -> str:
        parts = module.split(".")
        if parts[0] == "mid_block" and parts[1] == "attentions":
            return "_".join(["middle_block", "1"] + parts[3:])
        block, layer = int(parts[1]), int(parts[3])
        if parts[0] == "down_blocks" and parts[2] == "attentions":
            return "_".join(["input_blocks", str(1 + block * (layers_per_block + 1) + layer), "1"] + parts[4:])
        if parts[0] == "up_blocks" and parts[2] == "attentions":
            return "_".join(["output_blocks", str(block * (layers_per_block + 1) + layer), "1"] + parts[4:])
        raise ValueError(f"{module}: sd-scripts' default LoRA network targets attention blocks only")

    out = {}
    groups = [("lora_unet_", unet_sd, sgm_name)]
    for te, sd in (text_encoders or {}).items():
        groups.append((f"lora_{te}_", sd, lambda m: m.replace(".", "_")))
    for prefix, sd, rename in groups:
        for module in sorted({k.split(".lora_")[0] for k in sd}):
            name = prefix + rename(module)
            out[f"{name}.lora_down.weight"] = sd[f"{module}.lora_A.weight"].contiguous()
            out[f"{name}.lora_up.weight"] = sd[f"{module}.lora_B.weight"].contiguous()
            out[f"{name}.alpha"] = torch.tensor(float(alpha))
    return out


def sd_scripts_metadata(base_model_version: str, rank: int, alpha: float | None) -> dict[str, str]:
    """The ``ss_*`` / ``modelspec.*`` header fields sd-scripts writes (all strings, as safetensors wants)."""
    meta = {
        "ss_network_module": "networks.lora_flux" if base_model_version.startswith("flux") else "networks.lora",
        "ss_network_dim": str(rank), "ss_base_model_version": base_model_version, "ss_output_name": "corpus",
        "ss_training_comment": "None", "sshs_model_hash": "0" * 64, "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": "flux-1-dev/lora" if base_model_version.startswith("flux") else "stable-diffusion-xl-v1-base/lora",
    }
    if alpha is not None:
        meta["ss_network_alpha"] = str(float(alpha))
    return meta


def save_kohya_flux_lora_file(path: Path, sd: Mapping[str, torch.Tensor], rank: int, alpha: float | None,
                              dtype: torch.dtype | None = None) -> Path:
    """A kohya-layout Flux LoRA (from :func:`kohya_flux_lora`) as sd-scripts' ``flux_train_network.py``
    saves it: its header metadata, and optionally no ``.alpha`` keys (files converted by older tools
    lack them; diffusers then takes alpha = rank)."""
    from safetensors.torch import save_file

    kept = {k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in sd.items()
            if alpha is not None or not k.endswith(".alpha")}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(kept, str(path), metadata=sd_scripts_metadata("flux1", rank, alpha))
    return path


def ai_toolkit_flux_lora(sd: Mapping[str, torch.Tensor], name: str = "corpus") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """ostris ai-toolkit's Flux LoRA: diffusers module names under ``transformer.``, ``lora_A`` /
    ``lora_B``, no alphas, saved in float16 (its default ``save_dtype``); the header metadata as
    its ``get_meta_for_safetensors`` writes it (the job config and software info as JSON strings)."""
    tensors = {f"transformer.{k}": v.to(torch.float16).contiguous() for k, v in sd.items()}
    meta = {
        "name": name, "version": "1.0",
        "training_info": json.dumps({"step": 1000, "epoch": 2}),
        "software": json.dumps({"name": "ai-toolkit", "repo": "https://github.com/ostris/ai-toolkit", "version": "0.1.0"}),
        "sshs_model_hash": "0" * 64, "sshs_legacy_hash": "0" * 8, "format": "pt",
    }
    return tensors, meta


# ----------------------------------------------------------------------------- the reference


def plain_diffusers_reference(model_dir, adapters, *, prompt: str, num_images: int, num_inference_steps: int,
                              guidance_scale: float, height: int, width: int, seed: int, output_type="latent"):
    """What a fresh, plain diffusers pipeline gives: ``load_lora_weights`` per adapter, then
    ``set_adapters`` with the scales, one batch, image i seeded ``seed + i``. The correctness
    contract compares the warm engine against exactly this."""
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(str(model_dir), local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    names, weights = [], []
    for slot, (source, scale) in adapters.items():
        if source is None:
            continue
        source = dict(source) if isinstance(source, Mapping) else str(source)
        pipeline.load_lora_weights(source, adapter_name=f"ref_{slot}")
        names.append(f"ref_{slot}")
        weights.append(scale)
    if names:
        pipeline.set_adapters(names, weights)
    generators = [torch.Generator().manual_seed(seed + i) for i in range(num_images)]
    return pipeline(prompt=prompt, num_images_per_prompt=num_images, generator=generators,
                    num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, height=height,
                    width=width, output_type=output_type).images
