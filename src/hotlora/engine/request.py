"""A request, checked and resolved once: what ``Engine.prepare`` makes and ``Engine.run`` runs.

The server prepares on the request's own thread (parameters checked, adapters fetched, converted,
validated and laid out for the writer) and queues the ``PreparedRequest``; the worker thread only
runs it. Nothing is checked or resolved twice, and one ``Timings`` travels from prepare to the
response.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

from hotlora.adapters.formats import Adapter
from hotlora.config import RequestLimits
from hotlora.engine.runner import Timings
from hotlora.errors import InvalidRequest, RequestTooLarge

OUTPUT_TYPES = ("pil", "latent", "pt", "np")
MAX_PROMPT_CHARS = 10_000  # prompts are truncated to the text encoders' length anyway

Resolved = Mapping[str, tuple[Adapter, float]]  # slot -> (validated adapter, scale)


class UnservedShape(InvalidRequest):
    """A request the warm engine has no compiled graph for: serving it would start a compile
    (tens of seconds on a GPU, the queue waiting), so it is refused instead."""


@dataclass(frozen=True)
class CallParams:
    """The denoising parameters; requests with equal ones can share a forward batch."""

    num_inference_steps: int
    guidance_scale: float
    height: int
    width: int

    def pipeline_kwargs(self) -> dict:
        return {"num_inference_steps": self.num_inference_steps, "guidance_scale": self.guidance_scale,
                "height": self.height, "width": self.width}


@dataclass(frozen=True)
class PreparedRequest:
    prompt: str
    params: CallParams
    adapters: Resolved
    num_images: int = 1
    seed: int = 0
    output_type: str = "pil"
    negative_prompt: str | None = None
    progress: Callable[[int, int], None] | None = field(default=None, compare=False)
    timings: Timings = field(default_factory=Timings, compare=False)

    @property
    def seeds(self) -> list[int]:
        return [self.seed + i for i in range(self.num_images)]

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one forward batch."""
        return (self.params, self.output_type)


@dataclass(frozen=True)
class RequestRules:
    """What a request may ask of one warm engine: its defaults, limits and served sizes."""

    family: str
    defaults: Mapping  # num_inference_steps, guidance_scale
    limits: RequestLimits
    sizes: tuple[tuple[int, int], ...]  # (height, width) pairs warmed up; the first is the default
    size_multiple: int  # height and width must be multiples of this (VAE factor x patch size)
    compiled: bool  # a compiled engine refuses sizes it was not warmed at

    def sizes_text(self) -> str:
        return ", ".join(f"{w}x{h}" for h, w in self.sizes)

    def check(self, prompt, num_images=1, steps=None, guidance=None, height=None, width=None, seed=0,
              output_type="pil", negative_prompt=None) -> CallParams:
        """Every problem at once (InvalidRequest), or a work / length bound (RequestTooLarge)."""
        limits = self.limits
        for label, text in (("prompt", prompt), ("negative_prompt", negative_prompt)):
            if isinstance(text, str) and len(text) > MAX_PROMPT_CHARS:
                raise RequestTooLarge(f"{label} has {len(text)} characters; the limit is {MAX_PROMPT_CHARS}")
        problems = []
        if not isinstance(prompt, str) or not prompt.strip():
            problems.append("prompt must be a non-empty string")
        if negative_prompt is not None and not isinstance(negative_prompt, str):
            problems.append("negative_prompt must be a string")
        if not (isinstance(num_images, int) and 1 <= num_images <= limits.max_images):
            problems.append(f"num_images must be an integer in 1..{limits.max_images}")
        steps = self.defaults["num_inference_steps"] if steps is None else steps
        if not (isinstance(steps, int) and 1 <= steps <= limits.max_steps):
            problems.append(f"num_inference_steps must be an integer in 1..{limits.max_steps}")
        guidance = self.defaults["guidance_scale"] if guidance is None else guidance
        if not (isinstance(guidance, (int, float)) and math.isfinite(guidance) and 0 <= guidance <= 50):
            problems.append("guidance_scale must be a finite number in 0..50")
        height, width = height or self.sizes[0][0], width or self.sizes[0][1]
        for label, value in (("height", height), ("width", width)):
            if not (isinstance(value, int) and 0 < value <= 4096 and value % self.size_multiple == 0):
                problems.append(f"{label} must be a positive multiple of {self.size_multiple} up to 4096")
        if not (isinstance(seed, int) and 0 <= seed < 2**63 - limits.max_images):
            problems.append("seed must be a non-negative integer")
        if output_type not in OUTPUT_TYPES:
            problems.append(f"output_type must be one of {', '.join(OUTPUT_TYPES)}")
        if negative_prompt is not None and self.family != "sdxl":
            problems.append(f"negative_prompt is not supported by the {self.family} family")
        if problems:
            raise InvalidRequest("; ".join(problems))
        work = height * width * num_images * steps
        if work > limits.max_work:
            raise RequestTooLarge(
                f"the request asks for {work:,} pixel-steps (height x width x images x steps = {height} x {width} x "
                f"{num_images} x {steps}); the limit is {limits.max_work:,}")
        if self.compiled and (height, width) not in self.sizes:
            # Until the engine serves a size set, any other size would compile new graphs.
            raise UnservedShape(f"size {width}x{height} (width x height) is not served by this warm engine; "
                                f"served sizes: {self.sizes_text()}")
        return CallParams(steps, float(guidance), height, width)
