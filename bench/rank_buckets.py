"""What the default rank buckets cost and buy: warm-up time and memory, and the pack time of a
request without adapters and of a request at a quarter of the target rank, against the same
model with no slots and against plain diffusers' unfused LoRA (both compiled the same way).

Usage: .venv/bin/python bench/rank_buckets.py [--models tiny-flux,tiny-sdxl,wide-flux] [--runs 3]
       [--pack 2] [--steps 2] [--target-rank 16] [--out bench/results]

``wide-flux``: the real Flux block (width 3072, 24 heads of 128, bf16), one double and one single
block (bench/gpu_flux.py's reduced configuration), 64x64. Configurations per model, each compiled
(regional, fullgraph), measured interleaved, median of --runs packs:
  no slots         the engine with ``slots=()`` (no LoRA layer at all: the base model's cost)
  before           the engine with ``rank_buckets=()`` (every request runs 2 x target_rank)
  default          the engine with ``rank_buckets`` unset (0, target_rank/4, target_rank)
  diffusers        plain diffusers with the quarter-rank adapter loaded (``load_lora_weights``,
                   unfused PEFT layers), its transformer/unet compiled the same way
Writes rank_buckets.json and rank_buckets.md.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a file, Python puts bench/ first on sys.path: bench.harness needs the checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (  # noqa: E402
    allow_many_compiled_engines, markdown_table, use_repo_compile_cache, write_results,
)

use_repo_compile_cache()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pipeline_of(name: str, root: Path, target_rank: int):
    """A fresh pipeline of the model ``name`` (the same seeded weights each time)."""
    from diffusers import DiffusionPipeline

    if name == "wide-flux":
        from bench.gpu_flux import build_full_flux

        return build_full_flux(1, 1, "cpu", heads=24, text_width=256), {"height": 64, "width": 64}
    from hotlora.testing import save_tiny_model

    family = name.removeprefix("tiny-")
    folder = root / family
    if not folder.exists():
        save_tiny_model(folder, family, target_rank=target_rank)
    pipeline = DiffusionPipeline.from_pretrained(str(folder), local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline, {}


def quarter_adapter(engine, rank: int) -> dict:
    """A random diffusers-layout state dict of ``rank`` on every Linear of the engine's ceiling."""
    from hotlora.tiny import random_lora

    prefix = engine.family.denoiser
    sd = random_lora(dict(engine.ceiling.modules), rank, seed=1)
    dtype = engine.denoiser.dtype
    return {f"{prefix}.{k}": v.to(dtype) for k, v in sd.items()}


def build(name, root, args, options):
    from hotlora import Engine
    from hotlora.families import family_of_pipeline

    gc.collect()
    before = rss_bytes()
    pipeline, size = pipeline_of(name, root, args.target_rank)
    began = time.perf_counter()
    engine = Engine(pipeline, family_of_pipeline(pipeline), target_rank=args.target_rank, batch_size=args.pack,
                    compile=True, **size, **options)
    return engine, {"warmup_s": round(time.perf_counter() - began, 1), "rss_growth_mb": (rss_bytes() - before) >> 20,
                    "slot_mb": engine.writer.nbytes >> 20, "buckets": list(engine.writer.warmup_states())}


def plain_diffusers(name, root, args, adapter):
    from hotlora.engine.pipeline import compile_denoiser
    from hotlora.families import family_of_pipeline
    from hotlora.settings import read_model_defaults

    pipeline, size = pipeline_of(name, root, args.target_rank)
    pipeline.load_lora_weights(adapter, adapter_name="quarter")
    family = family_of_pipeline(pipeline)
    compile_denoiser(getattr(pipeline, family.denoiser), family)
    # Guidance the family's way at the engine's default, as the engine calls the pipeline.
    guidance = {**family.defaults, **read_model_defaults(pipeline.name_or_path)}["guidance_scale"]
    negative = family.default_negative_prompt(guidance)
    size = {**size, **family.call_arguments(guidance), **({} if negative is None else {"negative_prompt": negative})}
    return pipeline, size


def engine_pack(engine, adapters, args) -> float:
    result = engine.generate("a lighthouse", adapters=adapters, num_images=args.pack, num_inference_steps=args.steps,
                             output_type="latent")
    return sum(result.timings.generate_ms)


def diffusers_pack(pipeline, size, args) -> float:
    import torch

    began = time.perf_counter()
    pipeline(prompt="a lighthouse", num_images_per_prompt=args.pack, num_inference_steps=args.steps, output_type="latent",
             generator=[torch.Generator().manual_seed(i) for i in range(args.pack)], **size)
    return (time.perf_counter() - began) * 1000


def measure(name: str, root: Path, args) -> list[dict]:
    quarter = max(1, args.target_rank // 4)
    none, rows = {}, {}
    engines = {}
    for label, options in (("no slots", {"slots": ()}), ("before", {"rank_buckets": ()}), ("default", {})):
        engines[label], rows[label] = build(name, root, args, options)
    adapter = quarter_adapter(engines["default"], quarter)
    request = {"identity": (adapter, 1.0)}
    reference, size = plain_diffusers(name, root, args, adapter)
    diffusers_pack(reference, size, args)  # compiles
    for engine in engines.values():  # first packs: page things in
        engine_pack(engine, none, args)
    times = {(label, kind): [] for label in engines for kind in ("none", "quarter")}
    times[("diffusers", "quarter")] = []
    for _ in range(args.runs):  # interleaved: the machine's load hits every configuration alike
        for label, engine in engines.items():
            times[(label, "none")].append(engine_pack(engine, none, args))
            if label != "no slots":
                times[(label, "quarter")].append(engine_pack(engine, request, args))
        times[("diffusers", "quarter")].append(diffusers_pack(reference, size, args))
    median = {key: round(statistics.median(v), 1) for key, v in times.items() if v}
    base, plain = median[("no slots", "none")], median[("diffusers", "quarter")]
    out = []
    for label in ("no slots", "before", "default"):
        row = {"model": name, "config": label, **rows[label], "none_ms": median[(label, "none")],
               "none_over_no_slots": round(median[(label, "none")] / base, 3)}
        if (label, "quarter") in median:
            row["quarter_ms"] = median[(label, "quarter")]
            row["quarter_over_diffusers"] = round(median[(label, "quarter")] / plain, 3)
        row["recompiles"] = engines[label].recompiles
        out.append(row)
    out.append({"model": name, "config": f"diffusers r{quarter}", "quarter_ms": plain})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="tiny-flux,tiny-sdxl,wide-flux")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pack", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--target-rank", type=int, default=16)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    allow_many_compiled_engines()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            rows += measure(name, Path(tmp), args)
            print(rows[-4:], flush=True)
    quarter = max(1, args.target_rank // 4)
    table = markdown_table(
        ["model", "config", "buckets warmed", "warm-up (s)", "RSS growth (MB)", "slots (MB)",
         "no adapters (ms)", "vs no slots", f"rank-{quarter} request (ms)", "vs diffusers unfused", "recompiles"],
        [[r["model"], r["config"], ",".join(map(str, r.get("buckets", []))) or "-", r.get("warmup_s", "-"),
          r.get("rss_growth_mb", "-"), r.get("slot_mb", "-"), r.get("none_ms", "-"), r.get("none_over_no_slots", "-"),
          r.get("quarter_ms", "-"), r.get("quarter_over_diffusers", "-"), r.get("recompiles", "-")] for r in rows])
    write_results(args.out, "rank_buckets", {"args": vars(args), "rows": rows}, table,
                  f"Target rank {args.target_rank}, 2 slots; packs of {args.pack} at batch {args.pack}, {args.steps} "
                  f"steps, median of {args.runs}, interleaved; compiled (regional, fullgraph) everywhere.")


if __name__ == "__main__":
    main()
