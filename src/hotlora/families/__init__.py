"""The model families hotlora serves: one ``ModelFamily`` module each, found by name, by pipeline
class (MRO-aware, so img2img and inpaint variants resolve) or by a saved model's
``model_index.json``.

A family is registered by listing it in ``REGISTERED``; from then on the CLI's choices, the plan,
the tiny models and the contract test (tests/integration/test_contract.py) cover it.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Mapping

from hotlora.errors import HotloraError
from hotlora.families.base import REFERENCE_TASKS, CfgStyle, ModelFamily
from hotlora.families.chroma import Chroma
from hotlora.families.flux import Flux
from hotlora.families.flux2 import Flux2, Flux2Klein, Flux2KleinBase
from hotlora.families.generic import GENERIC_FAMILIES, convention_problems
from hotlora.families.ltx import LTXVideo
from hotlora.families.ltx2 import LTX2Video
from hotlora.families.qwenimage import QwenImage
from hotlora.families.qwenimage21 import QwenImage21
from hotlora.families.sd3 import StableDiffusion3
from hotlora.families.sd15 import StableDiffusion15
from hotlora.families.sdxl import StableDiffusionXL
from hotlora.families.wan import Wan
from hotlora.families.zimage import ZImage

REGISTERED: tuple[ModelFamily, ...] = (Flux(), StableDiffusionXL(), StableDiffusion15(), StableDiffusion3(), ZImage(),
                                       QwenImage(), QwenImage21(), Flux2(), Flux2Klein(), Flux2KleinBase(), Chroma(), Wan(),
                                       LTXVideo(), LTX2Video())
# The generic families (families.generic: pipelines served from diffusers' facts) come last, and
# family_of_class only looks at them when no explicit family matches.
REGISTERED += GENERIC_FAMILIES
FAMILIES: dict[str, ModelFamily] = {family.name: family for family in REGISTERED}
DEFAULT_FAMILY = REGISTERED[0].name  # the built-in tiny model of `hotlora serve` with no --model


class UnservedModel(HotloraError, ValueError):
    """Start-up: the model's pipeline is not one a registered family serves; the message names the
    pipeline and what is missing."""


def why_unserved(pipeline_type: type) -> str:
    """What a pipeline no family matches lacks, in words."""
    mixins = [cls.__name__ for cls in pipeline_type.__mro__
              if cls.__name__.endswith("LoraLoaderMixin") and "_lora_loadable_modules" in vars(cls)]
    if not mixins:
        return "it has no diffusers LoRA loader mixin, so diffusers loads no LoRA into it"
    known = [family.unserved_pipelines[pipeline_type.__name__] for family in REGISTERED
             if pipeline_type.__name__ in family.unserved_pipelines]
    if known:
        return known[0]
    # Kin: a served family's pipelines in the same diffusers package with the same mixin (not another model
    # borrowing a mixin: PRX's Stable Diffusion one, Bria FIBO's Flux one).
    package = getattr(pipeline_type, "__module__", "").rpartition(".")[0]
    kin = [family for family in REGISTERED if not family.generic and family.lora_mixin.__name__ == mixins[0]
           and family.pipeline_type.__module__.rpartition(".")[0] == package]
    tasks = [(f, task) for f in kin for task, name in f.task_pipelines.items() if name == pipeline_type.__name__]
    if tasks:
        family, task = tasks[0]
        return (f"hotlora's {family.name} family runs it as its {task} task on a {family.pipeline_class} checkpoint; "
                f"a checkpoint saved as {pipeline_type.__name__} is not served: serve the {family.pipeline_class} one")
    if kin:  # a variant of a served pipeline: another denoiser or another __call__ (Wan VACE, LTX condition)
        served = ", ".join(dict.fromkeys([f.pipeline_class for f in kin] + [c for f in kin for c in f.task_pipelines.values()]))
        names = ", ".join(dict.fromkeys(f.name for f in kin))
        init = inspect.signature(pipeline_type.__init__).parameters
        denoisers = list(dict.fromkeys(getattr(p.annotation, "__name__", str(p.annotation)) for name, p in init.items()
                                       if name.startswith(("transformer", "unet"))))
        return (f"it shares the LoRA mixin {mixins[0]} of hotlora's {names} family, which serves {served}, but is none "
                f"of those: a variant with its own __call__ (denoiser: {', '.join(denoisers) or 'none'}) that no family "
                "has been tested on")
    module = getattr(pipeline_type, "__module__", "")
    if any(part in module.lower() for part in ("video", "ltx", "hunyuan", "mochi", "cogvideo", "skyreels")):
        served = ", ".join(f"{f.name} ({f.pipeline_class})" for f in REGISTERED if f.video)
        return f"it is a video pipeline ({mixins[0]}) of no served video family (served: {served})"
    problems = convention_problems(pipeline_type)
    if problems:
        return (f"no registered family uses its LoRA mixin {mixins[0]} with its denoiser, and the generic family "
                f"cannot serve it: {'; '.join(problems)}")
    return (f"no registered family uses its LoRA mixin {mixins[0]} with its denoiser; it follows the generic "
            "family's conventions, but no tiny model of it is tested, so hotlora does not claim it "
            "(hotlora.families.generic.GENERIC)")


def family_named(name: str) -> ModelFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None


def family_of_class(pipeline_type: type, denoiser_class: str | None = None,
                    config: Mapping | None = None) -> ModelFamily:
    """The family of a pipeline class: the one it subclasses, else the one whose LoRA mixin and
    denoiser class it shares (variants such as FluxImg2ImgPipeline); the generic families only
    when no explicit one matches. ``config`` (the pipeline's config or model_index.json) tells
    apart families of one pipeline class (``fits_config``)."""
    for generic in (False, True):
        # fits_config only where the class matches: it imports the family's pipeline (and its models)
        ranked = sorted(((score * family.fits_config(config) if score else 0, i)
                         for i, family in enumerate(REGISTERED) if family.generic is generic
                         for score in (family.matches(pipeline_type, denoiser_class),)), reverse=True)
        best, index = ranked[0] if ranked else (0, None)
        if best:
            return REGISTERED[index]
    raise UnservedModel(f"{pipeline_type.__name__} is not a pipeline hotlora serves: {why_unserved(pipeline_type)} "
                        f"(served families: {', '.join(FAMILIES)}; `hotlora families` lists them)")


def family_of_pipeline(pipeline) -> ModelFamily:
    return family_of_class(type(pipeline), config=dict(getattr(pipeline, "config", None) or {}))


def family_of_model_index(index: Mapping | str | Path) -> ModelFamily:
    """The family of a saved pipeline, from its ``model_index.json`` (a folder, the file, or its contents)."""
    if not isinstance(index, Mapping):
        path = Path(index)
        index = json.loads((path / "model_index.json" if path.is_dir() else path).read_text())
    import diffusers

    name = index.get("_class_name", "")
    pipeline_type = getattr(diffusers, name, None)
    if not isinstance(pipeline_type, type):
        raise UnservedModel(f"{name or 'a model_index.json without _class_name'} is not a diffusers pipeline "
                         f"hotlora serves ({', '.join(FAMILIES)})")
    denoisers = [entry[1] for key, entry in index.items()
                 if key in ("transformer", "unet") and isinstance(entry, list) and len(entry) == 2]
    return family_of_class(pipeline_type, denoisers[0] if denoisers else None, config=index)


def family_of_denoiser_class(class_name: str) -> ModelFamily | None:
    """The family whose denoiser is this diffusers class, if exactly one is registered: None too
    when families share it (SD1.5 and SDXL both denoise with UNet2DConditionModel; their pipeline
    class tells them apart)."""
    found = [family for family in REGISTERED if family.denoiser_class == class_name]
    return found[0] if len(found) == 1 else None


def full_size_model(name: str) -> tuple[ModelFamily, str] | None:
    """A built-in plan name (``flux-dev``, ``sdxl``) -> its family and the ``hotlora.fullsize`` module."""
    for family in REGISTERED:
        if name in family.full_size_models:
            return family, family.full_size_models[name]
    return None


def describe_families() -> list[dict]:
    """What each registered family serves (``hotlora families``): its pipelines, how guidance runs,
    what a request may set, which text encoders take LoRA, the defaults, the built-in plans."""
    return [family.describe() for family in REGISTERED]


def full_size_names() -> list[str]:
    return [name for family in REGISTERED for name in family.full_size_models]


__all__ = ["CfgStyle", "DEFAULT_FAMILY", "FAMILIES", "ModelFamily", "REFERENCE_TASKS", "REGISTERED", "UnservedModel", "describe_families",
           "family_named", "family_of_class", "family_of_denoiser_class", "family_of_model_index", "family_of_pipeline",
           "full_size_model", "full_size_names", "why_unserved"]
