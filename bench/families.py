"""Per family, side by side in one run: what swapping costs, what the slots cost in steady state at rank
buckets 0 and target/4 against the model without slots and against plain diffusers' unfused LoRA, and what
mixed-adapter batches buy against one request at a time; on the family's tiny model and on its real-width
blocks.

Usage: .venv/bin/python bench/families.py [--families zimage,qwenimage,...] [--widths tiny,wide]
       [--runs 3] [--pack 2] [--steps 2] [--target-rank 16] [--out bench/results] [--name families]

``tiny``: the family's own tiny model (``family.build_tiny``), float32. ``wide``: the same pipeline with its
denoiser rebuilt from the published configuration of the family's first full-size model
(``hotlora.fullsize``), every width as published (heads, head size, MLPs, UNet channels), one block of each
kind (``LAYER_KEYS``), and the keys that face the tiny text encoders and VAE kept tiny (``INTERFACE_KEYS``),
random bf16 weights. Per block the slots' cost is the published model's; the share of a step outside the
blocks is not (bench/rank_buckets.py's ``wide-flux`` is this for Flux with two text layers of real width).
Families without a published configuration (AuraFlow, CogView4) have tiny rows only.

Per model, each compiled (regional, fullgraph), median of --runs, interleaved:
  no slots      the engine with ``slots=()``: the base model's cost
  slots         the engine as served (default rank buckets 0, target/4, target): a pack without adapters
                (bucket 0) and a pack with one rank-target/4 adapter
  diffusers     plain diffusers with that adapter (``load_lora_weights``, unfused PEFT layers), compiled the same
  swap          both slots rewritten in place with rank-target adapters (two pairs alternated), against one
                ``copy_`` of the same bytes
  mixed         --pack one-image requests, each with its own rank-target/4 adapter pair: one forward batch on a
                ``mixed=True`` engine against the slots engine running them one after another
Goals (issue "Serve the image families..."): no adapters within 3% of no slots; a rank-32 request (here
target/4) within 10% of diffusers unfused. Writes NAME.json and NAME.md.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (  # noqa: E402
    allow_many_compiled_engines, machine, markdown_table, use_repo_compile_cache, write_results,
)

use_repo_compile_cache()

# Block counts of the published configurations, set to one block of each kind for the ``wide`` model.
LAYER_KEYS = ("num_layers", "num_single_layers", "n_layers", "n_refiner_layers", "approximator_layers",
              "layers_per_block", "transformer_layers_per_block", "num_mmdit_layers", "num_single_dit_layers",
              "num_layerwise_text_blocks", "num_refiner_text_blocks")
# Keys that must match the tiny text encoders, VAE and pipeline (their widths, latent channels, position
# tables): kept from the tiny denoiser. A UNet's cross_attention_dim is its text encoder's width; a
# transformer's is its own inner width (kept published).
INTERFACE_KEYS = ("in_channels", "out_channels", "joint_attention_dim", "pooled_projection_dim", "cap_feat_dim",
                  "text_dim", "caption_channels", "context_in_dim", "sample_size", "pos_embed_max_size",
                  "addition_time_embed_dim", "projection_class_embeddings_input_dim",
                  # Krea 2's text fusion runs at the text encoder's width on its tapped layers
                  "text_hidden_dim", "num_text_layers", "text_num_attention_heads", "text_num_key_value_heads",
                  "text_intermediate_size")
UNET_INTERFACE_KEYS = ("cross_attention_dim",)
IMAGE_FAMILIES_SKIPPED = ("wan", "ltx")  # video: bench/video.py


def published_denoiser(family) -> dict | None:
    """The denoiser config of the family's first full-size model, or None (generic families)."""
    import importlib

    for module in getattr(family, "full_size_models", {}).values():
        return dict(importlib.import_module(f"hotlora.fullsize.{module}").COMPONENTS[family.denoiser])
    return None


def wide_config(tiny: dict, published: dict) -> dict:
    """``published`` with one block of each kind and the tiny model's interface keys."""
    unet = "block_out_channels" in published
    keep = INTERFACE_KEYS + (UNET_INTERFACE_KEYS if unet else ())
    config = {k: v for k, v in published.items() if not k.startswith("_")}
    config.update({k: tiny[k] for k in keep if k in tiny})
    config.update({k: 1 for k in LAYER_KEYS if k in config})
    return config


def tiny_model(family, root: Path) -> Path:
    """The family's tiny model saved under ``root`` once (its ``hotlora.json`` holds the size and guidance the
    tiny model is served at)."""
    from hotlora.testing import save_tiny_model

    folder = root / family.name
    if not (folder / "model_index.json").is_file():
        save_tiny_model(folder, family.name)
    return folder


def build_pipeline(family, width: str, folder: Path, seed: int = 0):
    """A fresh pipeline of ``family`` at ``width`` (tiny or wide), the same weights each time."""
    import torch
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(str(folder), local_files_only=True)
    if width == "wide":
        denoiser = getattr(pipeline, family.denoiser)
        config = wide_config(dict(denoiser.config), published_denoiser(family))
        torch.manual_seed(seed)
        wide = type(denoiser).from_config(config).to(torch.bfloat16)
        pipeline.register_modules(**{family.denoiser: wide})
        pipeline.to(torch.bfloat16)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def random_adapter(engine, rank: int, seed: int) -> dict:
    """A random diffusers-layout state dict of ``rank`` on every Linear of the engine's ceiling, in the
    denoiser's dtype, with the family's key prefix."""
    from hotlora.testing import random_lora

    prefix = engine.family.denoiser
    dtype = engine.denoiser.dtype
    sd = random_lora(dict(engine.ceiling.modules), rank, seed=seed, strength=0.05)
    return {f"{prefix}.{k}": v.to(dtype) for k, v in sd.items()}


def plain_diffusers(family, width: str, folder: Path, adapter: dict, engine):
    """Plain diffusers with ``adapter`` loaded unfused, compiled as the engine compiles, called the family's way."""
    from hotlora.engine.pipeline import compile_denoiser

    pipeline = build_pipeline(family, width, folder).to(engine.device, engine.denoiser.dtype)
    pipeline.load_lora_weights(adapter, adapter_name="quarter")
    if engine.compile_mode:
        compile_denoiser(getattr(pipeline, family.denoiser), family)
    guidance = engine.defaults["guidance_scale"]
    negative = family.default_negative_prompt(guidance)
    call = {"height": engine.height, "width": engine.width, **family.call_arguments(guidance),
            **({} if negative is None else {"negative_prompt": negative})}
    return pipeline, call


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_pack(engine, adapters, args) -> float:
    sync()
    began = time.perf_counter()
    engine.generate("a lighthouse", adapters=adapters, num_images=args.pack, num_inference_steps=args.steps,
                    output_type="latent", seed=0)
    sync()
    return (time.perf_counter() - began) * 1000


def diffusers_pack(pipeline, call, args) -> float:
    import torch

    sync()
    began = time.perf_counter()
    pipeline(prompt="a lighthouse", num_images_per_prompt=args.pack, num_inference_steps=args.steps, output_type="latent",
             generator=[torch.Generator().manual_seed(i) for i in range(args.pack)], **call)
    sync()
    return (time.perf_counter() - began) * 1000


def mixed_requests(engine, adapters, args) -> list:
    return [engine.prepare("a lighthouse", adapters=pair, num_images=1, num_inference_steps=args.steps,
                           output_type="latent", seed=i) for i, pair in enumerate(adapters)]


def one_at_a_time(engine, adapters, args) -> float:
    sync()
    began = time.perf_counter()
    for prepared in mixed_requests(engine, adapters, args):
        engine.run(prepared)
    sync()
    return (time.perf_counter() - began) * 1000


def one_batch(engine, adapters, args) -> float:
    sync()
    began = time.perf_counter()
    results = engine.run(mixed_requests(engine, adapters, args))
    for result in results:
        if isinstance(result, BaseException):
            raise result
    sync()
    return (time.perf_counter() - began) * 1000


def swap_ms(engine, args) -> dict:
    from bench.swap import swap_rows

    (row,) = swap_rows(engine, args.target_rank, args.swap_repeats, ranks=(args.target_rank,))
    return {"swap_ms": row["swap_ms"], "swap_copy_ms": row["copy_ms"], "swap_bytes": row["bytes"]}


def size_of(pipeline, args) -> dict:
    """--latent-side L: L latent pixels a side at the pipeline's VAE scale (128: 1024x1024 at scale 8); else the
    tiny model's own size (its hotlora.json)."""
    if not args.latent_side:
        return {}
    side = args.latent_side * getattr(pipeline, "vae_scale_factor", 8)
    return {"height": side, "width": side}


def measure(family, width: str, args, root: Path) -> dict:
    """One model's row (see the module's docstring)."""
    from hotlora import Engine
    from hotlora.settings import read_model_defaults

    folder = tiny_model(family, root)

    quarter = max(1, args.target_rank // 4)
    engines, warmup_s = {}, {}
    configs = [("no slots", {"slots": ()}), ("slots", {})] + ([("mixed", {"mixed": True})] if family.mixed_batches else [])
    for label, options in configs:
        gc.collect()
        began = time.perf_counter()
        pipeline = build_pipeline(family, width, folder)
        engines[label] = Engine(pipeline, family, model=str(folder), defaults=read_model_defaults(folder),
                                target_rank=args.target_rank, batch_size=args.pack, compile=not args.no_compile,
                                device=args.device, **size_of(pipeline, args), **options)
        warmup_s[label] = round(time.perf_counter() - began, 1)
    slots = engines["slots"]
    adapter = random_adapter(slots, quarter, seed=1)
    request = {"identity": (adapter, 1.0)}
    # Over the banks' layers where a mixed engine leaves some out (Qwen-Image 2.1's shared timestep rows).
    owner = engines.get("mixed", slots)
    pairs = [{"identity": (random_adapter(owner, quarter, seed=10 + i), 0.9),
              "style": (random_adapter(owner, quarter, seed=20 + i), 0.7)} for i in range(args.pack)]
    reference, call = plain_diffusers(family, width, folder, adapter, slots)
    packs = {
        "no_slots_none": lambda: engine_pack(engines["no slots"], {}, args),
        "slots_none": lambda: engine_pack(slots, {}, args),
        "slots_quarter": lambda: engine_pack(slots, request, args),
        "diffusers_quarter": lambda: diffusers_pack(reference, call, args),
        "one_at_a_time": lambda: one_at_a_time(slots, pairs, args),
    }
    if "mixed" in engines:
        packs["mixed_batch"] = lambda: one_batch(engines["mixed"], pairs, args)
    for pack in packs.values():  # compiles what warm-up did not (diffusers), pages things in
        pack()
    times = {key: [] for key in packs}
    for _ in range(args.runs):  # interleaved: the machine's load hits every configuration alike
        for key, pack in packs.items():
            times[key].append(pack())
    ms = {key: round(statistics.median(v), 1) for key, v in times.items()}
    row = {"family": family.name, "model": width, "denoiser": type(slots.denoiser).__name__,
           "denoiser_params": sum(p.numel() for n, p in slots.denoiser.named_parameters() if "lora_" not in n),
           "dtype": str(slots.denoiser.dtype).removeprefix("torch."), "size": f"{slots.width}x{slots.height}",
           "warmup_s": warmup_s, "slot_bytes": slots.writer.nbytes, **ms, **swap_ms(slots, args),
           "none_over_no_slots": round(ms["slots_none"] / ms["no_slots_none"], 3),
           "quarter_over_diffusers": round(ms["slots_quarter"] / ms["diffusers_quarter"], 3),
           "mixed_speedup": round(ms["one_at_a_time"] / ms["mixed_batch"], 2) if "mixed_batch" in ms else None,
           "recompiles": {label: engine.recompiles for label, engine in engines.items()}}
    return row


def table(rows: list[dict], quarter: int) -> str:
    return markdown_table(
        ["family", "model", "denoiser (params)", "size", "swap ms (copy_ ms)", "no adapters vs no slots",
         f"r{quarter} vs diffusers unfused", "mixed batch vs one at a time", "pack ms: no slots / none / "
         f"r{quarter} / diffusers", "recompiles"],
        [[r["family"], r["model"], f"{r['denoiser']} ({r['denoiser_params'] / 1e6:.1f}M, {r['dtype']})", r["size"],
          f"{r['swap_ms']} ({r['swap_copy_ms']})", f"{r['none_over_no_slots']}x", f"{r['quarter_over_diffusers']}x",
          f"{r['mixed_speedup']}x" if r["mixed_speedup"] else "not served", f"{r['no_slots_none']} / {r['slots_none']} / {r['slots_quarter']} / "
          f"{r['diffusers_quarter']}", max(r["recompiles"].values())] if "error" not in r else
         [r["family"], r["model"], r["error"], "-", "-", "-", "-", "-", "-", "-"] for r in rows])


def main() -> None:
    from hotlora.families import FAMILIES, family_named

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(n for n in FAMILIES if n not in IMAGE_FAMILIES_SKIPPED))
    parser.add_argument("--widths", default="tiny,wide")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--pack", type=int, default=2, help="images a pack, and requests a mixed batch")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--target-rank", type=int, default=16)
    parser.add_argument("--swap-repeats", type=int, default=10)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--latent-side", type=int, default=0, help="latent pixels a side (default: the tiny size)")
    parser.add_argument("--no-compile", action="store_true", help="every configuration eager (CPU dry runs)")
    parser.add_argument("--budget-s", type=float, default=0, help="start no model the longest so far would not "
                                                                      "finish within (0: no budget)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default="families")
    parser.add_argument("--update", action="store_true", help="keep the rows of an existing NAME.json that this "
                                                              "run does not measure again")
    args = parser.parse_args()
    started = time.perf_counter()
    allow_many_compiled_engines()
    rows = []
    kept = previous_rows(args)
    root = Path(tempfile.mkdtemp(prefix="hotlora-bench-families-"))
    for width in args.widths.split(","):
        for name in args.families.split(","):
            family = family_named(name)
            if width == "wide" and published_denoiser(family) is None:
                continue
            longest = max((r["bench_s"] for r in rows), default=0)
            if args.budget_s and time.perf_counter() - started + 1.2 * longest > args.budget_s:
                rows.append({"family": name, "model": width, "error": f"skipped: --budget-s {args.budget_s:.0f} "
                             f"left less than the longest model's {longest:.0f} s", "bench_s": 0})
                continue
            began = time.perf_counter()
            try:
                row = measure(family, width, args, root)
            except Exception as error:  # one family's failure costs no other row; said in the table
                row = {"family": name, "model": width, "error": f"{type(error).__name__}: {error}"[:300]}
            row["bench_s"] = round(time.perf_counter() - began, 1)
            rows.append(row)
            print(row, flush=True)
            gc.collect()
            measured = {(r["family"], r["model"]) for r in rows}
            every = [r for r in kept if (r["family"], r["model"]) not in measured] + rows
            every.sort(key=lambda r: (r["model"] != "tiny", r["model"]))  # tiny rows first, each run's order kept
            write_results(args.out, args.name, {"args": vars(args), "machine": machine(), "rows": every},
                          table(every, max(1, args.target_rank // 4)), description(args))
    shutil.rmtree(root, ignore_errors=True)


def previous_rows(args) -> list[dict]:
    """--update: the rows of the existing NAME.json, if its settings are this run's."""
    import json

    path = Path(args.out) / f"{args.name}.json"
    if not args.update or not path.is_file():
        return []
    data = json.loads(path.read_text())
    same = ("runs", "pack", "steps", "target_rank", "latent_side", "no_compile")
    if any((data["args"].get(k) or 0) != (getattr(args, k) or 0) for k in same):  # absent: the default
        raise SystemExit(f"--update: {path} was measured with other settings ({data['args']})")
    return data["rows"]


def description(args) -> str:
    return (f"Target rank {args.target_rank}, 2 slots, rank buckets 0/{max(1, args.target_rank // 4)}/"
            f"{args.target_rank}; packs of {args.pack} at batch {args.pack}, {args.steps} steps, latents out, median "
            f"of {args.runs}, interleaved; {'eager' if args.no_compile else 'compiled (regional, fullgraph)'} everywhere. Mixed: {args.pack} one-image "
            f"requests with their own adapter pairs. Ratios > 1: slower than the reference.")


if __name__ == "__main__":
    main()
