"""The real SDXL architecture, built offline: stable-diffusion-xl-base-1.0's published
configuration with random seeded weights, saved like a Hub snapshot, and real-size adapters written
as trainers write them.

Usage::

    python -m hotlora.fullsize.sdxl build DIR [--seed 0] [--dtype bfloat16] [--adapters DIR]

``DIR`` gets ``model_index.json`` and one subfolder per component (what ``save_pretrained`` writes
and ``hotlora serve --model DIR`` / ``DiffusionPipeline.from_pretrained(DIR)`` read); ``--adapters``
(default ``DIR/adapters``) gets a kohya sd-scripts rank-32 LoRA (U-Net and both text encoders) and
a diffusers-layout rank-128 LoRA (U-Net attention), a few hundred MB together.

What is real: every shape, layer count and option (the configs below are the Hub repository's
``*/config.json`` and ``scheduler/scheduler_config.json``, copied field by field; the U-Net has
2,567,463,684 parameters, as published). What is not: the weights (each module's default
initialization under ``torch.manual_seed``) and the tokenizer, a byte-level CLIP BPE with no merges
(514 tokens: every byte, with and without ``</w>``, plus start and end of text), built in memory
because the real 49,408-token vocabulary cannot be downloaded here. The text encoders keep their
real 49,408-row embedding tables; prompts just use the first 514 rows.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from hotlora.families.sdxl import StableDiffusionXL

log = logging.getLogger(__name__)

SOURCE = "stabilityai/stable-diffusion-xl-base-1.0"  # the Hub repository the configs come from
UNET_PARAMETERS = 2_567_463_684  # published: the U-Net's parameter count (SDXL report, Table 1: 2.6B)

# unet/config.json (diffusers' defaults for fields the file leaves out are the same).
UNET = {
    "act_fn": "silu", "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280],
    "center_input_sample": False, "class_embed_type": None, "class_embeddings_concat": False,
    "conv_in_kernel": 3, "conv_out_kernel": 3, "cross_attention_dim": 2048, "cross_attention_norm": None,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"], "downsample_padding": 1,
    "dual_cross_attention": False, "encoder_hid_dim": None, "encoder_hid_dim_type": None, "flip_sin_to_cos": True,
    "freq_shift": 0, "in_channels": 4, "layers_per_block": 2, "mid_block_only_cross_attention": None,
    "mid_block_scale_factor": 1, "mid_block_type": "UNetMidBlock2DCrossAttn", "norm_eps": 1e-05,
    "norm_num_groups": 32, "num_attention_heads": None, "num_class_embeds": None, "only_cross_attention": False,
    "out_channels": 4, "projection_class_embeddings_input_dim": 2816, "resnet_out_scale_factor": 1.0,
    "resnet_skip_time_act": False, "resnet_time_scale_shift": "default", "sample_size": 128,
    "time_cond_proj_dim": None, "time_embedding_act_fn": None, "time_embedding_dim": None,
    "time_embedding_type": "positional", "timestep_post_act": None, "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], "upcast_attention": None,
    "use_linear_projection": True,
}
# text_encoder/config.json: CLIP ViT-L/14's text tower (CLIPTextModel).
TEXT_ENCODER = {
    "attention_dropout": 0.0, "bos_token_id": 0, "dropout": 0.0, "eos_token_id": 2, "hidden_act": "quick_gelu",
    "hidden_size": 768, "initializer_factor": 1.0, "initializer_range": 0.02, "intermediate_size": 3072,
    "layer_norm_eps": 1e-05, "max_position_embeddings": 77, "num_attention_heads": 12, "num_hidden_layers": 12,
    "pad_token_id": 1, "projection_dim": 768, "vocab_size": 49408,
}
# text_encoder_2/config.json: OpenCLIP ViT-bigG/14's text tower (CLIPTextModelWithProjection).
TEXT_ENCODER_2 = {
    **TEXT_ENCODER, "hidden_act": "gelu", "hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 20,
    "num_hidden_layers": 32, "projection_dim": 1280,
}
# vae/config.json
VAE = {
    "act_fn": "silu", "block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
    "force_upcast": True, "in_channels": 3, "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32,
    "out_channels": 3, "sample_size": 1024, "scaling_factor": 0.13025, "up_block_types": ["UpDecoderBlock2D"] * 4,
}
# scheduler/scheduler_config.json (EulerDiscreteScheduler)
SCHEDULER = {
    "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False,
    "interpolation_type": "linear", "num_train_timesteps": 1000, "prediction_type": "epsilon",
    "sample_max_value": 1.0, "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
    "timestep_spacing": "leading", "trained_betas": None, "use_karras_sigmas": False,
}

# The layers trainers put LoRA on. kohya sd-scripts (networks/lora.py) wraps every Linear inside a
# Transformer2DModel of the U-Net (proj_in, proj_out, attn1, attn2, ff) and every Linear of
# CLIPAttention / CLIPMLP in the text encoders; diffusers' train_dreambooth_lora_sdxl.py targets
# the U-Net attention projections only.
# What ``hotlora plan sdxl`` builds on the meta device (engine/plan/models.py): each config with the
# class its config.json names, and the published tokenizers' vocabulary sizes.
COMPONENTS = {"unet": {"_class_name": "UNet2DConditionModel", **UNET},
              "text_encoder": {"architectures": ["CLIPTextModel"], **TEXT_ENCODER},
              "text_encoder_2": {"architectures": ["CLIPTextModelWithProjection"], **TEXT_ENCODER_2},
              "vae": {"_class_name": "AutoencoderKL", **VAE}}
MODEL_INDEX = {"_class_name": "StableDiffusionXLPipeline"}
TOKENIZER_VOCABULARY = {"tokenizer": 49408, "tokenizer_2": 49408}

KOHYA_UNET_BLOCKS = ".attentions."
TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
DIFFUSERS_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
ADAPTER_STRENGTH = 0.05  # a LoRA branch ~9% of its layer's output (x alpha/rank): visible, not exploding


def components(seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> dict:
    """The pipeline's parts, seeded; built directly in ``dtype`` so that a full-size build never
    holds a float32 copy (the U-Net alone is 10.3 GB in float32). ``device="meta"``: shapes only."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from hotlora.families._tiny import clip_tokenizer

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(seed)
            parts = {"unet": UNet2DConditionModel.from_config(UNET)}
            parts["text_encoder"] = CLIPTextModel(CLIPTextConfig(**TEXT_ENCODER))
            parts["text_encoder_2"] = CLIPTextModelWithProjection(CLIPTextConfig(**TEXT_ENCODER_2))
            parts["vae"] = AutoencoderKL.from_config(VAE)
    finally:
        torch.set_default_dtype(previous)
    parts = {name: module.eval() for name, module in parts.items()}
    parts["scheduler"] = EulerDiscreteScheduler.from_config(SCHEDULER)
    parts["tokenizer"], parts["tokenizer_2"] = clip_tokenizer(), clip_tokenizer()
    return parts


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def save_sdxl(directory: str | Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Build and save the pipeline like a Hub snapshot; returns ``directory``."""
    from diffusers import StableDiffusionXLPipeline

    directory = Path(directory)
    parts = components(seed, dtype)
    count = parameter_count(parts["unet"])
    if count != UNET_PARAMETERS:  # the configs above were mistyped: refuse to save a wrong model
        raise AssertionError(f"U-Net has {count:,} parameters, the published SDXL U-Net {UNET_PARAMETERS:,}")
    StableDiffusionXLPipeline(**parts).save_pretrained(str(directory))
    defaults = {"model_id": "hotlora/sdxl-full-size-random", "base_model_aliases": [SOURCE], "height": 256,
                "width": 256, "num_inference_steps": 4}
    (directory / "hotlora.json").write_text(json.dumps(defaults, indent=2))
    log.info("saved SDXL (U-Net %s parameters, %s) to %s", f"{count:,}", dtype, directory)
    return directory


# ----------------------------------------------------------------------------- adapters


def _linears(module: torch.nn.Module, keep) -> dict[str, tuple[int, int]]:
    return {name: (m.in_features, m.out_features) for name, m in module.named_modules()
            if isinstance(m, torch.nn.Linear) and keep(name)}


def _clip_names(linears: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """CLIP module names as trainers write them: under ``text_model.``, the level transformers 5's
    ``CLIPTextModel`` no longer has (sd-scripts pins transformers 4: ``lora_te1_text_model_encoder_...``)."""
    return {name if name.startswith("text_model.") else f"text_model.{name}": shape for name, shape in linears.items()}


def adapter_layers() -> dict[str, dict[str, tuple[int, int]]]:
    """The layers each trainer targets, read from the architecture on the meta device (no weights):
    {"kohya_unet", "te1", "te2", "diffusers_unet"} -> module name -> (in, out)."""
    parts = components(device="meta")
    unet = parts["unet"]
    return {
        "kohya_unet": _linears(unet, lambda n: KOHYA_UNET_BLOCKS in f".{n}"),
        "te1": _clip_names(_linears(parts["text_encoder"], lambda n: n.endswith(TEXT_TARGETS))),
        "te2": _clip_names(_linears(parts["text_encoder_2"], lambda n: n.endswith(TEXT_TARGETS))),
        "diffusers_unet": _linears(unet, lambda n: n.endswith(DIFFUSERS_TARGETS)),
    }


def write_kohya_lora(path: Path, layers: dict, rank: int = 32, alpha: float = 16.0, seed: int = 1,
                     dtype: torch.dtype = torch.float16) -> Path:
    """kohya sd-scripts' SDXL LoRA (``sdxl_train_network.py``, ``--network_module networks.lora``):
    ``lora_unet_*`` (SGM block names), ``lora_te1_*``, ``lora_te2_*``, ``lora_down`` / ``lora_up`` and
    ``.alpha`` per module, saved in float16 (``--save_precision fp16``) with its ``ss_*`` header."""
    from safetensors.torch import save_file

    from hotlora.tiny import random_lora
    from hotlora.trainer_layouts import sd_scripts_metadata, sd_scripts_sdxl_lora

    sds = {key: random_lora(layers[key], rank, seed + i, strength=ADAPTER_STRENGTH)
           for i, key in enumerate(("kohya_unet", "te1", "te2"))}
    kohya = sd_scripts_sdxl_lora(sds["kohya_unet"], UNET["layers_per_block"], alpha,
                                 text_encoders={"te1": sds["te1"], "te2": sds["te2"]})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in kohya.items()}, str(path),
              metadata=sd_scripts_metadata("sdxl_base_v1-0", rank, alpha))
    return path


def write_diffusers_lora(directory: Path, layers: dict, rank: int = 128, seed: int = 4) -> Path:
    """diffusers' layout as ``train_dreambooth_lora_sdxl.py`` saves it (U-Net attention,
    ``LoraConfig`` metadata with ``lora_alpha = rank``), in float16 as most shared files are."""
    from hotlora.tiny import random_lora, save_diffusers_lora

    sd = {k: v.half() for k, v in random_lora(layers["diffusers_unet"], rank, seed, strength=ADAPTER_STRENGTH).items()}
    return save_diffusers_lora(directory, StableDiffusionXL.name, sd, rank=rank, alpha=rank)


def write_adapters(out: str | Path) -> dict[str, Path]:
    """Both real-size adapters under ``out``: {"kohya-r32": file, "diffusers-r128": file}."""
    out = Path(out)
    layers = adapter_layers()
    return {"kohya-r32": write_kohya_lora(out / "kohya-r32.safetensors", layers),
            "diffusers-r128": write_diffusers_lora(out / "diffusers-r128", layers)}


def main(argv: list[str] | None = None) -> None:
    from hotlora.fullsize._build import build_command

    build_command(argv, module="sdxl", what="SDXL", save=save_sdxl, write_adapters=write_adapters)


if __name__ == "__main__":
    main()
