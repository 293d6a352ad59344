"""Qwen-Image-2.1 (``QwenImage21Pipeline``, diffusers 0.42): the transformer of the Hugging Face Hub
repository ``Qwen/Qwen-Image-2.1`` (the id diffusers' pipeline docstring loads), so
``hotlora plan qwen-image-2.1`` can build its denoiser on the meta device.

Source (the Hub is not reachable where this was written): ``TRANSFORMER``'s ``_class_name``,
``in_channels``, ``out_channels``, ``num_layers``, ``attention_head_dim``, ``num_attention_heads``,
``context_in_dim``, ``axes_dims_rope`` and ``causal_condition`` are the fields a public trainer
pins the repository's ``transformer/config.json`` to (with its SHA-256); ``patch_size`` 1 is
confirmed by a public MLX bundle's copy. ``mlp_ratio`` (3) and ``eps`` (1e-6) are NOT confirmed:
they are ``QwenImage21Transformer2DModel``'s defaults, and the count below matches the model
card's "7B" with them. ``MODEL_INDEX``'s classes (``Qwen3VLForConditionalGeneration`` text encoder,
``AutoencoderKLQwenImage21`` VAE, ``Qwen3VLProcessor``) are from public copies of its
``model_index.json``; the text encoder's and the VAE's configs could not be found and are not
shipped, so a plan of this model counts the transformer only (its text encoder, a Qwen3-VL with
a 4096-wide text tower, is several GB more in bf16).

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
    "eps": 1e-06,  # unconfirmed: the class default
    "in_channels": 64,
    "mlp_ratio": 3,  # unconfirmed: the class default
    "num_attention_heads": 32,
    "num_layers": 32,
    "out_channels": 64,
    "patch_size": 1,
}

COMPONENTS = {"transformer": TRANSFORMER}
