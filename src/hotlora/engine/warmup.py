"""Making a model warm: every shape steady state will see is run once at start-up (so no request
compiles), then, with ``batch_size="auto"``, the chunk size is chosen by measuring.

Why measure: batching a pack is the biggest lever on a launch-bound model (the tiny one: ~2x), but
on a compute-bound one a big batch can be slower per image than a smaller one (measured on a tiny
Flux at 256x256 on 2 cores: the pack one image at a time was 3.5-8% faster). Which wins depends on
the hardware, the size and CFG, so it is timed on the machine that serves, after the compile runs.

The measurement is saved beside the compile artifacts so a restart measures nothing
(``measured_chunks``). Why: at full size on a CPU it took ~640 s of a 1,002 s start (sizes 1, 3,
5 and 6 timed twice, with and without CFG), repeated on every start. Its result depends only on
what the graphs run and where: the compile fingerprint (model, family, slots, ranks, rank buckets,
batch limit, sizes, dtype, attention, compile mode, quantization, step cache), the torch version,
the hardware (device type and name, CPU threads), and how it was measured (steps, repeats,
candidates, budget). All of it is the record's key; a record under any other key is not used.

A record is JSON (never unpickled), but it still decides how every pack runs, so it is read under
the compile artifacts' rules (``pipeline.read_private``: only this user or root could have written
it, and only a whole file, its sha256 checked) and checked against what this engine can run: every
key present, every choice a compiled candidate. Anything else is ignored with a log line and the
measurement runs again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch

from hotlora.settings import format_size
from hotlora.engine.device import synchronize
from hotlora.engine.pipeline import graph_count, read_private, write_private
from hotlora.engine.request import TEXT_TO_IMAGE, images_per_video

log = logging.getLogger(__name__)

TIMED_STEPS = 2  # denoising steps of one timed run
TIMED_REPEATS = 2  # runs per candidate; the fastest counts (the first may still page things in)
SCHEMA = 1  # of the saved measurement
clock: Callable[[], float] = time.perf_counter  # replaced by tests with a fake timer


def guidance_scales(warm) -> list[float]:
    """The guidance values whose batch shapes differ (the family says: under batch CFG, guidance 1
    runs a batch half as big)."""
    return warm.family.warmup_guidance_scales(warm.defaults["guidance_scale"])


def candidates(limit: int) -> list[int]:
    """Chunk sizes warm-up runs anyway (1, the limit and the one below it, which cover every last
    chunk once the batch dimension is dynamic) plus half the limit: the ones worth timing."""
    return sorted({1, max(1, limit // 2), max(1, limit - 1), limit})


def warm_up(warm, *, skip: frozenset = frozenset(), after_state: Callable[[], object] | None = None) -> dict:
    """Run every batch shape steady state will see, at every served size, in every state of the
    writer, so no request compiles. Batch 1 specializes differently from larger batches, and the
    second distinct batch turns the batch dimension dynamic; the limit and a size in between cover
    every last chunk, at each guidance whose batch shape differs (``guidance_scales``).

    With dynamic sizes, the second size turns the sequence / spatial dimensions dynamic (dynamo's
    automatic dynamic shapes). Duck shaping is off while compiling: with it, dims that happen to be
    equal at warm-up (a square image's height and width, a sequence length and a channel count)
    would share one symbol and a later size that breaks the equality would recompile (diffusers
    documents ``use_duck_shape=False`` with dynamic shapes).

    ``skip``: passes (``pass_name``) not run, those an earlier start under the same key saw compile
    nothing (``idle_passes``). ``after_state``: called after each writer state (warm.py saves the
    compile artifacts there). Returns the graphs each pass compiled, by name."""
    began = time.perf_counter()
    duck = torch.fx.experimental._config.patch(use_duck_shape=False) if warm.dynamic_sizes else nullcontext()
    compiled: dict[str, int] = {}
    with duck:
        for state, passes in planned_passes(warm):
            warm.writer.enter(state)
            for name, (height, width, scale, batch, prompt, task, references, frames) in passes:
                if name in skip:
                    continue
                log.info("warm-up: %s%s%s, batch %d, guidance %.1f, writer state %s (%s)",
                         format_size(height, width), "" if frames is None else f" x {frames} frames",
                         "" if task == TEXT_TO_IMAGE else f", {task}", batch, scale, state, warm.compile_mode or "eager")
                graphs = graph_count()
                task_keywords = {} if task == TEXT_TO_IMAGE else {"task": task, "references": references}
                _run(warm, batch, height, width, scale, prompt, **task_keywords, frames=frames)
                compiled[name] = graph_count() - graphs
            if after_state is not None:
                after_state()
    warm.warmup_s = time.perf_counter() - began
    log.info("warm: %.1fs, %d graphs compiled, %d warm-up passes run, %d skipped (they compiled nothing in an "
             "earlier start under this key), %s", warm.warmup_s, graph_count(), len(compiled), len(skip),
             warm.compile_mode or "eager")
    return compiled


def planned_passes(warm) -> list[tuple[object, list[tuple[str, tuple]]]]:
    """Warm-up's passes in the order they run, per writer state: (name, (height, width, guidance,
    batch, prompt, task, references, frames)) each; ``frames``: every frame count a video family
    serves (each is another token count), None for images."""
    batches = sorted({1, warm.batch_size, max(1, warm.batch_size - 1)})
    # Eager, no state compiles anything: one state pages the model in (the rest would only cost time).
    states = warm.writer.warmup_states() if warm.compile_mode else warm.writer.warmup_states()[:1]
    prompts = warm.family.warmup_prompts(warm.pipeline)
    # The first task (text-to-image, or a conditioned checkpoint's one task) with every prompt; each
    # other with the first prompt (its text path is the first's) and, for an edit, every reference
    # count served (each is another token count).
    first, *others = warm.tasks
    tasks = [(first, 0 if first == TEXT_TO_IMAGE else input_images(warm, first), prompts)] + [
        (task, references, prompts[:1]) for task in others
        for references in (range(1, warm.config.max_reference_images + 1) if task == "edit"
                           else (input_images(warm, task),))]
    frame_counts = warm.frames or (None,)
    return [(state, [(pass_name(state, height, width, scale, batch, index, task, references, frames),
                      (height, width, scale, batch, prompt, task, references, frames))
                     for task, references, task_prompts in tasks
                     for height, width in warm.served_sizes for frames in frame_counts
                     for scale in guidance_scales(warm)
                     for batch in batches for index, prompt in enumerate(task_prompts)])
            for state in states]


def pass_name(state, height: int, width: int, scale: float, batch: int, prompt_index: int,
              task: str = TEXT_TO_IMAGE, references: int = 0, frames: int | None = None) -> str:
    """One warm-up pass, as the saved record names it."""
    size = format_size(height, width) + ("" if frames is None else f"x{frames}f")
    name = f"state={state} size={size} guidance={scale:g} batch={batch} prompt={prompt_index}"
    return name if task == TEXT_TO_IMAGE else f"{name} task={task} references={references}"


def _run(warm, batch: int, height: int, width: int, scale: float, prompt: str | tuple = "warm-up",
         task: str = TEXT_TO_IMAGE, references: int = 0, frames: int | None = None) -> None:
    """One warm-up call; a tuple ``prompt`` is one prompt per image (cycled), as a mixed batch runs.
    A task beyond text-to-image runs its pipeline on grey input images (and a half mask) at the
    served size, with its default strength (``warmup_strength``)."""
    family = warm.family
    negative = family.default_negative_prompt(scale)
    per_image = isinstance(prompt, tuple)
    if per_image:
        prompt = [prompt[i % len(prompt)] for i in range(batch)]
        negative = None if negative is None else [negative] * batch
    inputs = {} if task == TEXT_TO_IMAGE else family.task_arguments(
        task, *warmup_inputs(task, height, width, batch if images_per_video(family, task) else references),
        warmup_strength(family, task), references)
    if frames is None and warm.frames:  # the chunk-size measurement: the default frame count
        frames = warm.frames[0]
    texts = {"prompt": prompt, **({} if negative is None else {"negative_prompt": negative})}
    per_prompt = warm.output.per_prompt
    warm.task_pipelines[task](
        **({per_prompt: 1, **texts} if per_image else family.call_prompts(task, texts, batch, per_prompt)),
        num_inference_steps=family.warmup_steps(warm.pipeline, TIMED_STEPS),
        **({} if frames is None else {"num_frames": frames}),
        height=height, width=width, generator=[torch.Generator().manual_seed(i) for i in range(batch)],
        output_type="latent", **family.call_arguments(scale), **inputs)


def first_task(warm) -> dict:
    """``_run``'s task keywords for the engine's first task: none for text-to-image; a conditioned
    checkpoint's one task (Wan image-to-video) with its input images."""
    task = warm.tasks[0]
    return {} if task == TEXT_TO_IMAGE else {"task": task, "references": input_images(warm, task)}


def input_images(warm, task: str) -> int:
    """The input images a warm-up pass of a task beyond text-to-image gives (edits: each count apart):
    image-to-video its first served count (the first frame; first and last on Wan FLF2V, whose image
    features take both), every other task one. The other count (Wan 2.2 I2V's last frame) changes
    the condition's values, not a shape the denoiser sees."""
    return warm.input_frames[0] if task == "image-to-video" else 1


def warmup_strength(family, task: str) -> float | None:
    """The task's default strength, raised where it would leave none of warm-up's few steps to run
    (SDXL img2img's 0.3 of 2 steps: no timestep at all)."""
    strength = family.default_strength(task)
    return None if strength is None else max(strength, 1 / TIMED_STEPS)


def warmup_inputs(task: str, height: int, width: int, count: int) -> tuple[list, list | None]:
    """``count`` input images for a warm-up pass of ``task`` (one per image of the batch, or an
    edit's references): mid-grey at the served size; inpaint's masks repaint the right half."""
    from PIL import Image

    images = [Image.new("RGB", (width, height), (128, 128, 128)) for _ in range(max(count, 1))]
    if task != "inpaint":
        return images, None
    mask = Image.new("L", (width, height), 0)
    mask.paste(255, (width // 2, 0, width, height))
    return images, [mask] * len(images)


def chunk_key(height: int, width: int, cfg: bool) -> str:
    """How a measured choice is named: ``WIDTHxHEIGHT``, ``+cfg`` when the batch is doubled."""
    return format_size(height, width) + ("+cfg" if cfg else "")


def choose(ms_per_image: dict[int, float]) -> int:
    """The chunk size with the best time per image; on a tie, the larger one (fewer chunks, fewer
    progress events and swaps). Deterministic given the timings."""
    return min(ms_per_image, key=lambda batch: (ms_per_image[batch], -batch))


def measure_chunks(warm, budget_s: float | None = None) -> dict[str, dict]:
    """For every served size and CFG mode: the time per image of each candidate chunk size (after
    the compile runs, synchronised on CUDA, the fastest of a few repeats) and the choice. Runs in
    whatever writer state warm-up left (the timing of a chunk does not depend on the adapters).

    Bounded by ``budget_s`` (``EngineConfig.chunk_budget_s``): the runs go round by round (every
    key's candidates once, the limit first, then the repeats), so a budget that runs out leaves
    every key measured as far as it got; a candidate never timed is never chosen, and a key with
    none timed runs at the compiled limit (``"bounded": true`` says the budget cut it short)."""
    keys = [(h, w, scale) for h, w in warm.served_sizes for scale in guidance_scales(warm)]
    # The limit first: it is what runs when nothing else was timed, and usually the best on a GPU.
    order = sorted(candidates(warm.batch_size), key=lambda b: (b != warm.batch_size, b))
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
        synchronize(warm.device)
        start = clock()
        _run(warm, batch, height, width, scale, **first_task(warm))
        synchronize(warm.device)
        took = clock() - start
        best[key][batch] = min(best[key].get(batch, float("inf")), took)
        done += 1
        log.info("chunk timing %d/%d: %s, batch %d, %.0f ms per image (%.0fs of %s)", done, len(runs),
                 chunk_key(height, width, warm.uses_cfg(scale)), batch, took * 1000 / batch, clock() - began,
                 f"{budget_s:.0f}s" if budget_s is not None else "no bound")
    measured = {}
    for key in keys:
        height, width, scale = key
        per_image = {b: round(best[key][b] * 1000 / b, 3) for b in sorted(best[key])}
        name = chunk_key(height, width, warm.uses_cfg(scale))
        measured[name] = {"chosen": choose(per_image) if per_image else warm.batch_size, "ms_per_image": per_image}
        if done < len(runs):
            measured[name]["bounded"] = True
        log.info("chunk size for %s: %d (ms per image: %s)", name, measured[name]["chosen"],
                 ", ".join(f"batch {b}: {ms:g}" for b, ms in per_image.items()) or "none timed")
    return measured


# ---------------------------------------------------------------------------- the saved measurement


def measured_chunks(warm, fingerprint: str | None) -> dict[str, dict]:
    """The warm model's chunk sizes: saved by an earlier start under the same key, else measured now
    (within ``chunk_budget_s``) and saved in ``compile_cache_dir``. No cache folder: measured only."""
    budget = warm.config.chunk_budget_s or None  # 0: no bound
    if fingerprint is None:
        return measure_chunks(warm, budget)
    key = record_key(fingerprint, warm.device, compile_mode=warm.compile_mode, budget_s=budget,
                     steps=TIMED_STEPS, repeats=TIMED_REPEATS)
    path = record_path(warm.config.compile_cache_dir, key)
    expected = {chunk_key(h, w, warm.uses_cfg(scale)) for h, w in warm.served_sizes
                for scale in guidance_scales(warm)}
    chunks = load_measurement(path, key, expected, set(candidates(warm.batch_size)))
    if chunks is None:
        chunks = measure_chunks(warm, budget)
        save_measurement(path, key, chunks)
    return chunks


def hardware(device: torch.device) -> dict:
    """What a timing depends on besides the graphs: the accelerator's name, or the CPU's model and
    the threads torch uses."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return {"device": "cuda", "name": torch.cuda.get_device_name(index),
                "capability": list(torch.cuda.get_device_capability(index))}
    return {"device": device.type, "cpu": _cpu_model(), "machine": platform.machine(),
            "threads": torch.get_num_threads()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def record_key(fingerprint: str, device: torch.device, **how) -> str:
    """The full key: the compile fingerprint, torch, the hardware and how it was measured (``how``)."""
    return json.dumps({"schema": SCHEMA, "torch": torch.__version__, "fingerprint": fingerprint,
                       "hardware": hardware(device), **how}, sort_keys=True, default=repr)


def record_path(cache_dir: str | os.PathLike, key: str) -> Path:
    return Path(cache_dir) / f"chunks-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def load_measurement(path: Path, key: str, expected: set[str], compiled: set[int]) -> dict[str, dict] | None:
    """The measurement saved under ``key``, or None (absent, untrusted, unreadable, another key,
    or not a measurement this engine can run: ``expected`` chunk keys, choices among ``compiled``)."""
    data = read_private(path, "the chunk-size measurement")
    if data is None:
        return None
    try:
        saved = json.loads(data)
        if saved.get("key") != key:
            raise ValueError("saved under another key")
        chunks = {name: _checked_entry(entry, compiled) for name, entry in saved["chunks"].items()}
        if set(chunks) != expected:
            raise ValueError(f"measured {sorted(chunks)}, this engine serves {sorted(expected)}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # json's errors are ValueErrors
        log.warning("ignoring the saved chunk-size measurement %s (%s); measuring again", path, exc)
        return None
    log.info("chunk sizes from %s (measured by an earlier start): %s", path,
             ", ".join(f"{name}: {entry['chosen']}" for name, entry in chunks.items()))
    return chunks


def _checked_entry(entry: dict, compiled: set[int]) -> dict:
    chosen = entry["chosen"]
    if type(chosen) is not int or chosen not in compiled:
        raise ValueError(f"chosen chunk size {chosen!r} is not one compiled for ({sorted(compiled)})")
    # JSON keys are text: back to the integers warmup.measure_chunks writes.
    per_image = {int(batch): float(ms) for batch, ms in entry["ms_per_image"].items()}
    checked = {"chosen": chosen, "ms_per_image": per_image}
    if entry.get("bounded"):
        checked["bounded"] = True
    return checked


def save_measurement(path: Path, key: str, chunks: dict[str, dict]) -> bool:
    """Write the measurement atomically, into a folder no other user can write (as the artifacts)."""
    return write_private(path, json.dumps({"key": key, "chunks": chunks}, indent=1).encode(),
                         "the chunk-size measurement")


# ---------------------------------------------------------------------------- passes that compiled nothing

# Why a restart may skip a pass: dynamo's state (its cache entries, automatic-dynamic marks) changes
# only when it compiles, so a pass that compiled no graph in a start that ran every pass left that
# state as it found it; from the same state (a fresh process: warm.py neither records nor skips in a
# process that has compiled before, such as a test session or an engine rebuilt in place) the same passes, in
# the same order, minus those, compile exactly the same graphs, and the skipped shapes are served by
# them (the start that recorded it ran them and compiled nothing). Keyed by everything the graphs depend on: the compile fingerprint, the device
# type, torch, diffusers and peft (their code is what dynamo traces) and the whole list of passes.
# Restart with the compile artifacts on the tiny model, 3 writer states: the three passes at the
# batch limit compile nothing (the batch dimension is already dynamic); docs/benchmarks.md has the figures.


def passes_key(warm, fingerprint: str) -> str:
    from importlib.metadata import version

    names = [name for _state, passes in planned_passes(warm) for name, _ in passes]
    return json.dumps({"schema": SCHEMA, "record": "warm-up passes", "torch": torch.__version__,
                       "diffusers": version("diffusers"), "peft": version("peft"), "fingerprint": fingerprint,
                       "device": torch.device(warm.device).type, "passes": names}, sort_keys=True)


def passes_path(cache_dir: str | os.PathLike, key: str) -> Path:
    return Path(cache_dir) / f"warmup-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def idle_passes(path: Path, key: str) -> frozenset:
    """The passes the start that saved ``path`` under ``key`` saw compile no graph; none when the
    record is absent, untrusted (``untrusted_because``), not whole, unreadable or saved under another key."""
    data = read_private(path, "the warm-up record")  # trusted and whole, or None
    if data is None:
        return frozenset()
    try:
        saved = json.loads(data)
        if saved.get("key") != key:
            raise ValueError("saved under another key")
        known = set(json.loads(key)["passes"])
        idle = saved["idle"]
        if not (isinstance(idle, list) and all(isinstance(name, str) and name in known for name in idle)):
            raise ValueError("names passes this engine does not run")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the saved warm-up record %s (%s); running every pass", path, exc)
        return frozenset()
    return frozenset(idle)


def save_idle_passes(path: Path, key: str, compiled: dict[str, int]) -> bool:
    """Record which passes compiled nothing; only a warm-up that ran every pass may say so."""
    idle = [name for name, graphs in compiled.items() if graphs == 0]
    return write_private(path, json.dumps({"key": key, "idle": idle}, indent=1).encode(), "the warm-up record")
