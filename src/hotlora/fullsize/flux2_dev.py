"""FLUX.2-dev as published: the Hugging Face Hub repository ``black-forest-labs/FLUX.2-dev``'s
diffusers configuration, so ``hotlora plan flux2-dev`` builds the full-size model on the meta device.

Sources (the Hub is not reachable where this was written):

* ``TRANSFORMER``: ``get_flux2_transformer_config("flux2-dev")`` in diffusers'
  ``scripts/convert_flux2_to_diffusers.py`` (the script that wrote the published ``transformer/``),
  which are also ``Flux2Transformer2DModel``'s defaults and the twelve fields a public Swift port's
  test decodes as FLUX.2-dev's config; that copy has no ``guidance_embeds`` (the class default,
  True, written out here: FLUX.2-dev is guidance-distilled) nor ``out_channels`` (null, =
  ``in_channels``).
* ``VAE``: the script builds ``AutoencoderKLFlux2()`` with its defaults and saves it, so the
  published ``vae/config.json`` is those defaults (copied here from diffusers 0.42.1).
* ``TEXT_ENCODER``: the script's text encoder, Mistral-Small-3.2-24B-Instruct-2506
  (``hotlora.fullsize._encoders.MISTRAL_SMALL_3``: shape fields confirmed by a public port's copy,
  the Pixtral vision tower's not).
* ``SCHEDULER``: the script copies FLUX.1-dev's ``scheduler/`` (``hotlora.fullsize.flux``).
* ``MODEL_INDEX``: the classes ``Flux2Pipeline`` takes (``PixtralProcessor`` for the tokenizer, as
  the script's ``AutoProcessor`` saves it); not confirmed against the published file.

The transformer has 32,223,281,152 parameters (the model card's "32B");
``tests/unit/test_fullsize_plans.py`` checks it. The text encoder has 24,011,361,280.
"""

from __future__ import annotations

from hotlora.fullsize._encoders import FLUX1_SCHEDULER, MISTRAL_SMALL_3

NAME = "flux2-dev"
HUB_ID = "black-forest-labs/FLUX.2-dev"
PUBLISHED_TRANSFORMER_PARAMETERS = "32B"
TRANSFORMER_PARAMETERS = 32_223_281_152

MODEL_INDEX = {
    "_class_name": "Flux2Pipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Mistral3ForConditionalGeneration"],
    "tokenizer": ["transformers", "PixtralProcessor"],
    "transformer": ["diffusers", "Flux2Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLFlux2"],
}

TRANSFORMER = {
    "_class_name": "Flux2Transformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [32, 32, 32, 32],
    "eps": 1e-06,
    "guidance_embeds": True,
    "in_channels": 128,
    "joint_attention_dim": 15360,
    "mlp_ratio": 3.0,
    "num_attention_heads": 48,
    "num_layers": 8,
    "num_single_layers": 48,
    "out_channels": None,
    "patch_size": 1,
    "rope_theta": 2000,
    "timestep_guidance_channels": 256,
}

TEXT_ENCODER = dict(MISTRAL_SMALL_3)

# AutoencoderKLFlux2's defaults (what the conversion script saved): FLUX.2's 32-channel VAE.
VAE = {
    "_class_name": "AutoencoderKLFlux2",
    "act_fn": "silu",
    "batch_norm_eps": 0.0001,
    "batch_norm_momentum": 0.1,
    "block_out_channels": [128, 256, 512, 512],
    "decoder_block_out_channels": None,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3,
    "latent_channels": 32,
    "layers_per_block": 2,
    "mid_block_add_attention": True,
    "norm_num_groups": 32,
    "out_channels": 3,
    "patch_size": [2, 2],
    "sample_size": 1024,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "use_post_quant_conv": True,
    "use_quant_conv": True,
}

SCHEDULER = dict(FLUX1_SCHEDULER)

TOKENIZER_VOCABULARY = {"tokenizer": 131072}  # Mistral's Tekken vocabulary

COMPONENTS = {"transformer": TRANSFORMER, "text_encoder": TEXT_ENCODER, "vae": VAE, "scheduler": SCHEDULER}
