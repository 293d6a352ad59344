"""Request bodies of the three APIs, and their translation into one engine request: each body's
``to_request`` is the only place its fields become a ``GenerationRequest``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hotlora.settings import parse_size
from hotlora.errors import InvalidRequest

if TYPE_CHECKING:
    from hotlora.adapters.binding import AdapterSpec as Spec
    from hotlora.engine.request import GenerationRequest

Format = Literal["png", "jpeg", "webp"]
# Every field is bounded: the body cap bounds the whole, these say which field is too big.
MAX_REF_CHARS = 4096
MAX_PROMPT_CHARS = 10000
MAX_SLOTS = 8  # more than any engine has; the engine names the unknown ones
Ref = Annotated[str, Field(min_length=1, max_length=MAX_REF_CHARS)]
Prompt = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
SlotName = Annotated[str, Field(max_length=64)]


class AdapterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ref: Ref
    scale: float | None = None  # None: the catalog entry's default, else 1.0
    # The adapter's pivotal-tuning tokens renamed for this request (default: <s0>, <s1>, ... or the
    # names its embeddings file lists); the prompt then uses these names.
    tokens: Annotated[list[Annotated[str, Field(min_length=1, max_length=64)]], Field(max_length=64)] | None = None


Adapters = Annotated[dict[SlotName, AdapterSpec | Ref | None], Field(max_length=MAX_SLOTS)]


class GenerateRequest(BaseModel):
    """``POST /v1/generate``: the richer JSON API."""

    model_config = ConfigDict(extra="forbid")
    prompt: Prompt
    negative_prompt: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | None = None
    adapters: Adapters = Field(default_factory=dict)
    num_images: int = 1
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    width: int | None = None
    height: int | None = None
    seed: int | None = None
    output_format: Format = "png"
    timeout_s: float | None = Field(default=None, gt=0, le=3600)

    def to_request(self, progress=None) -> GenerationRequest:
        from hotlora.engine.request import GenerationRequest  # here: importing schemas needs no torch

        return GenerationRequest(self.prompt, specs(self.adapters), self.num_images, self.num_inference_steps,
                                 self.guidance_scale, self.height, self.width, self.seed or 0, self.negative_prompt,
                                 timeout_s=self.timeout_s, progress=progress)


class HFParameters(BaseModel):
    """The ``parameters`` of the Hugging Face inference API for text-to-image (extras allowed, ignored)."""

    model_config = ConfigDict(extra="ignore")
    negative_prompt: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | None = None
    guidance_scale: float | None = None
    num_inference_steps: int | None = None
    width: int | None = None
    height: int | None = None
    seed: int | None = None
    adapters: Adapters | None = None  # hotlora extension
    lora_scale: float | None = None  # scale for the adapter named in the `lora` header


class HFRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    inputs: Prompt
    parameters: HFParameters = Field(default_factory=HFParameters)

    def to_request(self, lora: str | None = None, lora_slot: str = "") -> GenerationRequest:
        """``lora``: the ``lora`` header's reference, for ``lora_slot`` at ``parameters.lora_scale``."""
        from hotlora.adapters.binding import AdapterSpec as Spec  # here: importing schemas needs no torch
        from hotlora.engine.request import GenerationRequest

        params = self.parameters
        adapters = specs(params.adapters)
        if lora:
            adapters[lora_slot] = Spec(lora, params.lora_scale)
        return GenerationRequest(self.inputs, adapters, 1, params.num_inference_steps, params.guidance_scale,
                                 params.height, params.width, params.seed or 0, params.negative_prompt)


class OpenAIImagesRequest(BaseModel):
    """``POST /v1/images/generations`` (OpenAI images API), with hotlora's ``adapters`` as an extension."""

    model_config = ConfigDict(extra="ignore")
    prompt: Prompt
    n: int = 1
    size: str | None = None
    response_format: Literal["b64_json", "url"] = "b64_json"
    model: str | None = None
    adapters: Adapters = Field(default_factory=dict)
    seed: int | None = None  # extension

    @field_validator("size")
    @classmethod
    def _size(cls, value):
        if value is not None and value != "auto":
            parse_size(value)  # ValueError: a 422 naming the expected form
        return value

    def dimensions(self) -> tuple[int | None, int | None]:
        """(height, width); None for the model's default (no size, or OpenAI's "auto")."""
        if not self.size or self.size == "auto":
            return None, None
        return parse_size(self.size)

    def to_request(self) -> GenerationRequest:
        from hotlora.engine.request import GenerationRequest  # here: importing schemas needs no torch

        height, width = self.dimensions()
        return GenerationRequest(self.prompt, specs(self.adapters), self.n, height=height, width=width,
                                 seed=self.seed or 0)


class PrefetchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    refs: list[Ref] = Field(min_length=1, max_length=64)


def specs(adapters) -> dict[str, Spec]:
    """``{slot: "ref" | {"ref", "scale", "tokens"} | None}`` as the engine's AdapterSpecs (an empty
    slot is left out); checked once, by ``Engine.check``."""
    from hotlora.adapters.binding import AdapterSpec as Spec  # here: importing schemas needs no torch

    out = {}
    for slot, spec in (adapters or {}).items():
        if spec is None:
            continue
        if isinstance(spec, str):
            out[slot] = Spec(spec)
        elif isinstance(spec, AdapterSpec):
            out[slot] = Spec(spec.ref, spec.scale, None if spec.tokens is None else tuple(spec.tokens))
        else:
            raise InvalidRequest(f"[{slot}] adapter spec must be a reference string or {{ref, scale}}")
    return out
