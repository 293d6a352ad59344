"""Qwen-Image as published: the ``config.json`` values of the Hugging Face Hub repository
``Qwen/Qwen-Image``, so ``hotlora plan qwen-image`` builds the full-size model on the meta device.

Sources (the Hub is not reachable where this was written):

* ``TRANSFORMER``: the repository's ``transformer/config.json`` as quoted verbatim in musubi-tuner's
  ``qwen_image_model.py`` (``_diffusers_version`` 0.34.0.dev0), the same fields a public validator
  checks a Qwen-Image snapshot against, and diffusers' ``QwenImageTransformer2DModel`` defaults.
  ``pooled_projection_dim`` is in the published file but no longer an argument of the class
  (diffusers ignores it).
* ``MODEL_INDEX`` and the VAE's ``z_dim`` / ``temperal_downsample`` / ``latents_mean`` /
  ``latents_std``: that validator's copy; the VAE's other fields are
  ``AutoencoderKLQwenImage``'s defaults (the published values, not confirmed field by field here).
* ``TEXT_ENCODER``: Qwen2.5-VL-7B-Instruct (``hotlora.fullsize._encoders.QWEN25_VL_7B``; its shape
  fields confirmed, its vision tower's not).
* ``SCHEDULER``: the published ``scheduler_config.json`` as remembered, consistent with the
  base/max shift and sequence lengths a public Qwen-Image trainer uses; not confirmed verbatim.

The transformer has 20,430,401,088 parameters (the model card's "20B"; a public analysis of the
published shards gives the same 20,430,401,088); ``tests/unit/test_fullsize_plans.py`` checks it.
"""

from __future__ import annotations

from hotlora.fullsize._encoders import QWEN25_VL_7B

NAME = "qwen-image"
HUB_ID = "Qwen/Qwen-Image"
PUBLISHED_TRANSFORMER_PARAMETERS = "20B"
TRANSFORMER_PARAMETERS = 20_430_401_088

MODEL_INDEX = {
    "_class_name": "QwenImagePipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}

TRANSFORMER = {
    "_class_name": "QwenImageTransformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": False,
    "in_channels": 64,
    "joint_attention_dim": 3584,
    "num_attention_heads": 24,
    "num_layers": 60,
    "out_channels": 16,
    "patch_size": 2,
    "pooled_projection_dim": 768,
}

TEXT_ENCODER = dict(QWEN25_VL_7B)

VAE = {
    "_class_name": "AutoencoderKLQwenImage",
    "attn_scales": [],
    "base_dim": 96,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715,
                     0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652,
                    1.5579, 1.6382, 1.1253, 2.8251, 1.916],
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
    "z_dim": 16,
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

TOKENIZER_VOCABULARY = {"tokenizer": 151665}  # len() of the Qwen2 tokenizer

COMPONENTS = {"transformer": TRANSFORMER, "text_encoder": TEXT_ENCODER, "vae": VAE, "scheduler": SCHEDULER}
