"""Stable Diffusion 3.5 Medium as published: the Hugging Face Hub repository
``stabilityai/stable-diffusion-3.5-medium``'s diffusers configuration, so
``hotlora plan sd3.5-medium`` builds the full-size model on the meta device.

Sources (the Hub is not reachable where this was written; the repository is gated):

* ``TRANSFORMER`` and ``VAE``: a public Tenstorrent port that rebuilds the repository's
  ``transformer/config.json`` and ``vae/config.json`` locally because the repository is gated (its
  two copies of the transformer configs agree with each other), cross-checked against diffusers'
  ``scripts/convert_sd3_to_diffusers.py`` (``num_attention_heads`` = ``num_layers``, ``qk_norm``
  rms_norm from the checkpoint's ``ln_q``, ``joint_attention_dim`` 4096, ``sample_size`` 128) and
  the model card (dual attention blocks in the first 13 layers, QK normalization).
* ``MODEL_INDEX``: the same port's copy (``StableDiffusion3Pipeline``: CLIP-L and OpenCLIP bigG with
  projection, T5-XXL).
* Text encoders: CLIP ViT-L/14 and OpenCLIP ViT-bigG/14 text towers with projection, T5 v1.1 XXL
  encoder (``hotlora.fullsize._encoders``; the same towers SDXL and FLUX.1 publish). Not
  confirmed against this repository's own files.
* ``SCHEDULER``: the published SD3 / SD3.5 ``scheduler_config.json`` as remembered
  (``shift`` 3.0, no dynamic shifting); not confirmed here (a plan does not read it).

The transformer has 2,243,171,520 parameters; the model card's figure is "2.5B", 10% over it
(outside the 1% the other modules meet). The architecture is what the card describes (24 layers of
width 1536, QK normalization, dual attention in layers 0-12: "the first 13 layers"; the card's
description says 12 in one place), so the gap is in the figure, not the config: Stability's
"2.5 billion" may count more than the MMDiT-X (it is not explained on the card). UNCONFIRMED:
whether the published transformer holds anything this class does not build.
``tests/unit/test_fullsize_plans.py`` checks the exact count on the meta device.
"""

from __future__ import annotations

from hotlora.fullsize._encoders import CLIP_G, CLIP_L, T5_XXL

NAME = "sd3.5-medium"
HUB_ID = "stabilityai/stable-diffusion-3.5-medium"
PUBLISHED_TRANSFORMER_PARAMETERS = "2.5B"
TRANSFORMER_PARAMETERS = 2_243_171_520

MODEL_INDEX = {
    "_class_name": "StableDiffusion3Pipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
    "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
    "text_encoder_3": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "CLIPTokenizer"],
    "tokenizer_3": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "SD3Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}

TRANSFORMER = {
    "_class_name": "SD3Transformer2DModel",
    "attention_head_dim": 64,
    "caption_projection_dim": 1536,
    "dual_attention_layers": list(range(13)),
    "in_channels": 16,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 24,
    "out_channels": 16,
    "patch_size": 2,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 384,
    "qk_norm": "rms_norm",
    "sample_size": 128,
}

TEXT_ENCODER = {**CLIP_L, "architectures": ["CLIPTextModelWithProjection"]}  # CLIP-L with its projection
TEXT_ENCODER_2 = dict(CLIP_G)
TEXT_ENCODER_3 = dict(T5_XXL)

VAE = {
    "_class_name": "AutoencoderKL",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "force_upcast": True,
    "in_channels": 3,
    "latent_channels": 16,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 1024,
    "scaling_factor": 1.5305,
    "shift_factor": 0.0609,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "use_post_quant_conv": False,
    "use_quant_conv": False,
}

SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}

TOKENIZER_VOCABULARY = {"tokenizer": 49408, "tokenizer_2": 49408, "tokenizer_3": 32100}

COMPONENTS = {"transformer": TRANSFORMER, "text_encoder": TEXT_ENCODER, "text_encoder_2": TEXT_ENCODER_2,
              "text_encoder_3": TEXT_ENCODER_3, "vae": VAE, "scheduler": SCHEDULER}
