"""Request bodies of the three APIs, and their translation into one engine request."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hotlora.config import parse_size
from hotlora.errors import InvalidRequest

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
        """(width, height); None for the model's default (no size, or OpenAI's "auto")."""
        if not self.size or self.size == "auto":
            return None, None
        height, width = parse_size(self.size)
        return width, height


class PrefetchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    refs: list[Ref] = Field(min_length=1, max_length=64)


def specs(adapters) -> dict:
    """``{slot: "ref" | {"ref", "scale"} | None}`` as the engine's spec dicts."""
    out = {}
    for slot, spec in (adapters or {}).items():
        if spec is None:
            continue
        if isinstance(spec, str):
            out[slot] = {"ref": spec, "scale": None}
        elif isinstance(spec, AdapterSpec):
            out[slot] = spec.model_dump()
        else:
            raise InvalidRequest(f"[{slot}] adapter spec must be a reference string or {{ref, scale}}")
    return out
