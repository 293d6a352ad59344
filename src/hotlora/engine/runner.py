"""Run one pack: chunks of the compiled batch size, per-image seeds, timings."""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from hotlora.engine.device import synchronize
from hotlora.engine.request import Timings
from hotlora.tracing import NO_TRACE, Trace


def chunk_sizes(num_images: int, batch_size: int) -> list[int]:
    """``num_images`` split into ceil(n / batch_size) chunks, all full but the last."""
    full, rest = divmod(num_images, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


def step_callback(progress: Callable[[int, int], None], done_before: int, total: int):
    """diffusers' ``callback_on_step_end``; a failing listener must never break generation."""

    def on_step_end(pipeline, step, timestep, callback_kwargs):
        try:
            progress(done_before + step + 1, total)
        except Exception:
            logging.getLogger(__name__).exception("progress listener failed")
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
    ``progress``. None until the pipeline called back after its last step."""

    def __init__(self, device, steps: int, progress: Callable[[int, int], None] | None = None,
                 done_before: int = 0, total: int = 0):
        self.device, self.steps = device, steps
        self.last_step_ended: float | None = None
        self._progress = step_callback(progress, done_before, total) if progress is not None else None

    def __call__(self, pipeline, step, timestep, callback_kwargs):
        if self._progress is not None:
            callback_kwargs = self._progress(pipeline, step, timestep, callback_kwargs)
        if step + 1 == self.steps:
            synchronize(self.device)
            self.last_step_ended = time.perf_counter()
        return callback_kwargs


def split_chunk(timings: Timings, trace: Trace, began: float, ended: float, clock: DenoiseClock, size: int) -> None:
    """One chunk's time as denoise + decode (timings and the request's trace)."""
    timings.generate_ms.append((ended - began) * 1000)
    timings.chunks.append(size)
    boundary = clock.last_step_ended
    if boundary is not None:
        timings.decode_ms.append((ended - boundary) * 1000)
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


def run_pack(pipeline, *, prompt, num_images: int, batch_size: int, seed: int, output_type: str, call_kwargs: dict,
             timings: Timings, progress: Callable[[int, int], None] | None = None,
             before_chunk: Callable[[int], None] | None = None, trace: Trace = NO_TRACE):
    """Run ``num_images`` through ``pipeline`` in chunks; returns images (list or concatenated tensor).

    ``progress(done, total)`` is called after every denoising step of every chunk. Each chunk's
    time goes to ``timings`` (and to ``trace`` as a denoise and a decode span).
    """
    outputs = []
    start = 0
    chunks = chunk_sizes(num_images, batch_size)
    steps = call_kwargs["num_inference_steps"]
    for index, size in enumerate(chunks):
        if before_chunk is not None:
            before_chunk(size)
        began = time.perf_counter()
        clock = DenoiseClock(pipeline.device, steps, progress, index * steps, len(chunks) * steps)
        result = pipeline(
            prompt=prompt,
            num_images_per_prompt=size,
            generator=image_generators(seed, start, size),
            output_type=output_type,
            callback_on_step_end=clock,
            **call_kwargs,
        )
        synchronize(pipeline.device)
        split_chunk(timings, trace, began, time.perf_counter(), clock, size)
        outputs.append(result.images)
        start += size
    if output_type == "pil":
        return [img for chunk in outputs for img in chunk]
    if output_type == "np":
        import numpy as np

        return np.concatenate(outputs)
    return torch.cat(outputs)
