"""The request's records, checked and resolved once, as typed values along one corridor:

    GenerationRequest  what a front end asks (each route translates its body once); its adapters
                       slot -> ``AdapterSpec``
    CheckedRequest     ``Engine.check``: parameters, slots, scales, token names (no I/O)
    PreparedRequest    ``Engine.prepare``: adapters fetched, validated, laid out for the writers
                       (``Bindings``: slot -> ``Binding``); ``Engine.run`` runs it
    Timings            one per request, from prepare to the response

The server checks and fetches on the event loop, prepares on a request thread and queues the
``PreparedRequest``; the worker thread only runs it. Nothing is checked or resolved twice. No
record imports torch: the HTTP edge (and the Ray ingress) builds them without it. Every record is
built by keyword.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from hotlora.adapters.binding import AdapterSpec, Binding, Bindings  # noqa: F401 (re-exported)
from hotlora.settings import RequestLimits, format_size
from hotlora.errors import InvalidRequest, RequestTooLarge
from hotlora.engine.shift import shift_problems
from hotlora.families import REFERENCE_TASKS, ModelFamily
from hotlora.tracing import NO_TRACE, Trace

OUTPUT_TYPES = ("pil", "latent", "pt", "np")
TEXT_TO_IMAGE = "text-to-image"
IMAGE_TASKS = ("image-to-image", "inpaint")  # one input image, a strength; inpaint a mask too
MAX_PROMPT_CHARS = 10_000  # prompts are truncated to the text encoders' length anyway


def images_per_video(family, task: str) -> bool:
    """Whether ``task``'s pipeline takes its input image once per image (or video) of the batch:
    image-to-image and inpaint, and the image-to-video of a family that encodes the first frame per
    video (``ModelFamily.first_frame_per_video``); else once a call (an edit's references)."""
    return task in IMAGE_TASKS or (task == "image-to-video" and family.first_frame_per_video)


class UnservedShape(InvalidRequest):
    """A request the warm engine has no compiled graph for: serving it would start a compile
    (tens of seconds on a GPU, the queue waiting), so it is refused instead. ``sizes``: the
    served sizes as WIDTHxHEIGHT strings (for a response body that lists them)."""

    def __init__(self, message: str, sizes: tuple[str, ...] = ()):
        super().__init__(message)
        self.sizes = tuple(sizes)


class UnservedTask(UnservedShape):
    """A task (or an edit's reference count) the warm engine was not started with: nothing of it is
    warmed up. ``tasks``: what is served."""

    def __init__(self, message: str, tasks: tuple[str, ...] = ()):
        super().__init__(message)
        self.tasks = tuple(tasks)


def nearest_size(sizes, height: int, width: int) -> tuple[int, int]:
    """The served (height, width) closest to ``height`` x ``width`` in aspect ratio, then in area
    (both compared as log ratios, so 2x too big and 2x too small are equally far); ties go to the
    earlier size. Aspect ratios within 1e-6 count as equal."""
    aspect, area = math.log(width / height), math.log(width * height)
    return min(sizes, key=lambda s: (round(abs(math.log(s[1] / s[0]) - aspect), 6),
                                     abs(math.log(s[0] * s[1]) - area)))


@dataclass(kw_only=True)
class Timings:
    resolve_ms: float = 0.0  # read + convert + validate the request's adapters
    swap_ms: float = 0.0
    generate_ms: list[float] = field(default_factory=list)  # one entry per chunk: denoise and decode
    # The part of each chunk after its last denoising step (VAE decode, post-processing); empty
    # where the pipeline did not call back after its steps.
    decode_ms: list[float] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # images per forward pass, one entry per chunk
    total_ms: float = 0.0

    def as_dict(self) -> dict:
        return {
            "resolve_ms": round(self.resolve_ms, 3),
            "swap_ms": round(self.swap_ms, 3),
            "generate_ms": [round(x, 3) for x in self.generate_ms],
            "decode_ms": [round(x, 3) for x in self.decode_ms],
            "total_ms": round(self.total_ms, 3),
        }


@dataclass(frozen=True, kw_only=True)
class CallParams:
    """The denoising parameters; requests with equal ones can share a forward batch."""

    num_inference_steps: int
    guidance_scale: float
    height: int  # the size served (snapped when the policy is "nearest")
    width: int
    # (height, width) the request asked for when it was snapped to another served size, else None.
    # Not part of equality: requests snapped to the same size share a forward batch.
    requested: tuple[int, int] | None = field(default=None, compare=False)
    task: str = TEXT_TO_IMAGE
    strength: float | None = None  # image-to-image and inpaint: how much of the input is noised away
    references: int = 0  # the input images a request gives (edit: its reference images)
    # The steps a strength leaves to run (``ModelFamily.denoising_steps``); None: all of them.
    strength_steps: int | None = field(default=None, compare=False)
    num_frames: int | None = None  # a video family's frames per video; None for images
    # An edit of one reference the pipeline takes per batch position (``ModelFamily.edit_references_per_image``):
    # it may share a forward batch with other such edits (``PreparedRequest.batch_key``).
    reference_per_image: bool = False
    # A model of two experts (Wan 2.2 A14B): the low-noise one's guidance (None: ``guidance_scale``).
    guidance_scale_2: float | None = None
    shift: float | None = None  # the scheduler's timestep shift for this run (None: the model's own)

    @property
    def denoising_steps(self) -> int:
        """The steps the pipeline runs (the step clock and progress count them)."""
        return self.num_inference_steps if self.strength_steps is None else self.strength_steps

    @property
    def size(self) -> str:
        """The size served, WIDTHxHEIGHT."""
        return format_size(self.height, self.width)

    @property
    def snapped_from(self) -> str | None:
        """The size asked for, WIDTHxHEIGHT, when the request was snapped to ``size``; else None."""
        return format_size(*self.requested) if self.requested else None

    def pipeline_kwargs(self, family) -> dict:
        """The pipeline's arguments for these parameters (guidance the family's way: ``call_arguments``)."""
        return {"num_inference_steps": self.num_inference_steps, "height": self.height, "width": self.width,
                **({} if self.num_frames is None else {"num_frames": self.num_frames}),
                **({} if self.guidance_scale_2 is None else {"guidance_scale_2": self.guidance_scale_2}),
                **family.call_arguments(self.guidance_scale)}


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One generation as every front end asks for it: each API route translates its body into one
    (once), the Python API builds one from ``Engine.prepare``'s keywords. Nothing here is checked
    yet: ``Engine.check`` does that, once.

    ``adapters``: slot -> AdapterSpec (the routes); the Python API may also give any form the
    resolver reads (a source, ``(source, scale)``, ``{"ref": ..}``), parsed by ``Engine.check``.
    ``timeout_s``: the server's deadline for the request (None: the server's default).
    ``trace``: where the engine's spans for this request go (``hotlora.tracing``; default: nowhere).
    ``task``: text-to-image, or one the engine was started with (``EngineConfig.tasks``); ``images``:
    its input images (image-to-image and inpaint one, edit its references), each the bytes of a PNG,
    JPEG or WebP file (decoded under the server's budget, ``hotlora.images``), a PIL image or an
    HxWx3 uint8 array; ``mask``: inpaint's (white: repainted), in the same forms."""

    prompt: str
    adapters: Mapping[str, AdapterSpec] = field(default_factory=dict)
    num_images: int = 1
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    height: int | None = None
    width: int | None = None
    seed: int = 0
    negative_prompt: str | None = None
    output_type: str = "pil"
    timeout_s: float | None = None
    task: str | None = TEXT_TO_IMAGE  # None: the task the inputs imply (``RequestRules.implied_task``)
    images: tuple = field(default=(), compare=False)
    mask: object = field(default=None, compare=False)
    strength: float | None = None
    num_frames: int | None = None  # a video family's frames per video (None: the engine's default)
    guidance_scale_2: float | None = None  # two experts (Wan 2.2 A14B): the low-noise one's guidance
    shift: float | None = None  # the scheduler's timestep shift (None: the model's own)
    progress: Callable[[int, int], None] | None = field(default=None, compare=False)
    trace: Trace = field(default=NO_TRACE, compare=False)


@dataclass(frozen=True, kw_only=True)
class CheckedRequest:
    """A GenerationRequest whose parameters and adapter specs were checked (``Engine.check``): no
    I/O yet. ``specs`` hold every scale (a missing one is the catalog's default, else 1.0)."""

    request: GenerationRequest
    params: CallParams
    specs: Mapping[str, AdapterSpec]


@dataclass(frozen=True, kw_only=True)
class PreparedRequest:
    prompt: str
    params: CallParams
    adapters: Bindings
    num_images: int = 1
    seed: int = 0
    output_type: str = "pil"
    negative_prompt: str | None = None
    # The decoded input images (HxWx3 uint8 arrays; edit's references fitted to the served size)
    # and inpaint's mask (HxW uint8): plain arrays, so they cross to the engine process as they are.
    images: tuple = field(default=(), compare=False)
    mask: object = field(default=None, compare=False)
    progress: Callable[[int, int], None] | None = field(default=None, compare=False)
    timings: Timings = field(default_factory=Timings, compare=False)
    trace: Trace = field(default=NO_TRACE, compare=False)
    # The inference defaults the adapters declared and the request runs at (``EngineFront.adapter_defaults``):
    # parameter -> {"value": v, "slots": [...]}; already in ``params``, kept to be reported.
    adapter_defaults: Mapping = field(default_factory=dict, compare=False)
    # Whether the request's caller stopped wanting it (the worker sets it from its job's cancel flag):
    # a run whose every request is cancelled stops at the next step boundary (``runner.DenoiseClock``).
    cancelled: Callable[[], bool] | None = field(default=None, compare=False)
    # What of its texts every request of its forward batch must share (``ModelFamily.mixed_batch_texts``).
    shared_texts: tuple = ()

    @property
    def seeds(self) -> list[int]:
        return [self.seed + i for i in range(self.num_images)]

    @property
    def size(self) -> str:
        return self.params.size

    @property
    def snapped_from(self) -> str | None:
        return self.params.snapped_from

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one forward batch: image-to-image and inpaint requests
        with different input images too (one image per batch position; the runner resizes each to
        the served size). An edit's references are the pipeline's for every prompt of its call
        (``image``: Flux.2's pipelines take a list as several references of EVERY prompt, so two
        edits in one call would each see the other's), so an edit shares its batch with none, unless
        the pipeline takes one reference per batch position (Kontext, ``reference_per_image``); an
        image-to-video request's first frame likewise (Wan's pipeline takes one image a call). A
        family may mix only requests whose texts agree (``shared_texts``: Qwen-Image 2.1's samples
        depend on the other prompts' lengths)."""
        alone = self.params.task in REFERENCE_TASKS and not self.params.reference_per_image
        return (self.params, self.output_type, self.shared_texts, *((id(self),) if alone else ()))


def input_frames_text(counts: tuple[int, ...]) -> str:
    """What image-to-video's input images are, for ``counts`` (``RequestRules.input_frames``)."""
    said = {1: "one input image (the first frame)", 2: "two input images (the first and the last frame)"}
    return " or ".join(said[count] for count in counts)


def all_cancelled(predicates) -> Callable[[], bool] | None:
    """True once every request of a run is cancelled (a mixed batch goes on while one still wants
    it); None when one of them cannot be cancelled."""
    predicates = list(predicates)
    if not predicates or any(p is None for p in predicates):
        return None
    return lambda: all(p() for p in predicates)


@dataclass(frozen=True)
class RequestRules:
    """What a request may ask of one warm engine: its defaults, limits and served sizes."""

    family: ModelFamily
    defaults: Mapping  # num_inference_steps, guidance_scale
    limits: RequestLimits
    sizes: tuple[tuple[int, int], ...]  # (height, width) pairs warmed up; the first is the default
    size_multiple: int  # height and width must be multiples of this (VAE factor x patch size)
    # Only ``sizes`` are served (a compiled engine, or one given a size set); otherwise any multiple
    # of ``size_multiple`` is (an eager engine compiles nothing whatever the size).
    sizes_only: bool
    size_policy: str = "refuse"  # refuse | nearest: what a request at another size gets
    tasks: tuple[str, ...] = (TEXT_TO_IMAGE,)  # warmed up (EngineConfig.tasks)
    max_reference_images: int = 1
    strengths: Mapping = field(default_factory=dict)  # task -> the strength a request without one runs at
    # A video family's frame counts warmed up, the default first (a compiled engine serves only these).
    frames: tuple[int, ...] = ()
    # The input images image-to-video takes (1: the first frame; 2: the first and the last frame).
    input_frames: tuple[int, ...] = (1,)
    experts: int = 1  # the denoisers a run switches between (Wan 2.2 A14B: 2, one guidance each)
    # The scheduler's fixed-shift config key (``engine.shift``; None: no shift a request can set) and its class.
    shift_key: str | None = None
    scheduler: str = ""
    # The steps the model's pipeline always runs (its own sigma schedule, ``ModelFamily.schedule_steps``);
    # None: a request's steps are run.
    schedule_steps: int | None = None
    # The fewest steps the model's pipeline runs right, and why (``ModelFamily.fewest_steps``, which reads
    # its scheduler); None: the family's own ``min_steps``.
    fewest_steps: tuple[int, str] | None = None

    def _steps(self, steps) -> list[str]:
        fewest, why = self.fewest_steps or (self.family.min_steps, self.family.min_steps_reason)
        most = self.limits.max_steps
        if not (isinstance(steps, int) and fewest <= steps <= most):
            return [f"num_inference_steps must be an integer in {fewest}..{most}" + (f" ({why})" if fewest > 1 else "")]
        if self.schedule_steps is not None and steps != self.schedule_steps:
            return [f"num_inference_steps must be {self.schedule_steps} on this model: its pipeline runs the "
                    f"checkpoint's own sigma schedule (model_index.json sample_sigmas) of that many steps whatever "
                    f"a request asks"]
        return []

    def options(self) -> tuple[str, ...]:
        """What a request may set on this model: its family's options, and the model's own
        (``guidance_scale_2`` with two experts, ``shift`` where the scheduler has a fixed one)."""
        return (*self.family.request_options(), *(("guidance_scale_2",) if self.experts > 1 else ()),
                *(("shift",) if self.shift_key else ()))

    def sizes_text(self) -> str:
        return ", ".join(self.size_names())

    def size_names(self) -> tuple[str, ...]:
        """The served sizes as WIDTHxHEIGHT strings (the OpenAI API's ``size``), default first."""
        return tuple(format_size(h, w) for h, w in self.sizes)

    def untaken(self, **given) -> list[str]:
        """The options given that the family does not take, as one problem listing what it takes (also
        said of a body's fields the API does not have: ``server/handlers.py``)."""
        family = self.family
        taken = family.request_options()
        untaken = [name for name, value in given.items() if value is not None and name not in taken]
        if not untaken:
            return []
        return [f"{' and '.join(untaken)} not taken by the {family.name} family (it takes: {', '.join(taken)})"]

    def check_request(self, request: "GenerationRequest") -> CallParams:
        """``check`` on a request's parameters."""
        r = request
        params = self.check(r.prompt, r.num_images, r.num_inference_steps, r.guidance_scale, r.height, r.width, r.seed,
                            r.output_type, r.negative_prompt, r.num_frames, r.guidance_scale_2, r.shift)
        return self.check_task(params, r.task, len(r.images), r.mask is not None, r.strength)

    def implied_task(self, images: int, mask: bool) -> str:
        """The task a request that names none asks for: no input image, text-to-image; a mask,
        inpaint; input images, edit where it is served (as OpenAI's images edits reads them), else
        image-to-video where that is (a video model's first frame), else image-to-image (refused as
        such where that is not served either)."""
        if mask:
            return "inpaint"
        if not images:
            return TEXT_TO_IMAGE
        return next((task for task in ("edit", "image-to-video") if task in self.tasks), "image-to-image")

    def check_task(self, params: CallParams, task, images: int, mask: bool, strength) -> CallParams:
        """The task's inputs (how many images, a mask, the strength) against what is served: an
        unserved task or reference count is an UnservedTask naming what is (nothing else warmed
        it up: serving it would compile). ``task`` None: the one the inputs imply
        (``implied_task``). Returns ``params`` with the task's fields."""
        if task is None:
            task = self.implied_task(images, mask)
        if task not in self.tasks:
            hint = ""
            if task == TEXT_TO_IMAGE and TEXT_TO_IMAGE not in self.tasks:  # an image-to-video checkpoint
                hint = (f" (this model makes nothing from text alone: name the task {self.tasks[0]!r} with the input "
                        "image, or none to imply it)" if images else
                        " (this model makes nothing from text alone: give an input image)")
            raise UnservedTask(f"task {task!r} is not served by this warm engine; served tasks: {', '.join(self.tasks)}"
                               + hint, self.tasks)
        problems = []
        if task == TEXT_TO_IMAGE:
            if images or mask:
                problems.append("text-to-image takes no input image or mask (ask for image-to-image, inpaint or edit)")
            if strength is not None:
                problems.append("strength is taken by image-to-image and inpaint only")
        elif task == "image-to-video":
            if images not in self.input_frames:
                problems.append(f"image-to-video on this model takes {input_frames_text(self.input_frames)}, got "
                                f"{images} input image(s)" + self.family.input_frames_hint(self.input_frames, images))
            if mask:
                problems.append("image-to-video takes no mask")
            if strength is not None:
                problems.append("strength is taken by image-to-image and inpaint only")
        elif task in IMAGE_TASKS:
            if images != 1:
                problems.append(f"{task} takes exactly one input image, got {images}")
            if mask != (task == "inpaint"):
                problems.append("inpaint needs a mask" if task == "inpaint" else f"{task} takes no mask")
            strength = self.strengths.get(task) if strength is None else strength
            if strength is not None and not (isinstance(strength, (int, float)) and not isinstance(strength, bool)
                                             and 0 < strength <= 1):
                problems.append("strength must be a number in (0, 1]")
            elif strength is not None:
                steps_run = self.family.denoising_steps(params.num_inference_steps, strength)
                if steps_run < 1:
                    problems.append(f"strength {strength:g} of {params.num_inference_steps} steps leaves no step to run")
        else:  # edit
            if not 1 <= images <= self.max_reference_images:
                if images > self.max_reference_images:
                    raise UnservedTask(f"edit with {images} reference images is not served: this engine warmed up "
                                       f"1..{self.max_reference_images} (max_reference_images)", self.tasks)
                problems.append("edit needs at least one reference image")
            if mask:
                problems.append("edit takes no mask")
            if strength is not None:
                problems.append("strength is taken by image-to-image and inpaint only")
        if problems:
            raise InvalidRequest("; ".join(problems))
        if strength is None:
            per_image = task == "edit" and images == 1 and self.family.edit_references_per_image
            return replace(params, task=task, references=images, reference_per_image=per_image)
        return replace(params, task=task, strength=float(strength), references=images,
                       strength_steps=self.family.denoising_steps(params.num_inference_steps, strength))

    def check(self, prompt, num_images=1, steps=None, guidance=None, height=None, width=None, seed=0,
              output_type="pil", negative_prompt=None, num_frames=None, guidance_scale_2=None,
              shift=None) -> CallParams:
        """Every problem at once (InvalidRequest), or a work / length / pixel bound (RequestTooLarge),
        or a size not served (UnservedShape, policy "refuse"). The CallParams returned hold the size
        served: the one asked for, or the nearest served one (policy "nearest"; ``requested`` and
        ``snapped_from`` then say what was asked). Nothing here compiles or touches the model."""
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
        problems += self._steps(steps)
        problems += self.untaken(negative_prompt=negative_prompt, guidance_scale=guidance, num_frames=num_frames)
        frames = self._frames(num_frames, problems)
        guidance = self.defaults["guidance_scale"] if guidance is None else guidance
        problems += self._guidance(guidance, guidance_scale_2) + shift_problems(shift, self.shift_key, self.scheduler)
        height, width = height or self.sizes[0][0], width or self.sizes[0][1]
        for label, value in (("height", height), ("width", width)):
            if not (isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 4096):
                problems.append(f"{label} must be a positive integer up to 4096"
                                + ("" if self.sizes_only else f", a multiple of {self.size_multiple}"))
            elif not self.sizes_only and value % self.size_multiple:
                problems.append(f"{label} must be a positive multiple of {self.size_multiple} up to 4096")
        if not (isinstance(seed, int) and 0 <= seed < 2**63 - limits.max_images):
            problems.append("seed must be a non-negative integer")
        if output_type not in OUTPUT_TYPES:
            problems.append(f"output_type must be one of {', '.join(OUTPUT_TYPES)}")
        if problems:
            raise InvalidRequest("; ".join(problems))
        if frames is not None and self.sizes_only and self.frames and frames not in self.frames:
            raise UnservedShape(f"{frames} frames is not served by this warm engine; served frame counts: "
                                f"{', '.join(map(str, self.frames))}", self.size_names())
        requested = None
        if self.sizes_only and (height, width) not in self.sizes:
            if self.size_policy != "nearest":
                raise UnservedShape(f"size {format_size(height, width)} (width x height) is not served by this "
                                    f"warm engine; served sizes: {self.sizes_text()}", self.size_names())
            requested, (height, width) = (height, width), nearest_size(self.sizes, height, width)
        if (height, width) not in self.sizes and height * width > limits.max_pixels:
            # Only an engine that serves any size gets here with an unconfigured size (a sizes-only
            # one refused or snapped it above): bound the image itself, not just the work.
            raise RequestTooLarge(
                f"size {format_size(height, width)} (width x height) is {height * width:,} pixels; this engine "
                f"serves at most {limits.max_pixels:,} (max_pixels) at a size it was not configured with")
        self._bound_work(height, width, num_images, steps, frames)
        return CallParams(num_inference_steps=steps, guidance_scale=float(guidance), height=height, width=width,
                          requested=requested, num_frames=frames,
                          guidance_scale_2=None if guidance_scale_2 is None else float(guidance_scale_2),
                          shift=None if shift is None else float(shift))

    def _guidance(self, guidance, guidance_2) -> list[str]:
        """``guidance_scale`` in 0..50, and the low-noise expert's (``guidance_scale_2``): taken with two
        experts; a number like ``guidance_scale``; then as the family's pipeline reads the pair
        (``ModelFamily.second_guidance_problems``)."""
        if not (isinstance(guidance, (int, float)) and math.isfinite(guidance) and 0 <= guidance <= 50):
            return ["guidance_scale must be a finite number in 0..50"]
        if guidance_2 is None:
            return []
        if self.experts < 2:
            return ["guidance_scale_2 is taken by a model of two experts (Wan 2.2 A14B: the low-noise one's "
                    "guidance); this one has one denoiser"]
        if isinstance(guidance_2, bool) or not isinstance(guidance_2, (int, float)) \
                or not (math.isfinite(guidance_2) and 0 <= guidance_2 <= 50):
            return ["guidance_scale_2 must be a finite number in 0..50"]
        return self.family.second_guidance_problems(guidance, guidance_2)

    def _bound_work(self, height: int, width: int, num_images: int, steps: int, frames: int | None) -> None:
        """RequestTooLarge past ``max_work`` pixel-steps (a video's every frame counted)."""
        work = height * width * num_images * steps * (frames or 1)
        if work > self.limits.max_work:
            named, given = ("height x width x images x steps", f"{height} x {width} x {num_images} x {steps}")
            if frames is not None:
                named, given = ("height x width x videos x steps x frames", f"{given} x {frames}")
            raise RequestTooLarge(f"the request asks for {work:,} pixel-steps ({named} = {given}); the limit is "
                                  f"{self.limits.max_work:,}")

    def default_frames(self) -> int | None:
        """The frames of a video request that gives none: the first count served, else the model's
        default; None for an image family."""
        if not self.family.video:
            return None
        return self.frames[0] if self.frames else self.defaults["num_frames"]

    def _frames(self, num_frames, problems: list) -> int | None:
        """A video family's frame count for the request (the default when it gives none), its
        problems added to ``problems``; None for an image family. A count the family's VAE cannot
        make is an InvalidRequest naming the rule; a valid one not warmed up an UnservedShape
        (raised after every other problem was collected: it is the engine's limit, not the
        request's mistake)."""
        if not self.family.video:
            return None
        if num_frames is None:
            return self.default_frames()
        wrong = self.family.frame_problems(num_frames)
        problems += wrong
        return None if wrong else num_frames
