"""What the generic family's claim of Krea 2 (``Krea2Pipeline``) declares beyond diffusers' facts:
its tiny offline model, how its trainers' files are told from a PEFT save, and its distilled
checkpoint's defaults. The claim itself is in ``families.generic.GENERIC``.

Read from ``Krea2Pipeline``: one single-stream transformer (``Krea2Transformer2DModel``, which declares
its repeated block) over the latents in 2x2 patches and a Qwen3-VL's hidden states from several
layers (fused by the transformer's own text blocks); every prompt padded to a fixed length
(``max_sequence_length``, 512), so the text length never reaches the compiled blocks as a new
shape. Guidance is a second forward pass on the negative prompt ("" by default) whenever
``guidance_scale > 0``, not > 1 as most pipelines. ``is_distilled`` (the few-step TDM checkpoint)
fixes the schedule's shift; that checkpoint runs 8 steps without guidance.

LoRA files: diffusers' converter (``_convert_non_diffusers_krea2_lora_to_diffusers``) reads the
original model's module names (``blocks.N.attn.wq``, ``txtfusion.refiner_blocks.N.mlp.up``, ``first``,
...) under ``diffusion_model.`` (Krea's reference trainer, ComfyUI) and under ``base_model.model.``
(ai-toolkit), lora_A / lora_B without alphas; hotlora hands both to it (the writers of those
layouts, for the tests: ``hotlora.trainer_layouts.krea2_trainer_lora``).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from hotlora.families.base import PEFT_PREFIX

# The original model's top-level modules (``hotlora.trainer_layouts.krea2_original_name``): keys
# under PEFT's prefix naming these are ai-toolkit's, which diffusers' converter reads.
ORIGINAL_TOP_LEVEL = ("blocks", "txtfusion", "first", "last", "tmlp", "tproj", "txtmlp")

# The text fusion's layerwise blocks attend across the tapped layers token by token: their Linears
# see (batch x prompt tokens, layers, width), each sample's tokens one run (mixed batches bind them so).
PACKED_LINEARS = ("text_fusion.layerwise_blocks.",)

# Krea2Pipeline's docstring: "For the few-step distilled (TDM) checkpoint use num_inference_steps=8,
# guidance_scale=0.0".
DISTILLED_DEFAULTS = {"num_inference_steps": 8, "guidance_scale": 0.0}


def ai_toolkit_names(keys: Iterable[str]) -> bool:
    """Whether the keys under PEFT's prefix name the original model's modules (ai-toolkit's file,
    which diffusers' converter reads), not diffusers' (a PEFT save)."""
    under = [k.removeprefix(PEFT_PREFIX) for k in keys if k.startswith(PEFT_PREFIX)]
    return bool(under) and all(k.split(".", 1)[0] in ORIGINAL_TOP_LEVEL for k in under)


def ai_toolkit_lora(sd: Mapping[str, Any]) -> dict:
    from hotlora.trainer_layouts import krea2_trainer_lora

    return krea2_trainer_lora(sd, PEFT_PREFIX)


def comfy_lora(sd: Mapping[str, Any]) -> dict:
    from hotlora.trainer_layouts import krea2_trainer_lora

    return krea2_trainer_lora(sd, "diffusion_model.")


# The sample adapters of the tiny model in its trainers' layouts (the first is the contract test's).
TRAINER_LAYOUTS = {"style-ai-toolkit": ai_toolkit_lora, "style-comfy": comfy_lora}


def packed_segments(args: tuple, kwargs: Mapping[str, Any]) -> dict[str, list[int]]:
    """Each sample's prompt tokens, from ``Krea2Transformer2DModel.forward``'s ``encoder_hidden_states``
    ([batch, tokens, layers, width])."""
    states = kwargs["encoder_hidden_states"] if "encoder_hidden_states" in kwargs else args[1]
    return {PACKED_LINEARS[0]: [states.shape[1]] * states.shape[0]}


def checkpoint_defaults(pipeline) -> dict[str, Any]:
    return dict(DISTILLED_DEFAULTS) if (getattr(pipeline, "config", None) or {}).get("is_distilled") else {}


def tiny_krea2(seed: int = 0, distilled: bool = False):
    """diffusers' classes at small widths (its own tests' shapes), the Qwen byte-level tokenizer
    built in memory, the text encoder's three hidden states (embeddings and both layers) tapped.
    The zero-started norms and modulation tables drawn (``_tiny.draw_zero_parameters``)."""
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline, Krea2Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLModel

    from hotlora.families._tiny import draw_zero_parameters, qwen_tokenizer

    torch.manual_seed(seed)
    transformer = Krea2Transformer2DModel(
        in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=32, timestep_embed_dim=8, text_hidden_dim=16, num_text_layers=3, text_num_attention_heads=2,
        text_num_key_value_heads=1, text_intermediate_size=16, num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
        axes_dims_rope=(4, 2, 2), rope_theta=1000.0)
    draw_zero_parameters(transformer)
    z_dim = 4
    vae = AutoencoderKLQwenImage(base_dim=z_dim * 6, z_dim=z_dim, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=6400)
    tokenizer = qwen_tokenizer()
    config = Qwen3VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "head_dim": 8, "vocab_size": len(tokenizer)},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        vocab_size=len(tokenizer))
    return Krea2Pipeline(transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=Qwen3VLModel(config).eval(),
                         tokenizer=tokenizer, text_encoder_select_layers=(0, 1, 2), is_distilled=distilled)
