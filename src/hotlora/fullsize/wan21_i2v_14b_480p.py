"""Wan 2.1 I2V 14B 480P as published: ``Wan-AI/Wan2.1-I2V-14B-480P-Diffusers`` (``hotlora plan
wan2.1-i2v-14b-480p``): an image-to-video checkpoint (``WanImageToVideoPipeline``; it serves
``image-to-video`` alone).

Sources: ``TRANSFORMER`` is the ``"Wan-I2V-14B-480p"`` ``diffusers_config`` of diffusers'
``scripts/convert_wan_to_diffusers.py`` (huggingface/diffusers at 58eb52c0), field by field: Wan 2.1
14B's (40 layers, 40 heads of 128, ffn_dim 13824) with 36 input channels (the noise, the first frame's
latents and a 4-channel mask), ``image_dim`` 1280 (the CLIP features' width) and ``added_kv_proj_dim``
5120 (the cross-attention's ``add_k_proj`` / ``add_v_proj`` on them). ``IMAGE_ENCODER``: the script
loads ``CLIPVisionModelWithProjection`` from ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, whose config
it does not quote; the ViT-H/14 vision tower's shape (width 1280, 32 layers, 16 heads, MLP 5120,
patch 14 at 224 pixels, projection 1024) is that model's published architecture, not confirmed
against the Hub file here. Text encoder, VAE and tokenizer: Wan 2.1's (``wan21_t2v_1_3b`` says what
of them could be confirmed); the scheduler's flow_shift 3.0 as the script sets it for I2V.

The transformer has 16,394,878,784 parameters built from that config: the model card's "14B" is the
family's name (the text-to-video model's 14.29B), the image cross-attention's ``add_k_proj`` /
``add_v_proj`` (40 layers x 2 x 5120 x 5120) and the image embedder add 2.1B. The image encoder has
632,076,800. ``tests/unit/test_fullsize_plans.py`` checks both.
"""

from __future__ import annotations

from hotlora.fullsize import wan21_t2v_14b as _t2v

NAME = "wan2.1-i2v-14b-480p"
HUB_ID = "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"
PUBLISHED_TRANSFORMER_PARAMETERS = "14B"
TRANSFORMER_PARAMETERS = 16_394_878_784
IMAGE_ENCODER_PARAMETERS = 632_076_800

MODEL_INDEX = {
    **_t2v.MODEL_INDEX,
    "_class_name": "WanImageToVideoPipeline",
    "image_encoder": ["transformers", "CLIPVisionModelWithProjection"],
    "image_processor": ["transformers", "CLIPImageProcessor"],
}

TRANSFORMER = {**_t2v.TRANSFORMER, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}
IMAGE_ENCODER = {
    "architectures": ["CLIPVisionModelWithProjection"],
    "hidden_act": "gelu",
    "hidden_size": 1280,
    "image_size": 224,
    "intermediate_size": 5120,
    "layer_norm_eps": 1e-05,
    "num_attention_heads": 16,
    "num_channels": 3,
    "num_hidden_layers": 32,
    "patch_size": 14,
    "projection_dim": 1024,
}
TEXT_ENCODER = dict(_t2v.TEXT_ENCODER)
VAE = dict(_t2v.VAE)
SCHEDULER = dict(_t2v.SCHEDULER)
TOKENIZER_VOCABULARY = dict(_t2v.TOKENIZER_VOCABULARY)
PLAN_SIZES = ("832x480",)  # the 480P model's (WIDTHxHEIGHT), 81 frames: the family default

COMPONENTS = {"transformer": TRANSFORMER, "image_encoder": IMAGE_ENCODER, "text_encoder": TEXT_ENCODER, "vae": VAE,
              "scheduler": SCHEDULER}
