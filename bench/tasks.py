"""Tasks on one warm denoiser against plain diffusers' variant pipelines, and the memory ``from_pipe`` saves.

Usage: .venv/bin/python bench/tasks.py [--images 3] [--steps 4] [--requests 4] [--rounds 2] [--strength 0.6]
                                       [--no-full-size] [--out bench/results] [--tasks text-to-image,edit]
                                       [--model DIR --dtype bfloat16 --size 256 --target-rank 128
                                        --identity REF --style REF --name tasks-sdxl-full]

Real width (``--model``): the speed rows on another model's tasks, e.g. the full-size SDXL architecture
(``python -m hotlora.fullsize.sdxl build .cache/fullsize/sdxl``, random weights, with the kohya rank-32
and diffusers rank-128 adapters bench/served.py uses), its text-to-image, image-to-image and inpaint
(the edit task's real-width rows: FLUX.1's transformer at its width with fewer blocks, bench/flux_width.py)::

    .venv/bin/python bench/tasks.py --model .cache/fullsize/sdxl --dtype bfloat16 --size 256 --images 1 \
        --steps 4 --requests 3 --target-rank 128 --identity .cache/fullsize/sdxl/adapters/kohya-r32.safetensors \
        --style .cache/fullsize/sdxl/adapters/diffusers-r128 --name tasks-sdxl-full --no-eager

(no memory rows there: the tiny run's full-size rows measure them on the meta device; diffusers' task
pipelines there are made with ``from_pipe`` from its text-to-image one, adapters loaded once, so that one
copy of the weights serves each way; ``--no-eager`` leaves the eager engine's copy out).

Speed, tiny Flux (its 32x32), float32, one request = ``--images`` images x ``--steps`` steps with both
slots filled (the model's sample adapters, scales 1.0 and 0.7), the same request for every way, per
task (text-to-image, image-to-image, inpaint, edit):

- ``diffusers``: the task's own diffusers pipeline (FluxPipeline, FluxImg2ImgPipeline,
  FluxInpaintPipeline, FluxKontextPipeline), each loaded with ``from_pretrained``, the adapters
  loaded with ``load_lora_weights`` x2 + ``set_adapters`` once, eager, as users run it;
- ``hotlora eager`` / ``hotlora compiled``: one warm engine each serving all four tasks
  (``tasks=...``, each task's pipeline made from the warm one with ``from_pipe``),
  ``engine.generate`` per request.

Milliseconds per request (median), ratios against ``diffusers`` measured in the same run; the
ways take turns request by request, and rounds alternate their order.

Memory: the bytes of parameters and buffers of each task pipeline that are not shared with the
warm pipeline (the engine's ``from_pipe`` pipelines: tensors compared by storage), against a
second pipeline of that task loaded with ``from_pretrained`` (all of its bytes). For the tiny Flux
the real engine's pipelines; for the published FLUX.1-dev and SDXL architectures
(``hotlora.fullsize``) pipelines built on the meta device in bfloat16 (no weight allocated: tensors
compared by identity, sizes from their shapes), where a second ``from_pretrained`` pipeline would
hold every component's bytes again.

Writes bench/results/tasks.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import REPO, markdown_table, use_repo_compile_cache, write_results  # noqa: E402

use_repo_compile_cache()
PROMPT = "the same portrait, at dusk"
TASKS = ("text-to-image", "image-to-image", "inpaint", "edit")
FULL_SIZE = ("flux-dev", "sdxl")


def picture(height: int, width: int, seed: int):
    """A smooth random picture (what a VAE's input looks like), ``width`` x ``height``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC)


def task_inputs(family, task: str, height: int, width: int, images: int, strength: float):
    """(the engine's request keywords, the diffusers pipeline's own arguments) for one request of ``task``."""
    from PIL import Image

    if task == "text-to-image":
        return {}, {}
    image = picture(height, width, 3)
    if task == "edit":
        return {"task": task, "images": (image,)}, family.task_arguments(task, [image], None, None, 1)
    mask = None
    if task == "inpaint":
        mask = Image.new("L", (width, height), 0)
        mask.paste(255, (0, height // 2, width, height))
    keywords = {"task": task, "images": (image,), "mask": mask, "strength": strength}
    # One input image (and mask) per output image: how the engine calls the pipeline.
    return keywords, family.task_arguments(task, [image] * images, None if mask is None else [mask] * images,
                                           strength, 1)


def tensor_bytes(pipeline, key) -> tuple[int, dict]:
    """Every parameter and buffer of ``pipeline``'s modules, once each: total bytes and ``key(t)`` -> bytes."""
    import torch

    seen = {}
    for module in pipeline.components.values():
        if isinstance(module, torch.nn.Module):
            for t in (*module.parameters(), *module.buffers()):
                seen[key(t)] = t.numel() * t.element_size()
    return sum(seen.values()), seen


def unshared_bytes(pipeline, base, key) -> int:
    """The bytes of ``pipeline``'s tensors that ``base`` does not hold."""
    _, own = tensor_bytes(pipeline, key)
    _, theirs = tensor_bytes(base, key)
    return sum(size for k, size in own.items() if k not in theirs)


def storage(t):
    return t.untyped_storage().data_ptr()


def meta_pipelines(name: str, plain: bool = False):
    """The published model ``name`` as its family's pipeline on the meta device (bfloat16), and each
    of the family's task pipelines made from it as the engine makes them (``shared_pipeline``: with
    ``from_pipe``, every dtype kept), or, ``plain``, by ``from_pipe`` as it is (no ``torch_dtype``)."""
    import diffusers
    import torch

    from hotlora.engine.plan.models import build_parts, find_model

    from hotlora.families import full_size_model

    spec = find_model(name)
    parts = build_parts(spec, torch.bfloat16)
    base_class = spec.family.pipeline_type
    accepted = inspect.signature(base_class.__init__).parameters
    modules = {k: v for k, v in vars(parts).items() if isinstance(v, torch.nn.Module)}
    # The scheduler and tokenizers hold no tensors: the published scheduler (SDXL's module names no
    # class for it in MODEL_INDEX: its scheduler_config.json's, Euler), no tokenizers (the plan's
    # stand-ins are no tokenizer class a pipeline takes).
    published = importlib.import_module(f"hotlora.fullsize.{full_size_model(name)[1]}")
    scheduler_class = getattr(published, "MODEL_INDEX", {}).get("scheduler", ["diffusers", "EulerDiscreteScheduler"])[1]
    scheduler = getattr(diffusers, scheduler_class).from_config(getattr(published, "SCHEDULER", {}))
    base = base_class(scheduler=scheduler, **{p: modules.get(p) for p, v in accepted.items()
                                              if p not in ("self", "scheduler") and v.kind == v.POSITIONAL_OR_KEYWORD})
    from hotlora.engine.warm import shared_pipeline

    def made(cls):
        return cls.from_pipe(base) if plain else shared_pipeline(cls, base, torch.bfloat16)

    return base, {task: made(spec.family.task_pipeline_type(task)) for task in spec.family.task_pipelines}


def memory_rows(engine, model: Path, full_size: bool) -> tuple[list, dict]:
    import diffusers

    rows, data = [], {}
    base = engine.pipeline
    for task, pipeline in engine.warm.task_pipelines.items():
        if task == "text-to-image":
            continue
        second = getattr(diffusers, engine.family.task_pipelines[task]).from_pretrained(str(model), local_files_only=True)
        full, _ = tensor_bytes(second, storage)
        shared = unshared_bytes(pipeline, base, storage)
        data[f"tiny-flux {task}"] = {"from_pipe_unshared_bytes": shared, "from_pretrained_bytes": full}
        rows.append(["tiny Flux (float32)", type(pipeline).__name__, shared, f"{full:,}", "-"])
        del second
    for name in FULL_SIZE if full_size else ():
        base, tasks = meta_pipelines(name)
        # from_pipe as it is, on a fresh base: it casts the new pipeline, shared modules and all, to float32.
        plain_base, _ = meta_pipelines(name, plain=True)
        cast, _ = tensor_bytes(plain_base, id)
        for task, pipeline in tasks.items():
            full, _ = tensor_bytes(pipeline, id)  # what a second from_pretrained pipeline would hold again
            shared = unshared_bytes(pipeline, base, id)
            data[f"{name} {task}"] = {"from_pipe_unshared_bytes": shared, "from_pretrained_bytes": full,
                                      "plain_from_pipe_warm_bytes_after": cast}
            rows.append([f"{name} (bfloat16, meta)", type(pipeline).__name__, shared, f"{full / 2**30:.2f} GiB",
                         f"{cast / 2**30:.2f} GiB"])
    return rows, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--requests", type=int, default=4, help="timed requests per task, way and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--strength", type=float, default=0.6)
    parser.add_argument("--no-full-size", action="store_true", help="skip the full-size architectures' memory rows")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--model", default=None, help="a model directory (default: the tiny Flux)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--size", type=int, default=None, help="height = width served (default: the model's)")
    parser.add_argument("--target-rank", type=int, default=8)
    parser.add_argument("--identity", default=None, help="the identity slot's adapter (default: the model's sample)")
    parser.add_argument("--style", default=None, help="the style slot's adapter (default: the model's sample)")
    parser.add_argument("--name", default="tasks", help="results file name")
    parser.add_argument("--tasks", default=None,
                        help="comma-separated tasks to time (default: every task of the model's family)")
    parser.add_argument("--no-eager", action="store_true",
                        help="no eager engine (a full-size model's third copy of the weights)")
    args = parser.parse_args()

    import diffusers
    import torch

    from hotlora import Engine
    from hotlora.tiny import save_tiny_model

    model = Path(args.model) if args.model else REPO / ".cache" / "bench" / "tiny-flux"
    if args.model is None and not (model / "model_index.json").is_file():
        save_tiny_model(model, "flux")
    adapters = {"identity": (args.identity or str(model / "adapters" / "identity-diffusers"), 1.0),
                "style": (args.style or str(model / "adapters" / "style-diffusers"), 0.7)}
    dtype = getattr(torch, args.dtype)
    from hotlora.families import family_of_model_index

    tasks = ("text-to-image", *family_of_model_index(model).task_pipelines)
    if args.tasks:
        unknown = set(args.tasks.split(",")) - set(tasks)
        if unknown:
            parser.error(f"--tasks: {', '.join(sorted(unknown))} not among this model's tasks ({', '.join(tasks)})")
        # text-to-image stays first: the other tasks' diffusers pipelines are made from it.
        tasks = tuple(t for t in tasks if t == "text-to-image" or t in args.tasks.split(","))
    size = {} if args.size is None else {"height": args.size, "width": args.size}
    engines = {label: Engine.from_pretrained(model, target_rank=args.target_rank, batch_size=args.images,
                                             compile=compiled, rank_buckets=(), tasks=tasks[1:], dtype=args.dtype,
                                             **({"max_reference_images": 1} if "edit" in tasks else {}), **size)
               for label, compiled in (("hotlora eager", False), ("hotlora compiled", True))
               if compiled or not args.no_eager}
    family = engines["hotlora compiled"].family
    height, width = engines["hotlora compiled"].height, engines["hotlora compiled"].width
    guidance = engines["hotlora compiled"].defaults["guidance_scale"]
    references = {}
    for task in tasks:
        name = family.pipeline_class if task == "text-to-image" else family.task_pipelines[task]
        if args.model is not None and task != "text-to-image":
            # A full-size model: the task's pipeline shares the text-to-image one's weights and LoRA layers
            # (from_pipe, as diffusers documents it for this), instead of a copy of every weight each.
            pipeline = getattr(diffusers, name).from_pipe(references["text-to-image"], dtype=dtype)
        else:
            pipeline = getattr(diffusers, name).from_pretrained(str(model), local_files_only=True, dtype=dtype)
            for slot, (source, _) in adapters.items():
                pipeline.load_lora_weights(source, adapter_name=slot)
            pipeline.set_adapters(list(adapters), [scale for _, scale in adapters.values()])
        pipeline.set_progress_bar_config(disable=True)
        references[task] = pipeline

    def way(label: str, task: str, seed: int):
        keywords, arguments = task_inputs(family, task, height, width, args.images, args.strength)
        if label == "diffusers":
            generators = [torch.Generator().manual_seed(seed + i) for i in range(args.images)]
            # SDXL's image-to-image pipeline takes no size (it denoises at the input's: made at the size served).
            takes_size = "height" in inspect.signature(type(references[task]).__call__).parameters
            return lambda: references[task](prompt=PROMPT, num_images_per_prompt=args.images, generator=generators,
                                            num_inference_steps=args.steps, guidance_scale=guidance,
                                            **({"height": height, "width": width} if takes_size else {}), **arguments)
        engine = engines[label]
        return lambda: engine.generate(PROMPT, adapters=adapters, num_images=args.images,
                                       num_inference_steps=args.steps, seed=seed, **keywords)

    labels = ("diffusers", *engines)
    runs = {task: {label: [] for label in labels} for task in tasks}
    for task in tasks:  # one untimed request each: first-call costs (allocations, lazy imports) out of the figures
        for label in labels:
            way(label, task, 0)()
    # The ways take turns request by request (a shared machine's load then falls on all of them alike),
    # in an order that alternates each round.
    for round_ in range(args.rounds):
        order = labels if round_ % 2 == 0 else tuple(reversed(labels))
        for task in tasks:
            for i in range(args.requests):
                for label in order:
                    call = way(label, task, 1 + i)
                    began = time.perf_counter()
                    call()
                    runs[task][label].append((time.perf_counter() - began) * 1000)
        print(f"round {round_ + 1} done", flush=True)

    recompiles = engines["hotlora compiled"].recompiles
    rows, speed = [], {}
    for task in tasks:
        median = {label: statistics.median(runs[task][label]) for label in labels}
        speed[task] = {"median_ms": median, "runs_ms": runs[task]}
        base = median["diffusers"]
        eager = median.get("hotlora eager")
        rows.append([task, type(engines["hotlora compiled"].warm.task_pipelines[task]).__name__, round(base, 1),
                     "-" if eager is None else round(eager, 1), "-" if eager is None else f"{base / eager:.2f}x",
                     round(median["hotlora compiled"], 1), f"{base / median['hotlora compiled']:.2f}x"])
    memory, memory_data = memory_rows(engines["hotlora compiled"], model, not args.no_full_size) if args.model is None \
        else ([], {})
    table = (markdown_table(["task", "pipeline", "diffusers (ms/request)", "hotlora eager (ms)", "speedup",
                             "hotlora compiled (ms)", "speedup"], rows)
             + f"\n\nRecompiles of the compiled engine after warm-up, over every task: {recompiles}.\n\n"
             + (markdown_table(["model", "task pipeline", "from_pipe: bytes not shared with the warm pipeline",
                                "a second from_pretrained pipeline: bytes",
                                "the warm pipeline after a plain from_pipe (no torch_dtype)"], memory) if memory else ""))
    denoiser = getattr(engines["hotlora compiled"].pipeline, family.denoiser)
    shown = "Tiny Flux" if args.model is None else (
        f"{family.name} from {model} ({type(denoiser).__name__}, "
        f"{sum(p.numel() for p in denoiser.parameters()) / 1e9:.2f}B parameters)")
    made = ("the text-to-image pipeline from_pretrained with load_lora_weights x2 + set_adapters, the task "
            "pipelines from_pipe of it (adapters shared)" if args.model else
            "the task's own pipeline, from_pretrained, load_lora_weights x2 + set_adapters")
    memory_text = ("" if args.model else " Memory: parameters and buffers; the full-size rows are the published "
                   "architectures built on the meta device. The last column: diffusers' from_pipe without "
                   "torch_dtype casts the pipeline it makes, the shared modules included, to float32 (what the "
                   "engine's shared_pipeline prevents).")
    description = (f"{shown} {width}x{height}, {args.dtype}, {args.images} images x {args.steps} steps per request "
                   f"(image-to-image and inpaint at strength {args.strength}: fewer steps run), both slots filled "
                   f"(target rank {args.target_rank}); {args.requests} requests x {args.rounds} rounds per task and "
                   "way (after one untimed request), the ways taking turns request by request, orders alternating; "
                   f"median ms per request. diffusers: {made}, eager. hotlora: one warm engine serving every task "
                   f"({', '.join(tasks)}; from_pipe). Speedup = diffusers ms / hotlora ms.{memory_text}")
    write_results(args.out, args.name, {"args": {k: str(v) for k, v in vars(args).items()}, "speed": speed,
                                      "recompiles": recompiles, "memory": memory_data}, table, description)


if __name__ == "__main__":
    main()
