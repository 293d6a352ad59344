"""Chroma1-HD as published: the Hugging Face Hub repository ``lodestones/Chroma1-HD``'s diffusers
configuration, so ``hotlora plan chroma1-hd`` builds the full-size model on the meta device.

Sources (the Hub is not reachable where this was written):

* ``TRANSFORMER``: the Chroma1-HD architecture as two public copies give it field for field (a
  diffusers cache test's ``CHROMA_HD_SIGNATURE``, ``out_channels`` null; InvokeAI's Chroma loader's
  ``CHROMA_TRANSFORMER_CONFIG``, which writes ``out_channels`` 64, the same thing): 19 double and
  38 single blocks of FLUX.1's width, a 5-layer 5120-wide distilled guidance approximator over 64
  channels, no CLIP pooled input. These are also ``ChromaTransformer2DModel``'s defaults. Not seen
  verbatim from the repository's own ``transformer/config.json`` (its bookkeeping keys aside, a
  public converter writes the same field list); the count matches the model card's "8.9B".
* ``MODEL_INDEX``: the classes ``ChromaPipeline`` takes (T5 encoder only, FLUX.1's VAE); not
  confirmed against the published file.
* ``TEXT_ENCODER``: T5 v1.1 XXL's encoder, ``VAE``: FLUX.1's (``hotlora.fullsize._encoders``).
* ``SCHEDULER``: FLUX.1-dev's values; NOT confirmed for Chroma (a plan does not read it).

The transformer has 8,899,983,424 parameters ("8.9B"); ``tests/unit/test_fullsize_plans.py``
checks it.
"""

from __future__ import annotations

from hotlora.fullsize._encoders import FLUX1_SCHEDULER, FLUX1_VAE, T5_XXL

NAME = "chroma1-hd"
HUB_ID = "lodestones/Chroma1-HD"
PUBLISHED_TRANSFORMER_PARAMETERS = "8.9B"
TRANSFORMER_PARAMETERS = 8_899_983_424

MODEL_INDEX = {
    "_class_name": "ChromaPipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "ChromaTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}

TRANSFORMER = {
    "_class_name": "ChromaTransformer2DModel",
    "approximator_hidden_dim": 5120,
    "approximator_layers": 5,
    "approximator_num_channels": 64,
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 19,
    "num_single_layers": 38,
    "out_channels": None,
    "patch_size": 1,
}

TEXT_ENCODER = dict(T5_XXL)  # T5 v1.1 XXL encoder (the pipeline's only text encoder: "text_encoder")

VAE = dict(FLUX1_VAE)

SCHEDULER = dict(FLUX1_SCHEDULER)

TOKENIZER_VOCABULARY = {"tokenizer": 32100}

COMPONENTS = {"transformer": TRANSFORMER, "text_encoder": TEXT_ENCODER, "vae": VAE, "scheduler": SCHEDULER}
