"""Adapter files laid out as the trainers people use write them: kohya sd-scripts' SDXL keys and
its ``ss_*`` header, its Flux files, ostris ai-toolkit's Flux files. No library writes these layouts
(only readers exist), so these writers are ours; the full-size SDXL builder (``hotlora.fullsize``)
and the tests (through ``hotlora.testing``) write their adapters with them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch


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


# sd-scripts' ss_base_model_version -> the network module and modelspec architecture it writes.
SD_SCRIPTS_NETWORKS = {"flux1": ("networks.lora_flux", "flux-1-dev/lora"),
                       "sd_v1": ("networks.lora", "stable-diffusion-v1/lora"),
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
