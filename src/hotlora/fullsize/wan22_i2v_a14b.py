"""Wan 2.2 I2V A14B as published: ``Wan-AI/Wan2.2-I2V-A14B-Diffusers`` (``hotlora plan
wan2.2-i2v-a14b``): two image-to-video experts (``WanImageToVideoPipeline``; it serves
``image-to-video`` alone), ``transformer`` for the high-noise steps and ``transformer_2`` below the
boundary.

Sources: both experts' config is the ``"Wan2.2-I2V-14B-720p"`` ``diffusers_config`` of diffusers'
``scripts/convert_wan_to_diffusers.py`` (huggingface/diffusers at 58eb52c0; ``high_noise_model`` and
``low_noise_model`` converted with it): Wan 2.1 14B's with 36 input channels and no image encoder
(no ``image_dim``, no ``added_kv_proj_dim``). The script builds ``WanImageToVideoPipeline(...,
boundary_ratio=0.9)`` (0.875 for T2V), with the Wan 2.1 VAE, UMT5-XXL and UniPC (flow_shift 3.0).

Each expert has 14,288,901,184 parameters (the model card's "14B" per expert; 36 input channels
against the T2V experts' 16 add 409,600 to the patch embedding);
``tests/unit/test_fullsize_plans.py`` checks both.
"""

from __future__ import annotations

from hotlora.fullsize import wan22_t2v_a14b as _t2v

NAME = "wan2.2-i2v-a14b"
HUB_ID = "Wan-AI/Wan2.2-I2V-A14B-Diffusers"
PUBLISHED_TRANSFORMER_PARAMETERS = "14B per expert"
TRANSFORMER_PARAMETERS = 14_288_901_184  # each expert's
BOUNDARY_RATIO = 0.9

MODEL_INDEX = {**_t2v.MODEL_INDEX, "_class_name": "WanImageToVideoPipeline", "boundary_ratio": BOUNDARY_RATIO}

TRANSFORMER = {**_t2v.TRANSFORMER, "in_channels": 36}
TRANSFORMER_2 = dict(TRANSFORMER)
TEXT_ENCODER = dict(_t2v.TEXT_ENCODER)
VAE = dict(_t2v.VAE)
SCHEDULER = dict(_t2v.SCHEDULER)
TOKENIZER_VOCABULARY = dict(_t2v.TOKENIZER_VOCABULARY)
PLAN_SIZES = ("832x480", "1280x720")  # 480p and 720p (WIDTHxHEIGHT), 81 frames: the family default

COMPONENTS = {"transformer": TRANSFORMER, "transformer_2": TRANSFORMER_2, "text_encoder": TEXT_ENCODER, "vae": VAE,
              "scheduler": SCHEDULER}
