"""Stable Diffusion 1.5 as published: the Hugging Face Hub repository
``stable-diffusion-v1-5/stable-diffusion-v1-5`` (the mirror of the withdrawn
``runwayml/stable-diffusion-v1-5``), so ``hotlora plan sd15`` builds the full-size model on the
meta device.

Source (the Hub is not reachable where this was written): the repository's ``unet/``, ``vae/``,
``text_encoder/`` and ``scheduler/`` configs as the SD v1 release defines them and diffusers'
``scripts/convert_original_stable_diffusion_to_diffusers.py`` writes them for ``v1-inference.yaml``
(U-Net: 4 blocks of 320/640/1280/1280 channels, 8 heads, cross-attention 768, 64x64 latents; VAE: 4
latent channels, scale 0.18215 (the class default); CLIP ViT-L/14's text tower; ``PNDMScheduler``).
The shape fields are confirmed by public copies: diffusers-rs's SD 1.5 U-Net config (citing
``runwayml/stable-diffusion-v1-5/blob/main/unet/config.json``: 320/640/1280/1280, 8 heads, cross
attention on the first three blocks) and mmagic's Stable Diffusion config (the same U-Net block
types and widths, cross-attention 768, and this VAE field for field, the scheduler's betas). The
bookkeeping fields (``center_input_sample``, ``downsample_padding``, ``freq_shift`` ...) are recalled,
not compared with a copy of the file. The U-Net has the published 859,520,964 parameters ("860M").
The safety checker and feature extractor in ``model_index.json`` are not built by a plan.

Built offline with random seeded weights for the full-size run (``bench/full_size.py --family sd15``)::

    python -m hotlora.fullsize.sd15 build DIR [--seed 0] [--dtype bfloat16] [--adapters DIR]

as ``hotlora.fullsize.sdxl`` builds SDXL (the same byte-level CLIP tokenizer, the real 49,408-row
embedding table), with a kohya sd-scripts rank-32 LoRA (U-Net attention blocks and the text
encoder, ``lora_unet_`` / ``lora_te_`` in diffusers' flattened names, as ``train_network.py`` writes
SD1.x files) and a diffusers-layout rank-128 LoRA (U-Net attention projections).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from hotlora.fullsize._encoders import CLIP_L

NAME = "sd15"
HUB_ID = "stable-diffusion-v1-5/stable-diffusion-v1-5"
PUBLISHED_UNET_PARAMETERS = "860M"
UNET_PARAMETERS = 859_520_964

MODEL_INDEX = {
    "_class_name": "StableDiffusionPipeline",
    "feature_extractor": ["transformers", "CLIPImageProcessor"],
    "requires_safety_checker": True,
    "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
    "scheduler": ["diffusers", "PNDMScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}

UNET = {
    "_class_name": "UNet2DConditionModel",
    "act_fn": "silu",
    "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "out_channels": 4,
    "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
}

TEXT_ENCODER = {**CLIP_L, "torch_dtype": "float32"}

VAE = {
    "_class_name": "AutoencoderKL",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 512,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}

SCHEDULER = {
    "_class_name": "PNDMScheduler",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
}

TOKENIZER_VOCABULARY = {"tokenizer": 49408}

COMPONENTS = {"unet": UNET, "text_encoder": TEXT_ENCODER, "vae": VAE, "scheduler": SCHEDULER}

ADAPTER_STRENGTH = 0.05  # as for SDXL: a LoRA branch a few % of its layer's output
log = logging.getLogger(__name__)


def _config(values: dict) -> dict:
    """A published config as its class's constructor takes it (without the keys naming the class)."""
    return {k: v for k, v in values.items() if k not in ("_class_name", "architectures", "torch_dtype")}


def components(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The pipeline's parts from the configs above, seeded, built directly in ``dtype``."""
    from diffusers import AutoencoderKL, PNDMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from hotlora.families._tiny import clip_tokenizer

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(seed)
        parts = {"unet": UNet2DConditionModel.from_config(_config(UNET)),
                 "text_encoder": CLIPTextModel(CLIPTextConfig(**_config(TEXT_ENCODER))),
                 "vae": AutoencoderKL.from_config(_config(VAE))}
    finally:
        torch.set_default_dtype(previous)
    parts = {name: module.eval() for name, module in parts.items()}
    parts["scheduler"] = PNDMScheduler.from_config(_config(SCHEDULER))
    parts["tokenizer"] = clip_tokenizer()
    return parts


def save_sd15(directory: str | Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Build and save the pipeline like a Hub snapshot (no safety checker); returns ``directory``."""
    from diffusers import StableDiffusionPipeline

    directory = Path(directory)
    parts = components(seed, dtype)
    count = sum(p.numel() for p in parts["unet"].parameters())
    if count != UNET_PARAMETERS:  # the configs above were mistyped: refuse to save a wrong model
        raise AssertionError(f"U-Net has {count:,} parameters, the published SD1.5 U-Net {UNET_PARAMETERS:,}")
    StableDiffusionPipeline(**parts, safety_checker=None, feature_extractor=None,
                            requires_safety_checker=False).save_pretrained(str(directory))
    defaults = {"model_id": "hotlora/sd15-full-size-random", "base_model_aliases": [HUB_ID], "height": 256,
                "width": 256, "num_inference_steps": 4}
    (directory / "hotlora.json").write_text(json.dumps(defaults, indent=2))
    log.info("saved SD1.5 (U-Net %s parameters, %s) to %s", f"{count:,}", dtype, directory)
    return directory


def adapter_layers() -> dict[str, dict[str, tuple[int, int]]]:
    """{"kohya_unet", "kohya_unet_convs", "te", "diffusers_unet"} -> module name -> (in, out), read on the
    meta device. ``kohya_unet_convs``: the attentions' 1x1 ``proj_in`` / ``proj_out``, which sd-scripts'
    default network wraps beside the Linears."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from hotlora.fullsize.sdxl import DIFFUSERS_TARGETS, KOHYA_UNET_BLOCKS, TEXT_TARGETS, _clip_names, _linears

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(_config(UNET))
        text = CLIPTextModel(CLIPTextConfig(**_config(TEXT_ENCODER)))
    return {"kohya_unet": _linears(unet, lambda n: KOHYA_UNET_BLOCKS in f".{n}"),
            "kohya_unet_convs": {name: (m.in_channels, m.out_channels) for name, m in unet.named_modules()
                                 if KOHYA_UNET_BLOCKS in f".{name}" and isinstance(m, torch.nn.Conv2d)
                                 and m.kernel_size == (1, 1)},
            "te": _clip_names(_linears(text, lambda n: n.endswith(TEXT_TARGETS))),
            "diffusers_unet": _linears(unet, lambda n: n.endswith(DIFFUSERS_TARGETS))}


def write_kohya_lora(path: Path, layers: dict, rank: int = 32, alpha: float = 16.0, seed: int = 1) -> Path:
    """kohya sd-scripts' SD1.x LoRA (``train_network.py``, ``networks.lora``): diffusers' module names
    flattened under ``lora_unet_`` and ``lora_te_``, ``lora_down`` / ``lora_up`` and ``.alpha`` per
    module (written by diffusers' ``convert_state_dict_to_kohya``; its ``lora_te1_`` is SDXL's first
    text encoder, sd-scripts names SD1.x's one ``lora_te_``), float16, with the ``ss_*`` header."""
    from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya
    from safetensors.torch import save_file

    from hotlora.tiny import random_lora
    from hotlora.trainer_layouts import sd_scripts_metadata

    convs = {k: v[..., None, None] for k, v in  # a 1x1 conv's LoRA: [r, in, 1, 1] and [out, r, 1, 1]
             random_lora(layers["kohya_unet_convs"], rank, seed + 2, strength=ADAPTER_STRENGTH).items()}
    sds = {"unet": {**random_lora(layers["kohya_unet"], rank, seed, strength=ADAPTER_STRENGTH), **convs},
           "text_encoder": random_lora(layers["te"], rank, seed + 1, strength=ADAPTER_STRENGTH)}
    kohya = convert_state_dict_to_kohya({f"{part}.{k}": v for part, sd in sds.items() for k, v in sd.items()})
    kohya = {k.replace("lora_te1_", "lora_te_"): (torch.tensor(alpha) if k.endswith(".alpha") else v.half().contiguous())
             for k, v in kohya.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(kohya, str(path), metadata=sd_scripts_metadata("sd_v1", rank, alpha))
    return path


def write_adapters(out: str | Path) -> dict[str, Path]:
    """Both real-size adapters under ``out``: {"kohya-r32": file, "diffusers-r128": folder file}."""
    from hotlora.tiny import random_lora, save_diffusers_lora

    out = Path(out)
    layers = adapter_layers()
    style = {k: v.half() for k, v in random_lora(layers["diffusers_unet"], 128, 4, strength=ADAPTER_STRENGTH).items()}
    return {"kohya-r32": write_kohya_lora(out / "kohya-r32.safetensors", layers),
            "diffusers-r128": save_diffusers_lora(out / "diffusers-r128", NAME, style, rank=128, alpha=128)}


def main(argv: list[str] | None = None) -> None:
    from hotlora.fullsize._build import build_command

    build_command(argv, module="sd15", what="SD1.5", save=save_sd15, write_adapters=write_adapters)


if __name__ == "__main__":
    main()
