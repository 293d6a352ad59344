"""Wan 2.2 TI2V-5B as published: ``Wan-AI/Wan2.2-TI2V-5B-Diffusers`` (``hotlora plan
wan2.2-ti2v-5b``): one transformer that makes video from text alone or from text and a first frame
(``expand_timesteps``: the first frame's latent kept at timestep 0), over the 48-channel Wan 2.2 VAE
(16x spatial, 4x temporal). Its ``model_index.json`` names ``WanPipeline``, so the plan name is a
text-to-video model of the wan family, and the family serves image-to-video on it through
``from_pipe`` (``hotlora.families.wan``).

Sources (the Hub is not reachable where this was written):

* ``TRANSFORMER``: every field is the ``"Wan2.2-TI2V-5B"`` ``diffusers_config`` of diffusers'
  ``scripts/convert_wan_to_diffusers.py`` (huggingface/diffusers at 58eb52c0, the script that made
  the Diffusers repositories), field by field: 30 layers, 24 heads of 128 (width 3072), ffn_dim
  14336, in/out channels 48, text_dim 4096, freq_dim 256, patch (1, 2, 2), cross_attn_norm,
  ``rms_norm_across_heads``, eps 1e-6, no ``added_kv_proj_dim`` (no image encoder).
  ``rope_max_seq_len`` (1024) is the class default the script leaves alone. Wan's own
  ``wan/configs/wan_ti2v_5B.py`` (Wan-Video/Wan2.2 at 42bf4cfa) agrees: dim 3072, 24 heads, 30
  layers, ffn 14336, ``vae_stride`` (4, 16, 16).
* ``VAE``: the script's ``vae22_diffusers_config`` (``convert_vae_22``: ``AutoencoderKLWan(**...)``
  from ``Wan2.2_VAE.pth``): base_dim 160, decoder_base_dim 256, z_dim 48, ``is_residual``, in/out
  channels 12 (3 x a 2 x 2 ``patch_size`` 2), scale_factor_spatial 16, scale_factor_temporal 4, its
  48 latents mean / std; the rest (dim_mult [1, 2, 4, 4], 2 res blocks, temporal downsample [False,
  True, True], no attention scales) are ``AutoencoderKLWan``'s defaults, which the script leaves
  alone, written out from diffusers 0.42.1. The script's ``clip_output: False`` is not an argument of
  ``AutoencoderKLWan`` (neither at 58eb52c0 nor in 0.42.1) and is left out. The plan reads the
  spatial factor from ``scale_factor_spatial`` (16; ``activations.vae_scale_factor``), so a latent
  frame at 1280x704 is 80 x 44 latent pixels, 40 x 22 = 880 tokens after the (1, 2, 2) patch. Its
  decode is planned with its own measured fit (``residual_vae_decode`` in
  ``hotlora.engine.plan.coefficients``; ``activations.vae_part`` picks it by ``is_residual``), not
  Wan 2.1's VAE's.
* ``TEXT_ENCODER`` / ``TOKENIZER_VOCABULARY``: UMT5-XXL's encoder, which the script loads for every
  Wan model (``hotlora.fullsize.wan21_t2v_1_3b`` says what of it could be confirmed).
* ``SCHEDULER``: the script's ``UniPCMultistepScheduler(prediction_type="flow_prediction",
  use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=5.0)`` for TI2V (``sample_shift`` 5.0
  in Wan's config too).
* ``MODEL_INDEX``: the script's ``WanPipeline(transformer=..., text_encoder=..., tokenizer=...,
  vae=..., scheduler=..., expand_timesteps=True)``: no ``transformer_2``, no boundary.

Sizes and frames: Wan's repository lists 1280*704 and 704*1280 alone for ti2v-5B
(``SUPPORTED_SIZES``; sides are multiples of 32 = 16 x the patch's 2: 720 is not) and samples
121 frames at 24 fps (``frame_num``, ``sample_fps``). The plan uses the wan family's default frame
count, 81 frames (21 latent frames: 18,480 tokens a forward at 1280x704), for the tokens and the
decoded video alike, as for the other Wan plans: that is what a request that names no frame count
is served. Wan's own 121 frames would be 31 latent frames (27,280 tokens) and a decoded video 1.49x
as long. ``PLAN_SIZES`` is 1280x704 alone.

The transformer has 4,999,787,712 parameters built from that config (the model card's "5B");
``tests/unit/test_fullsize_plans.py`` checks both.
"""

from __future__ import annotations

from hotlora.fullsize._encoders import UMT5_XXL
from hotlora.fullsize import wan21_t2v_1_3b as _wan21

NAME = "wan2.2-ti2v-5b"
HUB_ID = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
PUBLISHED_TRANSFORMER_PARAMETERS = "5B"
TRANSFORMER_PARAMETERS = 4_999_787_712

MODEL_INDEX = {**_wan21.MODEL_INDEX, "expand_timesteps": True}

# Wan 2.1 1.3B's transformer config but for these (the script's "Wan2.2-TI2V-5B" config otherwise equal).
TRANSFORMER = {**_wan21.TRANSFORMER, "ffn_dim": 14336, "in_channels": 48, "num_attention_heads": 24, "out_channels": 48}

TEXT_ENCODER = dict(UMT5_XXL)

VAE = {
    "_class_name": "AutoencoderKLWan",
    "attn_scales": [],
    "base_dim": 160,
    "decoder_base_dim": 256,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "in_channels": 12,
    "is_residual": True,
    "latents_mean": [
        -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
        0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
        -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
        -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
    ],
    "latents_std": [
        0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
        0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
        0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
        0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
    ],
    "num_res_blocks": 2,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
    "temperal_downsample": [False, True, True],
    "z_dim": 48,
}

SCHEDULER = {**_wan21.SCHEDULER, "flow_shift": 5.0}

TOKENIZER_VOCABULARY = dict(_wan21.TOKENIZER_VOCABULARY)
PLAN_SIZES = ("1280x704",)  # 720p as Wan publishes it for TI2V-5B (WIDTHxHEIGHT), 81 frames: the family default

COMPONENTS = {"transformer": TRANSFORMER, "text_encoder": TEXT_ENCODER, "vae": VAE, "scheduler": SCHEDULER}
