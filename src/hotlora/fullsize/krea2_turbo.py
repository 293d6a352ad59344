"""Krea 2 Turbo (``Krea2Pipeline``, diffusers 0.42): the Hugging Face Hub repository ``krea/Krea-2-Turbo``
(the few-step distilled checkpoint; the base model shares its architecture), so ``hotlora plan
krea2-turbo`` can build it on the meta device.

Sources (the Hub is not reachable where this was written):

* ``MODEL_INDEX``: a public manifest tool's test fixture copying the repository's ``model_index.json``
  (``Qwen3VLModel`` text encoder, ``Qwen2Tokenizer``, ``AutoencoderKLQwenImage``, ``is_distilled``
  true, ``patch_size`` 2, the twelve tapped layers 2, 5, ..., 35).
* ``TRANSFORMER``: a public conversion script's config for "the 12.9B Krea 2 Base/Turbo", "verified
  against the original weight shapes and equal to diffusers' Krea2Transformer2DModel defaults"
  (checked: they are the class's defaults); the same fixture confirms ``num_layers`` 28 and
  ``text_hidden_dim`` 2560.
* ``TEXT_ENCODER``: Qwen/Qwen3-VL-4B-Instruct's ``config.json`` as two public Krea 2 ports copy it
  (identical; the fixture confirms the text tower's widths). Its LM head is absent
  (``Qwen3VLModel``), its embeddings tied anyway.
* ``VAE``: the fixture says ``AutoencoderKLQwenImage`` with ``z_dim`` 16; the other fields are
  Qwen-Image's VAE (``hotlora.fullsize.qwen_image``), NOT confirmed for this repository.
* ``SCHEDULER``: the fixture names the class only; the dynamic-shift values are the ones
  ``Krea2Pipeline.__call__`` falls back to (``base_image_seq_len`` 256, ``max_image_seq_len`` 6400,
  shifts 0.5 / 1.15), NOT confirmed (the distilled checkpoint fixes its shift, ``mu`` = 1.15, anyway).

The transformer built from ``TRANSFORMER`` has 12,820,073,036 parameters (the conversion script says
"12.9B", 0.6% more); ``tests/unit/test_fullsize_plans.py`` checks the count on the meta device.
"""

from __future__ import annotations

from hotlora.fullsize.qwen_image import VAE as QWEN_IMAGE_VAE

NAME = "krea2-turbo"
HUB_ID = "krea/Krea-2-Turbo"
PUBLISHED_TRANSFORMER_PARAMETERS = "12.9B"
TRANSFORMER_PARAMETERS = 12_820_073_036

MODEL_INDEX = {
    "_class_name": "Krea2Pipeline",
    "is_distilled": True,
    "patch_size": 2,
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen3VLModel"],
    "text_encoder_select_layers": [2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "Krea2Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}

TRANSFORMER = {
    "_class_name": "Krea2Transformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [32, 48, 48],
    "in_channels": 64,
    "intermediate_size": 16384,
    "norm_eps": 1e-5,
    "num_attention_heads": 48,
    "num_key_value_heads": 12,
    "num_layers": 28,
    "num_layerwise_text_blocks": 2,
    "num_refiner_text_blocks": 2,
    "num_text_layers": 12,
    "rope_theta": 1000.0,
    "text_hidden_dim": 2560,
    "text_intermediate_size": 6912,
    "text_num_attention_heads": 20,
    "text_num_key_value_heads": 20,
    "timestep_embed_dim": 256,
}

TEXT_ENCODER = {
    "architectures": ["Qwen3VLModel"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560, "initializer_range": 0.02,
        "intermediate_size": 9728, "max_position_embeddings": 262144, "model_type": "qwen3_vl_text",
        "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000, "tie_word_embeddings": True, "use_cache": False, "vocab_size": 151936,
    },
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1024,
        "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096, "model_type": "qwen3_vl",
        "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2560, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}

VAE = dict(QWEN_IMAGE_VAE)

SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 6400,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "use_dynamic_shifting": True,
}

TOKENIZER_VOCABULARY = {"tokenizer": 151665}  # len() of the Qwen2 tokenizer: 151,643 BPE tokens + 22 special

COMPONENTS = {"transformer": TRANSFORMER, "text_encoder": TEXT_ENCODER, "vae": VAE, "scheduler": SCHEDULER}
