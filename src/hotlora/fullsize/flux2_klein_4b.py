"""FLUX.2-klein-4B as published: the Hugging Face Hub repository
``black-forest-labs/FLUX.2-klein-4B``'s diffusers configuration (the distilled 4-step model;
``-base-4B`` has the same architecture), so ``hotlora plan flux2-klein-4b`` builds the
full-size model on the meta device.

Sources (the Hub is not reachable where this was written):

* ``TRANSFORMER``: ``get_flux2_transformer_config("klein-4b")`` in diffusers'
  ``scripts/convert_flux2_to_diffusers.py`` (5 double and 20 single blocks, 24 heads of 128,
  ``joint_attention_dim`` 7680, ``guidance_embeds`` False), and every field of a public trainer's
  copy "pinned from a config that was actually read" of the published ``transformer/config.json``
  (both 4B variants);
  ``out_channels`` null (= ``in_channels``).
* ``MODEL_INDEX``: a public copy of FLUX.2-klein-base-4B's ``model_index.json``
  (``Flux2KleinPipeline``, ``Qwen3ForCausalLM``, ``Qwen2TokenizerFast``, ``AutoencoderKLFlux2``);
  ``is_distilled`` as diffusers' modular FLUX.2-klein-4B index has it.
* ``TEXT_ENCODER``: Qwen3-4B (the same Qwen3-4B Z-Image ships) (``hotlora.fullsize._encoders.QWEN3_4B``).
* ``VAE`` / ``SCHEDULER``: FLUX.2-dev's (``hotlora.fullsize.flux2_dev``): the same ``AutoencoderKLFlux2``
  class; neither file's values are confirmed for klein (the VAE's are the class defaults; a plan
  does not read the scheduler).

The transformer has 3,875,544,576 parameters; the model card's figure is "4B", a rounded
name: 3.88B is 3.1% under it (outside the 1% the other modules meet; nothing published gives
a finer figure).
``tests/unit/test_fullsize_plans.py`` checks the exact count on the meta device.
"""

from __future__ import annotations

from hotlora.fullsize._encoders import QWEN3_4B
from hotlora.fullsize.flux2_dev import SCHEDULER as _SCHEDULER
from hotlora.fullsize.flux2_dev import VAE as _VAE

NAME = "flux2-klein-4b"
HUB_ID = "black-forest-labs/FLUX.2-klein-4B"
PUBLISHED_TRANSFORMER_PARAMETERS = "4B"
TRANSFORMER_PARAMETERS = 3_875_544_576

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
    "joint_attention_dim": 7680,
    "mlp_ratio": 3.0,
    "num_attention_heads": 24,
    "num_layers": 5,
    "num_single_layers": 20,
    "out_channels": None,
    "patch_size": 1,
    "rope_theta": 2000,
    "timestep_guidance_channels": 256,
}

TEXT_ENCODER = dict(QWEN3_4B)

VAE = dict(_VAE)

SCHEDULER = dict(_SCHEDULER)

TOKENIZER_VOCABULARY = {"tokenizer": 151665}  # len() of the Qwen2 tokenizer

COMPONENTS = {"transformer": TRANSFORMER, "text_encoder": TEXT_ENCODER, "vae": VAE, "scheduler": SCHEDULER}
