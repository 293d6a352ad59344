"""Flux.1 (FluxPipeline): a guidance-distilled transformer over 2x2-packed latent patches, CLIP-L
and T5 text encoders; diffusers loads LoRA into the transformer and CLIP-L (not T5)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from hotlora.errors import AdapterFormatError
from hotlora.families.base import ModelFamily

TEXT_TOKENS = 512  # FluxPipeline's max_sequence_length default; the engine does not change it

# The double-block layers of BFL's original Flux naming, as kohya and XLabs name them. No
# library writes these layouts (only readers exist), so these writers are ours.
KOHYA_DOUBLE_BLOCK = {
    "img_attn_proj": ["attn.to_out.0"],
    "img_attn_qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "img_mlp_0": ["ff.net.0.proj"],
    "img_mlp_2": ["ff.net.2"],
    "txt_attn_proj": ["attn.to_add_out"],
    "txt_attn_qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
}
XLABS_DOUBLE_BLOCK = {
    "qkv_lora1": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "proj_lora1": ["attn.to_out.0"],
    "qkv_lora2": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    "proj_lora2": ["attn.to_add_out"],
}


class Flux(ModelFamily):
    name = "flux"
    pipeline_class = "FluxPipeline"
    # FluxSingleTransformerBlock returns slices of its joined sequence: without this, every single
    # block after the first compiled graphs of its own for the other strides (19 -> 16 graphs on the
    # tiny model's warm-up).
    contiguous_block_outputs = ("FluxSingleTransformerBlock",)
    task_pipelines = {"image-to-image": "FluxImg2ImgPipeline", "inpaint": "FluxInpaintPipeline",
                      "edit": "FluxKontextPipeline"}
    edit_references_per_image = True  # Kontext: an ``image`` list as long as the batch
    denoiser_class = "FluxTransformer2DModel"
    default_steps, default_guidance = 28, 3.5
    cfg = "none"  # guidance goes in through the guidance embedding
    latent_multiple = 2  # the transformer packs 2x2 latent patches into one token
    # diffusers' advanced training script writes clip_l and, with --enable_t5_ti, t5.
    embedding_keys = (("clip_l", "text_encoder"), ("t5", "text_encoder_2"))
    full_size_models = {"flux-dev": "flux"}
    lora_key_pattern = (r"single_transformer_blocks\.\d+\.(proj_mlp|proj_out|norm\.linear)|(double|single)[._]blocks[._]\d+"
                        r"|guidance_embedder")
    base_model_markers = ("flux.1", "flux-1", "flux1", "flux-dev", "flux_dev", "flux-schnell")
    tiny_size = 32

    def task_arguments(self, task, images, masks, strength, references):
        arguments = super().task_arguments(task, images, masks, strength, references)
        if task == "edit":
            # References come fitted to the served size. Kontext would otherwise resize them to one of
            # its preferred resolutions and scale the output to ``max_area`` (1024x1024): another shape.
            first = images[0]
            arguments.update(_auto_resize=False, max_area=first.width * first.height)
        return arguments

    def encode_prompts(self, pipeline, prompts: Mapping[str, list], cfg: bool) -> dict:
        embeds, pooled, _ = pipeline.encode_prompt(prompt=prompts["prompt"], prompt_2=prompts.get("prompt_2"),
                                                   device=pipeline.device, num_images_per_prompt=1)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def lora_state_dict_kwargs(self, denoiser_config: Mapping | None) -> dict:
        return {"return_alphas": True}

    def check_raw_lora(self, raw: Mapping[str, Any], label: str) -> None:
        """diffusers' kohya-Flux converter splits ``alpha / rank`` between down and up in a loop
        (``while scale_down * 2 < scale_up``) that never ends for a negative alpha: refused before it
        runs. The trigger is the converter's own (``.lora_down.weight`` in a key)."""
        import torch

        if not any(".lora_down.weight" in k for k in raw):
            return
        negative = []
        for key, value in raw.items():
            if not key.endswith("alpha") or value.numel() == 0 or value.is_complex() or value.dtype == torch.bool:
                continue
            try:
                if bool((value.detach().double() < 0).any()):
                    negative.append(key)
            except RuntimeError:  # a dtype without a double conversion: the converter fails on it by itself
                continue
        if negative:
            raise AdapterFormatError(
                f"{label}: negative alpha in {', '.join(sorted(negative)[:8])} "
                "(diffusers' kohya Flux converter never finishes on it)"
            )

    def plan_tokens(self, configs: Mapping[str, dict], latent_pixels: int) -> tuple[int, int]:
        denoiser = configs["transformer"]
        tokens = latent_pixels // (2 * 2) + TEXT_TOKENS
        return tokens, denoiser["num_attention_heads"] * denoiser["attention_head_dim"]

    def build_tiny(self, seed: int = 0):
        import torch
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
        from transformers import CLIPTextModel, T5Config, T5EncoderModel

        from hotlora.families._tiny import clip_config, clip_tokenizer, t5_tokenizer

        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
            guidance_embeds=True,
        )
        text_encoder = CLIPTextModel(clip_config())
        text_encoder_2 = T5EncoderModel(
            T5Config(vocab_size=160, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        )
        vae = AutoencoderKL(
            sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
            latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
            shift_factor=0.0609, scaling_factor=1.5035,
        )
        return FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
            tokenizer=clip_tokenizer(), text_encoder_2=text_encoder_2, tokenizer_2=t5_tokenizer(),
            transformer=transformer,
        )

    def trainer_lora(self, path: Path, linears, sd, rank: int, seed: int) -> Path:
        """kohya sd-scripts' layout over the double blocks (fused qkv), alpha 1.5 x rank."""
        from safetensors.torch import save_file

        blocks = sum(1 for n in linears if n.startswith("transformer_blocks") and n.endswith("attn.to_out.0"))
        save_file(kohya_lora(linears, blocks, rank, alpha=rank * 1.5, seed=seed), str(path))
        return path

    def write_trainer_samples(self, pipeline, linears, out: Path, rank: int, attention_only) -> dict:
        from safetensors.torch import save_file

        blocks = len(pipeline.transformer.transformer_blocks)
        save_file(kohya_lora(linears, blocks, rank=rank, alpha=rank / 2, seed=4), str(out / "style-kohya.safetensors"))
        save_file(xlabs_lora(linears, blocks, rank=rank, seed=5), str(out / "style-xlabs.safetensors"))
        return {"style-kohya": out / "style-kohya.safetensors", "style-xlabs": out / "style-xlabs.safetensors"}


def _double_block_lora(linears, num_double_blocks: int, rank: int, seed: int, parts: Mapping[str, list],
                       key_of, down: str, up: str, alpha: float | None = None) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(num_double_blocks):
        for part, targets in parts.items():
            in_f = linears[f"transformer_blocks.{i}.{targets[0]}"][0]
            out_f = sum(linears[f"transformer_blocks.{i}.{t}"][1] for t in targets)
            key = key_of(i, part)
            sd[f"{key}.{down}"] = torch.randn(rank, in_f, generator=g) / in_f**0.5
            sd[f"{key}.{up}"] = torch.randn(out_f, rank, generator=g) * 0.5 / rank**0.5
            if alpha is not None:
                sd[f"{key}.alpha"] = torch.tensor(float(alpha))
    return sd


def kohya_lora(linears, num_double_blocks: int, rank: int, alpha: float, seed: int) -> dict:
    """A random kohya-layout Flux LoRA over the double blocks (fused qkv with one shared down)."""
    return _double_block_lora(linears, num_double_blocks, rank, seed, KOHYA_DOUBLE_BLOCK,
                              lambda i, part: f"lora_unet_double_blocks_{i}_{part}",
                              "lora_down.weight", "lora_up.weight", alpha)


def xlabs_lora(linears, num_double_blocks: int, rank: int, seed: int) -> dict:
    """A random XLabs-layout Flux LoRA (``double_blocks.N.processor.{qkv,proj}_lora{1,2}``)."""
    return _double_block_lora(linears, num_double_blocks, rank, seed, XLABS_DOUBLE_BLOCK,
                              lambda i, part: f"double_blocks.{i}.processor.{part}", "down.weight", "up.weight")
