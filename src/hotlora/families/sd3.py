"""Stable Diffusion 3 and 3.5 (StableDiffusion3Pipeline): an MMDiT transformer over 2x2 latent
patches, classifier-free guidance as one doubled batch, CLIP-L and OpenCLIP-G text encoders (both
take LoRA in diffusers) and T5 (none)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from hotlora.families.base import ModelFamily

TEXT_TOKENS = 77 + 256  # CLIP's 77 then T5's max_sequence_length (256 by default), one sequence


class StableDiffusion3(ModelFamily):
    name = "sd3"
    lora_key_pattern = r"joint_blocks[._]\d+|transformer_blocks\.\d+\.attn2\.|context_block|x_block"
    base_model_markers = ("sd3", "stable-diffusion-3")
    full_size_models = {"sd3.5-large": "sd35_large", "sd3.5-medium": "sd35_medium"}
    pipeline_class = "StableDiffusion3Pipeline"
    task_pipelines = {"image-to-image": "StableDiffusion3Img2ImgPipeline",
                      "inpaint": "StableDiffusion3InpaintPipeline"}
    denoiser_class = "SD3Transformer2DModel"
    # SD3.5 large's model card (28 steps, guidance 3.5, 1024 px); the pipeline's own default guidance
    # is SD3 medium's 7.0.
    default_steps, default_guidance = 28, 3.5
    cfg = "batch"
    # One negative prompt for the three encoders: encode_prompt gives negative_prompt_2 and _3 the
    # negative prompt when they are None, and encodes "" for a missing one (never zeros).
    negative_prompts = True
    # SD3Transformer2DModel declares no _repeated_blocks; its MMDiT blocks are these.
    repeated_blocks = ("JointTransformerBlock",)
    latent_multiple = 2  # patch_size 2 in SD3 and SD3.5
    tokenizer_of = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2", "text_encoder_3": "tokenizer_3"}
    prompt_argument_of = {"text_encoder": "prompt", "text_encoder_2": "prompt_2", "text_encoder_3": "prompt_3"}
    tiny_size = 32

    def encode_prompts(self, pipeline, prompts: Mapping[str, list], cfg: bool) -> dict:
        embeds, negative, pooled, negative_pooled = pipeline.encode_prompt(
            prompt=prompts["prompt"], prompt_2=prompts.get("prompt_2"), prompt_3=prompts.get("prompt_3"),
            device=pipeline.device, num_images_per_prompt=1, do_classifier_free_guidance=cfg,
            negative_prompt=prompts.get("negative_prompt"), negative_prompt_2=prompts.get("negative_prompt_2"),
            negative_prompt_3=prompts.get("negative_prompt_3"))
        out = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
        if cfg:
            out.update(negative_prompt_embeds=negative, negative_pooled_prompt_embeds=negative_pooled)
        return out

    def plan_tokens(self, configs: Mapping[str, dict], latent_pixels: int) -> tuple[int, int]:
        denoiser = configs["transformer"]
        patch = denoiser.get("patch_size", 2)
        return latent_pixels // (patch * patch) + TEXT_TOKENS, denoiser["num_attention_heads"] * denoiser["attention_head_dim"]

    def build_tiny(self, seed: int = 0):
        import torch
        from diffusers import (
            AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline,
        )
        from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

        from hotlora.families._tiny import clip_config, clip_tokenizer, t5_tokenizer

        torch.manual_seed(seed)
        # Two blocks: SD3.5's (qk RMS norm, block 0 with SD3.5 medium's second attention) and the
        # last one, which updates no context (context_pre_only). pooled: both CLIPs' projections.
        # 16 latent channels, as SD3 and SD3.5 have: StableDiffusion3InpaintPipeline refuses any
        # transformer but one of 16 (or 33, an inpainting model's) input channels.
        transformer = SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, caption_projection_dim=32, joint_attention_dim=64, pooled_projection_dim=64,
            pos_embed_max_size=32, qk_norm="rms_norm", dual_attention_layers=(0,),
        )
        text_encoder_3 = T5EncoderModel(
            T5Config(vocab_size=160, d_model=64, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        )
        vae = AutoencoderKL(
            sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
            latent_channels=16, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
            shift_factor=0.0609, scaling_factor=1.5035,
        )
        return StableDiffusion3Pipeline(
            transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
            text_encoder=CLIPTextModelWithProjection(clip_config()), tokenizer=clip_tokenizer(),
            text_encoder_2=CLIPTextModelWithProjection(clip_config()), tokenizer_2=clip_tokenizer(),
            text_encoder_3=text_encoder_3, tokenizer_3=t5_tokenizer(),
        )

    def trainer_lora(self, path: Path, linears, sd, rank: int, seed: int) -> Path:
        """ostris ai-toolkit's SD3 layout (toolkit/lora_special.py: ``is_v3`` saves in PEFT form):
        diffusers module names under ``transformer.``, ``lora_A`` / ``lora_B``, no alphas (alpha =
        rank), float16, the transformer blocks only. kohya sd-scripts' SD3 layout
        (networks/lora_sd3.py: ``lora_unet_joint_blocks_N_x_block_attn_qkv``, SD3's original module
        names, fused qkv) has no converter in diffusers 0.42.1: plain diffusers cannot load it,
        so it is not written here."""
        return save_ai_toolkit_lora(path, sd)

    def write_trainer_samples(self, pipeline, linears, out: Path, rank: int, attention_only) -> dict:
        from hotlora.families._tiny import random_lora

        path = save_ai_toolkit_lora(out / "style-ai-toolkit.safetensors", random_lora(linears, rank, seed=4))
        return {"style-ai-toolkit": path}


def save_ai_toolkit_lora(path: Path, sd) -> Path:
    from safetensors.torch import save_file

    from hotlora.trainer_layouts import ai_toolkit_flux_lora

    tensors, meta = ai_toolkit_flux_lora({k: v for k, v in sd.items() if k.startswith("transformer_blocks.")})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path
