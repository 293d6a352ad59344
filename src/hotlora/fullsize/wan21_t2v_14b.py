"""Wan 2.1 T2V 14B as published: ``Wan-AI/Wan2.1-T2V-14B-Diffusers`` (``hotlora plan
wan2.1-t2v-14b``).

Sources: ``TRANSFORMER`` is the ``"Wan-T2V-14B"`` ``diffusers_config`` of diffusers'
``scripts/convert_wan_to_diffusers.py`` (huggingface/diffusers at 58eb52c0), field by field: 40
layers, 40 heads of 128 (width 5120), ffn_dim 13824, the other fields as the 1.3B model's. The text
encoder, VAE, scheduler and tokenizer are the 1.3B model's (the script builds the same ones for every
Wan 2.1 T2V model; ``hotlora.fullsize.wan21_t2v_1_3b`` says what of them could be confirmed).

The transformer has 14,288,491,584 parameters built from that config (the model card's "14B", 2%
over it); ``tests/unit/test_fullsize_plans.py`` checks it.
"""

from __future__ import annotations

from hotlora.fullsize import wan21_t2v_1_3b as _small

NAME = "wan2.1-t2v-14b"
HUB_ID = "Wan-AI/Wan2.1-T2V-14B-Diffusers"
PUBLISHED_TRANSFORMER_PARAMETERS = "14B"
TRANSFORMER_PARAMETERS = 14_288_491_584

MODEL_INDEX = dict(_small.MODEL_INDEX)

TRANSFORMER = {**_small.TRANSFORMER, "ffn_dim": 13824, "num_attention_heads": 40, "num_layers": 40}

TEXT_ENCODER = dict(_small.TEXT_ENCODER)
VAE = dict(_small.VAE)
SCHEDULER = dict(_small.SCHEDULER)
TOKENIZER_VOCABULARY = dict(_small.TOKENIZER_VOCABULARY)
PLAN_SIZES = ("832x480", "1280x720")  # 480p and 720p (WIDTHxHEIGHT), 81 frames: the family default

COMPONENTS = {"transformer": TRANSFORMER, "text_encoder": TEXT_ENCODER, "vae": VAE, "scheduler": SCHEDULER}
