"""Z-Image-Turbo as published: the ``config.json`` values of the Hugging Face Hub repository
``Tongyi-MAI/Z-Image-Turbo`` (``model_index.json``, ``transformer/``, ``text_encoder/``, ``vae/``,
``scheduler/``), so ``hotlora plan zimage-turbo`` builds the full-size model on the meta device
with no download.

Source (the Hub is not reachable where this was written): the transformer, text-encoder, VAE,
scheduler and model-index values are the repository's files as mirrored verbatim in public ports
(a Rust port's test fixtures "Verbatim Tongyi-MAI/Z-Image-Turbo upstream configs"; an MLX converter
citing ``huggingface.co/Tongyi-MAI/Z-Image-Turbo/blob/main/transformer/config.json``; an installer's
embedded copies of all five files); the copies agree field for field. The text encoder's
bookkeeping fields not in those copies are Qwen/Qwen3-4B's (``hotlora.fullsize._encoders``).

The transformer built from ``TRANSFORMER`` has 6,154,908,736 parameters (the model card's "6B";
``tests/unit/test_fullsize_plans.py`` checks the count on the meta device). The pipeline loads
the text encoder as ``Qwen3Model`` (``MODEL_INDEX``; no LM head, the embeddings being tied anyway).
"""

from __future__ import annotations

from hotlora.fullsize._encoders import FLUX1_VAE, QWEN3_4B

NAME = "zimage-turbo"
HUB_ID = "Tongyi-MAI/Z-Image-Turbo"
PUBLISHED_TRANSFORMER_PARAMETERS = "6B"
TRANSFORMER_PARAMETERS = 6_154_908_736

MODEL_INDEX = {
    "_class_name": "ZImagePipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen3Model"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "ZImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}

TRANSFORMER = {
    "_class_name": "ZImageTransformer2DModel",
    "all_f_patch_size": [1],
    "all_patch_size": [2],
    "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
    "cap_feat_dim": 2560,
    "dim": 3840,
    "in_channels": 16,
    "n_heads": 30,
    "n_kv_heads": 30,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "norm_eps": 1e-05,
    "qk_norm": True,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
}

TEXT_ENCODER = dict(QWEN3_4B)  # Qwen3-4B; architectures: Qwen3ForCausalLM (the pipeline loads Qwen3Model)

VAE = dict(FLUX1_VAE)  # FLUX.1's 16-channel VAE, the same values

SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": False,
}

TOKENIZER_VOCABULARY = {"tokenizer": 151665}  # len() of the Qwen2 tokenizer: 151,643 BPE tokens + 22 special

COMPONENTS = {"transformer": TRANSFORMER, "text_encoder": TEXT_ENCODER, "vae": VAE, "scheduler": SCHEDULER}
