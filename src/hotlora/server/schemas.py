"""Request bodies of the three APIs, and their translation into one engine request: each body's
``to_request`` is the only place its fields become a ``GenerationRequest``. The engine's records
import no torch, so neither does this module (the Ray ingress validates bodies with it)."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hotlora.settings import parse_size
from hotlora.engine.request import AdapterSpec, GenerationRequest
from hotlora.errors import InvalidRequest
from hotlora.server.inputs import ImageInput

# What /v1/generate may ask its outputs encoded as; which of them a model makes is its output
# kind's (``Service.output_format``: images png/jpeg/webp, a video mp4/webp/png frames).
Format = Literal["png", "jpeg", "webp", "mp4"]
# Every field is bounded: the body cap bounds the whole, these say which field is too big.
MAX_REF_CHARS = 4096
MAX_PROMPT_CHARS = 10000
MAX_SLOTS = 8  # more than any engine has; the engine names the unknown ones
Ref = Annotated[str, Field(min_length=1, max_length=MAX_REF_CHARS)]
Prompt = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
SlotName = Annotated[str, Field(max_length=64)]
# An input image in a JSON body: base64, a data: URL, or an http(s) URL. The body cap of a route
# taking images (server/app.py) and input_image_max_bytes bound it; this only bounds the field.
MAX_IMAGE_CHARS = 256 * 2**20
MAX_INPUT_IMAGES = 8  # the most max_reference_images allows
ImageText = Annotated[str, Field(min_length=1, max_length=MAX_IMAGE_CHARS)]
Task = Literal["text-to-image", "image-to-image", "inpaint", "edit", "image-to-video"]
Strength = Annotated[float, Field(gt=0, le=1)]


class AdapterBody(BaseModel):
    """One slot's adapter as a JSON body writes it, bounded; ``specs`` makes it an ``AdapterSpec``."""

    model_config = ConfigDict(extra="forbid")
    ref: Ref
    scale: float | None = None  # None: the catalog entry's default, else 1.0
    # The adapter's pivotal-tuning tokens renamed for this request (default: <s0>, <s1>, ... or the
    # names its embeddings file lists); the prompt then uses these names.
    tokens: Annotated[list[Annotated[str, Field(min_length=1, max_length=64)]], Field(max_length=64)] | None = None
    # A two-expert model (Wan 2.2 A14B): the low-noise expert's LoRA file, ``ref`` the high-noise one's.
    low_noise: Ref | None = None


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
    num_frames: int | None = None  # a video model's frames per video (None: its default)
    guidance_scale_2: float | None = None  # two experts (Wan 2.2 A14B): the low-noise one's guidance
    shift: float | None = None  # the scheduler's timestep shift, where it has a fixed one (None: the model's)
    output_format: Format | None = None  # None: the model's default (png; a video model's mp4)
    timeout_s: float | None = Field(default=None, gt=0, le=3600)
    # Image-conditioned tasks (served when the engine was started with them): ``task`` None is
    # the one the inputs imply (a mask: inpaint; images: edit where served, else image-to-image).
    task: Task | None = None
    images: Annotated[list[ImageText], Field(max_length=MAX_INPUT_IMAGES)] = Field(default_factory=list)
    mask: ImageText | None = None
    strength: Strength | None = None
    # A job's (``Prefer: respond-async``; server/jobs.py): where its completion is announced
    # (server/webhooks.py) and how long it is kept once finished (the server's default and most bound it).
    webhook: Annotated[str, Field(min_length=1, max_length=MAX_REF_CHARS)] | None = None
    retention_s: float | None = Field(default=None, gt=0)

    def to_request(self, progress=None) -> GenerationRequest:
        return GenerationRequest(prompt=self.prompt, adapters=specs(self.adapters), num_images=self.num_images,
                                 num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale,
                                 height=self.height, width=self.width, seed=self.seed or 0,
                                 negative_prompt=self.negative_prompt, timeout_s=self.timeout_s, progress=progress,
                                 num_frames=self.num_frames, guidance_scale_2=self.guidance_scale_2, shift=self.shift,
                                 **image_inputs(self.task, self.images, self.mask, self.strength))


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


class HFTargetSize(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int
    height: int


class HFImageParameters(HFParameters):
    """The ``parameters`` of the Hugging Face image-to-image task: the prompt is here, the image in
    ``inputs``; ``target_size`` the size asked for; ``strength`` and ``task`` hotlora's."""

    prompt: Prompt
    target_size: HFTargetSize | None = None
    strength: Strength | None = None
    task: Task | None = None


class HFImageRequest(BaseModel):
    """The image-to-image task's body, as ``InferenceClient.image_to_image`` sends it: the input
    image as base64 (or a URL) in ``inputs``."""

    model_config = ConfigDict(extra="ignore")
    inputs: ImageText
    parameters: HFImageParameters

    def to_request(self, lora: str | None = None, lora_slot: str = "") -> GenerationRequest:
        params = self.parameters
        adapters = specs(params.adapters)
        if lora:
            adapters[lora_slot] = AdapterSpec(ref=lora, scale=params.lora_scale)
        size = params.target_size
        return GenerationRequest(prompt=params.prompt, adapters=adapters, num_images=1,
                                 num_inference_steps=params.num_inference_steps, guidance_scale=params.guidance_scale,
                                 height=size.height if size else params.height, width=size.width if size else params.width,
                                 seed=params.seed or 0, negative_prompt=params.negative_prompt,
                                 **image_inputs(params.task, [self.inputs], None, params.strength))


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


class SizedRequest(BaseModel):
    """OpenAI's ``size``: WIDTHxHEIGHT, or "auto" (the model's default)."""

    size: str | None = None

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


class OpenAIImagesRequest(SizedRequest):
    """``POST /v1/images/generations`` (OpenAI images API), with hotlora's ``adapters`` as an extension."""

    model_config = ConfigDict(extra="ignore")
    prompt: Prompt
    n: int = 1
    response_format: Literal["b64_json", "url"] = "b64_json"
    model: str | None = None
    adapters: Adapters = Field(default_factory=dict)
    seed: int | None = None  # extension
    num_inference_steps: int | None = None  # extension

    def to_request(self, images: Sequence[ImageInput] = (), mask: ImageInput | None = None) -> GenerationRequest:
        """The engine's request; ``images`` and ``mask``: an edits form's uploads."""
        height, width = self.dimensions()
        return GenerationRequest(prompt=self.prompt, adapters=specs(self.adapters), num_images=self.n, height=height,
                                 width=width, seed=self.seed or 0, num_inference_steps=self.num_inference_steps,
                                 **self.task_fields(images, mask))

    def task_fields(self, images: Sequence[ImageInput], mask: ImageInput | None) -> dict:
        return image_inputs(None, images, mask, None)


class OpenAIEditsRequest(OpenAIImagesRequest):
    """``POST /v1/images/edits`` (OpenAI images API, multipart): the generations request's fields
    as form fields; the uploaded ``image`` files (one or several) and ``mask`` come beside them
    (``to_request``). hotlora's extensions beyond the generations ones: ``strength``, ``task``
    (default: a mask inpaints, else edit where served, else image-to-image)."""

    strength: Strength | None = None
    task: Task | None = None

    def task_fields(self, images: Sequence[ImageInput], mask: ImageInput | None) -> dict:
        return image_inputs(self.task, images, mask, self.strength)


class OpenAIVideosRequest(SizedRequest):
    """``POST /v1/videos`` (OpenAI videos API; JSON, or multipart as the openai client sends it), with
    hotlora's ``adapters``, ``seed``, ``num_inference_steps``, ``guidance_scale`` (and ``guidance_scale_2``),
    ``shift`` and ``negative_prompt`` as extensions.
    ``seconds`` (OpenAI writes it as a string, "4") becomes a frame count at the route
    (``routes_videos.frames_for``): it needs the served model's frame rate."""

    model_config = ConfigDict(extra="ignore")
    prompt: Prompt
    model: Annotated[str, Field(max_length=256)] | None = None
    seconds: Annotated[str, Field(max_length=16)] | float | None = None
    negative_prompt: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | None = None
    adapters: Adapters = Field(default_factory=dict)
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    shift: float | None = None
    retention_s: float | None = Field(default=None, gt=0)  # the job's (server/jobs.py)

    def to_request(self, num_frames: int | None, input_frames: tuple = ()) -> GenerationRequest:
        """The engine's request; ``input_frames`` (``input_reference`` and ``last_frame``, ``ImageInput``s):
        image-to-video."""
        height, width = self.dimensions()
        return GenerationRequest(prompt=self.prompt, adapters=specs(self.adapters), num_images=1, height=height,
                                 width=width, seed=self.seed or 0, num_inference_steps=self.num_inference_steps,
                                 negative_prompt=self.negative_prompt, num_frames=num_frames,
                                 guidance_scale=self.guidance_scale, guidance_scale_2=self.guidance_scale_2,
                                 shift=self.shift, **({"task": "image-to-video", "images": tuple(input_frames)}
                                                      if input_frames else {}))


MAX_FORM_FIELDS = 64
# A bracketed form key as the openai client flattens ``extra_body``: adapters[identity][scale].
FORM_KEY = re.compile(r"^(?P<name>[^\[\]]+)(?P<path>(?:\[[^\[\]]*\])*)$")


def place(fields: dict, key: str, value: str) -> None:
    """``adapters[identity][ref]=x`` as ``fields["adapters"]["identity"]["ref"] = "x"``."""
    match = FORM_KEY.match(key)
    if match is None:
        raise InvalidRequest(f"form field name {key[:80]!r} is malformed")
    path = [match.group("name"), *re.findall(r"\[([^\[\]]*)\]", match.group("path"))]
    if path[-1] == "":
        raise InvalidRequest(f"form field {key[:80]!r}: lists are taken for image files only")
    if len(path) == 1 and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidRequest(f"form field {key!r} starts like a JSON object but is not one") from None
    target = fields
    for name in path[:-1]:
        target = target.setdefault(name, {})
        if not isinstance(target, dict):
            raise InvalidRequest(f"form field {key[:80]!r} conflicts with another field of the form")
    if path[-1] in target:
        raise InvalidRequest(f"form field {key[:80]!r} is given twice")
    target[path[-1]] = value


def prefers_async(prefer_values) -> bool:
    """Whether ``Prefer`` header values ask for ``respond-async`` (RFC 7240; among other preferences,
    any case): a job rather than an answer."""
    return any(pref.split(";")[0].split("=")[0].strip().lower() == "respond-async"
               for value in prefer_values for pref in value.split(","))


def image_inputs(task, images, mask, strength) -> dict:
    """A request's image-task fields (``GenerationRequest``), images as ``ImageInput``s: the JSON
    bodies' text (base64, data URL or URL) or an upload's already."""
    def given(image):
        return image if isinstance(image, ImageInput) else ImageInput(text=image)

    if not images and mask is None:  # text-to-image unless the body names another task
        return {"task": task or "text-to-image", "strength": strength}
    return {"task": task, "images": tuple(given(image) for image in images),
            "mask": None if mask is None else given(mask), "strength": strength}


class PrefetchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    refs: list[Ref] = Field(min_length=1, max_length=64)


def specs(adapters) -> dict[str, AdapterSpec]:
    """``{slot: "ref" | {"ref", "scale", "tokens", "low_noise"} | None}`` as the engine's AdapterSpecs (an empty
    slot is left out); checked once, by ``Engine.check``."""
    out = {}
    for slot, spec in (adapters or {}).items():
        if spec is None:
            continue
        if isinstance(spec, str):
            out[slot] = AdapterSpec(ref=spec)
        elif isinstance(spec, AdapterBody):
            out[slot] = AdapterSpec(ref=spec.ref, scale=spec.scale, low_noise=spec.low_noise,
                                    tokens=None if spec.tokens is None else tuple(spec.tokens))
        else:
            raise InvalidRequest(f"[{slot}] adapter spec must be a reference string or {{ref, scale}}")
    return out
