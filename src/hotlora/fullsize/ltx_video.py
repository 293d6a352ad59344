"""LTX-Video 2B as published: ``Lightricks/LTX-Video`` (version 0.9.0's Diffusers layout), so
``hotlora plan ltx-video`` builds the full-size model on the meta device.

Source (the Hub is not reachable where this was written): diffusers' own
``scripts/convert_ltx_to_diffusers.py``, the script that made the Diffusers repository, read field
by field:

* ``TRANSFORMER``: the script builds ``LTXVideoTransformer3DModel()`` with no arguments and loads the
  checkpoint into it strictly, so the published config is the class's defaults (diffusers 0.42.1):
  28 layers, 32 heads of 64, cross-attention 2048, caption channels 4096, in/out channels 128, patch
  1 x 1, ``rms_norm_across_heads``, biases on. It has 1,923,385,472 parameters ("2B").
* ``VAE``: the script's ``get_vae_config("0.9.0")`` (128 latent channels, blocks 128/256/512/512,
  patch 4, a causal encoder and a non-causal decoder without timestep conditioning): 32x spatial
  and 8x temporal compression (``decoder_inject_noise``: the class default's five entries, all
  False, as the script's four). Version 0.9.1 changed only the decoder (256/512/1024, noise
  injection, timestep conditioning); the transformer is the same.
* ``TEXT_ENCODER`` (``_encoders.T5_XXL``): the script loads ``google/t5-v1_1-xxl``'s encoder, the one
  FLUX.1 ships; its tokenizer padded to 128 tokens (``TOKENIZER_MAX_LENGTH``).
* ``SCHEDULER``: the script's ``FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True,
  base_shift=0.95, max_shift=2.05, base_image_seq_len=1024, max_image_seq_len=4096,
  shift_terminal=0.1)``.

``PLAN_SIZES``: LTX takes sides that are multiples of 32, so 480p is 832 x 480 and "720p" 1280 x 704
(the nearest multiple of 32 under 720); 161 frames, the family default.
"""

from __future__ import annotations

from hotlora.fullsize._encoders import T5_XXL

NAME = "ltx-video"
HUB_ID = "Lightricks/LTX-Video"
PUBLISHED_TRANSFORMER_PARAMETERS = "2B"
TRANSFORMER_PARAMETERS = 1_923_385_472

MODEL_INDEX = {
    "_class_name": "LTXPipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "LTXVideoTransformer3DModel"],
    "vae": ["diffusers", "AutoencoderKLLTXVideo"],
}

TRANSFORMER = {
    "_class_name": "LTXVideoTransformer3DModel",
    "activation_fn": "gelu-approximate",
    "attention_bias": True,
    "attention_head_dim": 64,
    "attention_out_bias": True,
    "caption_channels": 4096,
    "cross_attention_dim": 2048,
    "in_channels": 128,
    "norm_elementwise_affine": False,
    "norm_eps": 1e-06,
    "num_attention_heads": 32,
    "num_layers": 28,
    "out_channels": 128,
    "patch_size": 1,
    "patch_size_t": 1,
    "qk_norm": "rms_norm_across_heads",
}

VAE = {
    "_class_name": "AutoencoderKLLTXVideo",
    "block_out_channels": [128, 256, 512, 512],
    "decoder_block_out_channels": [128, 256, 512, 512],
    "decoder_causal": False,
    "decoder_inject_noise": [False, False, False, False, False],
    "decoder_layers_per_block": [4, 3, 3, 3, 4],
    "decoder_spatio_temporal_scaling": [True, True, True, False],
    "encoder_causal": True,
    "in_channels": 3,
    "latent_channels": 128,
    "layers_per_block": [4, 3, 3, 3, 4],
    "out_channels": 3,
    "patch_size": 4,
    "patch_size_t": 1,
    "resnet_norm_eps": 1e-06,
    "scaling_factor": 1.0,
    "spatio_temporal_scaling": [True, True, True, False],
    "timestep_conditioning": False,
    "upsample_factor": [1, 1, 1, 1],
    "upsample_residual": [False, False, False, False],
}

TEXT_ENCODER = dict(T5_XXL)

SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 1024,
    "base_shift": 0.95,
    "max_image_seq_len": 4096,
    "max_shift": 2.05,
    "shift_terminal": 0.1,
    "use_dynamic_shifting": True,
}

TOKENIZER_VOCABULARY = {"tokenizer": 32100}  # T5TokenizerFast's len(), as FLUX.1's tokenizer_2
PLAN_SIZES = ("832x480", "1280x704")

COMPONENTS = {"transformer": TRANSFORMER, "text_encoder": TEXT_ENCODER, "vae": VAE, "scheduler": SCHEDULER}
