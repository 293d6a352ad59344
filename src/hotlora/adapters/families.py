"""The model families hotlora serves, and which diffusers classes stand for each."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    pipeline_class: str  # diffusers pipeline class; its LoRA mixin owns the format converters
    denoiser: str  # pipeline attribute (and LoRA key prefix) of the model that gets the slots
    # Text encoders diffusers loads LoRA into (pipeline attribute = LoRA key prefix): its mixin's
    # ``_lora_loadable_modules`` minus the denoiser. Flux's T5 takes no LoRA in diffusers.
    lora_text_encoders: tuple[str, ...] = ()
    # Pivotal-tuning embedding file keys -> the text encoder they extend. diffusers' advanced
    # training scripts write clip_l / clip_g (SDXL) and clip_l / t5 (Flux); the Hugging Face
    # inference API also reads text_encoders_0 / text_encoders_1 (its older SDXL names).
    embedding_keys: tuple[tuple[str, str], ...] = ()

    @property
    def text_encoders(self) -> tuple[str, ...]:
        """Every text encoder an adapter can change (LoRA or embeddings), in pipeline order."""
        return tuple(sorted({*self.lora_text_encoders, *(te for _, te in self.embedding_keys)}))


# Each text encoder's tokenizer and the pipeline argument its prompt comes in.
TOKENIZER_OF = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"}
PROMPT_ARGUMENT_OF = {"text_encoder": "prompt", "text_encoder_2": "prompt_2"}

FAMILIES = {
    "flux": Family("flux", "FluxPipeline", "transformer", ("text_encoder",),
                   (("clip_l", "text_encoder"), ("t5", "text_encoder_2"))),
    "sdxl": Family("sdxl", "StableDiffusionXLPipeline", "unet", ("text_encoder", "text_encoder_2"),
                   (("clip_l", "text_encoder"), ("text_encoders_0", "text_encoder"),
                    ("clip_g", "text_encoder_2"), ("text_encoders_1", "text_encoder_2"))),
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
