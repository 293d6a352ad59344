"""Wan 2.1 T2V 1.3B as published: ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``, so ``hotlora plan
wan2.1-t2v-1.3b`` builds the full-size model on the meta device.

Sources (the Hub is not reachable where this was written):

* ``TRANSFORMER``: every field is the ``"Wan-T2V-1.3B"`` ``diffusers_config`` of diffusers'
  ``scripts/convert_wan_to_diffusers.py`` (``get_transformer_config``; huggingface/diffusers at
  58eb52c0, the script that made the Diffusers repositories), field by field: 30 layers, 12 heads of
  128, ffn_dim 8960, in/out channels 16, text_dim 4096, freq_dim 256, patch (1, 2, 2),
  cross_attn_norm, ``rms_norm_across_heads``, eps 1e-6, no ``added_kv_proj_dim``. ``rope_max_seq_len``
  (1024) is the class default the script leaves alone.
* ``VAE`` (``hotlora.fullsize._encoders.WAN21_VAE``): the script builds ``AutoencoderKLWan()`` with
  its defaults (base_dim 96, z_dim 16, dim_mult [1, 2, 4, 4], 2 res blocks, temporal downsample
  [False, True, True], the latents mean / std): written out here from diffusers 0.42.1's defaults.
* ``TEXT_ENCODER`` (``_encoders.UMT5_XXL``): the script loads ``google/umt5-xxl``'s encoder
  (``UMT5EncoderModel.from_pretrained``), whose config the script does not quote. The shape fields
  (d_model 4096, 24 layers, d_ff 10240, 64 heads, d_kv 64, vocabulary 256384, 32 relative buckets,
  gated GELU) agree with several public copies of that config (a ComfyUI ``umt5_config_xxl.json``
  quoted in third-party code, Wan ports' text-encoder specs); not confirmed against the Hub file.
  d_model 4096 is the transformer's ``text_dim``, which the script does confirm.
* ``SCHEDULER``: the script's ``UniPCMultistepScheduler(prediction_type="flow_prediction",
  use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0)`` for T2V.
* ``TOKENIZER_VOCABULARY``: the text encoder's ``vocab_size`` (256384); ``len()`` of the UMT5
  tokenizer itself is not confirmed here.

The transformer has 1,418,996,800 parameters built from that config (the model card's "1.3B" is a
rounded name: 9% under it); ``tests/unit/test_fullsize_plans.py`` checks both.
"""

from __future__ import annotations

from hotlora.fullsize._encoders import UMT5_XXL, WAN21_VAE

NAME = "wan2.1-t2v-1.3b"
HUB_ID = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
PUBLISHED_TRANSFORMER_PARAMETERS = "1.3B"
TRANSFORMER_PARAMETERS = 1_418_996_800

MODEL_INDEX = {
    "_class_name": "WanPipeline",
    "scheduler": ["diffusers", "UniPCMultistepScheduler"],
    "text_encoder": ["transformers", "UMT5EncoderModel"],
    "tokenizer": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "WanTransformer3DModel"],
    "vae": ["diffusers", "AutoencoderKLWan"],
}

TRANSFORMER = {
    "_class_name": "WanTransformer3DModel",
    "added_kv_proj_dim": None,
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 8960,
    "freq_dim": 256,
    "in_channels": 16,
    "num_attention_heads": 12,
    "num_layers": 30,
    "out_channels": 16,
    "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm_across_heads",
    "text_dim": 4096,
}

TEXT_ENCODER = dict(UMT5_XXL)
VAE = dict(WAN21_VAE)

SCHEDULER = {
    "_class_name": "UniPCMultistepScheduler",
    "flow_shift": 3.0,
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
}

TOKENIZER_VOCABULARY = {"tokenizer": 256384}
PLAN_SIZES = ("832x480", "1280x720")  # 480p and 720p (WIDTHxHEIGHT), 81 frames: the family default

COMPONENTS = {"transformer": TRANSFORMER, "text_encoder": TEXT_ENCODER, "vae": VAE, "scheduler": SCHEDULER}
