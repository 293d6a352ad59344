"""Making an engine warm: every shape steady state will see is run once at start-up (so no request
compiles), then, with ``batch_size="auto"``, the chunk size is chosen by measuring.

Why measure: batching a pack is the biggest lever on a launch-bound model (the tiny one: ~2x), but
on a compute-bound one a big batch can be slower per image than a smaller one (measured on a tiny
Flux at 256x256 on 2 cores: the pack one image at a time was 3.5-8% faster). Which wins depends on
the hardware, the size and CFG, so it is timed on the machine that serves, after the compile runs.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Callable

import torch

from hotlora.config import format_size
from hotlora.engine.pipeline import graph_count
from hotlora.engine.runner import synchronize

log = logging.getLogger(__name__)

TIMED_STEPS = 2  # denoising steps of one timed run
TIMED_REPEATS = 2  # runs per candidate; the fastest counts (the first may still page things in)
clock: Callable[[], float] = time.perf_counter  # replaced by tests with a fake timer


def guidance_scales(engine) -> list[float]:
    """The guidance values whose batch shapes differ: SDXL also runs without CFG (half the batch)."""
    return [engine.defaults["guidance_scale"], *([1.0] if engine.family.name == "sdxl" else [])]


def candidates(limit: int) -> list[int]:
    """Chunk sizes warm-up runs anyway (1, the limit and the one below it, which cover every last
    chunk once the batch dimension is dynamic) plus half the limit: the ones worth timing."""
    return sorted({1, max(1, limit // 2), max(1, limit - 1), limit})


def warm_up(engine) -> None:
    """Run every batch shape steady state will see, at every served size, in every state of the
    writer, so no request compiles. Batch 1 specializes differently from larger batches, and the
    second distinct batch turns the batch dimension dynamic; the limit and a size in between cover
    every last chunk. SDXL also runs without CFG (a batch half as big).

    With dynamic sizes, the second size turns the sequence / spatial dimensions dynamic (dynamo's
    automatic dynamic shapes). Duck shaping is off while compiling: with it, dims that happen to be
    equal at warm-up (a square image's height and width, a sequence length and a channel count)
    would share one symbol and a later size that breaks the equality would recompile (diffusers
    documents ``use_duck_shape=False`` with dynamic shapes)."""
    batches = sorted({1, engine.batch_size, max(1, engine.batch_size - 1)})
    began = time.perf_counter()
    duck = torch.fx.experimental._config.patch(use_duck_shape=False) if engine.dynamic_sizes else nullcontext()
    with duck:
        for state in engine.writer.warmup_states():
            engine.writer.enter(state)
            for height, width in engine.served_sizes:
                for scale in guidance_scales(engine):
                    for batch in batches:
                        log.info("warm-up: %s, batch %d, guidance %.1f, writer state %s (%s)",
                                 format_size(height, width), batch, scale, state, engine.compile_mode or "eager")
                        _run(engine, batch, height, width, scale)
    engine.warmup_s = time.perf_counter() - began
    log.info("warm: %.1fs, %d graphs compiled, %s", engine.warmup_s, graph_count(), engine.compile_mode or "eager")


def _run(engine, batch: int, height: int, width: int, scale: float) -> None:
    engine.pipeline(prompt="warm-up", num_images_per_prompt=batch, num_inference_steps=TIMED_STEPS,
                    guidance_scale=scale, height=height, width=width,
                    generator=[torch.Generator().manual_seed(i) for i in range(batch)], output_type="latent")


def chunk_key(height: int, width: int, cfg: bool) -> str:
    """How a measured choice is named: ``WIDTHxHEIGHT``, ``+cfg`` when the batch is doubled."""
    return format_size(height, width) + ("+cfg" if cfg else "")


def choose(ms_per_image: dict[int, float]) -> int:
    """The chunk size with the best time per image; on a tie, the larger one (fewer chunks, fewer
    progress events and swaps). Deterministic given the timings."""
    return min(ms_per_image, key=lambda batch: (ms_per_image[batch], -batch))


def measure_chunks(engine) -> dict[str, dict]:
    """For every served size and CFG mode: the time per image of each candidate chunk size (after
    the compile runs, synchronised on CUDA, the fastest of a few repeats) and the choice. Runs in
    whatever writer state warm-up left (the timing of a chunk does not depend on the adapters)."""
    measured = {}
    for height, width in engine.served_sizes:
        for scale in guidance_scales(engine):
            per_image = {}
            for batch in candidates(engine.batch_size):
                best = float("inf")
                for _ in range(TIMED_REPEATS):
                    synchronize(engine.device)
                    began = clock()
                    _run(engine, batch, height, width, scale)
                    synchronize(engine.device)
                    best = min(best, clock() - began)
                per_image[batch] = round(best * 1000 / batch, 3)
            key = chunk_key(height, width, engine.uses_cfg(scale))
            measured[key] = {"chosen": choose(per_image), "ms_per_image": per_image}
            log.info("chunk size for %s: %d (ms per image: %s)", key, measured[key]["chosen"],
                     ", ".join(f"batch {b}: {ms:g}" for b, ms in per_image.items()))
    return measured
