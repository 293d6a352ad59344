"""What a request pays at full size, before and after the default rank buckets: the real SDXL
architecture (bench/full_size.py's model), one process, every configuration side by side.

Usage: PYTHONPATH=src .venv/bin/python bench/full_size_packs.py [--model .cache/fullsize/sdxl]
       [--runs 3] [--steps 2] [--size 256] [--target-rank 128] [--out bench/results]

Two U-Nets in one process (the text encoders, VAE and scheduler shared; ~16 GB in bfloat16), both
compiled the same way (regional, fullgraph), timed by the same pipeline call (one image, CFG,
``--steps`` steps, latents out), interleaved so the machine's load hits every row alike:

  plain diffusers, none   the reference U-Net with its LoRA switched off (``disable_lora``): the
                          base model's cost
  plain diffusers, r32    the same with a rank-``target/4`` adapter on every ceiling Linear,
                          loaded by ``load_lora_weights`` (unfused PEFT layers), switched on
  default, none / r32     the engine as served (rank buckets 0, target/4, target): the bucket the
                          request needs
  before, none / r32      the same engine made to run its full-rank bucket (``use_bucket(target)``):
                          what every request ran before the default buckets (``rank_buckets=()``),
                          the same compiled graphs, the same slot contents
  ..., eager              plain diffusers and the default engine with their compiled blocks run
                          eagerly (``set_stance("force_eager")``): what compiling buys on this CPU;
                          compared with plain diffusers eager

``recompiles`` counts dynamo graphs compiled inside the timed runs (must be 0). Writes
full_size_packs.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hotlora.benchmarking import (
    allow_many_compiled_engines,
    markdown_table,
    use_repo_compile_cache,
    write_results,
)

use_repo_compile_cache()


def rss_gib() -> float:
    import os

    with open("/proc/self/statm") as f:
        return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30, 2)


def pipelines(model: Path):
    """The engine's pipeline and the reference's: two U-Nets, the rest shared (the reference's
    adapter touches its U-Net only, so sharing the text encoders changes neither)."""
    import torch
    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel

    served = StableDiffusionXLPipeline.from_pretrained(str(model), torch_dtype=torch.bfloat16, local_files_only=True)
    unet = UNet2DConditionModel.from_pretrained(str(model / "unet"), torch_dtype=torch.bfloat16, local_files_only=True)
    reference = StableDiffusionXLPipeline(**{**served.components, "unet": unet})
    for pipeline in (served, reference):
        pipeline.set_progress_bar_config(disable=True)
    return served, reference


def timed_pack(pipeline, args, eager: bool = False) -> float:
    """One pipeline call, the same for every row: milliseconds. ``eager``: the compiled blocks run
    their Python code instead (``torch.compiler.set_stance("force_eager")``), the same modules."""
    import torch

    began = time.perf_counter()
    with torch.compiler.set_stance("force_eager" if eager else "default"):
        pipeline("a lighthouse on a cliff at dawn", num_images_per_prompt=1, num_inference_steps=args.steps,
                 guidance_scale=5.0, height=args.size, width=args.size, output_type="latent",
                 generator=[torch.Generator().manual_seed(0)])
    return (time.perf_counter() - began) * 1000


def measure(args) -> dict:
    from bench.rank_buckets import quarter_adapter
    from hotlora import Engine
    from hotlora.families import family_of_pipeline
    from hotlora.engine.pipeline import compile_denoiser, graph_count

    served, reference = pipelines(args.model)
    family = family_of_pipeline(served)
    loaded_gib = rss_gib()
    began = time.perf_counter()
    engine = Engine(served, family, target_rank=args.target_rank, batch_size=1, compile=True,
                    height=args.size, width=args.size)
    warmup_s = round(time.perf_counter() - began, 1)
    quarter = args.target_rank // 4
    adapter = quarter_adapter(engine, quarter)
    reference.load_lora_weights(adapter, adapter_name="quarter")
    compile_denoiser(reference.unet, family)
    request = {"identity": (adapter, 1.0)}

    def engine_state(adapters: dict, bucket: int | None):
        def enter():
            engine.generate("set up", adapters=adapters, num_images=1, num_inference_steps=1, output_type="latent")
            if bucket is not None:
                engine.writer.use_bucket(bucket)  # the full-rank bucket: what rank_buckets=() ran
            return served
        return enter

    def reference_state(on: bool):
        def enter():
            (reference.unet.enable_lora if on else reference.unet.disable_lora)()
            return reference
        return enter

    r = f"r{quarter}"
    # (configuration, request) -> (set-up, eager?). Eager rows: the same modules with compile off.
    rows = {("plain diffusers", "none"): (reference_state(False), False), ("plain diffusers", r): (reference_state(True), False),
            ("default", "none"): (engine_state({}, None), False), ("default", r): (engine_state(request, None), False),
            ("before", "none"): (engine_state({}, args.target_rank), False),
            ("before", r): (engine_state(request, args.target_rank), False),
            ("plain diffusers, eager", "none"): (reference_state(False), True),
            ("plain diffusers, eager", r): (reference_state(True), True),
            ("default, eager", "none"): (engine_state({}, None), True), ("default, eager", r): (engine_state(request, None), True)}
    for enter, eager in rows.values():  # the first call of each: compiles the reference, pages everything in
        timed_pack(enter(), args, eager)
    graphs, times = graph_count(), {key: [] for key in rows}
    for _ in range(args.runs):  # interleaved
        for key, (enter, eager) in rows.items():
            times[key].append(timed_pack(enter(), args, eager))
            print(key, round(times[key][-1]), flush=True)
    medians = {key: statistics.median(v) for key, v in times.items()}

    def baseline(config: str, request_name: str) -> float:  # plain diffusers, the same request, compiled or not
        return medians[("plain diffusers, eager" if config.endswith("eager") else "plain diffusers", request_name)]

    out = [{"config": config, "request": request_name, "pack_ms": round(medians[(config, request_name)], 1),
            "runs_ms": [round(t, 1) for t in times[(config, request_name)]],
            "vs_plain_diffusers": round(medians[(config, request_name)] / baseline(config, request_name), 3)}
           for config, request_name in rows]
    result = {"rows": out, "warmup_s": warmup_s, "rss_after_load_gib": loaded_gib, "rss_end_gib": rss_gib(),
              "slot_bytes": engine.writer.nbytes, "rank_buckets": list(engine.writer.rank_buckets),
              "recompiles": graph_count() - graphs, "engine_recompiles": engine.recompiles}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=Path(".cache/fullsize/sdxl"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--target-rank", type=int, default=128)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    if not (args.model / "model_index.json").is_file():
        sys.exit(f"no model at {args.model}: python -m hotlora.fullsize.sdxl build {args.model}")
    allow_many_compiled_engines()
    result = measure(args)
    table = markdown_table(["configuration", "request", "pack (ms, median)", "runs (ms)", "vs plain diffusers"],
                           [[r["config"], r["request"], r["pack_ms"], r["runs_ms"], r["vs_plain_diffusers"]]
                            for r in result["rows"]])
    write_results(args.out, "full_size_packs", {"args": {k: str(v) for k, v in vars(args).items()}, **result}, table,
                  f"The real SDXL architecture (random weights), bfloat16, {args.size}x{args.size}, one image with CFG, "
                  f"{args.steps} steps, compiled (regional, fullgraph) on both sides (eager rows: compile off on both), median of {args.runs} interleaved; "
                  f"target rank {args.target_rank}, rank buckets {result['rank_buckets']}; engine warm-up "
                  f"{result['warmup_s']} s; {result['recompiles']} graphs compiled during the timed runs. "
                  "`PYTHONPATH=src .venv/bin/python bench/full_size_packs.py`")


if __name__ == "__main__":
    main()
