"""Adapter files laid out as the trainers people use write them: kohya sd-scripts' SDXL keys and
its ``ss_*`` header, its Flux files, ostris ai-toolkit's Flux files. No library writes these layouts
(only readers exist), so these writers are ours; the full-size SDXL builder (``hotlora.fullsize``)
and the tests (through ``hotlora.testing``) write their adapters with them."""

from __future__ import annotations

import json
import re
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


# --------------------------------------------------------------------------------------------- Wan
# Wan's trainers name its modules as the original Wan code does (Wan-Video/Wan2.1 ``wan/modules/
# model.py``: ``WanAttentionBlock``'s ``self_attn.q`` / ``cross_attn.k`` / ``ffn.0``), not as
# diffusers' WanTransformer3DModel does (``attn1.to_q`` / ``attn2.to_k`` / ``ffn.net.0.proj``).
WAN_ORIGINAL_PARTS = {"attn1": "self_attn", "attn2": "cross_attn", "to_q": "q", "to_k": "k", "to_v": "v",
                      "add_k_proj": "k_img", "add_v_proj": "v_img"}


def wan_original_name(module: str) -> str:
    """A diffusers WanTransformer3DModel block Linear (``blocks.0.attn1.to_out.0``) by its original
    Wan name (``blocks.0.self_attn.o``); ``ffn.net.0.proj`` / ``ffn.net.2`` are ``ffn.0`` / ``ffn.2``
    (the original FFN is ``nn.Sequential(Linear, GELU, Linear)``). Only the blocks' attention and
    FFN Linears, what the trainers below target."""
    parts = module.split(".")
    if parts[0] != "blocks" or len(parts) < 4:
        raise ValueError(f"{module}: not a Wan block Linear the trainers wrap")
    rest = ".".join(parts[2:])
    ffn = {"ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}
    if rest in ffn:
        return f"blocks.{parts[1]}.{ffn[rest]}"
    if parts[2] in ("attn1", "attn2") and rest.endswith("to_out.0"):
        return f"blocks.{parts[1]}.{WAN_ORIGINAL_PARTS[parts[2]]}.o"
    if parts[2] in ("attn1", "attn2") and len(parts) == 4 and parts[3] in WAN_ORIGINAL_PARTS:
        return f"blocks.{parts[1]}.{WAN_ORIGINAL_PARTS[parts[2]]}.{WAN_ORIGINAL_PARTS[parts[3]]}"
    raise ValueError(f"{module}: not a Wan block Linear the trainers wrap")


def wan_block_linear(module: str) -> bool:
    """Whether ``module`` (a diffusers name) is one of the Linears inside a ``WanAttentionBlock``."""
    try:
        wan_original_name(module)
    except ValueError:
        return False
    return True


def musubi_wan_lora(sd: Mapping[str, torch.Tensor], alpha: float | None, rank: int,
                    architecture: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """kohya musubi-tuner's Wan LoRA (read: ``src/musubi_tuner/networks/lora_wan.py``, which builds
    ``networks/lora.py``'s LoRANetwork over ``WanAttentionBlock`` with prefix ``lora_unet`` and the
    default exclude ``.*(patch_embedding|text_embedding|time_embedding|time_projection|norm|head).*``;
    ``lora.py`` names a module ``f"{pfx}.{original_name}".replace(".", "_")`` and saves
    ``lora_down`` / ``lora_up`` and an ``alpha`` buffer per module). So the Linears of the blocks, by
    their original Wan names: ``lora_unet_blocks_0_self_attn_q.lora_down.weight``, ``..._cross_attn_o``,
    ``..._ffn_0``. ``sd``: PEFT form, diffusers names (modules outside the blocks are not written).
    The header as ``hv_train_network.py`` / ``utils/sai_model_spec.py`` write it (``ss_network_module``,
    ``modelspec.architecture`` "wan2.1/lora"; ``architecture``: its ``ss_base_model_version``, musubi's
    name for the architecture, which the family passes); ``alpha`` None: a file without alphas (older
    converters' output: readers take alpha = rank). A Wan 2.2 A14B LoRA is shipped as two such files
    of the same keys, one per expert (``docs/wan.md``: each trained with ``--dit`` on that expert's
    checkpoint and its timestep range, 875-1000 high noise, 0-875 low noise, for T2V)."""
    out: dict[str, torch.Tensor] = {}
    for module in sorted({k.split(".lora_")[0] for k in sd}):
        if not wan_block_linear(module):
            continue
        name = "lora_unet_" + wan_original_name(module).replace(".", "_")
        out[f"{name}.lora_down.weight"] = sd[f"{module}.lora_A.weight"].contiguous()
        out[f"{name}.lora_up.weight"] = sd[f"{module}.lora_B.weight"].contiguous()
        if alpha is not None:
            out[f"{name}.alpha"] = torch.tensor(float(alpha))
    meta = {"ss_network_module": "networks.lora_wan", "ss_network_dim": str(rank),
            "ss_base_model_version": architecture, "modelspec.sai_model_spec": "1.0.0",
            "modelspec.architecture": "wan2.1/lora", "modelspec.implementation": "https://github.com/Wan-Video/Wan2.1",
            "ss_training_comment": "None"}
    if alpha is not None:
        meta["ss_network_alpha"] = str(float(alpha))
    return out, meta


def ai_toolkit_wan_lora(sd: Mapping[str, torch.Tensor], name: str = "corpus") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """ostris ai-toolkit's Wan LoRA (read: ``toolkit/models/wan21/wan21.py``:
    ``convert_lora_weights_before_save`` = ``wan_lora_convert.py: convert_to_original``, which maps
    diffusers' ``transformer.blocks.0.attn1.to_q`` to ComfyUI's ``diffusion_model.blocks.0.self_attn.q``);
    ``lora_A`` / ``lora_B`` kept, no alphas, float16 and its metadata as for Flux
    (:func:`ai_toolkit_flux_lora`). Wan 2.2 A14B: ``extensions_built_in/diffusion_models/wan22/
    wan22_14b_model.py`` splits the same layout into ``<name>_high_noise.safetensors`` and
    ``<name>_low_noise.safetensors``."""
    tensors, meta = ai_toolkit_flux_lora({}, name)
    for key, value in sd.items():
        module, part = key.split(".lora_")
        if wan_block_linear(module):
            tensors[f"diffusion_model.{wan_original_name(module)}.lora_{part}"] = value.to(torch.float16).contiguous()
    return tensors, meta


def lightx2v_wan_lora(sd: Mapping[str, torch.Tensor],
                      patches: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """ModelTC lightx2v's Wan LoRA (the step/CFG-distill LoRAs; read: ``tools/extract/lora_extractor.py``,
    which writes SVD factors of a weight difference as ``diffusion_model.<original name>.lora_up.weight``
    / ``.lora_down.weight`` with no alpha, and differences it does not factor (1-D tensors and any
    tensor under 1M values) whole: ``<name>.diff`` for a ``.weight``, ``.diff_b`` for a ``.bias``,
    ``.diff_m`` for a block's ``.modulation``; ``lightx2v/models/networks/wan/lora_adapter.py``
    adds each to the base weight unscaled). ``patches``: those whole differences by their full
    original key (``blocks.0.norm3.diff``, ``blocks.0.self_attn.q.diff_b``, ``blocks.0.diff_m``),
    written under the same prefix; no header metadata (the extractor's ``save_file`` writes none)."""
    out = {}
    for key, value in sd.items():
        module, part = key.split(".lora_")
        if wan_block_linear(module):
            kind = "down" if part.startswith("A") else "up"
            out[f"diffusion_model.{wan_original_name(module)}.lora_{kind}.weight"] = value.contiguous()
    for key, value in (patches or {}).items():
        out[f"diffusion_model.{key}"] = value.contiguous()
    return out


# ------------------------------------------------------------------------------------------ Krea 2
# Krea 2's trainers name its modules as the original model does (``blocks.0.attn.wq``,
# ``txtfusion.refiner_blocks.0.mlp.up``, ``first``); diffusers' converter
# (``_convert_non_diffusers_krea2_lora_to_diffusers``) maps them to Krea2Transformer2DModel's names.
# These are its maps read backwards: diffusers' name -> the original one.
KREA2_ATTENTION = {"to_q": "wq", "to_k": "wk", "to_v": "wv", "to_out.0": "wo", "to_gate": "gate"}
KREA2_FEED_FORWARD = {"ff.gate": "mlp.gate", "ff.up": "mlp.up", "ff.down": "mlp.down"}
KREA2_OUTSIDE_BLOCKS = {"img_in": "first", "final_layer.linear": "last.linear", "time_embed.linear_1": "tmlp.0",
                        "time_embed.linear_2": "tmlp.2", "time_mod_proj": "tproj.1", "txt_in.linear_1": "txtmlp.1",
                        "txt_in.linear_2": "txtmlp.3", "text_fusion.projector": "txtfusion.projector"}
_KREA2_BLOCK = re.compile(r"(transformer_blocks|text_fusion\.layerwise_blocks|text_fusion\.refiner_blocks)\.(\d+)\.(.+)")


def krea2_original_name(module: str) -> str:
    """A Krea2Transformer2DModel Linear (``transformer_blocks.0.attn.to_out.0``) by the original
    model's name (``blocks.0.attn.wo``)."""
    if module in KREA2_OUTSIDE_BLOCKS:
        return KREA2_OUTSIDE_BLOCKS[module]
    match = _KREA2_BLOCK.fullmatch(module)
    if match:
        blocks, index, rest = match.groups()
        blocks = "blocks" if blocks == "transformer_blocks" else blocks.replace("text_fusion.", "txtfusion.")
        if rest.startswith("attn.") and rest.removeprefix("attn.") in KREA2_ATTENTION:
            return f"{blocks}.{index}.attn.{KREA2_ATTENTION[rest.removeprefix('attn.')]}"
        if rest in KREA2_FEED_FORWARD:
            return f"{blocks}.{index}.{KREA2_FEED_FORWARD[rest]}"
    raise ValueError(f"{module}: no original Krea 2 name")


def krea2_trainer_lora(sd: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """A Krea 2 LoRA as its trainers write it (what diffusers' converter reads): the original names
    under ``prefix``, ``base_model.model.`` for ostris ai-toolkit, ``diffusion_model.`` for Krea's
    reference trainer and ComfyUI; ``lora_A`` / ``lora_B`` and no alpha (the converter refuses any
    other key). ``sd`` in PEFT key form over diffusers' names."""
    out = {}
    for key, value in sd.items():
        module, part = key.split(".lora_")
        out[f"{prefix}{krea2_original_name(module)}.lora_{part}"] = value.contiguous()
    return out
