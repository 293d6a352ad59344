"""Test helpers: adapters written the way real tools write them, and the plain diffusers reference.

The tiny models and their sample adapters live in ``hotlora.tiny`` (the serve path uses them
too); they are re-exported here so tests import one module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch

from hotlora.families.flux import Flux, kohya_lora as kohya_flux_lora, xlabs_lora as xlabs_flux_lora
from hotlora.families.sdxl import StableDiffusionXL, save_kohya_lora as save_kohya_sdxl_lora
from hotlora.tiny import (
    TINY_SIZE, build_tiny_pipeline, denoiser_linears, random_lora, save_diffusers_lora, save_peft_lora,
    save_tiny_model, write_sample_adapters,
)

build_tiny_flux, build_tiny_sdxl = Flux().build_tiny, StableDiffusionXL().build_tiny

__all__ = [  # the tiny models' helpers, re-exported, and this module's own
    "TINY_SIZE", "build_tiny_flux", "build_tiny_pipeline", "build_tiny_sdxl", "denoiser_linears", "kohya_flux_lora",
    "random_lora", "save_diffusers_lora", "save_kohya_sdxl_lora", "save_peft_lora", "save_tiny_model",
    "write_sample_adapters", "xlabs_flux_lora", "sd_scripts_sdxl_lora", "sd_scripts_metadata",
    "save_kohya_flux_lora_file", "ai_toolkit_flux_lora", "plain_diffusers_reference", "random_conv_lora",
    "controlled_lora",
]


def sd_scripts_sdxl_lora(unet_sd: Mapping[str, torch.Tensor], layers_per_block: int, alpha: float,
                         text_encoders: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
                         conv_alpha: float | None = None, up_blocks_with_attention=()) -> dict[str, torch.Tensor]:
    """kohya sd-scripts' SDXL layout (``sdxl_train_network.py``): U-Net modules under their SGM
    (Stability's original) block numbers, ``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``;
    text encoders as ``lora_te1_*`` / ``lora_te2_*``; ``lora_down`` / ``lora_up`` and a scalar ``.alpha``
    per module. ``unet_sd`` and ``text_encoders`` ({"te1": sd, "te2": sd}) are in PEFT key form.

    With ``conv_dim`` (LoCon, "LoRA-C3Lier") sd-scripts also wraps the ResBlocks, Downsamples and
    Upsamples: ``..._0_in_layers_2`` (conv1), ``out_layers_3`` (conv2), ``skip_connection``
    (conv_shortcut), ``emb_layers_1`` (time_emb_proj), ``..._0_op`` (a downsampler's conv) and
    ``..._2_conv`` (an upsampler's, index 1 in an up block without attention:
    ``up_blocks_with_attention`` says which have them). A conv's ``lora_down`` is a conv with the
    layer's kernel, ``[r, in, kh, kw]``, and its ``lora_up`` is 1x1, ``[out, r, 1, 1]``; 3x3 convs
    take ``conv_alpha`` (``conv_dim``'s alpha), 1x1 convs and Linears ``alpha``."""
    resnet_parts = {"conv1": "in_layers_2", "conv2": "out_layers_3", "conv_shortcut": "skip_connection",
                    "time_emb_proj": "emb_layers_1"}
    per_block = layers_per_block + 1

    def inner(kind: str, rest: list[str]) -> list[str]:
        return ["1", *rest] if kind == "attentions" else ["0", resnet_parts[rest[0]], *rest[1:]]

    def sgm_name(module: str) -> str:
        parts = module.split(".")
        if parts[0] == "mid_block" and parts[1] in ("attentions", "resnets"):
            index = "1" if parts[1] == "attentions" else str(2 * int(parts[2]))  # resnet, attention, resnet
            return "_".join(["middle_block", index] + inner(parts[1], parts[3:])[1:])
        block, kind, layer = int(parts[1]), parts[2], int(parts[3])
        if parts[0] == "down_blocks" and kind in ("attentions", "resnets"):
            return "_".join(["input_blocks", str(1 + block * per_block + layer)] + inner(kind, parts[4:]))
        if parts[0] == "down_blocks" and kind == "downsamplers":
            return f"input_blocks_{(block + 1) * per_block}_0_op"
        if parts[0] == "up_blocks" and kind in ("attentions", "resnets"):
            return "_".join(["output_blocks", str(block * per_block + layer)] + inner(kind, parts[4:]))
        if parts[0] == "up_blocks" and kind == "upsamplers":
            index = 2 if block in up_blocks_with_attention else 1
            return f"output_blocks_{block * per_block + layers_per_block}_{index}_conv"
        raise ValueError(f"{module}: not a module sd-scripts' LoRA network wraps")

    out = {}
    groups = [("lora_unet_", unet_sd, sgm_name)]
    for te, sd in (text_encoders or {}).items():
        groups.append((f"lora_{te}_", sd, lambda m: m.replace(".", "_")))
    for prefix, sd, rename in groups:
        for module in sorted({k.split(".lora_")[0] for k in sd}):
            name = prefix + rename(module)
            down = sd[f"{module}.lora_A.weight"]
            out[f"{name}.lora_down.weight"] = down.contiguous()
            out[f"{name}.lora_up.weight"] = sd[f"{module}.lora_B.weight"].contiguous()
            spatial = down.ndim == 4 and tuple(down.shape[2:]) != (1, 1)
            out[f"{name}.alpha"] = torch.tensor(float(conv_alpha if spatial and conv_alpha is not None else alpha))
    return out


def random_conv_lora(convs: Mapping[str, tuple[int, int, int, int]], rank: int, seed: int,
                     strength: float = 0.5) -> dict[str, torch.Tensor]:
    """A random conv LoRA in PEFT key form: ``lora_A`` [r, in, kh, kw] (the layer's kernel) and
    ``lora_B`` [out, r, 1, 1] per Conv2d (``convs``: name -> weight shape)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (out_c, in_c, kh, kw) in convs.items():
        fan_in = in_c * kh * kw
        sd[f"{name}.lora_A.weight"] = torch.randn(rank, in_c, kh, kw, generator=g) / fan_in**0.5
        sd[f"{name}.lora_B.weight"] = torch.randn(out_c, rank, 1, 1, generator=g) * strength / rank**0.5
    return sd


# sd-scripts' ss_base_model_version -> the network module and modelspec architecture it writes.
SD_SCRIPTS_NETWORKS = {"flux1": ("networks.lora_flux", "flux-1-dev/lora"),
                       "sdxl_base_v1-0": ("networks.lora", "stable-diffusion-xl-v1-base/lora")}


def sd_scripts_metadata(base_model_version: str, rank: int, alpha: float | None,
                        network_args: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``ss_*`` / ``modelspec.*`` header fields sd-scripts writes (all strings, as safetensors wants);
    ``network_args`` as ``--network_args`` saves them (``{"conv_dim": "8", "conv_alpha": "4"}`` for LoCon)."""
    network_module, architecture = SD_SCRIPTS_NETWORKS.get(base_model_version, SD_SCRIPTS_NETWORKS["sdxl_base_v1-0"])
    meta = {
        "ss_network_module": network_module,
        "ss_network_dim": str(rank), "ss_base_model_version": base_model_version, "ss_output_name": "corpus",
        "ss_training_comment": "None", "sshs_model_hash": "0" * 64, "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": architecture,
    }
    if alpha is not None:
        meta["ss_network_alpha"] = str(float(alpha))
    if network_args:
        meta["ss_network_args"] = json.dumps(dict(network_args))
    return meta


def save_kohya_flux_lora_file(path: Path, sd: Mapping[str, torch.Tensor], rank: int, alpha: float | None,
                              dtype: torch.dtype | None = None) -> Path:
    """A kohya-layout Flux LoRA (from :func:`kohya_flux_lora`) as sd-scripts' ``flux_train_network.py``
    saves it: its header metadata, and optionally no ``.alpha`` keys (files converted by older tools
    lack them; diffusers then takes alpha = rank)."""
    from safetensors.torch import save_file

    kept = {k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in sd.items()
            if alpha is not None or not k.endswith(".alpha")}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(kept, str(path), metadata=sd_scripts_metadata("flux1", rank, alpha))
    return path


def ai_toolkit_flux_lora(sd: Mapping[str, torch.Tensor], name: str = "corpus") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """ostris ai-toolkit's Flux LoRA: diffusers module names under ``transformer.``, ``lora_A`` /
    ``lora_B``, no alphas, saved in float16 (its default ``save_dtype``); the header metadata as
    its ``get_meta_for_safetensors`` writes it (the job config and software info as JSON strings)."""
    tensors = {f"transformer.{k}": v.to(torch.float16).contiguous() for k, v in sd.items()}
    meta = {
        "name": name, "version": "1.0",
        "training_info": json.dumps({"step": 1000, "epoch": 2}),
        "software": json.dumps({"name": "ai-toolkit", "repo": "https://github.com/ostris/ai-toolkit", "version": "0.1.0"}),
        "sshs_model_hash": "0" * 64, "sshs_legacy_hash": "0" * 8, "format": "pt",
    }
    return tensors, meta


def text_encoder_linears(pipeline, encoder: str) -> dict[str, tuple[int, int]]:
    """The attention and MLP Linear layers of a text encoder, the ones diffusers' training scripts
    put LoRA on (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, ``fc1``, ``fc2``)."""
    module = getattr(pipeline, encoder)
    return {name: (m.in_features, m.out_features) for name, m in module.named_modules()
            if isinstance(m, torch.nn.Linear) and name.endswith(("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"))}


def random_embeddings(pipeline, family: str, tokens: int, seed: int) -> dict[str, torch.Tensor]:
    """Pivotal-tuning vectors keyed as diffusers' advanced scripts save them (the family's first
    embedding key per text encoder: ``clip_l`` and ``clip_g`` on SDXL, ``clip_l`` and ``t5`` on
    Flux), [tokens, the encoder's width]."""
    from hotlora.families import family_named

    g = torch.Generator().manual_seed(seed)
    first: dict[str, str] = {}
    for key, encoder in family_named(family).embedding_keys:
        first.setdefault(encoder, key)
    keys = [(key, encoder) for encoder, key in first.items()]
    return {key: torch.randn(tokens, getattr(pipeline, te).get_input_embeddings().embedding_dim, generator=g)
            for key, te in keys}


def save_pivotal_lora(path: Path, family: str, denoiser_sd: Mapping[str, torch.Tensor],
                      text_sds: Mapping[str, Mapping[str, torch.Tensor]], alpha: float,
                      embeddings: Mapping[str, torch.Tensor] | None = None) -> Path:
    """What diffusers' advanced DreamBooth LoRA scripts leave in their output folder: one
    ``save_lora_weights`` call with the denoiser's and each text encoder's layers and their
    ``LoraConfig`` metadata (``pytorch_lora_weights.safetensors``), and the pivotal-tuning
    vectors as ``<folder name>_emb.safetensors``. ``text_sds``: text encoder -> PEFT-form layers."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    from hotlora.families import family_named

    fam = family_named(family)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {}
    for part, sd in {fam.denoiser: denoiser_sd, **text_sds}.items():
        if sd:
            kwargs[f"{part}_lora_layers"] = dict(sd)
            part_rank = next(v.shape[0] for k, v in sd.items() if ".lora_A." in k)  # each part its own rank
            kwargs[f"{part}_lora_adapter_metadata"] = LoraConfig(
                r=part_rank, lora_alpha=alpha, target_modules=sorted({k.split(".lora_")[0] for k in sd})).to_dict()
    fam.pipeline_type.save_lora_weights(str(path), **kwargs)
    if embeddings:
        save_file({k: v.contiguous() for k, v in embeddings.items()}, str(path / f"{path.name}_emb.safetensors"))
    return path


# ----------------------------------------------------------------------------- the reference


def plain_diffusers_reference(model_dir, adapters, *, prompt: str, num_images: int, num_inference_steps: int,
                              guidance_scale: float, height: int, width: int, seed: int, output_type="latent",
                              embeddings=(), prepare=None):
    """What a fresh, plain diffusers pipeline gives: ``load_lora_weights`` per adapter, then
    ``set_adapters`` with the scales, one batch, image i seeded ``seed + i``. The correctness
    contract compares the warm engine against exactly this.

    ``embeddings``: (file tensors keyed clip_l / clip_g / t5, token names) pairs, each loaded
    with ``load_textual_inversion`` into the text encoder its key names, in order, as the
    advanced training scripts' model cards show. ``prepare(pipeline)``: called once before any
    adapter is loaded (e.g. torchao's ``quantize_`` on the denoiser)."""
    from diffusers import DiffusionPipeline

    from hotlora.families import family_of_pipeline

    pipeline = DiffusionPipeline.from_pretrained(str(model_dir), local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    if prepare is not None:
        prepare(pipeline)
    names, weights = [], []
    for slot, (source, scale) in adapters.items():
        if source is None:
            continue
        source = dict(source) if isinstance(source, Mapping) else str(source)
        pipeline.load_lora_weights(source, adapter_name=f"ref_{slot}")
        names.append(f"ref_{slot}")
        weights.append(scale)
    if names:
        pipeline.set_adapters(names, weights)
    family = family_of_pipeline(pipeline)
    targets = dict(family.embedding_keys)
    for tensors, tokens in embeddings:
        for key, vectors in tensors.items():
            encoder = targets[key]
            pipeline.load_textual_inversion(vectors, token=list(tokens), text_encoder=getattr(pipeline, encoder),
                                            tokenizer=getattr(pipeline, family.tokenizer_of[encoder]))
    generators = [torch.Generator().manual_seed(seed + i) for i in range(num_images)]
    return pipeline(prompt=prompt, num_images_per_prompt=num_images, generator=generators,
                    num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, height=height,
                    width=width, output_type=output_type).images


def controlled_lora(denoiser: torch.nn.Module, magnitude: float, rank: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """A LoRA on every Linear of ``denoiser`` (PEFT key form, for ``save_diffusers_lora`` with
    ``alpha = rank``) whose delta's RMS is ``magnitude`` times each layer's weight RMS: how strong
    an adapter is, as the precision contract measures it (a trained identity LoRA is ~0.1-1%)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, module in denoiser.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = module.weight.detach().float()
        down = torch.randn(rank, weight.shape[1], generator=g)
        up = torch.randn(weight.shape[0], rank, generator=g)
        factor = magnitude * weight.pow(2).mean().sqrt() / (up @ down).pow(2).mean().sqrt()
        sd[f"{name}.lora_A.weight"] = down
        sd[f"{name}.lora_B.weight"] = up * factor
    return sd
