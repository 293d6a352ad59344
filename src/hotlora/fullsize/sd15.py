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
"""

from __future__ import annotations

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
