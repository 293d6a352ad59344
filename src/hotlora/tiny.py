"""The built-in tiny models: fully offline Flux and SDXL pipelines and their sample adapters.

What ``make serve`` (``hotlora serve`` with no ``--model``) and ``hotlora tiny-model`` build. The
pipelines are real diffusers pipelines built from small configs with seeded random weights and
tokenizers made in memory, then saved with ``save_pretrained`` so the engine loads them through
``from_pretrained`` exactly as it would a hub id or a model directory. Sample adapters are
written in every layout the store understands. Tests use them through ``hotlora.testing``.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Iterable, Mapping

import torch

from hotlora.adapters.families import family_named
TINY_SIZE = {"flux": 32, "sdxl": 64}  # image side in pixels the tiny models are built for


def _clip_tokenizer():
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # Byte-level BPE with no merges: every byte is a token. End-of-text gets the highest id,
    # which is what CLIP's legacy pooling (argmax of input ids) expects.
    vocab = {}
    for suffix in ("", "</w>"):
        for char in bytes_to_unicode().values():
            vocab[char + suffix] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def _t5_tokenizer():
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + c, -2.0) for c in string.ascii_lowercase]
    pieces += [(c, -3.0) for c in string.ascii_lowercase + string.digits + string.punctuation]
    return T5TokenizerFast(vocab=pieces, model_max_length=512)


def _clip_config():
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        bos_token_id=512, eos_token_id=2, hidden_size=32, intermediate_size=37, layer_norm_eps=1e-5,
        num_attention_heads=4, num_hidden_layers=2, pad_token_id=513, vocab_size=600, hidden_act="gelu",
        projection_dim=32, max_position_embeddings=77,
    )


def build_tiny_flux(seed: int = 0):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
        guidance_embeds=True,
    )
    text_encoder = CLIPTextModel(_clip_config())
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
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder, tokenizer=_clip_tokenizer(),
        text_encoder_2=text_encoder_2, tokenizer_2=_t5_tokenizer(), transformer=transformer,
    )


def build_tiny_sdxl(seed: int = 0):
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=80,
        cross_attention_dim=64, norm_num_groups=1,
    )
    vae = AutoencoderKL(
        block_out_channels=[32, 64], in_channels=3, out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=4, sample_size=64, norm_num_groups=1,
    )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, steps_offset=1, beta_schedule="scaled_linear", timestep_spacing="leading"
    )
    return StableDiffusionXLPipeline(
        vae=vae, text_encoder=CLIPTextModel(_clip_config()), text_encoder_2=CLIPTextModelWithProjection(_clip_config()),
        tokenizer=_clip_tokenizer(), tokenizer_2=_clip_tokenizer(), unet=unet, scheduler=scheduler,
    )


BUILDERS = {"flux": build_tiny_flux, "sdxl": build_tiny_sdxl}


def build_tiny_pipeline(family: str, seed: int = 0):
    family_named(family)
    return BUILDERS[family](seed)


# ----------------------------------------------------------------------------- adapters


def denoiser_linears(pipeline) -> dict[str, tuple[int, int]]:
    """Every Linear layer of the pipeline's denoiser: the widest slot ceiling."""
    from hotlora.adapters.families import family_of_pipeline
    from hotlora.engine.writers.base import ceiling_modules

    return ceiling_modules(getattr(pipeline, family_of_pipeline(pipeline).denoiser), None)


def random_lora(
    linears: Mapping[str, tuple[int, int]], rank: int, seed: int, modules: Iterable[str] | None = None,
    strength: float = 0.5,
) -> dict[str, torch.Tensor]:
    """A random LoRA in PEFT key form (``module.lora_A.weight``), unprefixed.

    ``strength`` sizes the update so that it visibly moves the output of the tiny models.
    """
    g = torch.Generator().manual_seed(seed)
    chosen = list(modules) if modules is not None else list(linears)
    sd = {}
    for name in chosen:
        in_f, out_f = linears[name]
        sd[f"{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) / in_f**0.5
        sd[f"{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * strength / rank**0.5
    return sd


def save_diffusers_lora(path: Path, family: str, sd: Mapping[str, torch.Tensor], rank: int, alpha: float) -> Path:
    """diffusers layout, written as diffusers' training scripts write it: ``save_lora_weights`` with
    the ``LoraConfig`` as metadata (so alpha survives; ``base_model_name_or_path`` and other
    fields null, exactly what a user's file carries)."""
    from peft import LoraConfig

    from hotlora.adapters.families import pipeline_class

    fam = family_named(family)
    path.mkdir(parents=True, exist_ok=True)
    meta = LoraConfig(r=rank, lora_alpha=alpha, target_modules=sorted({k.split(".lora_")[0] for k in sd})).to_dict()
    pipeline_class(fam).save_lora_weights(
        str(path), **{f"{fam.denoiser}_lora_layers": dict(sd), f"{fam.denoiser}_lora_adapter_metadata": meta}
    )
    return path / "pytorch_lora_weights.safetensors"


def save_peft_lora(path: Path, sd: Mapping[str, torch.Tensor], rank: int, alpha: float, base_model: str | None = None) -> Path:
    """PEFT layout: ``adapter_model.safetensors`` with ``base_model.model.*`` keys + ``adapter_config.json``."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({f"base_model.model.{k}": v.contiguous() for k, v in sd.items()}, str(path / "adapter_model.safetensors"))
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=sorted({k.split(".lora_")[0] for k in sd}),
        base_model_name_or_path=base_model,
    )
    config.save_pretrained(str(path))
    return path


def save_kohya_sdxl_lora(path: Path, sd: Mapping[str, torch.Tensor], alpha: float) -> Path:
    """kohya (sd-scripts) layout for SDXL, written by diffusers' own ``convert_state_dict_to_kohya``."""
    from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya
    from safetensors.torch import save_file

    kohya = convert_state_dict_to_kohya({f"unet.{k}": v for k, v in sd.items()})
    kohya = {k: (torch.tensor(float(alpha)) if k.endswith(".alpha") else v.contiguous()) for k, v in kohya.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(kohya, str(path))
    return path


# The double-block layers of BFL's original Flux naming, as kohya and XLabs name them. No
# library writes these layouts (only readers exist), so these writers are ours.
_KOHYA_FLUX_DOUBLE = {
    "img_attn_proj": ["attn.to_out.0"],
    "img_attn_qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "img_mlp_0": ["ff.net.0.proj"],
    "img_mlp_2": ["ff.net.2"],
    "txt_attn_proj": ["attn.to_add_out"],
    "txt_attn_qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
}


def kohya_flux_lora(linears, num_double_blocks: int, rank: int, alpha: float, seed: int) -> dict[str, torch.Tensor]:
    """A random kohya-layout Flux LoRA over the double blocks (fused qkv with one shared down)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(num_double_blocks):
        for kohya_name, targets in _KOHYA_FLUX_DOUBLE.items():
            in_f = linears[f"transformer_blocks.{i}.{targets[0]}"][0]
            out_f = sum(linears[f"transformer_blocks.{i}.{t}"][1] for t in targets)
            key = f"lora_unet_double_blocks_{i}_{kohya_name}"
            sd[f"{key}.lora_down.weight"] = torch.randn(rank, in_f, generator=g) / in_f**0.5
            sd[f"{key}.lora_up.weight"] = torch.randn(out_f, rank, generator=g) * 0.5 / rank**0.5
            sd[f"{key}.alpha"] = torch.tensor(float(alpha))
    return sd


def xlabs_flux_lora(linears, num_double_blocks: int, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A random XLabs-layout Flux LoRA (``double_blocks.N.processor.{qkv,proj}_lora{1,2}``)."""
    g = torch.Generator().manual_seed(seed)
    parts = {
        "qkv_lora1": ["attn.to_q", "attn.to_k", "attn.to_v"],
        "proj_lora1": ["attn.to_out.0"],
        "qkv_lora2": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
        "proj_lora2": ["attn.to_add_out"],
    }
    sd = {}
    for i in range(num_double_blocks):
        for part, targets in parts.items():
            in_f = linears[f"transformer_blocks.{i}.{targets[0]}"][0]
            out_f = sum(linears[f"transformer_blocks.{i}.{t}"][1] for t in targets)
            key = f"double_blocks.{i}.processor.{part}"
            sd[f"{key}.down.weight"] = torch.randn(rank, in_f, generator=g) / in_f**0.5
            sd[f"{key}.up.weight"] = torch.randn(out_f, rank, generator=g) * 0.5 / rank**0.5
    return sd


# Files as the trainers people use write them: key layout, alphas and the safetensors header. The
# weights are random; what is mirrored is the layout a reader meets.


def write_sample_adapters(pipeline, family: str, out: Path, target_rank: int = 8) -> dict[str, Path]:
    """Sample adapters in each layout this family's users meet, at a few ranks."""
    from safetensors.torch import save_file

    linears = denoiser_linears(pipeline)
    out.mkdir(parents=True, exist_ok=True)
    samples: dict[str, Path] = {}
    low, high = max(1, target_rank // 4), target_rank
    samples["identity-diffusers"] = save_diffusers_lora(
        out / "identity-diffusers", family, random_lora(linears, low, seed=1), rank=low, alpha=low * 2
    )
    samples["style-diffusers"] = save_diffusers_lora(
        out / "style-diffusers", family, random_lora(linears, high, seed=2), rank=high, alpha=high / 2
    )
    attention_only = [n for n in linears if ".attn" in n or "attn1" in n or "attn2" in n]
    samples["identity-peft"] = save_peft_lora(
        out / "identity-peft", random_lora(linears, low, seed=3, modules=attention_only), rank=low, alpha=low,
        base_model=f"hotlora/tiny-{family}",
    )
    if family == "flux":
        blocks = len(pipeline.transformer.transformer_blocks)
        save_file(kohya_flux_lora(linears, blocks, rank=low, alpha=low / 2, seed=4), str(out / "style-kohya.safetensors"))
        save_file(xlabs_flux_lora(linears, blocks, rank=low, seed=5), str(out / "style-xlabs.safetensors"))
        samples["style-kohya"] = out / "style-kohya.safetensors"
        samples["style-xlabs"] = out / "style-xlabs.safetensors"
    else:
        samples["style-kohya"] = save_kohya_sdxl_lora(
            out / "style-kohya.safetensors", random_lora(linears, low, seed=4, modules=attention_only), alpha=low / 2
        )
    (out / "README.json").write_text(json.dumps({k: str(v.relative_to(out)) for k, v in samples.items()}, indent=2))
    # A catalog of the samples, so a server on the tiny model has named adapters to offer.
    scales = {"identity": 1.0, "style": 0.8}
    (out / "catalog.toml").write_text("".join(
        f'[adapters.{name}]\nref = "{path.relative_to(out)}"\nscale = {scales[name.split("-")[0]]}\n'
        for name, path in samples.items()
    ))
    return samples


def save_tiny_model(directory: Path, family: str, seed: int = 0, target_rank: int = 8) -> Path:
    """Build and save a tiny pipeline plus sample adapters under ``directory``; returns the model dir."""
    directory = Path(directory)
    pipeline = build_tiny_pipeline(family, seed)
    pipeline.save_pretrained(str(directory))
    side = TINY_SIZE[family]
    defaults = {"model_id": f"hotlora/tiny-{family}", "height": side, "width": side, "num_inference_steps": 4}
    (directory / "hotlora.json").write_text(json.dumps(defaults))
    write_sample_adapters(pipeline, family, directory / "adapters", target_rank=target_rank)
    return directory
