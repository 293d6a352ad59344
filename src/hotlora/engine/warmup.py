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

from hotlora.settings import format_size
from hotlora.engine.pipeline import graph_count
from hotlora.engine.runner import synchronize

log = logging.getLogger(__name__)

TIMED_STEPS = 2  # denoising steps of one timed run
TIMED_REPEATS = 2  # runs per candidate; the fastest counts (the first may still page things in)
clock: Callable[[], float] = time.perf_counter  # replaced by tests with a fake timer


def guidance_scales(engine) -> list[float]:
    """The guidance values whose batch shapes differ (the family says: under batch CFG, guidance 1
    runs a batch half as big)."""
    return engine.family.warmup_guidance_scales(engine.defaults["guidance_scale"])


def candidates(limit: int) -> list[int]:
    """Chunk sizes warm-up runs anyway (1, the limit and the one below it, which cover every last
    chunk once the batch dimension is dynamic) plus half the limit: the ones worth timing."""
    return sorted({1, max(1, limit // 2), max(1, limit - 1), limit})


def warm_up(engine) -> None:
    """Run every batch shape steady state will see, at every served size, in every state of the
    writer, so no request compiles. Batch 1 specializes differently from larger batches, and the
    second distinct batch turns the batch dimension dynamic; the limit and a size in between cover
    every last chunk, at each guidance whose batch shape differs (``guidance_scales``).

    With dynamic sizes, the second size turns the sequence / spatial dimensions dynamic (dynamo's
    automatic dynamic shapes). Duck shaping is off while compiling: with it, dims that happen to be
    equal at warm-up (a square image's height and width, a sequence length and a channel count)
    would share one symbol and a later size that breaks the equality would recompile (diffusers
    documents ``use_duck_shape=False`` with dynamic shapes)."""
    batches = sorted({1, engine.batch_size, max(1, engine.batch_size - 1)})
    began = time.perf_counter()
    duck = torch.fx.experimental._config.patch(use_duck_shape=False) if engine.dynamic_sizes else nullcontext()
    # Eager, no state compiles anything: one state pages the model in (the rest would only cost time).
    states = engine.writer.warmup_states() if engine.compile_mode else engine.writer.warmup_states()[:1]
    with duck:
        for state in states:
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


def measure_chunks(engine, budget_s: float | None = None) -> dict[str, dict]:
    """For every served size and CFG mode: the time per image of each candidate chunk size (after
    the compile runs, synchronised on CUDA, the fastest of a few repeats) and the choice. Runs in
    whatever writer state warm-up left (the timing of a chunk does not depend on the adapters).

    Bounded by ``budget_s`` (``EngineConfig.chunk_budget_s``): the runs go round by round (every
    key's candidates once, the limit first, then the repeats), so a budget that runs out leaves
    every key measured as far as it got; a candidate never timed is never chosen, and a key with
    none timed runs at the compiled limit (``"bounded": true`` says the budget cut it short)."""
    keys = [(h, w, scale) for h, w in engine.served_sizes for scale in guidance_scales(engine)]
    # The limit first: it is what runs when nothing else was timed, and usually the best on a GPU.
    order = sorted(candidates(engine.batch_size), key=lambda b: (b != engine.batch_size, b))
    runs = [(repeat, key, batch) for repeat in range(TIMED_REPEATS) for key in keys for batch in order]
    best: dict[tuple, dict[int, float]] = {key: {} for key in keys}
    began, done = clock(), 0
    for repeat, key, batch in runs:
        spent = clock() - began
        if budget_s is not None and spent >= budget_s:
            log.warning("chunk-size measurement stopped at its budget (%.0fs, chunk_budget_s) after %d of %d runs",
                        budget_s, done, len(runs))
            break
        height, width, scale = key
        synchronize(engine.device)
        start = clock()
        _run(engine, batch, height, width, scale)
        synchronize(engine.device)
        took = clock() - start
        best[key][batch] = min(best[key].get(batch, float("inf")), took)
        done += 1
        log.info("chunk timing %d/%d: %s, batch %d, %.0f ms per image (%.0fs of %s)", done, len(runs),
                 chunk_key(height, width, engine.uses_cfg(scale)), batch, took * 1000 / batch, clock() - began,
                 f"{budget_s:.0f}s" if budget_s is not None else "no bound")
    measured = {}
    for key in keys:
        height, width, scale = key
        per_image = {b: round(best[key][b] * 1000 / b, 3) for b in sorted(best[key])}
        name = chunk_key(height, width, engine.uses_cfg(scale))
        measured[name] = {"chosen": choose(per_image) if per_image else engine.batch_size, "ms_per_image": per_image}
        if done < len(runs):
            measured[name]["bounded"] = True
        log.info("chunk size for %s: %d (ms per image: %s)", name, measured[name]["chosen"],
                 ", ".join(f"batch {b}: {ms:g}" for b, ms in per_image.items()) or "none timed")
    return measured
