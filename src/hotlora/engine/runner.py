"""Run one pack: chunks of the compiled batch size, per-image seeds, timings."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Timings:
    resolve_ms: float = 0.0  # read + convert + validate the request's adapters
    swap_ms: float = 0.0
    generate_ms: list[float] = field(default_factory=list)  # one entry per chunk
    total_ms: float = 0.0

    def as_dict(self) -> dict:
        return {
            "resolve_ms": round(self.resolve_ms, 3),
            "swap_ms": round(self.swap_ms, 3),
            "generate_ms": [round(x, 3) for x in self.generate_ms],
            "total_ms": round(self.total_ms, 3),
        }


def synchronize(device) -> None:
    """Wait for the work queued on ``device``. diffusers returns latents without a host sync and
    CUDA copies are asynchronous: a timer read before this misses the last kernels. Called at
    measurement boundaries only, never inside the denoising loop. A no-op on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":  # mps, xpu, ...: each backend module has its own synchronize
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "synchronize"):
            backend.synchronize()


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


def image_generators(seed: int, start: int, count: int) -> list[torch.Generator]:
    """Image i's noise comes from its own generator seeded ``seed + i``: the same request gives
    the same images whatever the batch size or chunking. CPU generators, so devices agree too."""
    return [torch.Generator(device="cpu").manual_seed(seed + i) for i in range(start, start + count)]


def run_pack(pipeline, *, prompt, num_images: int, batch_size: int, seed: int, output_type: str, call_kwargs: dict,
             timings: Timings, progress: Callable[[int, int], None] | None = None,
             before_chunk: Callable[[int], None] | None = None):
    """Run ``num_images`` through ``pipeline`` in chunks; returns images (list or concatenated tensor).

    ``progress(done, total)`` is called after every denoising step of every chunk.
    """
    outputs = []
    start = 0
    chunks = chunk_sizes(num_images, batch_size)
    steps = call_kwargs["num_inference_steps"]
    for index, size in enumerate(chunks):
        if before_chunk is not None:
            before_chunk(size)
        began = time.perf_counter()
        extra = {}
        if progress is not None:
            extra["callback_on_step_end"] = step_callback(progress, index * steps, len(chunks) * steps)
        result = pipeline(
            prompt=prompt,
            num_images_per_prompt=size,
            generator=image_generators(seed, start, size),
            output_type=output_type,
            **call_kwargs,
            **extra,
        )
        synchronize(pipeline.device)
        timings.generate_ms.append((time.perf_counter() - began) * 1000)
        outputs.append(result.images)
        start += size
    if output_type == "pil":
        return [img for chunk in outputs for img in chunk]
    if output_type == "np":
        import numpy as np

        return np.concatenate(outputs)
    return torch.cat(outputs)


