"""Qwen-Image-2.1 (``QwenImage21Pipeline``, diffusers 0.42): the transformer of the Hugging Face Hub
repository ``Qwen/Qwen-Image-2.1`` (the id diffusers' pipeline docstring loads), so
``hotlora plan qwen-image-2.1`` can build its denoiser on the meta device.

Sources (the Hub is not reachable where this was written):

* ``TRANSFORMER``: every field as public ports copy the repository's ``transformer/config.json``
  (a trainer pins it by SHA-256 and checks ``in_channels`` / ``out_channels`` / ``num_layers`` /
  ``attention_head_dim`` / ``num_attention_heads`` / ``context_in_dim`` / ``axes_dims_rope`` /
  ``causal_condition``; an MLX converter and an MLX bundle's fixtures write all twelve, ``mlp_ratio``
  3 and ``eps`` 1e-6 included; a vendoring test quotes "Qwen/Qwen-Image-2.1 @ 790c92633540,
  transformer/config.json"). They are also ``QwenImage21Transformer2DModel``'s defaults.
* ``MODEL_INDEX``: public copies of its ``model_index.json`` (``Qwen3VLProcessor`` as ``processor``,
  ``Qwen3VLForConditionalGeneration``, ``AutoencoderKLQwenImage21``).
* ``TEXT_ENCODER``: the ``text_config`` an MLX bundle's fixture copies from the repository's
  ``text_encoder/config.json`` (Qwen3-VL-8B's text tower: 36 layers of 4096, 32 heads, 8 KV heads,
  12288 MLP, 151936 vocabulary, untied); the ``vision_config`` is Qwen3-VL-8B-Instruct's published
  one as a TensorRT-LLM test copies it, NOT confirmed for this repository (a 0.58B vision tower).
* ``VAE``: the fields the same fixtures copy (64 latent channels, ``dim_mult`` [1, 2, 4, 8, 8],
  ``decoder_base_dim`` 144, residual, 16x spatial); ``latents_mean`` / ``latents_std`` are
  ``AutoencoderKLQwenImage21``'s defaults, NOT confirmed (the fixtures hold stand-ins; a plan
  does not read them).
* ``SCHEDULER``: the same fixtures' copy (the same values as Qwen-Image's).

The transformer has 7,115,124,736 parameters ("7B"); ``tests/unit/test_fullsize_plans.py`` checks it.
"""

from __future__ import annotations

NAME = "qwen-image-2.1"
HUB_ID = "Qwen/Qwen-Image-2.1"
PUBLISHED_TRANSFORMER_PARAMETERS = "7B"
TRANSFORMER_PARAMETERS = 7_115_124_736

MODEL_INDEX = {
    "_class_name": "QwenImage21Pipeline",
    "processor": ["transformers", "Qwen3VLProcessor"],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
    "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage21"],
}

TRANSFORMER = {
    "_class_name": "QwenImage21Transformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "causal_condition": True,
    "context_in_dim": 4096,
    "eps": 1e-06,
    "in_channels": 64,
    "mlp_ratio": 3,
    "num_attention_heads": 32,
    "num_layers": 32,
    "out_channels": 64,
    "patch_size": 1,
}

TEXT_ENCODER = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24],
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4304,
        "model_type": "qwen3_vl",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 4096,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}

VAE = {
    "_class_name": "AutoencoderKLQwenImage21",
    "attn_scales": [],
    "base_dim": 96,
    "decoder_base_dim": 144,
    "dim_mult": [1, 2, 4, 8, 8],
    "dropout": 0.0,
    "in_channels": 4,
    "is_residual": True,
    "num_res_blocks": 2,
    "out_channels": 4,
    "patch_size": None,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 8,
    "temperal_downsample": [False, True, True, True],
    "z_dim": 64,
}

SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

# The pipeline's tokenizer is its processor's (Qwen2 BPE); hotlora's tokenizer_of names it per family.
TOKENIZER_VOCABULARY = {"tokenizer": 151665}

COMPONENTS = {"transformer": TRANSFORMER, "text_encoder": TEXT_ENCODER, "vae": VAE, "scheduler": SCHEDULER}
