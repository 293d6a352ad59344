"""Wan 2.1 FLF2V 14B 720P as published: ``Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers`` (``hotlora plan
wan2.1-flf2v-14b-720p``): a first-last-frame-to-video checkpoint (``WanImageToVideoPipeline``; it
serves ``image-to-video`` alone, with two input images: the first and the last frame).

Sources: ``TRANSFORMER`` is the ``"Wan-FLF2V-14B-720P"`` ``diffusers_config`` of diffusers'
``scripts/convert_wan_to_diffusers.py`` (huggingface/diffusers at 58eb52c0, the commit
``wan21_i2v_14b_480p`` cites), field by field: the I2V-14B config (36 input channels, ``image_dim``
1280, ``added_kv_proj_dim`` 5120) with ``rope_max_seq_len`` 1024 (the class's default, written out
there) and ``pos_embed_seq_len`` 257 x 2 (a position embedding over both frames' CLIP tokens, 257
each: the image embedder takes them as one sequence; the script renames ``img_emb.emb_pos`` to it).
The script builds a ``WanImageToVideoPipeline`` from it with the same image encoder as I2V
(``CLIPVisionModelWithProjection`` from ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, its processor
from the same repository), the Wan 2.1 VAE, UMT5-XXL, and ``UniPCMultistepScheduler`` with
``flow_shift`` 16.0 for FLF2V (3.0 for I2V).

The transformer has 16,395,536,704 parameters built from that config: the I2V transformer's
16,394,878,784 and the position embedding's 514 x 1280 = 657,920 (the model card's "14B" is the
family's name, as for I2V). The image encoder, I2V's, has 632,076,800 and is counted beside the text
encoder. ``tests/unit/test_fullsize_plans.py`` checks both, the config and the two input images.
"""

from __future__ import annotations

from hotlora.fullsize import wan21_i2v_14b_480p as _i2v

NAME = "wan2.1-flf2v-14b-720p"
HUB_ID = "Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers"
PUBLISHED_TRANSFORMER_PARAMETERS = "14B"
TRANSFORMER_PARAMETERS = 16_395_536_704
IMAGE_ENCODER_PARAMETERS = _i2v.IMAGE_ENCODER_PARAMETERS

MODEL_INDEX = dict(_i2v.MODEL_INDEX)
TRANSFORMER = {**_i2v.TRANSFORMER, "rope_max_seq_len": 1024, "pos_embed_seq_len": 257 * 2}
IMAGE_ENCODER = dict(_i2v.IMAGE_ENCODER)
TEXT_ENCODER = dict(_i2v.TEXT_ENCODER)
VAE = dict(_i2v.VAE)
SCHEDULER = {**_i2v.SCHEDULER, "flow_shift": 16.0}
TOKENIZER_VOCABULARY = dict(_i2v.TOKENIZER_VOCABULARY)
PLAN_SIZES = ("1280x720",)  # the 720P model's (WIDTHxHEIGHT), 81 frames: the family default

COMPONENTS = {"transformer": TRANSFORMER, "image_encoder": IMAGE_ENCODER, "text_encoder": TEXT_ENCODER, "vae": VAE,
              "scheduler": SCHEDULER}
