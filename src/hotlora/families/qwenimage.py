"""Qwen-Image (QwenImagePipeline): a double-stream MMDiT over packed 2x2 latent patches, a
Qwen2.5-VL text encoder (its last hidden state, the prompt template's first 34 tokens dropped);
diffusers loads LoRA into the transformer only.

Guidance, read from ``QwenImagePipeline.__call__``: "true" CFG, a second forward pass on the
negative prompt's embeddings, and only when ``true_cfg_scale > 1`` AND a negative prompt is given
(even " "); the combined prediction is rescaled to the conditional one's norm. ``guidance_scale``
goes to a guidance embedding the published models do not have (ignored, with a warning). So
hotlora's one guidance value is the pipeline's ``true_cfg_scale``, and a request without a
negative prompt runs with " " when it guides (``default_negative_prompt``).

Qwen-Image 2.1 (``QwenImage21Pipeline``) shares only the LoRA mixin (another denoiser class, a
Qwen3-VL encoder behind a processor, another VAE): its own family, ``families.qwenimage21``;
``matches`` tells the two apart by the denoiser class.

Text lengths: the pipeline pads a batch of prompts to its longest with zeros and a mask (None
when all are as long: one prompt per pack, and the negative pass on its own), so every prompt
length is a new shape and a batch of unequal ones takes the masked path. Text positions get RoPE
from 0 whatever the padding, and the mask hides padded keys, so padding further changes nothing
(what a mixed batch's groups rely on: ``join_encoded``). Warm-up runs prompts of two lengths,
alone and mixed (``warmup_prompts``), every dimension dynamic from the first compile.

Edit: Qwen-Image-Edit-2509 / 2511 (``QwenImageEditPlusPipeline``: one to three reference images, the
published checkpoints' model_index.json names it). A model directory of that pipeline serves the
edit task through it and text-to-image through ``QwenImagePipeline.from_pipe`` on the same weights
(the edit pipeline cannot run without a reference; what a diffusers user gets from the edit
checkpoint's weights without one). The edit pipelines need what Qwen-Image's text-to-image
checkpoint does not ship: a processor, for the Qwen2.5-VL encoder sees the references (the prompt
embeddings depend on them, so the edit pipeline encodes its prompt itself: an edit's batch is one
request, ``batch_key``), and a transformer trained to edit. Edit on a text-to-image directory is
refused. The original Qwen-Image-Edit (``QwenImageEditPipeline``, one image, another prompt template
and another reference size) is refused too: served by the Plus pipeline it would not give what its
own pipeline gives.

Reference shapes: the Plus pipeline resizes every reference to a fixed area at its own aspect
ratio (1024 x 1024 pixels for the VAE, 384 x 384 for the vision tower, sides multiples of 32); hotlora
fits references to the served size first (``engine.inputs.fitted``), so at each served size every
reference has one shape, the one warm-up compiled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from hotlora.families.base import ModelFamily

# The edit checkpoints whose weights also serve text-to-image (through QwenImagePipeline.from_pipe).
EDIT_CHECKPOINTS = ("QwenImageEditPlusPipeline", "QwenImageEditPipeline")
TEXT_TOKENS = 1024  # QwenImagePipeline's tokenizer_max_length (beyond the dropped template)
WARMUP_WORDS = "a watercolor portrait of an astronaut floating above a quiet city at dusk, soft light, "


class QwenImage(ModelFamily):
    name = "qwenimage"
    # Its MLPs' ``net`` (Qwen-Image 2.1's ``img_mlp`` has ``proj`` / ``gate_layer`` / ``out`` directly).
    lora_key_pattern = r"transformer_blocks[._]\d+[._]((img|txt)_mlp[._]net|(img|txt)_mod)"
    base_model_markers = ("qwen-image", "qwen_image", "qwenimage")
    full_size_models = {"qwen-image": "qwen_image"}
    pipeline_class = "QwenImagePipeline"
    task_pipelines = {"image-to-image": "QwenImageImg2ImgPipeline", "inpaint": "QwenImageInpaintPipeline",
                      "edit": "QwenImageEditPlusPipeline"}
    max_edit_references = 3  # Qwen-Image-Edit-2509's model card: one to three input images
    denoiser_class = "QwenImageTransformer2DModel"
    # Qwen-Image's model card: 50 steps, true_cfg_scale 4.0, 1328 x 1328 for 1:1.
    default_steps, default_guidance = 50, 4.0
    default_size = (1328, 1328)
    cfg = "true"
    negative_prompts = True
    latent_multiple = 2  # latents packed as 2x2 patches
    tokenizer_of = {"text_encoder": "tokenizer"}
    prompt_argument_of = {"text_encoder": "prompt"}
    tiny_size = 32
    compile_dynamic = True  # prompt lengths reach the blocks: one dynamic graph per code path

    def text_to_image_pipeline(self, loaded):
        from diffusers import QwenImagePipeline

        if isinstance(loaded, QwenImagePipeline):
            return loaded
        if type(loaded).__name__ not in EDIT_CHECKPOINTS:
            return super().text_to_image_pipeline(loaded)  # refused: another pipeline's checkpoint
        return QwenImagePipeline.from_pipe(loaded, dtype=loaded.dtype)

    def task_pipeline(self, task: str, loaded, share):
        if task == "edit":
            from hotlora.families import UnservedModel

            kind = type(loaded).__name__
            if kind == "QwenImageEditPipeline":
                raise UnservedModel("edit on the original Qwen-Image-Edit (QwenImageEditPipeline) is not served: hotlora "
                                    "serves Qwen-Image edits through QwenImageEditPlusPipeline (Qwen-Image-Edit-2509 "
                                    "or 2511), and the original checkpoint's own pipeline uses another prompt template "
                                    "and reference size")
            if getattr(loaded, "processor", None) is None:
                raise UnservedModel(f"edit needs a Qwen-Image-Edit checkpoint (model_index.json naming "
                                    f"QwenImageEditPlusPipeline, e.g. Qwen-Image-Edit-2509): this model ({kind}) has no "
                                    f"processor for its text encoder to see the reference images, and its transformer "
                                    f"is not trained to edit")
        return super().task_pipeline(task, loaded, share)

    def call_arguments(self, guidance_scale: float) -> dict[str, Any]:
        return {"true_cfg_scale": guidance_scale}

    def default_negative_prompt(self, guidance_scale: float) -> str | None:
        return " " if guidance_scale > 1 else None

    def warmup_guidance_scales(self, default: float) -> list[float]:
        """True CFG keeps the batch shape, but only a guided run makes the negative pass (its own,
        unmasked text length): both warmed so either is compiled whatever the default."""
        return [default, *([1.0] if default > 1 else [4.0])]

    def warmup_prompts(self, pipeline=None) -> tuple:
        """Two lengths alone (no mask) and an unequal pair in one batch (a mixed batch: the
        mask); with every dimension dynamic (``compile_dynamic``) no later length compiles."""
        short, long = "warm-up", WARMUP_WORDS
        return (short, long, (short, long))

    def encode_prompts(self, pipeline, prompts: Mapping[str, list], cfg: bool) -> dict:
        """``encode_prompt`` on the group, with masks made explicit (the pipeline drops an all-ones
        mask to None); the negative prompts too when given (true CFG is decided by the call's
        ``true_cfg_scale``: a pipeline not guiding ignores them)."""
        import torch

        def encoded(texts):
            embeds, mask = pipeline.encode_prompt(prompt=list(texts), device=pipeline.device, num_images_per_prompt=1)
            if mask is None:
                mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            return embeds, mask

        out = dict(zip(("prompt_embeds", "prompt_embeds_mask"), encoded(prompts["prompt"])))
        negative = prompts.get("negative_prompt")
        if negative and any(negative):
            out.update(zip(("negative_prompt_embeds", "negative_prompt_embeds_mask"), encoded(negative)))
        return out

    def join_encoded(self, rows: Sequence[Mapping[str, Any]]) -> dict:
        """Rows of groups encoded apart, padded to the longest as the pipeline pads one batch
        (zeros, mask 0); an all-ones mask becomes None, as ``encode_prompt`` makes it."""
        import torch

        out = {}
        for embeds_name in [name for name in rows[0] if name.endswith("_embeds")]:
            mask_name = embeds_name + "_mask"
            longest = max(row[embeds_name].shape[1] for row in rows)
            embeds, masks = [], []
            for row in rows:
                e, m = row[embeds_name], row[mask_name]
                pad = longest - e.shape[1]
                embeds.append(torch.cat([e, e.new_zeros(e.shape[0], pad, e.shape[2])], dim=1))
                masks.append(torch.cat([m, m.new_zeros(m.shape[0], pad)], dim=1))
            mask = torch.cat(masks)
            out[embeds_name], out[mask_name] = torch.cat(embeds), (None if bool(mask.all()) else mask)
        return out

    def plan_tokens(self, configs: Mapping[str, dict], latent_pixels: int) -> tuple[int, int]:
        denoiser = configs["transformer"]
        patch = denoiser.get("patch_size", 2)
        return (latent_pixels // (patch * patch) + TEXT_TOKENS,
                denoiser["num_attention_heads"] * denoiser["attention_head_dim"])

    def build_tiny(self, seed: int = 0):
        return self._build_tiny(seed, edit=False)

    def build_tiny_edit(self, seed: int = 0):
        """A tiny Qwen-Image-Edit-2509: the text-to-image model's components (the same seeded weights)
        as a QwenImageEditPlusPipeline, with the processor its checkpoints add (``qwen_vl_processor``:
        the vision tower sees at most 56 x 56 pixels of each reference)."""
        return self._build_tiny(seed, edit=True)

    def _build_tiny(self, seed: int, edit: bool):
        import torch
        from diffusers import (
            AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel,
        )
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        from hotlora.families._tiny import qwen_tokenizer

        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
        )
        z_dim = 4
        vae = AutoencoderKLQwenImage(
            base_dim=z_dim * 2, z_dim=z_dim, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
            latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim,
        )
        tokenizer = qwen_tokenizer()
        vocab = len(tokenizer) + 3  # the vision start / end / pad ids the config names, unused by text
        config = Qwen2_5_VLConfig(
            text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                         "num_key_value_heads": 2, "vocab_size": vocab, "max_position_embeddings": 2048,
                         "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                         "rope_theta": 1000000.0, "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
                         "pad_token_id": tokenizer.pad_token_id},
            vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                           "out_hidden_size": 16},
            hidden_size=16, vocab_size=vocab, vision_start_token_id=vocab - 3, vision_end_token_id=vocab - 2,
            vision_token_id=vocab - 1, image_token_id=vocab - 1, video_token_id=vocab - 1, bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
        text_encoder = Qwen2_5_VLForConditionalGeneration(config)
        components = dict(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                          tokenizer=tokenizer, transformer=transformer)
        if not edit:
            return QwenImagePipeline(**components)
        from diffusers import QwenImageEditPlusPipeline

        from hotlora.families._tiny import qwen_vl_processor

        tokenizer = qwen_tokenizer(vision=True)  # the same ids, plus the vision tokens the config numbers
        return QwenImageEditPlusPipeline(**{**components, "tokenizer": tokenizer},
                                         processor=qwen_vl_processor(tokenizer, max_pixels=56 * 56))

    def trainer_lora(self, path: Path, linears, sd, rank: int, seed: int) -> Path:
        """musubi-tuner's layout (``networks/lora_qwen_image.py``): kohya names over the
        ``transformer_blocks`` (``img_mod`` / ``txt_mod`` excluded by default), alpha 1.5 x rank."""
        from hotlora.families._tiny import save_kohya_layout

        return save_kohya_layout(path, sd, alpha=rank * 1.5, keep=musubi_targets)

    def write_trainer_samples(self, pipeline, linears, out: Path, rank: int, attention_only) -> dict:
        from hotlora.families._tiny import musubi_and_comfy_samples

        return musubi_and_comfy_samples(linears, out, rank, attention_only, keep=musubi_targets)


def musubi_targets(module: str) -> bool:
    """The Linears musubi-tuner trains in Qwen-Image: QwenImageTransformerBlock's, less ``.*(_mod_).*``."""
    return module.startswith("transformer_blocks.") and "_mod." not in module
