"""FLUX.2-klein-9B as published: the Hugging Face Hub repository
``black-forest-labs/FLUX.2-klein-9B``'s diffusers configuration (the distilled 4-step model;
``-base-9B`` has the same architecture), so ``hotlora plan flux2-klein-9b`` builds the
full-size model on the meta device.

Sources (the Hub is not reachable where this was written):

* ``TRANSFORMER``: ``get_flux2_transformer_config("klein-9b")`` in diffusers'
  ``scripts/convert_flux2_to_diffusers.py`` (8 double and 24 single blocks, 32 heads of 128,
  ``joint_attention_dim`` 12288, ``guidance_embeds`` False), consistent with public copies of the
  published ``transformer/config.json`` (``joint_attention_dim`` 12288);
  ``out_channels`` null (= ``in_channels``).
* ``MODEL_INDEX``: a public copy of FLUX.2-klein-base-4B's ``model_index.json``
  (``Flux2KleinPipeline``, ``Qwen3ForCausalLM``, ``Qwen2TokenizerFast``, ``AutoencoderKLFlux2``);
  ``is_distilled`` as diffusers' modular FLUX.2-klein-4B index has it.
* ``TEXT_ENCODER``: Qwen3-8B (``hotlora.fullsize._encoders.QWEN3_8B``).
* ``VAE`` / ``SCHEDULER``: FLUX.2-dev's (``hotlora.fullsize.flux2_dev``): the same ``AutoencoderKLFlux2``
  class; neither file's values are confirmed for klein (the VAE's are the class defaults; a plan
  does not read the scheduler).

The transformer has 9,078,581,248 parameters; the model card's figure is "9B" (0.9% over it).
``tests/unit/test_fullsize_plans.py`` checks the exact count on the meta device.
"""

from __future__ import annotations

from hotlora.fullsize._encoders import QWEN3_8B
from hotlora.fullsize.flux2_dev import SCHEDULER as _SCHEDULER
from hotlora.fullsize.flux2_dev import VAE as _VAE

NAME = "flux2-klein-9b"
HUB_ID = "black-forest-labs/FLUX.2-klein-9B"
PUBLISHED_TRANSFORMER_PARAMETERS = "9B"
TRANSFORMER_PARAMETERS = 9_078_581_248

MODEL_INDEX = {
    "_class_name": "Flux2KleinPipeline",
    "is_distilled": True,
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen3ForCausalLM"],
    "tokenizer": ["transformers", "Qwen2TokenizerFast"],
    "transformer": ["diffusers", "Flux2Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLFlux2"],
}

TRANSFORMER = {
    "_class_name": "Flux2Transformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [32, 32, 32, 32],
    "eps": 1e-06,
    "guidance_embeds": False,
    "in_channels": 128,
    "joint_attention_dim": 12288,
    "mlp_ratio": 3.0,
    "num_attention_heads": 32,
    "num_layers": 8,
    "num_single_layers": 24,
    "out_channels": None,
    "patch_size": 1,
    "rope_theta": 2000,
    "timestep_guidance_channels": 256,
}

TEXT_ENCODER = dict(QWEN3_8B)

VAE = dict(_VAE)

SCHEDULER = dict(_SCHEDULER)

TOKENIZER_VOCABULARY = {"tokenizer": 151665}  # len() of the Qwen2 tokenizer

COMPONENTS = {"transformer": TRANSFORMER, "text_encoder": TEXT_ENCODER, "vae": VAE, "scheduler": SCHEDULER}
