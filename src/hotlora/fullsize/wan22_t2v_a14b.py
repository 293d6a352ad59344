"""Wan 2.2 T2V A14B as published: ``Wan-AI/Wan2.2-T2V-A14B-Diffusers`` (``hotlora plan
wan2.2-t2v-a14b``): two experts of Wan 2.1 14B's architecture, ``transformer`` (high noise) and
``transformer_2`` (low noise), switched at ``boundary_ratio`` 0.875.

Sources: both experts' config is the ``"Wan2.2-T2V-A14B"`` ``diffusers_config`` of diffusers'
``scripts/convert_wan_to_diffusers.py`` (huggingface/diffusers at 58eb52c0; the script converts
``high_noise_model`` and ``low_noise_model`` with the same config), equal field by field to the 2.1
14B one; the script builds ``WanPipeline(..., boundary_ratio=0.875)`` for T2V, with the Wan 2.1 VAE
(``convert_vae``; the 48-channel Wan 2.2 VAE is TI2V-5B's only), UMT5-XXL and the same UniPC scheduler
(flow_shift 3.0). What of the text encoder could be confirmed: ``hotlora.fullsize.wan21_t2v_1_3b``.

Each expert has 14,288,491,584 parameters (the model card's "14B" per expert, 27B in all as it
counts them); ``tests/unit/test_fullsize_plans.py`` checks both.
"""

from __future__ import annotations

from hotlora.fullsize import wan21_t2v_14b as _wan21

NAME = "wan2.2-t2v-a14b"
HUB_ID = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
PUBLISHED_TRANSFORMER_PARAMETERS = "14B per expert"
TRANSFORMER_PARAMETERS = _wan21.TRANSFORMER_PARAMETERS  # each expert's
BOUNDARY_RATIO = 0.875

MODEL_INDEX = {
    **_wan21.MODEL_INDEX,
    "boundary_ratio": BOUNDARY_RATIO,
    "transformer_2": ["diffusers", "WanTransformer3DModel"],
}

TRANSFORMER = dict(_wan21.TRANSFORMER)
TRANSFORMER_2 = dict(_wan21.TRANSFORMER)
TEXT_ENCODER = dict(_wan21.TEXT_ENCODER)
VAE = dict(_wan21.VAE)
SCHEDULER = dict(_wan21.SCHEDULER)
TOKENIZER_VOCABULARY = dict(_wan21.TOKENIZER_VOCABULARY)
PLAN_SIZES = ("832x480", "1280x720")  # 480p and 720p (WIDTHxHEIGHT), 81 frames: the family default

COMPONENTS = {"transformer": TRANSFORMER, "transformer_2": TRANSFORMER_2, "text_encoder": TEXT_ENCODER, "vae": VAE,
              "scheduler": SCHEDULER}
