"""Stable Diffusion 1.x (StableDiffusionPipeline): a U-Net with classifier-free guidance as one
doubled batch and one CLIP-L text encoder, which takes LoRA in diffusers. It shares its denoiser
class (UNet2DConditionModel) and kohya converter with SDXL; the pipeline class tells them apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from hotlora.families.base import ModelFamily
from hotlora.families.sdxl import check_sgm_blocks


class StableDiffusion15(ModelFamily):
    name = "sd15"
    lora_key_pattern = r"(down_blocks|up_blocks|mid_block|input_blocks|output_blocks|middle_block)[._]"
    base_model_markers = ("stable-diffusion-v1", "sd_v1", "sd1.5", "sd-v1", "sd15", "v1-5")
    full_size_models = {"sd15": "sd15"}
    pipeline_class = "StableDiffusionPipeline"
    task_pipelines = {"image-to-image": "StableDiffusionImg2ImgPipeline", "inpaint": "StableDiffusionInpaintPipeline"}
    strength_floors_steps = True  # its img2img and inpaint pipelines: int(steps x strength)
    denoiser_class = "UNet2DConditionModel"
    # StableDiffusionPipeline.__call__'s defaults, which the SD1.5 model card uses; 512 px published.
    default_steps, default_guidance = 50, 7.5
    default_size = (512, 512)
    cfg = "batch"
    # encode_prompt encodes "" for a missing negative prompt (SD1.5 has no force_zeros_for_empty_prompt).
    negative_prompts = True
    latent_multiple = 2  # one U-Net downsampling step at least: an odd latent side takes the upsample-size path
    # diffusers' train_dreambooth_lora_sd15_advanced.py saves the pivotal vectors under clip_l.
    embedding_keys = (("clip_l", "text_encoder"),)
    tokenizer_of = {"text_encoder": "tokenizer"}
    prompt_argument_of = {"text_encoder": "prompt"}
    tiny_size = 32
    # SD1.x's transformers project in and out with 1x1 convs (no use_linear_projection), and kohya
    # sd-scripts' default network (networks/lora.py) wraps every Linear and 1x1 Conv2d of a
    # Transformer2DModel: most SD1.5 LoRA files carry LoRA on them.
    pointwise_convs = r".*\.attentions\.\d+\.proj_(in|out)"

    def encode_prompts(self, pipeline, prompts: Mapping[str, list], cfg: bool) -> dict:
        embeds, negative = pipeline.encode_prompt(
            prompt=prompts["prompt"], device=pipeline.device, num_images_per_prompt=1,
            do_classifier_free_guidance=cfg, negative_prompt=prompts.get("negative_prompt"))
        return {"prompt_embeds": embeds, **({"negative_prompt_embeds": negative} if cfg else {})}

    def converter_config(self, denoiser) -> Mapping | None:
        return denoiser.config  # what load_lora_weights passes lora_state_dict (SGM-numbered kohya files)

    def lora_state_dict_kwargs(self, denoiser_config: Mapping | None) -> dict:
        return {} if denoiser_config is None else {"unet_config": denoiser_config}

    def check_raw_lora(self, raw: Mapping[str, Any], label: str) -> None:
        check_sgm_blocks(raw, label, "SD1.5")  # the same quadratic SGM mapping as SDXL's

    def plan_tokens(self, configs: Mapping[str, dict], latent_pixels: int) -> tuple[int, int]:
        return latent_pixels, configs["unet"]["block_out_channels"][0]

    def build_tiny(self, seed: int = 0):
        import torch
        from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
        from transformers import CLIPTextModel

        from hotlora.families._tiny import clip_config, clip_tokenizer

        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            block_out_channels=(8, 16), layers_per_block=1, sample_size=16, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(2, 2), cross_attention_dim=32, norm_num_groups=1,
        )
        vae = AutoencoderKL(
            block_out_channels=[8, 16], in_channels=3, out_channels=3,
            down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
            latent_channels=4, sample_size=32, norm_num_groups=1,
        )
        # SD1.5's published scheduler (PLMS without the Runge-Kutta warm-up).
        scheduler = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", skip_prk_steps=True,
                                  steps_offset=1, set_alpha_to_one=False)
        return StableDiffusionPipeline(
            vae=vae, text_encoder=CLIPTextModel(clip_config()), tokenizer=clip_tokenizer(), unet=unet,
            scheduler=scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )

    def trainer_lora(self, path: Path, linears, sd, rank: int, seed: int) -> Path:
        """kohya sd-scripts' SD1.x layout (``train_network.py`` with ``networks.lora``): its U-Net
        (library/original_unet.py) keeps diffusers' module names, flattened to ``lora_unet_down_blocks_1_
        attentions_0_..._attn1_to_q`` with ``lora_down`` / ``lora_up`` and a scalar alpha each. What its
        default network wraps: every Linear of the transformer blocks and the attentions' 1x1
        ``proj_in`` / ``proj_out`` convs (``[r, in, 1, 1]``, ``[out, r, 1, 1]``). Alpha rank / 2."""
        from hotlora.families.sdxl import save_kohya_lora

        kept = {key: v for key, v in sd.items() if ".transformer_blocks." in key}
        return save_kohya_lora(path, {**kept, **projection_lora(linears, rank, seed)}, alpha=rank / 2)

    def write_trainer_samples(self, pipeline, linears, out: Path, rank: int, attention_only) -> dict:
        from hotlora.families._tiny import random_lora
        from hotlora.families.sdxl import save_kohya_lora

        sd = {**random_lora(linears, rank, seed=4, modules=attention_only), **projection_lora(linears, rank, seed=4)}
        return {"style-kohya": save_kohya_lora(out / "style-kohya.safetensors", sd, alpha=rank / 2)}


def projection_lora(linears, rank: int, seed: int) -> dict:
    """Random LoRA factors in PEFT key form on each attention's 1x1 ``proj_in`` and ``proj_out``, as
    a conv LoRA holds them. SD1.x's projections map the block's channels to the attention's width,
    which are equal (heads x head size = channels): that width is its ``attn1.to_q``'s input."""
    import torch

    g = torch.Generator().manual_seed(seed)
    sd = {}
    for block in sorted({name.split(".transformer_blocks.")[0] for name in linears if ".transformer_blocks." in name}):
        channels = linears[f"{block}.transformer_blocks.0.attn1.to_q"][0]
        for layer in ("proj_in", "proj_out"):
            sd[f"{block}.{layer}.lora_A.weight"] = torch.randn(rank, channels, 1, 1, generator=g) / channels**0.5
            sd[f"{block}.{layer}.lora_B.weight"] = torch.randn(channels, rank, 1, 1, generator=g) * 0.5 / rank**0.5
    return sd
