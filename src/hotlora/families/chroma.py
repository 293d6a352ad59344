"""Chroma (ChromaPipeline): a Flux.1-schnell-derived transformer without a guidance embedding
(its modulations come from an approximator network), one T5 text encoder, and true classifier-free
guidance: a second forward pass on the negative prompt for ``guidance_scale > 1``.

It loads LoRA through Flux's mixin (FluxLoraLoaderMixin: the same converters, kohya and XLabs
included) but is no FluxPipeline subclass: the registry tells the two apart by the denoiser class
(``ModelFamily.matches``). The mixin's loadable ``text_encoder`` is, on Chroma, the T5 encoder,
and diffusers 0.42 cannot load a LoRA into it: ``load_lora_weights`` with T5 keys
(``text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight``) raises "Could not
automatically infer state dict type" (its text-encoder loader converts CLIP key forms only). So
Chroma takes no text-encoder LoRA here either (``lora_text_encoders`` is empty: such keys are listed
as skipped); Flux's CLIP-L embedding keys do not apply.

T5 prompts are padded to 512 tokens with a mask that keeps one padding token: a fixed length
whatever the prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from hotlora.families.flux import Flux, kohya_lora


class Chroma(Flux):
    name = "chroma"
    lora_key_pattern = Flux.lora_key_pattern + r"|distilled_guidance_layer"
    base_model_markers = ("chroma",)
    pipeline_class = "ChromaPipeline"
    task_pipelines = {"image-to-image": "ChromaImg2ImgPipeline"}
    # Checked in diffusers 0.42.1: ChromaInpaintPipeline.__call__ reads the transformer's
    # ``config.guidance_embeds`` (copied from Flux's), which ChromaTransformer2DModel's config never has,
    # so every call raises AttributeError, on the published Chroma1-HD as on the tiny model.
    refused_tasks = {"inpaint": "diffusers' ChromaInpaintPipeline reads transformer.config.guidance_embeds, which "
                                "Chroma's transformer does not have: every call fails (diffusers 0.42)"}
    denoiser_class = "ChromaTransformer2DModel"
    default_steps, default_guidance = 35, 5.0  # ChromaPipeline.__call__'s defaults (the model card: 26-40 steps)
    cfg = "true"
    negative_prompts = True
    embedding_keys = ()  # no trainer writes pivotal-tuning vectors for Chroma
    lora_text_encoders = ()  # Flux's mixin lists text_encoder, which on Chroma is T5: diffusers cannot load it (above)
    tokenizer_of = {"text_encoder": "tokenizer"}
    prompt_argument_of = {"text_encoder": "prompt"}
    full_size_models = {"chroma1-hd": "chroma1_hd"}
    tiny_size = 32

    def encode_prompts(self, pipeline, prompts: Mapping[str, list], cfg: bool) -> dict:
        """The negative side is always encoded: true CFG keeps the batch single (``cfg`` says
        whether it is doubled, never here), and the pipeline only reads it when it guides."""
        embeds, _, mask, negative, _, negative_mask = pipeline.encode_prompt(
            prompt=prompts["prompt"], negative_prompt=prompts.get("negative_prompt") or [""] * len(prompts["prompt"]),
            device=pipeline.device, num_images_per_prompt=1, do_classifier_free_guidance=True)
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask, "negative_prompt_embeds": negative,
                "negative_prompt_attention_mask": negative_mask}

    def build_tiny(self, seed: int = 0):
        import torch
        from diffusers import AutoencoderKL, ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
        from transformers import T5Config, T5EncoderModel

        from hotlora.families._tiny import t5_tokenizer

        torch.manual_seed(seed)
        transformer = ChromaTransformer2DModel(
            patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=[4, 4, 8], approximator_hidden_dim=32,
            approximator_layers=1, approximator_num_channels=16,
        )
        text_encoder = T5EncoderModel(
            T5Config(vocab_size=160, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        ).eval()
        vae = AutoencoderKL(
            sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
            latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
            shift_factor=0.0609, scaling_factor=1.5035,
        )
        return ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                              tokenizer=t5_tokenizer(), transformer=transformer)

    def write_trainer_samples(self, pipeline, linears, out: Path, rank: int, attention_only) -> dict:
        """kohya sd-scripts (which trains Chroma with ``--model_type chroma``) in Flux's BFL naming."""
        from safetensors.torch import save_file

        blocks = len(pipeline.transformer.transformer_blocks)
        save_file(kohya_lora(linears, blocks, rank=rank, alpha=rank / 2, seed=4), str(out / "style-kohya.safetensors"))
        return {"style-kohya": out / "style-kohya.safetensors"}
