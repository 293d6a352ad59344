"""Running prepared requests on the warm model: one path for a pack and for a mixed batch.

A run is a list of requests whose images are laid out in order and cut into chunks: one request's
pack in chunks of ``chunk_for`` its size and CFG mode, or several requests in ONE forward batch
(the banks writer's mixed batch, filled by the worker up to the compiled limit). Per chunk the
writer binds each image's adapters, the pipeline runs once with one generator per image, and the
chunk's time is split into denoise and decode; then each request's images are checked and handed
to the one result builder (``results.build_result``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import groupby
from operator import itemgetter
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import torch

from hotlora.engine import guard
from hotlora.engine.device import synchronize
from hotlora.engine.guard import NonFiniteOutput
from hotlora.engine.inputs import as_pil
from hotlora.engine.prompts import batch_prompts
from hotlora.engine.request import IMAGE_TASKS, PreparedRequest, Timings, all_cancelled, images_per_video
from hotlora.engine.results import IMAGES, GenerationResult, OutputKind, build_result
from hotlora.engine.shift import shifted
from hotlora.engine.writers import SwapReport
from hotlora.errors import ClientGone, InvalidRequest
from hotlora.families import REFERENCE_TASKS
from hotlora.tracing import NO_TRACE, Trace, together

if TYPE_CHECKING:
    from hotlora.engine.warm import WarmModel

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Part:
    """Images ``start .. start + count`` of the run's request ``request``, side by side in a chunk."""

    request: int
    start: int
    count: int


Chunk = tuple[Part, ...]


def chunk_sizes(num_images: int, batch_size: int) -> list[int]:
    """``num_images`` split into ceil(n / batch_size) chunks, all full but the last."""
    full, rest = divmod(num_images, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


def plan_chunks(counts: Sequence[int], size: int) -> list[Chunk]:
    """The images of requests with ``counts[i]`` images each, in request order, cut into chunks of
    ``size`` (``chunk_sizes``: all full but the last), each chunk one part per request it holds."""
    images = [(request, index) for request, count in enumerate(counts) for index in range(count)]
    chunks, start = [], 0
    for n in chunk_sizes(len(images), size):
        parts = []
        for request, held in groupby(images[start:start + n], key=itemgetter(0)):
            indices = [index for _, index in held]
            parts.append(Part(request=request, start=indices[0], count=len(indices)))
        chunks.append(tuple(parts))
        start += n
    return chunks


def step_callback(progress: Callable[[int, int], None], done_before: int, total: int):
    """diffusers' ``callback_on_step_end``; a failing listener must never break generation."""

    def on_step_end(pipeline, step, timestep, callback_kwargs):
        try:
            progress(done_before + step + 1, total)
        except Exception:
            log.exception("progress listener failed")
        return callback_kwargs

    return on_step_end


def fan_out(listeners) -> Callable[[int, int], None] | None:
    """One progress listener that calls every one of ``listeners`` (None among them skipped)."""
    listeners = [listener for listener in listeners if listener is not None]
    if not listeners:
        return None

    def progress(done: int, total: int) -> None:
        for listener in listeners:
            listener(done, total)

    return progress


class DenoiseClock:
    """When a chunk's last denoising step ended (diffusers' step callback; the device synchronised
    there, once: it is the boundary between denoising and decoding), then passing each step on to
    ``progress``. None until the pipeline called back after its last step.

    ``stop()`` true after a step: the run ends there with ClientGone, raised out of the pipeline's
    loop. A step boundary is a clean place to leave: the slots and text encoders hold the request's
    adapters as after any run, the compiled graphs are untouched, and every pipeline call starts
    anew (its scheduler's timesteps set again, its own state reset). Raising, rather than diffusers'
    ``pipeline._interrupt``, also skips the VAE decode and works for pipelines without that flag."""

    def __init__(self, device, steps: int, progress: Callable[[int, int], None] | None = None,
                 done_before: int = 0, total: int = 0, stop: Callable[[], bool] | None = None):
        self.device, self.steps = device, steps
        self.last_step_ended: float | None = None
        self._progress = step_callback(progress, done_before, total) if progress is not None else None
        self._stop, self._done_before, self._total = stop, done_before, total

    def __call__(self, pipeline, step, timestep, callback_kwargs):
        if self._progress is not None:
            callback_kwargs = self._progress(pipeline, step, timestep, callback_kwargs)
        if self._stop is not None and self._stop():
            raise ClientGone(f"cancelled while running: stopped after step {self._done_before + step + 1} of "
                             f"{self._total or self.steps}")
        if step + 1 == self.steps:
            synchronize(self.device)
            self.last_step_ended = time.perf_counter()
        return callback_kwargs


def reset_stateful_hooks(pipeline) -> None:
    """What diffusers does at the end of every ``__call__`` (``maybe_free_model_hooks``): its
    stateful hooks (FirstBlockCache, TaylorSeer: the last step's residuals) reset. A run stopped
    inside the loop skipped that, and the next call would start from the cancelled one's cache.
    (cache-dit resets its context when a call begins, whatever ended the last one.)"""
    for component in pipeline.components.values():
        if hasattr(component, "_reset_stateful_cache"):
            component._reset_stateful_cache()


def split_chunk(timings: Iterable[Timings], trace: Trace, began: float, ended: float, clock: DenoiseClock,
                size: int) -> None:
    """One chunk's time as denoise + decode: in the timings of every request it carried, and as
    spans in ``trace``."""
    boundary = clock.last_step_ended
    for each in timings:
        each.generate_ms.append((ended - began) * 1000)
        each.chunks.append(size)
        if boundary is not None:
            each.decode_ms.append((ended - boundary) * 1000)
    if trace.recording:  # spans are wall clock: this chunk's perf_counter readings, shifted (``ended`` is now)
        offset = time.time_ns() - int(ended * 1e9)
        middle = boundary if boundary is not None else ended
        trace.record("denoise", offset + int(began * 1e9), offset + int(middle * 1e9), images=size)
        if boundary is not None:
            trace.record("decode", offset + int(boundary * 1e9), offset + int(ended * 1e9), images=size)


def image_generators(seed: int, start: int, count: int) -> list[torch.Generator]:
    """Image i's noise comes from its own generator seeded ``seed + i``: the same request gives
    the same images whatever the batch size or chunking. CPU generators, so devices agree too."""
    return [torch.Generator(device="cpu").manual_seed(seed + i) for i in range(start, start + count)]


def overflowed(warm: WarmModel, requests: Sequence[PreparedRequest], images: Sequence) -> dict[int, NonFiniteOutput]:
    """Request index -> its NonFiniteOutput, for each request whose own images are not finite (its
    adapters overflowed them): samples are independent, so a request that overflowed fails alone."""
    refused = {}
    for i, request in enumerate(requests):
        try:
            guard.check_finite(images[i], request.adapters, warm.pipeline)
        except NonFiniteOutput as exc:
            refused[i] = exc
    return refused


def run_chunks(pipeline, chunks: Sequence[Chunk], *, seeds: Sequence[int], output_type: str, call_kwargs: dict,
               timings: Sequence[Timings], progress: Callable[[int, int], None] | None = None,
               before_chunk: Callable[[Chunk], dict] | None = None, trace: Trace = NO_TRACE,
               output: OutputKind = IMAGES, steps: int | None = None, stop: Callable[[], bool] | None = None,
               sounds: list[list] | None = None) -> list:
    """Run each chunk through ``pipeline`` (one call each) and return each request's images, its
    parts joined in order. Image i of request r draws its noise from seed ``seeds[r] + i``.

    ``before_chunk(chunk)``: the chunk's own pipeline arguments (its prompts, its writer bound);
    default: samples per prompt (``output.per_prompt``: ``num_images_per_prompt``,
    ``num_videos_per_prompt``) of its size. ``output`` also names the pipeline output's attribute. ``progress(done, total)`` is called after every
    denoising step of every chunk. Each chunk's time goes to the ``timings`` of every request it
    carries (and to ``trace`` as a denoise and a decode span). ``steps``: the denoising steps each
    call runs (default: all of ``num_inference_steps``; fewer with an image-to-image strength).
    ``stop``: checked after every step (``DenoiseClock``). ``sounds``: one list per request, given where
    the pipeline makes a sound track with its videos (``ModelFamily.audio_rate``): each request's part of
    the output's ``.audio`` is appended to its list, chunk by chunk.
    """
    steps = steps or call_kwargs["num_inference_steps"]
    pieces: list[list] = [[] for _ in seeds]
    for index, chunk in enumerate(chunks):
        size = sum(part.count for part in chunk)
        arguments = before_chunk(chunk) if before_chunk is not None else {output.per_prompt: size}
        began = time.perf_counter()
        clock = DenoiseClock(pipeline.device, steps, progress, index * steps, len(chunks) * steps, stop)
        generators = [g for part in chunk for g in image_generators(seeds[part.request], part.start, part.count)]
        try:
            made = pipeline(generator=generators, output_type=output_type, callback_on_step_end=clock, **call_kwargs,
                            **arguments)
        except ClientGone:
            reset_stateful_hooks(pipeline)
            raise
        images = getattr(made, output.attribute)
        audio = made.audio if sounds is not None else None
        synchronize(pipeline.device)
        split_chunk([timings[part.request] for part in chunk], trace, began, time.perf_counter(), clock, size)
        offset = 0
        for part in chunk:
            pieces[part.request].append(images[offset:offset + part.count])
            if audio is not None:
                sounds[part.request].append(audio[offset:offset + part.count])
            offset += part.count
    return [output.join(own) for own in pieces]


def at_served_size(processor, image, height: int, width: int):
    """``image`` resized to ``width`` x ``height`` by the task pipeline's own image processor, as the
    pipelines that take ``height`` / ``width`` resize their inputs (``VaeImageProcessor.resize``):
    then an image already that size passes them unchanged. Why not leave it to the pipeline: SDXL's
    and SD1.5's image-to-image pipelines take no size and denoise at the input image's (a shape
    warm-up never compiled, and in a batch every image is resized to the first one's size)."""
    if image.size == (width, height):
        return image
    return processor.resize(image, height, width)


class TaskInputs:
    """A run's input images as its task pipeline takes them, per chunk (``ModelFamily.task_arguments``):
    each request's arrays made PIL images once, image-to-image and inpaint inputs at the served size
    (``at_served_size``). Image-to-image and inpaint pass one image (and mask) per image of the
    chunk, in order; an edit its request's references once (fitted to the served size in prepare),
    or, in a mixed batch of edits the pipeline takes a reference per position of (Kontext), each
    request's reference once per image of it."""

    def __init__(self, family, params, requests: Sequence[PreparedRequest], pipeline, mixed: bool = False):
        self.family, self.params = family, params
        self.per_position = mixed and params.reference_per_image
        self.images = [[as_pil(x) for x in r.images] for r in requests]
        self.masks = [None if r.mask is None else as_pil(r.mask) for r in requests]
        if params.task in IMAGE_TASKS:
            size = params.height, params.width
            self.images = [[at_served_size(pipeline.image_processor, x, *size) for x in own] for own in self.images]
            masks = getattr(pipeline, "mask_processor", pipeline.image_processor)
            self.masks = [None if m is None else at_served_size(masks, m, *size) for m in self.masks]

    def arguments(self, chunk: Chunk) -> dict:
        if not self.images or not self.images[0]:
            return {}
        per_image = images_per_video(self.family, self.params.task) or self.per_position
        owners = [part.request for part in chunk for _ in range(part.count if per_image else 1)]
        images = [image for i in owners for image in self.images[i]]
        masks = None if self.masks[0] is None else [self.masks[i] for i in owners]
        return self.family.task_arguments(self.params.task, images, masks, self.params.strength,
                                          len(images) if self.per_position else self.params.references)


def unshareable(family) -> str:
    """Why requests of unequal ``batch_key`` cannot share a mixed batch of ``family``."""
    shares = family.mixed_batch_shares
    return f"requests in one batch must share steps, guidance, size, output type{' and ' + shares if shares else ''}"


class Runner:
    """Runs prepared requests on one warm model, one run at a time inside its guards."""

    def __init__(self, warm: WarmModel):
        self.warm = warm

    def run(self, requests: Sequence[PreparedRequest], *,
            mixed: bool = False) -> list[GenerationResult | NonFiniteOutput]:
        """One GenerationResult per request, or that request's own NonFiniteOutput (its adapters
        overflowed its images; the others are served). ``mixed``: the requests share ONE forward
        batch (they must share their denoising parameters and fit the compiled batch); else there
        is one request, its pack run in chunks of ``chunk_for`` its size and CFG mode."""
        warm, total = self.warm, sum(r.num_images for r in requests)
        if mixed and (not requests or total > warm.batch_size):
            raise InvalidRequest(f"a mixed batch holds 1..{warm.batch_size} images, got {total}")
        if mixed and len({r.batch_key() for r in requests}) > 1:
            raise InvalidRequest(unshareable(warm.family))
        if not mixed and len(requests) != 1:
            raise ValueError(f"a pack is one request, got {len(requests)}")
        began, first = time.perf_counter(), requests[0]
        params = first.params
        # A mixed batch is one chunk holding every request whole (``batch_prompts`` reads them so).
        chunks = plan_chunks([r.num_images for r in requests], total if mixed else warm.chunk_for(params))
        trace = together([r.trace for r in requests]) if mixed else first.trace
        repeat = warm.batch_factor(params)
        swap, timings = SwapReport(), [Timings() for _ in requests]
        call = params.pipeline_kwargs(warm.family)
        # An edit's batch is one request (``batch_key``) and its pipeline takes the prompt once beside
        # the references (Qwen-Image-Edit-Plus refuses a list of prompts): a pack's prompt, also when
        # it runs as a mixed batch; unless each position takes its own reference (Kontext). Image-to-video too.
        one_prompt = not mixed or (params.task in REFERENCE_TASKS and not params.reference_per_image)
        texts = warm.text.prompts(first.adapters, first.prompt, first.negative_prompt) if one_prompt else None
        inputs = TaskInputs(warm.family, params, requests, warm.task_pipelines[params.task], mixed)
        per_prompt = warm.output.per_prompt

        def before_chunk(chunk: Chunk) -> dict:
            owners = [requests[part.request] for part in chunk]
            samples = [owner.adapters for part, owner in zip(chunk, owners) for _ in range(part.count)]
            size = len(samples)
            with trace.span("swap", images=size, **({"requests": len(owners)} if mixed else {})):
                swap.add(warm.writer.bind(samples, repeat))
                if not one_prompt:  # each image its own prompt, encoded group by group where text states differ
                    return {per_prompt: 1, **inputs.arguments(chunk),
                            **batch_prompts(warm.text, warm.pipeline, warm.family, owners,
                                            warm.uses_cfg(params.guidance_scale), swap)}
            return {**warm.family.call_prompts(params.task, texts, size, per_prompt), **inputs.arguments(chunk)}

        warm.active_adapters = len({b.adapter.sha256 for r in requests for b in r.adapters.values()})
        with warm.section():
            if one_prompt:  # one request: its text-encoder state once, its prompt encoded by the pipeline
                with trace.span("swap", target="text_encoders"):
                    swap.text_ms += warm.text.apply(first.adapters)
            sounds = [[] for _ in requests] if warm.audio_rate else None
            with shifted(pipeline := warm.task_pipelines[params.task], params.shift):
                images = run_chunks(pipeline, chunks, seeds=[r.seed for r in requests],
                                    output_type=warm.output.pipeline_output_type(first.output_type), call_kwargs=call,
                                    timings=timings, progress=fan_out([r.progress for r in requests]),
                                    before_chunk=before_chunk, trace=trace, output=warm.output,
                                    steps=params.denoising_steps, stop=all_cancelled(r.cancelled for r in requests),
                                    sounds=sounds)
            refused = overflowed(warm, requests, images)
        return [refused[i] if i in refused else build_result(warm, request, images[i], timings[i], swap, began,
                                                             torch.cat(sounds[i]).float() if sounds else None)
                for i, request in enumerate(requests)]
