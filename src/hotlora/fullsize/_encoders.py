"""Published text-encoder and VAE configurations shared by several full-size models (each model's
module in ``hotlora.fullsize`` copies the one it ships into its ``COMPONENTS``).

Where each comes from (the Hugging Face Hub is not reachable from the machine these were written
on, so each is a copy found in public material, named below; what could not be confirmed is said):

* ``CLIP_L`` / ``T5_XXL``: FLUX.1-dev's ``text_encoder`` / ``text_encoder_2`` (``hotlora.fullsize.flux``).
* ``CLIP_G``: OpenCLIP ViT-bigG/14's text tower as SDXL ships it (``hotlora.fullsize.sdxl``).
* ``QWEN3_4B``: ``Tongyi-MAI/Z-Image-Turbo`` ``text_encoder/config.json`` as mirrored verbatim in
  public Z-Image ports (a Rust port's test fixture "Verbatim Tongyi-MAI/Z-Image-Turbo upstream
  configs", and the same fields in an installer's embedded copy); FLUX.2-klein-4B ships the same
  Qwen3-4B (its ``joint_attention_dim`` 7680 = 3 x 2560). The bookkeeping ids (bos/eos,
  ``max_window_layers``, ``use_sliding_window``) are Qwen/Qwen3-4B's published values, not seen in
  those mirrors; none changes a shape.
* ``QWEN3_8B``: Qwen/Qwen3-8B's published ``config.json`` (FLUX.2-klein-9B's text encoder; its
  ``joint_attention_dim`` 12288 = 3 x 4096). Not confirmed against a mirror of the klein repository.
* ``MISTRAL_SMALL_3``: Mistral-Small-3.2-24B-Instruct-2506, the text encoder diffusers'
  ``scripts/convert_flux2_to_diffusers.py`` puts in FLUX.2-dev. The ``text_config`` shape fields
  (5120 hidden, 32 heads, 8 KV heads, head_dim 128, 32768 MLP, 40 layers, 131072 vocabulary,
  rope_theta 1e9) are confirmed by a public TensorRT port's copy of FLUX.2-dev's text-encoder config;
  the Pixtral ``vision_config`` is the published Mistral-Small-3.1/3.2 one, not confirmed here, and
  ``tie_word_embeddings: False`` is written out (Mistral Small's checkpoint holds its own ``lm_head``;
  transformers 5 otherwise ties it, which would drop 671M parameters from the plan).
* ``QWEN25_VL_7B``: Qwen-Image's ``text_encoder`` (Qwen2.5-VL-7B-Instruct). The shape fields (3584
  hidden, 28 layers, 28 heads, 4 KV heads, 18944 MLP, 152064 vocabulary, 128000 positions) are
  confirmed by a public validator that checks a Qwen-Image snapshot's ``text_encoder/config.json``
  field by field; the ``vision_config`` is Qwen2.5-VL-7B-Instruct's published one, not confirmed here.
* ``FLUX1_VAE``: FLUX.1-dev's ``vae`` (``hotlora.fullsize.flux``), which Z-Image and Chroma ship too.
* ``UMT5_XXL`` / ``WAN21_VAE``: the text encoder (google/umt5-xxl's encoder) and the Wan 2.1 VAE that
  Wan 2.1 T2V 1.3B / 14B and Wan 2.2 T2V A14B ship (``hotlora.fullsize.wan21_t2v_1_3b`` says where each
  value comes from and what could not be confirmed).
"""

from __future__ import annotations

from hotlora.fullsize import flux as _flux

CLIP_L = dict(_flux.TEXT_ENCODER)
T5_XXL = dict(_flux.TEXT_ENCODER_2)
FLUX1_VAE = dict(_flux.VAE)

CLIP_G = {
    "architectures": ["CLIPTextModelWithProjection"], "attention_dropout": 0.0, "bos_token_id": 0, "dropout": 0.0,
    "eos_token_id": 2, "hidden_act": "gelu", "hidden_size": 1280, "initializer_factor": 1.0,
    "initializer_range": 0.02, "intermediate_size": 5120, "layer_norm_eps": 1e-05, "max_position_embeddings": 77,
    "model_type": "clip_text_model", "num_attention_heads": 20, "num_hidden_layers": 32, "pad_token_id": 1,
    "projection_dim": 1280, "torch_dtype": "float16", "vocab_size": 49408,
}

QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
    "initializer_range": 0.02, "intermediate_size": 9728, "max_position_embeddings": 40960,
    "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}

QWEN3_8B = {
    **QWEN3_4B, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False,
}

MISTRAL_SMALL_3 = {
    "architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "model_type": "mistral3",
    "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "text_config": {
        "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
        "initializer_range": 0.02, "intermediate_size": 32768, "max_position_embeddings": 131072,
        "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "use_cache": True, "vocab_size": 131072,
    },
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vision_config": {
        "attention_dropout": 0.0, "head_dim": 64, "hidden_act": "silu", "hidden_size": 1024, "image_size": 1540,
        "initializer_range": 0.02, "intermediate_size": 4096, "model_type": "pixtral", "num_attention_heads": 16,
        "num_channels": 3, "num_hidden_layers": 24, "patch_size": 14, "rope_theta": 10000.0,
    },
    "vision_feature_layer": -1,
}

QWEN25_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "image_token_id": 151655,
    "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 128000,
    "max_window_layers": 28, "model_type": "qwen2_5_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "video_token_id": 151656, "vision_end_token_id": 151653,
    "vision_start_token_id": 151652, "vision_token_id": 151654,
    "vision_config": {
        "depth": 32, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu", "hidden_size": 1280,
        "in_channels": 3, "in_chans": 3, "intermediate_size": 3420, "model_type": "qwen2_5_vl", "num_heads": 16,
        "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
        "temporal_patch_size": 2, "tokens_per_second": 2, "window_size": 112,
    },
    "vocab_size": 152064,
}

# FlowMatchEulerDiscreteScheduler as FLUX.1-dev publishes it (FLUX.2-dev's, per diffusers' conversion script).
FLUX1_SCHEDULER = dict(_flux.SCHEDULER)

# Wan 2.1 / 2.2 (T2V 1.3B, 14B, A14B) ship the same text encoder and VAE (hotlora.fullsize.wan21_t2v_1_3b
# says where each value comes from).
UMT5_XXL = {
    "architectures": ["UMT5EncoderModel"], "classifier_dropout": 0.0, "d_ff": 10240, "d_kv": 64, "d_model": 4096,
    "decoder_start_token_id": 0, "dense_act_fn": "gelu_new", "dropout_rate": 0.1, "eos_token_id": 1,
    "feed_forward_proj": "gated-gelu", "initializer_factor": 1.0, "is_encoder_decoder": True,
    "is_gated_act": True, "layer_norm_epsilon": 1e-06, "model_type": "umt5", "num_decoder_layers": 24,
    "num_heads": 64, "num_layers": 24, "pad_token_id": 0, "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 256384,
}

WAN21_VAE = {
    "_class_name": "AutoencoderKLWan",
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
