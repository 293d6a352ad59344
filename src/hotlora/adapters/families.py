"""The model families hotlora serves, and which diffusers classes stand for each."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    pipeline_class: str  # diffusers pipeline class; its LoRA mixin owns the format converters
    denoiser: str  # pipeline attribute (and LoRA key prefix) of the model that gets the slots


FAMILIES = {
    "flux": Family("flux", "FluxPipeline", "transformer"),
    "sdxl": Family("sdxl", "StableDiffusionXLPipeline", "unet"),
}


def family_named(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None


def family_of_pipeline(pipeline) -> Family:
    # Variants (img2img, inpaint, ...) subclass or share the base pipeline's LoRA mixin.
    names = {cls.__name__ for cls in type(pipeline).__mro__}
    for family in FAMILIES.values():
        if family.pipeline_class in names:
            return family
    raise ValueError(f"{type(pipeline).__name__} is not a pipeline hotlora serves ({', '.join(FAMILIES)})")


def pipeline_class(family: Family):
    import diffusers

    return getattr(diffusers, family.pipeline_class)
