"""Stable Diffusion XL (StableDiffusionXLPipeline): a U-Net with classifier-free guidance as one
doubled batch, CLIP-L and OpenCLIP-G text encoders, both of which take LoRA in diffusers."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from hotlora.errors import AdapterFormatError
from hotlora.families.base import ModelFamily

SGM_BLOCKS = ("input_blocks", "middle_block", "output_blocks")
MAX_SGM_BLOCKS = 64  # real SDXL files use about a dozen; diffusers' mapping is quadratic in them


class StableDiffusionXL(ModelFamily):
    name = "sdxl"
    pipeline_class = "StableDiffusionXLPipeline"
    task_pipelines = {"image-to-image": "StableDiffusionXLImg2ImgPipeline",
                      "inpaint": "StableDiffusionXLInpaintPipeline"}
    strength_floors_steps = True  # its img2img and inpaint pipelines: int(steps x strength)
    denoiser_class = "UNet2DConditionModel"
    default_steps, default_guidance = 30, 5.0
    cfg = "batch"
    negative_prompts = True
    # One U-Net downsampling step: an odd latent side would take the U-Net's upsample-size path.
    latent_multiple = 2
    # diffusers' advanced training script writes clip_l / clip_g; the Hugging Face inference API
    # also reads text_encoders_0 / text_encoders_1 (its older names).
    embedding_keys = (("clip_l", "text_encoder"), ("text_encoders_0", "text_encoder"),
                      ("clip_g", "text_encoder_2"), ("text_encoders_1", "text_encoder_2"))
    full_size_models = {"sdxl": "sdxl"}
    # Diffusers' and kohya's U-Net block names; SD1.5 shares them (its family tells them apart by metadata).
    lora_key_pattern = r"(down_blocks|up_blocks|mid_block|input_blocks|output_blocks|middle_block)[._]"
    base_model_markers = ("sdxl", "stable-diffusion-xl", "stable_diffusion_xl")
    tiny_size = 64

    def encode_prompts(self, pipeline, prompts: Mapping[str, list], cfg: bool) -> dict:
        """Under CFG, ``encode_prompt`` makes zeros for a missing negative prompt
        (``force_zeros_for_empty_prompt``) but encodes a given one, even "": callers group the two
        kinds apart."""
        embeds, negative, pooled, negative_pooled = pipeline.encode_prompt(
            prompt=prompts["prompt"], prompt_2=prompts.get("prompt_2"), device=pipeline.device,
            num_images_per_prompt=1, do_classifier_free_guidance=cfg, negative_prompt=prompts.get("negative_prompt"),
            negative_prompt_2=prompts.get("negative_prompt_2"))
        out = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
        if cfg:
            out.update(negative_prompt_embeds=negative, negative_pooled_prompt_embeds=negative_pooled)
        return out

    def converter_config(self, denoiser) -> Mapping | None:
        return denoiser.config  # kohya files number U-Net blocks the SGM way: mapped with the config

    def lora_state_dict_kwargs(self, denoiser_config: Mapping | None) -> dict:
        return {} if denoiser_config is None else {"unet_config": denoiser_config}

    def check_raw_lora(self, raw: Mapping[str, Any], label: str) -> None:
        check_sgm_blocks(raw, label, "SDXL")

    def plan_tokens(self, configs: Mapping[str, dict], latent_pixels: int) -> tuple[int, int]:
        return latent_pixels, configs["unet"]["block_out_channels"][0]

    def build_tiny(self, seed: int = 0):
        import torch
        from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTextModelWithProjection

        from hotlora.families._tiny import clip_config, clip_tokenizer

        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            block_out_channels=(32, 64), layers_per_block=1, sample_size=32, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
            addition_time_embed_dim=8, transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=80,
            cross_attention_dim=64, norm_num_groups=1,
        )
        vae = AutoencoderKL(
            block_out_channels=[32, 64], in_channels=3, out_channels=3,
            down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
            latent_channels=4, sample_size=64, norm_num_groups=1,
        )
        scheduler = EulerDiscreteScheduler(
            beta_start=0.00085, beta_end=0.012, steps_offset=1, beta_schedule="scaled_linear", timestep_spacing="leading"
        )
        return StableDiffusionXLPipeline(
            vae=vae, text_encoder=CLIPTextModel(clip_config()), text_encoder_2=CLIPTextModelWithProjection(clip_config()),
            tokenizer=clip_tokenizer(), tokenizer_2=clip_tokenizer(), unet=unet, scheduler=scheduler,
        )

    def trainer_lora(self, path: Path, linears, sd, rank: int, seed: int) -> Path:
        """kohya sd-scripts' layout, attention layers only: kohya names flatten dots to underscores
        and diffusers maps attention layers back faithfully, not every layer
        (``add_embedding.linear_1`` comes back mangled). Alpha rank / 2."""
        return save_kohya_lora(path, {key: v for key, v in sd.items() if ".attn" in key}, alpha=rank / 2)

    def write_trainer_samples(self, pipeline, linears, out: Path, rank: int, attention_only) -> dict:
        from hotlora.families._tiny import random_lora

        path = save_kohya_lora(out / "style-kohya.safetensors",
                               random_lora(linears, rank, seed=4, modules=attention_only), alpha=rank / 2)
        return {"style-kohya": path}


def check_sgm_blocks(raw: Mapping[str, Any], label: str, model: str) -> None:
    """diffusers maps kohya U-Net keys in SGM block numbering (``lora_unet_input_blocks_4_1_...``)
    by scanning every key once per distinct block number: quadratic, minutes for a few thousand
    made-up block numbers. SD1.5 and SDXL have a dozen per kind; a file with more is no LoRA of theirs."""
    # The block number as _maybe_map_sgm_blocks_to_diffusers reads it: the 5th "_"-separated part.
    blocks = {key.split("_")[:5][-1] for key in raw if any(kind in key for kind in SGM_BLOCKS)}
    if len(blocks) > MAX_SGM_BLOCKS:
        raise AdapterFormatError(
            f"{label}: {len(blocks)} distinct SGM U-Net block numbers; {model} has fewer than {MAX_SGM_BLOCKS}"
        )


def save_kohya_lora(path: Path, sd: Mapping[str, Any], alpha: float) -> Path:
    """kohya (sd-scripts) layout in diffusers' module names (what SD1.x files hold; SDXL files as
    diffusers' converter writes them), written by diffusers' own ``convert_state_dict_to_kohya``."""
    import torch
    from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya
    from safetensors.torch import save_file

    kohya = convert_state_dict_to_kohya({f"unet.{k}": v for k, v in sd.items()})
    kohya = {k: (torch.tensor(float(alpha)) if k.endswith(".alpha") else v.contiguous()) for k, v in kohya.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(kohya, str(path))
    return path
