"""LTX-Video (LTXPipeline): text-to-video. A 3-D transformer over every latent pixel of every latent
frame (patch 1 x 1 x 1), a T5 text encoder, a video VAE that compresses 32x in space and 8x in time
(the published one); diffusers loads LoRA into the transformer only (``LTXVideoLoraLoaderMixin``).

Guidance, read from ``LTXPipeline.__call__``: classifier-free guidance for ``guidance_scale > 1`` as
ONE doubled batch ``[negative, positive]`` (latents and prompt embeddings concatenated, as SDXL),
a missing negative prompt encoded as "". Prompts are padded to ``max_sequence_length`` (128) and
their attention mask goes to the transformer: one text shape whatever the prompt.

Frames: 8k + 1 (the first frame kept, the rest compressed 8 to 1); the pipeline would round another
count silently, so a request is refused instead (``frame_problems``). The frame rate (25, the
pipeline's default ``frame_rate``) enters the transformer's rotary positions; hotlora always runs the
default, and encodes the video at it.

Image-to-video (``LTXImageToVideoPipeline``, the task ``image-to-video``) runs on the same weights
through ``from_pipe``: the input image is the first frame.
"""

from __future__ import annotations

from typing import Any, Mapping

from hotlora.families.base import ModelFamily


class LTXVideo(ModelFamily):
    name = "ltx"
    pipeline_class = "LTXPipeline"
    denoiser_class = "LTXVideoTransformer3DModel"
    # The blocks' self-attention at the top of the denoiser, as diffusers ("transformer.") and ComfyUI
    # ("diffusion_model.", the trainers') name it: SD3 names its first attention ``attn``, the U-Nets
    # nest their ``transformer_blocks`` inside ``attentions``, Wan's are ``blocks``.
    lora_key_pattern = r"(?:^|transformer\.|diffusion_model\.)transformer_blocks[._]\d+[._]attn1[._]"
    base_model_markers = ("ltx-video", "ltxv", "ltx video", "ltx_video")
    full_size_models = {"ltx-video": "ltx_video"}
    # LTXPipeline.__call__'s defaults (the LTX-Video 0.9 model card's): 50 steps, guidance 3,
    # 512 x 704, 161 frames at 25 fps.
    default_steps, default_guidance = 50, 3.0
    default_size = (512, 704)
    default_frames = 161
    fps = 25
    output_kind = "frames"
    frame_multiple = 8  # the published VAE's temporal compression (AutoencoderKLLTXVideo): 8k + 1 frames
    cfg = "batch"
    negative_prompts = True
    # LTX-Video's one transformer makes a video from text or from a first frame: image-to-video is
    # LTXImageToVideoPipeline on the same weights (the image's latents as the first latent frame, kept
    # by a conditioning mask). It encodes the frame once per video, sampling its latents with that
    # video's generator (``image[i]``): the image is given once per video of the batch.
    task_pipelines = {"image-to-video": "LTXImageToVideoPipeline"}
    first_frame_per_video = True
    # The condition pipeline (several conditions at chosen frames) is not served.
    serves_variants = False
    tokenizer_of = {"text_encoder": "tokenizer"}
    prompt_argument_of = {"text_encoder": "prompt"}
    min_steps = 2
    min_steps_reason = ("the LTX scheduler's shift_terminal stretches the schedule by its last step's sigma, "
                        "which divides by zero on a one-step schedule and makes a video of NaN")
    tiny_size = 32
    tiny_frames = 9
    text_tokens = 128  # LTXPipeline.__call__'s max_sequence_length: every prompt is padded to it

    def vae_scale_factor(self, pipeline) -> int:
        """LTXPipeline has no ``vae_scale_factor``: its spatial compression (the VAE's)."""
        return pipeline.vae_spatial_compression_ratio

    def encode_prompts(self, pipeline, prompts: Mapping[str, list], cfg: bool) -> dict:
        """The embeddings with their attention masks (the transformer reads them); under CFG the
        negative side too ("" where none was given, as the pipeline encodes it)."""
        embeds, mask, negative, negative_mask = pipeline.encode_prompt(
            prompt=list(prompts["prompt"]), negative_prompt=prompts.get("negative_prompt"),
            do_classifier_free_guidance=cfg, num_videos_per_prompt=1, max_sequence_length=self.text_tokens,
            device=pipeline.device)
        out = {"prompt_embeds": embeds, "prompt_attention_mask": mask}
        if cfg:
            out.update(negative_prompt_embeds=negative, negative_prompt_attention_mask=negative_mask)
        return out

    def task_arguments(self, task: str, images: list, masks: list | None, strength: float | None,
                       references: int) -> dict[str, Any]:
        """Image-to-video: the first frame once per video (``first_frame_per_video``), as a list."""
        if task == "image-to-video":
            return {"image": list(images)}
        return super().task_arguments(task, images, masks, strength, references)

    def plan_tokens(self, configs: Mapping[str, dict], latent_pixels: int) -> tuple[int, int]:
        """Every latent pixel of every latent frame (the default frame count's) in one sequence."""
        denoiser = configs["transformer"]
        latent_frames = (self.default_frames - 1) // self.frame_multiple + 1
        patch, patch_t = denoiser.get("patch_size", 1), denoiser.get("patch_size_t", 1)
        heads, head_dim = denoiser.get("num_attention_heads", 32), denoiser.get("attention_head_dim", 64)
        return latent_frames // patch_t * latent_pixels // (patch * patch), heads * head_dim

    def build_tiny(self, seed: int = 0):
        """As diffusers' own tests/pipelines/ltx/test_ltx.py builds it (its transformer and VAE
        configs), except that the VAE's third level scales too, so that time is compressed 8x as in
        the published VAE (the frame rule is the family's), and a T5 encoder and tokenizer made here
        instead of downloaded; the published scheduler settings."""
        import torch
        from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline, LTXVideoTransformer3DModel
        from transformers import T5Config, T5EncoderModel

        from hotlora.families._tiny import t5_tokenizer

        torch.manual_seed(seed)
        transformer = LTXVideoTransformer3DModel(
            in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
            cross_attention_dim=32, num_layers=2, caption_channels=32)
        vae = AutoencoderKLLTXVideo(
            in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, True, False),
            decoder_spatio_temporal_scaling=(True, True, True, False),
            decoder_inject_noise=(False, False, False, False, False), upsample_residual=(False, False, False, False),
            upsample_factor=(1, 1, 1, 1), timestep_conditioning=False, patch_size=1, patch_size_t=1,
            encoder_causal=True, decoder_causal=False)
        tokenizer = t5_tokenizer()
        text_encoder = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)).eval()
        # The published scheduler's settings (Lightricks/LTX-Video's scheduler_config.json): the shift
        # follows the video's token count, so a request's fixed ``shift`` is refused as on Flux.
        scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                    base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)
        return LTXPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                           tokenizer=tokenizer, transformer=transformer)

    def tiny_defaults(self) -> dict[str, Any]:
        return {"num_frames": self.tiny_frames}

    def write_trainer_samples(self, pipeline, linears, out, rank: int, attention_only) -> dict:
        """The trainers' layout: diffusers' module names under ComfyUI's ``diffusion_model.`` prefix,
        ``lora_A`` / ``lora_B``, no alpha (what diffusers' ``_convert_non_diffusers_ltxv_lora_to_diffusers``
        reads: a file that is not all under the prefix is refused there), over the attention layers
        that Lightricks' LTX-Video-Trainer targets by default (``to_k``, ``to_q``, ``to_v``, ``to_out.0``)."""
        from hotlora.families._tiny import random_lora, save_prefixed_layout

        sd = random_lora(linears, rank, seed=5, modules=attention_only)
        return {"style-comfy": save_prefixed_layout(out / "style-comfy.safetensors", sd)}
