"""The built-in tiny models: a fully offline pipeline of every registered family, and sample adapters.

What ``make serve`` (``hotlora serve`` with no ``--model``) and ``hotlora tiny-model`` build. The
pipelines are real diffusers pipelines built from small configs with seeded random weights and
tokenizers made in memory, then saved with ``save_pretrained`` so the engine loads them through
``from_pretrained`` exactly as it would a hub id or a model directory. Sample adapters are
written in every layout the store understands. Tests use them through ``hotlora.testing``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Mapping

import torch

from hotlora.durable import TMP, publish_dir, sweep_orphans, temp_dir, write_atomic
from hotlora.families import REGISTERED, family_named, family_of_pipeline
from hotlora.families._tiny import random_lora

log = logging.getLogger(__name__)

TINY_SIZE = {family.name: family.tiny_size for family in REGISTERED}  # image side in pixels


def build_tiny_pipeline(family: str, seed: int = 0, edit: bool = False, variant: str | None = None):
    """The family's tiny pipeline; ``edit``: of its edit checkpoints (``ModelFamily.build_tiny_edit``),
    where they differ from the text-to-image one; ``variant``: one of its ``tiny_variants``."""
    fam = family_named(family)
    if variant is not None:
        return fam.build_tiny_variant(variant, seed)
    return (fam.build_tiny_edit(seed) if edit else None) or fam.build_tiny(seed)


# ----------------------------------------------------------------------------- adapters


def denoiser_linears(pipeline) -> dict[str, tuple[int, int]]:
    """Every Linear layer of the pipeline's denoiser: the widest slot ceiling."""
    from hotlora.engine.writers.base import ceiling_modules

    return ceiling_modules(getattr(pipeline, family_of_pipeline(pipeline).denoiser), None)


def save_diffusers_lora(path: Path, family: str, sd: Mapping[str, torch.Tensor], rank: int, alpha: float) -> Path:
    """diffusers layout, written as diffusers' training scripts write it: ``save_lora_weights`` with
    the ``LoraConfig`` as metadata (so alpha survives; ``base_model_name_or_path`` and other
    fields null, exactly what a user's file carries)."""
    from peft import LoraConfig


    fam = family_named(family)
    path.mkdir(parents=True, exist_ok=True)
    meta = LoraConfig(r=rank, lora_alpha=alpha, target_modules=sorted({k.split(".lora_")[0] for k in sd})).to_dict()
    fam.pipeline_type.save_lora_weights(
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


# Files as the trainers people use write them: key layout, alphas and the safetensors header. The
# weights are random; what is mirrored is the layout a reader meets.


def write_sample_adapters(pipeline, family: str, out: Path, target_rank: int = 8) -> dict[str, Path]:
    """Sample adapters in each layout this family's users meet, at a few ranks."""
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
    attention_only = [n for n in linears if ".attn" in n or "attention." in n or "attn1" in n or "attn2" in n]
    samples["identity-peft"] = save_peft_lora(
        out / "identity-peft", random_lora(linears, low, seed=3, modules=attention_only), rank=low, alpha=low,
        base_model=f"hotlora/tiny-{family}",
    )
    samples.update(family_named(family).write_trainer_samples(pipeline, linears, out, low, attention_only))
    samples.update(write_expert_samples(pipeline, family, out, low, high))
    (out / "README.json").write_text(json.dumps({k: str(v.relative_to(out)) for k, v in samples.items()}, indent=2))
    # A catalog of the samples, so a server on the tiny model has named adapters to offer.
    scales = {"identity": 1.0, "style": 0.8}
    (out / "catalog.toml").write_text("".join(
        f'[adapters.{name}]\nref = "{path.relative_to(out)}"\nscale = {scales.get(name.split("-")[0], 1.0)}\n'
        for name, path in samples.items()
    ))
    return samples


def save_expert_pair(path: Path, family: str, experts: Mapping[str, tuple[Mapping[str, torch.Tensor], int, float]]) -> Path:
    """One adapter file for several experts (``experts``: pipeline attribute -> (PEFT-form layers,
    rank, alpha); any may be left out): each expert's layers and ``LoraConfig`` metadata under its
    own prefix (``transformer.``, ``transformer_2.``), packed by diffusers' own ``_save_lora_weights``
    as ``save_lora_weights`` packs one component's."""
    from peft import LoraConfig

    fam = family_named(family)
    path.mkdir(parents=True, exist_ok=True)
    layers = {name: dict(sd) for name, (sd, _, _) in experts.items()}
    metadata = {name: LoraConfig(r=rank, lora_alpha=alpha, target_modules=sorted({k.split(".lora_")[0] for k in sd})).to_dict()
                for name, (sd, rank, alpha) in experts.items()}
    fam.pipeline_type._save_lora_weights(str(path), lora_layers=layers, lora_metadata=metadata)
    return path / "pytorch_lora_weights.safetensors"


def write_expert_samples(pipeline, family: str, out: Path, low: int, high: int) -> dict[str, Path]:
    """For a model of several experts (Wan 2.2 A14B): a high-noise and a low-noise LoRA as diffusers
    loads them (two ``transformer.`` files, the second with ``load_into_transformer_2=True``), the
    pair in one hotlora adapter (``experts-pair``), and the low-noise LoRA alone under its expert's
    prefix (``experts-low-only``). None for a model of one denoiser."""
    fam = family_named(family)
    experts = list(fam.experts(pipeline))
    if len(experts) < 2:
        return {}
    from hotlora.engine.writers.base import ceiling_modules

    linears = [ceiling_modules(getattr(pipeline, name), None) for name in experts[:2]]
    high_sd, low_sd = random_lora(linears[0], high, seed=11), random_lora(linears[1], low, seed=12)
    first, second = experts[:2]
    return {
        "experts-high": save_diffusers_lora(out / "experts-high", family, high_sd, rank=high, alpha=high / 2),
        "experts-low": save_diffusers_lora(out / "experts-low", family, low_sd, rank=low, alpha=low * 2),
        "experts-pair": save_expert_pair(out / "experts-pair", family,
                                         {first: (high_sd, high, high / 2), second: (low_sd, low, low * 2)}),
        "experts-low-only": save_expert_pair(out / "experts-low-only", family, {second: (low_sd, low, low * 2)}),
    }


def save_tiny_model(directory: Path, family: str, seed: int = 0, target_rank: int = 8, edit: bool = False,
                    variant: str | None = None) -> Path:
    """Build and save a tiny pipeline plus sample adapters under ``directory``; returns the model dir.
    ``edit``: the family's edit checkpoint; ``variant``: one of its ``tiny_variants`` (``build_tiny_pipeline``)."""
    directory = Path(directory)
    pipeline = build_tiny_pipeline(family, seed, edit, variant)
    pipeline.save_pretrained(str(directory))
    side = TINY_SIZE[family]
    model_id = f"hotlora/tiny-{family}" + (f"-{variant}" if variant else "")
    defaults = {"model_id": model_id, "height": side, "width": side, "num_inference_steps": 4,
                **family_named(family).tiny_defaults()}
    (directory / "hotlora.json").write_text(json.dumps(defaults))
    write_sample_adapters(pipeline, family, directory / "adapters", target_rank=target_rank)
    return directory


BUILT = ".hotlora-built"  # written last: a tiny model folder without it is not one


def ensure_tiny_model(directory: Path, family: str) -> Path:
    """The tiny model at ``directory``, built the first time, whole or not at all: it is built in a
    temporary folder beside it (``hotlora.durable.temp_dir``), marked built, fsynced and renamed into
    place, so a start killed mid-build leaves only a leftover the next start removes, never a
    half-written model that looks complete (its ``model_index.json`` is among the first files
    ``save_pretrained`` writes). A folder without the mark (an older version's build, or one cut
    short) is removed and built again. Replicas sharing the folder race harmlessly: the first rename
    wins and the others drop their copy."""
    directory = Path(directory)
    if (directory / BUILT).is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    sweep_orphans(directory.parent, TMP)
    if directory.exists() and not (directory / BUILT).is_file():
        log.warning("removing %s: a tiny model whose build never finished", directory)
        shutil.rmtree(directory, ignore_errors=True)
    log.info("building the tiny offline %s model in %s", family, directory)
    built = temp_dir(directory.parent, f"{directory.name}-")
    try:
        save_tiny_model(built, family)
        write_atomic(built / BUILT, json.dumps({"family": family}).encode())
        if not publish_dir(built, directory):
            log.info("%s was built by another process meanwhile: using it", directory)
    except BaseException:
        shutil.rmtree(built, ignore_errors=True)
        raise
    return directory
