"""Test helpers: adapters written the way real tools write them, and the plain diffusers reference.

The tiny models and their sample adapters live in ``hotlora.tiny`` (the serve path uses them
too), the trainers' file layouts in ``hotlora.trainer_layouts`` (the full-size builder uses them);
they are re-exported here so tests import one module. Nothing under ``src/hotlora`` imports this
module (tests/unit/test_imports.py checks it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from hotlora.families.flux import Flux, kohya_lora as kohya_flux_lora, xlabs_lora as xlabs_flux_lora
from hotlora.families.sdxl import StableDiffusionXL, save_kohya_lora as save_kohya_sdxl_lora
from hotlora.tiny import (
    TINY_SIZE, build_tiny_pipeline, denoiser_linears, random_lora, save_diffusers_lora, save_peft_lora,
    save_tiny_model, write_sample_adapters,
)
from hotlora.trainer_layouts import (
    ai_toolkit_flux_lora, save_kohya_flux_lora_file, sd_scripts_metadata, sd_scripts_sdxl_lora,
)

build_tiny_flux, build_tiny_sdxl = Flux().build_tiny, StableDiffusionXL().build_tiny

__all__ = [  # the tiny models' and the trainer layouts' helpers, re-exported, and this module's own
    "TINY_SIZE", "build_tiny_flux", "build_tiny_pipeline", "build_tiny_sdxl", "denoiser_linears", "kohya_flux_lora",
    "random_lora", "save_diffusers_lora", "save_kohya_sdxl_lora", "save_peft_lora", "save_tiny_model",
    "write_sample_adapters", "xlabs_flux_lora", "sd_scripts_sdxl_lora", "sd_scripts_metadata",
    "save_kohya_flux_lora_file", "ai_toolkit_flux_lora", "plain_diffusers_reference", "random_conv_lora",
    "controlled_lora", "declare_defaults",
]


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


def plain_diffusers_reference(model_dir, adapters, *, prompt: str | list[str], num_images: int, num_inference_steps: int,
                              guidance_scale: float, height: int, width: int, seed: int, output_type="latent",
                              embeddings=(), prepare=None, pipeline_class: str | None = None,
                              task_arguments: Mapping | None = None, num_frames: int | None = None,
                              attribute: str | None = None):
    """What a fresh, plain diffusers pipeline gives: ``load_lora_weights`` per adapter, then
    ``set_adapters`` with the scales, one batch, image i seeded ``seed + i``. The correctness
    contract compares the warm engine against exactly this. ``prompt`` a list: one image per prompt
    (``num_images`` of them), for a pipeline that cannot make several of one prompt (Wan2.1-I2V).

    ``embeddings``: (file tensors keyed clip_l / clip_g / t5, token names) pairs, each loaded
    with ``load_textual_inversion`` into the text encoder its key names, in order, as the
    advanced training scripts' model cards show. ``prepare(pipeline)``: called once before any
    adapter is loaded (e.g. torchao's ``quantize_`` on the denoiser). ``pipeline_class``: a
    diffusers pipeline class name to load the model as (a task's variant: FluxImg2ImgPipeline),
    called with ``task_arguments`` too (image, mask_image, strength; any other of its arguments the
    engine passes, e.g. Wan 2.2's ``guidance_scale_2``). A video family's pipeline is
    asked for ``num_frames`` (default: the model's ``hotlora.json``, else the family's), its
    samples through the family's output kind (``num_videos_per_prompt``, ``.frames``). An adapter
    source may be a (high-noise, low-noise) pair of files for a two-expert Wan 2.2 model. ``attribute``:
    another of the output's (LTX-2's ``audio``) than the output kind's."""
    import diffusers

    from hotlora.engine.results import output_kind
    from hotlora.families import family_of_model_index
    from hotlora.settings import read_model_defaults

    loader = getattr(diffusers, pipeline_class or "DiffusionPipeline")
    pipeline = loader.from_pretrained(str(model_dir), local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    if prepare is not None:
        prepare(pipeline)
    _load_adapters(pipeline, adapters)
    family = family_of_model_index(model_dir)  # the model's, whatever variant pipeline it was loaded as
    targets = dict(family.embedding_keys)
    for tensors, tokens in embeddings:
        for key, vectors in tensors.items():
            encoder = targets[key]
            pipeline.load_textual_inversion(vectors, token=list(tokens), text_encoder=getattr(pipeline, encoder),
                                            tokenizer=getattr(pipeline, family.tokenizer_of[encoder]))
    generators = [torch.Generator().manual_seed(seed + i) for i in range(num_images)]
    negative = family.default_negative_prompt(guidance_scale)
    if family.video and num_frames is None:
        num_frames = {**family.defaults, **read_model_defaults(str(model_dir))}["num_frames"]
    kind = output_kind(family)
    made = pipeline(prompt=prompt, **{kind.per_prompt: 1 if isinstance(prompt, list) else num_images}, generator=generators,
                    num_inference_steps=num_inference_steps, height=height, width=width, output_type=output_type,
                    **({} if negative is None else {"negative_prompt": negative}),
                    **({} if num_frames is None else {"num_frames": num_frames}),
                    **family.call_arguments(guidance_scale), **(task_arguments or {}))
    return getattr(made, attribute or kind.attribute)


def _load_adapters(pipeline, adapters) -> None:
    """``load_lora_weights`` per slot's adapter, then one ``set_adapters`` with the scales."""
    names, weights = [], []
    for slot, (source, scale) in adapters.items():
        if source is None:
            continue
        # (high, low): a two-expert model's LoRA as diffusers loads it, the low-noise expert's file
        # with ``load_into_transformer_2=True`` (either may be None: that expert without this adapter).
        for part, second in ((source[0], False), (source[1], True)) if isinstance(source, tuple) else ((source, False),):
            if part is not None:
                part = dict(part) if isinstance(part, Mapping) else str(part)
                pipeline.load_lora_weights(part, adapter_name=f"ref_{slot}",
                                           **({"load_into_transformer_2": True} if second else {}))
        names.append(f"ref_{slot}")
        weights.append(scale)
    if names:
        pipeline.set_adapters(names, weights)


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


def declare_defaults(source: Path, out: Path, **declared) -> Path:
    """A copy of the safetensors adapter ``source`` (a file, or a folder's weights file) whose header
    also declares inference defaults (``hotlora.<name>`` keys, ``adapters.defaults``), the rest of
    its metadata kept; ``declared``: name -> value (written as strings, as safetensors stores them)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    source = Path(source)
    if source.is_dir():
        source = next(p for p in sorted(source.glob("*.safetensors")))
    with safe_open(str(source), framework="pt") as f:
        metadata = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    metadata.update({f"hotlora.{name}": str(value) for name, value in declared.items()})
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=metadata)
    return out
