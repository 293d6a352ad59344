"""FLUX.1-dev as published: the ``config.json`` values of each component of the Hugging Face Hub
repository ``black-forest-labs/FLUX.1-dev`` (``model_index.json``, ``transformer/``,
``text_encoder/``, ``text_encoder_2/``, ``vae/``, ``scheduler/``), copied here verbatim (minus the
``_diffusers_version`` / ``transformers_version`` / ``_name_or_path`` bookkeeping keys) so the
full-size model can be built with no download: ``hotlora plan flux-dev`` builds it on the meta
device. The transformer built from ``TRANSFORMER`` has 11,901,408,320 parameters (the "12B" the
model card states; ``tests/unit/test_plan.py`` checks the count from the meta model).

Each dict keeps the key that names its class (``_class_name`` for diffusers, ``architectures``
for transformers): ``hotlora.engine.plan`` builds a component from that class and the rest.
"""

from __future__ import annotations

NAME = "flux-dev"
HUB_ID = "black-forest-labs/FLUX.1-dev"
PUBLISHED_TRANSFORMER_PARAMETERS = "12B"  # the model card's figure; the exact count is the meta model's

MODEL_INDEX = {
    "_class_name": "FluxPipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "FluxTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}

TRANSFORMER = {
    "_class_name": "FluxTransformer2DModel",
    "attention_head_dim": 128,
    "guidance_embeds": True,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 19,
    "num_single_layers": 38,
    "patch_size": 1,
    "pooled_projection_dim": 768,
}

# CLIP-L (openai/clip-vit-large-patch14's text tower)
TEXT_ENCODER = {
    "architectures": ["CLIPTextModel"],
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "dropout": 0.0,
    "eos_token_id": 2,
    "hidden_act": "quick_gelu",
    "hidden_size": 768,
    "initializer_factor": 1.0,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 77,
    "model_type": "clip_text_model",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "projection_dim": 768,
    "torch_dtype": "bfloat16",
    "vocab_size": 49408,
}

# T5-XXL v1.1, encoder only
TEXT_ENCODER_2 = {
    "architectures": ["T5EncoderModel"],
    "classifier_dropout": 0.0,
    "d_ff": 10240,
    "d_kv": 64,
    "d_model": 4096,
    "decoder_start_token_id": 0,
    "dense_act_fn": "gelu_new",
    "dropout_rate": 0.1,
    "eos_token_id": 1,
    "feed_forward_proj": "gated-gelu",
    "initializer_factor": 1.0,
    "is_encoder_decoder": True,
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-06,
    "model_type": "t5",
    "num_decoder_layers": 24,
    "num_heads": 64,
    "num_layers": 24,
    "output_past": True,
    "pad_token_id": 0,
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32128,
}

VAE = {
    "_class_name": "AutoencoderKL",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "force_upcast": True,
    "in_channels": 3,
    "latent_channels": 16,
    "latents_mean": None,
    "latents_std": None,
    "layers_per_block": 2,
    "mid_block_add_attention": True,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "use_post_quant_conv": False,
    "use_quant_conv": False,
}

SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}

# The published tokenizers' vocabularies (the embedding rows hotlora reserves are added after them).
TOKENIZER_VOCABULARY = {"tokenizer": 49408, "tokenizer_2": 32100}

COMPONENTS = {"transformer": TRANSFORMER, "text_encoder": TEXT_ENCODER, "text_encoder_2": TEXT_ENCODER_2,
              "vae": VAE, "scheduler": SCHEDULER}
