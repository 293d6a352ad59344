"""Request bodies of the three APIs, and their translation into one engine request: each body's
``to_request`` is the only place its fields become a ``GenerationRequest``. The engine's records
import no torch, so neither does this module (the Ray ingress validates bodies with it)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hotlora.settings import parse_size
from hotlora.engine.request import AdapterSpec, GenerationRequest
from hotlora.errors import InvalidRequest

Format = Literal["png", "jpeg", "webp"]
# Every field is bounded: the body cap bounds the whole, these say which field is too big.
MAX_REF_CHARS = 4096
MAX_PROMPT_CHARS = 10000
MAX_SLOTS = 8  # more than any engine has; the engine names the unknown ones
Ref = Annotated[str, Field(min_length=1, max_length=MAX_REF_CHARS)]
Prompt = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
SlotName = Annotated[str, Field(max_length=64)]


class AdapterBody(BaseModel):
    """One slot's adapter as a JSON body writes it, bounded; ``specs`` makes it an ``AdapterSpec``."""

    model_config = ConfigDict(extra="forbid")
    ref: Ref
    scale: float | None = None  # None: the catalog entry's default, else 1.0
    # The adapter's pivotal-tuning tokens renamed for this request (default: <s0>, <s1>, ... or the
    # names its embeddings file lists); the prompt then uses these names.
    tokens: Annotated[list[Annotated[str, Field(min_length=1, max_length=64)]], Field(max_length=64)] | None = None


Adapters = Annotated[dict[SlotName, AdapterBody | Ref | None], Field(max_length=MAX_SLOTS)]


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
        return GenerationRequest(prompt=self.prompt, adapters=specs(self.adapters), num_images=self.num_images,
                                 num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale,
                                 height=self.height, width=self.width, seed=self.seed or 0,
                                 negative_prompt=self.negative_prompt, timeout_s=self.timeout_s, progress=progress)


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
        params = self.parameters
        adapters = specs(params.adapters)
        if lora:
            adapters[lora_slot] = AdapterSpec(ref=lora, scale=params.lora_scale)
        return GenerationRequest(prompt=self.inputs, adapters=adapters, num_images=1,
                                 num_inference_steps=params.num_inference_steps, guidance_scale=params.guidance_scale,
                                 height=params.height, width=params.width, seed=params.seed or 0,
                                 negative_prompt=params.negative_prompt)


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
        height, width = self.dimensions()
        return GenerationRequest(prompt=self.prompt, adapters=specs(self.adapters), num_images=self.n, height=height,
                                 width=width, seed=self.seed or 0)


class PrefetchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    refs: list[Ref] = Field(min_length=1, max_length=64)


def specs(adapters) -> dict[str, AdapterSpec]:
    """``{slot: "ref" | {"ref", "scale", "tokens"} | None}`` as the engine's AdapterSpecs (an empty
    slot is left out); checked once, by ``Engine.check``."""
    out = {}
    for slot, spec in (adapters or {}).items():
        if spec is None:
            continue
        if isinstance(spec, str):
            out[slot] = AdapterSpec(ref=spec)
        elif isinstance(spec, AdapterBody):
            out[slot] = AdapterSpec(ref=spec.ref, scale=spec.scale,
                                    tokens=None if spec.tokens is None else tuple(spec.tokens))
        else:
            raise InvalidRequest(f"[{slot}] adapter spec must be a reference string or {{ref, scale}}")
    return out
