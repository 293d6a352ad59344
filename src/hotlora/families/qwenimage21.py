"""Qwen-Image 2.1 (QwenImage21Pipeline): one single-stream, block-causal transformer
(``QwenImage21Transformer2DModel``) over the prompt's Qwen3-VL hidden states and the target image's
latents, unpatched (the VAE compresses 16x; one vision-language slot stands for 2x2 latent tokens, so
sides are multiples of 32 pixels). diffusers loads LoRA into the transformer only, through
Qwen-Image's mixin (``QwenImageLoraLoaderMixin``).

Guidance, read from ``QwenImage21Pipeline.__call__``: true CFG as in Qwen-Image (a second forward
pass on the negative prompt, only when ``true_cfg_scale > 1`` AND a negative prompt is given), but
"meant to be sampled without guidance": its default ``true_cfg_scale`` is 1.0, hotlora's default too.

The prefix key/value cache (``use_kv_cache``, the pipeline's default, kept): under
``causal_condition`` the prompt's tokens are modulated from t = 0, so the first step runs the whole
sequence and stores the prompt's keys and values per block ("extract"), every later step runs the
image's tokens only against them ("cached"): two code paths through each compiled block, both
warmed up (``warmup_steps``: at least two steps); a guided run keeps a second cache for the negative
prompt. Each request's cache is new (the pipeline makes it per call), so nothing of one request's
adapters outlives it.

Text lengths: the prompt's tokens come first in the joint sequence and its rotary positions run
on into the image's (``QwenImage21Rope``: the image block starts where the text ends, padding
included), so a prompt padded to a longer one's length gives another image than alone. So a mixed
batch (several requests in one call) holds requests of the same prompt and negative prompt only
(``mixed_batch_texts``: a templated prompt with each user's adapters), never padded. One
request's pack repeats one prompt (``num_images_per_prompt``): no padding. Every prompt length is
a new shape: every dimension dynamic from the first compile (``compile_dynamic``).

Edit: the pipeline's ``image``, one to ``max_edit_references`` references that the Qwen3-VL encoder
sees in the prompt (one vision slot per 2x2 latent tokens) and whose latents are prepended to the
noise, each its own block of the sequence; the same references for every image of a call (an edit's
batch is one request). The pipeline resizes each to ``output_resolution`` squared pixels' area at its
own aspect ratio whatever the output size: fixed at its default, 1024 (``reference_side``). The
references are the first step's prefix, so they are computed once a request and never compiled.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from hotlora.errors import AdapterFormatError
from hotlora.families.base import ModelFamily

PLAN_TEXT_TOKENS = 512  # a long prompt's tokens in the joint sequence, for the memory plan (no cap)

# Every Linear of QwenImage21Transformer2DModel ({n}: a block's index), for kohya-named files
# (``lora_unet_transformer_blocks_0_img_mlp_gate_layer``). diffusers' Qwen-Image converter un-flattens
# those names with Qwen-Image 1's vocabulary, so 2.1's ``img_mlp.gate_layer``, ``txt_in.in_layer`` and
# ``modulation.1`` came out as modules that do not exist (``img_mlp.gate.layer``). hotlora names them
# from this list (by hand: no converter knows 2.1's names) and hands the converter the dotted names
# under ComfyUI's prefix, which it reads as they are (alphas included).
KOHYA_MODULES = ("img_in", "modulation.1", "norm_out.linear", "proj_out", "txt_in.in_layer", "txt_in.out_layer",
                 "time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2",
                 *(f"transformer_blocks.{{n}}.{name}" for name in ("attn.to_q", "attn.to_k", "attn.to_v",
                                                                  "attn.to_out.0", "img_mlp.proj",
                                                                  "img_mlp.gate_layer", "img_mlp.out")))
_KOHYA_FLAT = {re.compile(re.escape(m.replace(".", "_")).replace(r"\{n\}", r"(\d+)")): m for m in KOHYA_MODULES}


def kohya_module(flat: str) -> str | None:
    """The dotted module of a kohya-flattened 2.1 name (``transformer_blocks_3_attn_to_out_0``), or None."""
    for pattern, module in _KOHYA_FLAT.items():
        match = pattern.fullmatch(flat)
        if match:
            return module.replace("{n}", match.group(1)) if match.groups() else module
    return None


class QwenImage21(ModelFamily):
    name = "qwenimage21"
    pipeline_class = "QwenImage21Pipeline"
    denoiser_class = "QwenImage21Transformer2DModel"
    # Its pipeline is the only one of its mixin with this denoiser: Qwen-Image's img2img / inpaint /
    # edit pipelines share the mixin but not the transformer.
    serves_variants = False
    lora_key_pattern = r"transformer_blocks[._]\d+[._]img_mlp[._](proj|gate_layer|out)\b"
    # Not "qwen-image-2": Qwen-Image-2512 is a Qwen-Image (1.x) checkpoint.
    base_model_markers = ("qwen-image-2.1", "qwen_image_2.1", "qwen_image_2_1", "qwenimage21", "qwenimage2.1",
                          "qwen-image21")
    full_size_models = {"qwen-image-2.1": "qwen_image_21"}
    unserved_pipelines = {"QwenImage21ModularPipeline": (
        "diffusers' modular pipeline of Qwen-Image 2.1 is not served; its checkpoint's model_index.json names "
        "QwenImage21Pipeline, which hotlora serves (family qwenimage21)")}
    task_pipelines = {"edit": "QwenImage21Pipeline"}  # the same pipeline, given references
    # hotlora's bound, as for Qwen-Image-Edit (the pipeline takes any number; each reference at
    # 1024 x 1024 adds 4,096 tokens to the first step's sequence and the cache).
    max_edit_references = 3
    reference_side = 1024  # QwenImage21Pipeline's output_resolution default: references' area, squared
    mixed_batch_shares = "the prompt, negative prompt and text-encoder state"  # see "Text lengths" above
    # Under ``causal_condition`` the timestep batch gets one more row, t = 0, that modulates the prompt's
    # tokens of every sample: the layers it runs through have no per-sample row to bind adapters to.
    mixed_batch_shared_rows = ("time_text_embed.", "modulation.", "norm_out.")
    # QwenImage21Pipeline.__call__'s defaults: 40 steps, true_cfg_scale 1.0, output_resolution 1024.
    default_steps, default_guidance = 40, 1.0
    default_size = (1024, 1024)
    cfg = "true"
    negative_prompts = True
    latent_multiple = 2  # one vision-language slot per 2x2 latent tokens (the pipeline's multiple_of = 32 px)
    tokenizer_of = {"text_encoder": "tokenizer"}
    prompt_argument_of = {"text_encoder": "prompt"}
    # 6 x 6 latent tokens: no tiny dimension of the same size (a head's 16 channels, the width's 32), which
    # dynamo's duck sizing would tie the image's token count to, making that count static.
    tiny_size = 96
    compile_dynamic = True  # prompt lengths reach the blocks: one dynamic graph per code path
    eager_block_paths = True

    def eager_block_call(self, kwargs: Mapping[str, Any]) -> bool:
        """The first step's blocks (the whole sequence; ``kv_cache_mode`` "extract", or None without
        the cache) run eagerly: they get the prompt's length as Python ints (the cache's slice, the
        attention's segments), which a compiled block specialises on, a graph per prompt length.
        Every later step ("cached": the image's tokens against the stored prefix) runs compiled."""
        return kwargs.get("kv_cache_mode") != "cached"

    tiny_variants = ("turbo",)
    # A few-step schedule for the tiny Turbo (the published one's eight sigmas are read from its model_index.json).
    TINY_TURBO_SIGMAS = (1.0, 0.8, 0.45)

    def schedule_steps(self, pipeline) -> int | None:
        """Qwen-Image-2.1-Turbo's model_index.json sets ``sample_sigmas`` (eight), which the pipeline
        runs instead of ``num_inference_steps`` (the base model sets none)."""
        sigmas = getattr(pipeline, "config", {}).get("sample_sigmas")
        return len(sigmas) if sigmas else None

    def call_arguments(self, guidance_scale: float) -> dict[str, Any]:
        return {"true_cfg_scale": guidance_scale}

    def mixed_batch_texts(self, prompt: str, negative: str | None, text_state: tuple) -> tuple:
        return prompt, negative, text_state

    def prepare_raw_lora(self, raw: Mapping[str, Any], label: str) -> dict:
        """kohya-named keys (``lora_unet_...``) renamed to ComfyUI's dotted ones (``KOHYA_MODULES``);
        a name of no 2.1 module is refused, named."""
        if not any(key.startswith("lora_unet_") for key in raw):
            return dict(raw)
        out, unknown = {}, []
        for key, value in raw.items():
            if not key.startswith("lora_unet_"):
                out[key] = value
                continue
            flat, _, suffix = key.removeprefix("lora_unet_").partition(".")
            module = kohya_module(flat)
            if module is None:
                unknown.append(key)
            else:
                out[f"diffusion_model.{module}.{suffix}"] = value
        if unknown:
            raise AdapterFormatError(f"{label}: {len(unknown)} kohya-named keys name no Qwen-Image 2.1 module "
                                     f"({', '.join(sorted(unknown)[:5])}); its Linears: {', '.join(KOHYA_MODULES)}")
        return out

    def default_negative_prompt(self, guidance_scale: float) -> str | None:
        return " " if guidance_scale > 1 else None

    def warmup_guidance_scales(self, default: float) -> list[float]:
        """Unguided (one pass a step) and guided (the negative prompt's pass, its own cache)."""
        return [default, *([1.0] if default > 1 else [4.0])]

    def task_arguments(self, task: str, images: list, masks: list | None, strength: float | None,
                       references: int) -> dict[str, Any]:
        arguments = super().task_arguments(task, images, masks, strength, references)
        return {**arguments, "output_resolution": self.reference_side} if task == "edit" else arguments

    def warmup_steps(self, pipeline, steps: int) -> int:
        """Two steps at least: the first fills the prefix cache ("extract"), later ones read it
        ("cached"); each is another graph of every block."""
        return max(super().warmup_steps(pipeline, steps), 2)

    def warmup_prompts(self, pipeline=None) -> tuple:
        return ("warm-up", "a watercolor portrait of an astronaut floating above a quiet city at dusk")

    def plan_tokens(self, configs: Mapping[str, dict], latent_pixels: int) -> tuple[int, int]:
        """The joint sequence: one token per latent pixel (unpatched) plus the prompt's."""
        denoiser = configs["transformer"]
        patch = denoiser.get("patch_size", 1)
        return (latent_pixels // (patch * patch) + PLAN_TEXT_TOKENS,
                denoiser["num_attention_heads"] * denoiser["attention_head_dim"])

    def build_tiny_variant(self, variant: str, seed: int = 0):
        """"turbo": the tiny model with a sigma schedule of its own in its config, as Qwen-Image-2.1-Turbo's."""
        if variant != "turbo":
            return super().build_tiny_variant(variant, seed)
        from diffusers import QwenImage21Pipeline

        base = self.build_tiny(seed)
        return QwenImage21Pipeline(**base.components, sample_sigmas=list(self.TINY_TURBO_SIGMAS))

    def build_tiny(self, seed: int = 0):
        """diffusers' classes at small widths: the VAE keeps its five stages (16x, as the pipeline
        assumes), the text encoder is a Qwen3-VL with a one-layer vision tower, the processor the
        Qwen tokenizer with the vision tokens (``_tiny.qwen_vl_processor``; Qwen3VLProcessor needs
        torchvision for its video part). Every transformer weight is drawn (its modulation and
        zero-centred norms start at values a test could not tell from a bug)."""
        import torch
        from diffusers import (
            AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline,
            QwenImage21Transformer2DModel,
        )
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        from hotlora.families._tiny import qwen_tokenizer, qwen_vl_processor

        torch.manual_seed(seed)
        transformer = QwenImage21Transformer2DModel(
            patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            context_in_dim=16, mlp_ratio=2, axes_dims_rope=(4, 6, 6),
        )
        with torch.no_grad():
            for parameter in transformer.parameters():
                parameter.copy_(torch.randn_like(parameter) * 0.2)
        z_dim = 4
        vae = AutoencoderKLQwenImage21(
            base_dim=4, decoder_base_dim=4, z_dim=z_dim, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
            temperal_downsample=[False, True, True, True], latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim,
        )
        tokenizer = qwen_tokenizer(vision=True)
        start, end, pad = (tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>",
                                                                        "<|image_pad|>"))
        config = Qwen3VLConfig(
            text_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                         "num_key_value_heads": 1, "head_dim": 8, "vocab_size": len(tokenizer), "rms_norm_eps": 1e-6,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                             "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
            vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                           "out_hidden_size": 16, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                           "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
            image_token_id=pad, video_token_id=pad, vision_start_token_id=start, vision_end_token_id=end,
        )
        text_encoder = Qwen3VLForConditionalGeneration(config)
        # Qwen3-VL's 16-pixel patches, and a pixel bound no reference reaches (16,777,216: the published
        # processor's longest_edge as recalled, not read here): every reference the pipeline hands it is seen
        # whole, so its vision slots match the reference's latents (a 1024 x 1024 bound cut a non-square
        # reference the pipeline had sized to 1312 x 800, and the two counts differed).
        processor = qwen_vl_processor(tokenizer, max_pixels=16_777_216, patch_size=16)
        return QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                                   processor=processor, transformer=transformer)

    def trainer_lora(self, path: Path, linears, sd, rank: int, seed: int) -> Path:
        """ComfyUI's ``diffusion_model.`` prefix over diffusers' names (what ai-toolkit writes for
        the Qwen-Image family; no trainer's own 2.1 layout is read here: see the README's Limits)."""
        from hotlora.families._tiny import save_prefixed_layout

        return save_prefixed_layout(path, sd)
